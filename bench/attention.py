"""Time and peak memory of one all-attention op, reference versus the fused backends.

    python bench/attention.py [--spans 512,2048,8192] [--persistent 0,1024,2048]
                              [--batch 1] [--impls sdpa,flex] [--repeat 3]

Block of T = 512 queries, H = 8 heads of 64 (the paper's d = 512), spans L' and N persistent
vectors per head, adaptive-span mask on. Forward + backward where the backend trains on this
device (flex is forward-only on CPU: it is timed forward-only there, and the reference with
it). Peak memory: CUDA max allocated above the inputs; CPU: not measured (prints -).
Prints a markdown table; asserts nothing.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeline.ops import adaptive_span_mask, get_attention_impl


def inputs(batch, span, n, device, dtype, grad):
    heads, m, d_h = 8, 512, 64
    g = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(device, dtype).requires_grad_(grad)

    q, k, v = (
        rand(batch, heads, m, d_h),
        rand(batch, heads, span + m, d_h),
        rand(batch, heads, span + m, d_h),
    )
    pos = rand(d_h, span)
    pk, pv = (rand(heads, n, d_h), rand(heads, n, d_h)) if n else (None, None)
    # spans spread over the window, so the mask ramps inside it (what a trained layer sees)
    z = torch.linspace(0.25, 0.9, heads) * span
    spans = z.to(device, torch.float32).requires_grad_(grad)
    return (q, k, v, pos), dict(persistent_k=pk, persistent_v=pv), spans


def measure(impl, batch, span, n, device, dtype, backward, repeat):
    fn = get_attention_impl(impl)
    args, kw, spans = inputs(batch, span, n, device, dtype, backward)

    def step():
        mask = adaptive_span_mask(spans, 32, span)
        if backward:
            fn(*args, span_mask=mask, **kw).float().sum().backward()
        else:
            with torch.no_grad():
                fn(*args, span_mask=mask, **kw)

    step()  # warm-up (and compilation)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    start = time.perf_counter()
    for _ in range(repeat):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    else:
        peak = float("nan")
    return (time.perf_counter() - start) / repeat * 1000, peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--spans", default="512,2048,8192")
    parser.add_argument("--persistent", default="0,1024,2048")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--impls", default="sdpa,flex")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    where = (
        torch.cuda.get_device_name()
        if device.type == "cuda"
        else f"CPU, {torch.get_num_threads()} threads"
    )
    print(
        f"all-attention op, T=512, H=8, d_h=64, batch {args.batch}, {dtype}, {where}, "
        f"torch {torch.__version__}\n"
    )
    print(
        "| impl | L' | N | pass | ref ms | fused ms | speed-up | ref MiB | fused MiB | mem ratio |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for span in (int(s) for s in args.spans.split(",")):
        for n in (int(s) for s in args.persistent.split(",")):
            for impl in args.impls.split(","):
                backward = not (impl == "flex" and device.type == "cpu")
                ref_ms, ref_mb = measure(
                    "reference", args.batch, span, n, device, dtype, backward, args.repeat
                )
                ms, mb = measure(impl, args.batch, span, n, device, dtype, backward, args.repeat)
                mem = (
                    "- | - | -"
                    if device.type == "cpu"
                    else f"{ref_mb:.0f} | {mb:.0f} | {mb / ref_mb:.2f}"
                )
                print(
                    f"| {impl} | {span} | {n} | {'fwd+bwd' if backward else 'fwd'} | "
                    f"{ref_ms:.0f} | {ms:.0f} | {ref_ms / ms:.2f}x | {mem} |",
                    flush=True,
                )
    if "flex" in args.impls.split(","):
        from pipeline.ops import fused

        tiles = {
            f"{d} {t} d_h {h}": tile or "torch's default"
            for (d, t, h), tile in fused.flex_tiles_in_use().items()
        }
        print(f"\nflex forward tile (the first of FLEX_TILES that compiled): {tiles}")


if __name__ == "__main__":
    main()
