"""Time and peak memory of one all-attention op, reference versus the fused backends.

    python -m bench.attention [--spans 512,2048,8192] [--persistent 0,1024,2048]
                              [--batch 1] [--impls sdpa,flex,triton] [--dropout 0.4]
                              [--repeat 3]

--impls triton-unsplit times triton with its persistent part in the kernels, as before the
split (``pipeline.ops.triton_attention.persistent_split``); ``triton`` splits it out by
default: ``--impls triton,triton-unsplit`` compares the two.

Block of T = 512 queries, H = 8 heads of 64 (the paper's d = 512), spans L' and N persistent
vectors per head, adaptive-span mask on, attention dropout --dropout (0: off). Forward +
backward where the backend trains on this device (flex is forward-only on CPU: it is timed
forward-only there, and the reference with it). A backend that cannot run a case is left
out with the reason (sdpa has no attention dropout; triton on a CPU machine runs Triton's
interpreter, minutes per call at these shapes). Peak memory: CUDA max allocated above the
inputs; CPU: not measured (prints -). Prints a markdown table; asserts nothing.
"""

from __future__ import annotations

import argparse
import time

import torch

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


def attend_fn(impl: str):
    """The op an --impls name stands for: a registered backend, or triton-unsplit (triton
    with the persistent part in its kernels; the choice is made in the forward)."""
    if impl != "triton-unsplit":
        return get_attention_impl(impl)
    from pipeline.ops.triton_attention import persistent_split

    triton = get_attention_impl("triton")

    def unsplit(*args, **kw):
        with persistent_split(False):
            return triton(*args, **kw)

    return unsplit


def measure(impl, batch, span, n, device, dtype, backward, repeat, dropout):
    """(ms per call, peak MiB above the inputs; NaN on CPU)."""
    fn = attend_fn(impl)
    args, kw, spans = inputs(batch, span, n, device, dtype, backward)
    kw |= dict(dropout_p=dropout, training=dropout > 0)

    def step():
        mask = adaptive_span_mask(spans, 32, span)
        if backward:
            fn(*args, span_mask=mask, **kw).float().sum().backward()
        else:
            with torch.no_grad():
                fn(*args, span_mask=mask, **kw)

    step()  # warm-up (and compilation, and the Triton tile's choice)
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


def cannot_run(impl: str, device: torch.device, dropout: float) -> str | None:
    if impl == "sdpa" and dropout > 0:
        return "no attention dropout"
    if impl.startswith("triton") and device.type == "cpu":
        return "Triton's interpreter on a CPU machine (minutes a call at these shapes)"
    return None


def rows(args, device, dtype):
    """The table's rows: each (L', N) timed once with the reference, then each backend."""
    for span in (int(s) for s in args.spans.split(",")):
        for n in (int(s) for s in args.persistent.split(",")):
            reference: dict[bool, tuple[float, float]] = {}
            for impl in args.impls.split(","):
                why = cannot_run(impl, device, args.dropout)
                if why:
                    yield f"| {impl} | {span} | {n} | - | - | - | - | - | - | - ({why}) |"
                    continue
                backward = not (impl == "flex" and device.type == "cpu")
                case = (args.batch, span, n, device, dtype, backward, args.repeat, args.dropout)
                if backward not in reference:
                    reference[backward] = measure("reference", *case)
                (ref_ms, ref_mb), (ms, mb) = reference[backward], measure(impl, *case)
                mem = (
                    "- | - | -"
                    if device.type == "cpu"
                    else f"{ref_mb:.0f} | {mb:.0f} | {mb / ref_mb:.2f}"
                )
                yield (
                    f"| {impl} | {span} | {n} | {'fwd+bwd' if backward else 'fwd'} | "
                    f"{ref_ms:.0f} | {ms:.0f} | {ref_ms / ms:.2f}x | {mem} |"
                )


def tiles(impls: list[str]) -> str:
    """The tiles the fused backends kept (the first that compiled, or the fastest)."""
    from pipeline.ops import fused, triton_attention

    lines = []
    if "flex" in impls:
        kept = {
            f"{d} {t} d_h {h}": tile or "torch's default"
            for (d, t, h), tile in fused.flex_tiles_in_use().items()
        }
        lines.append(f"flex forward tile (the first of FLEX_TILES that compiled): {kept}")
    if any(impl.startswith("triton") for impl in impls):
        kept = {
            f"{k} {d} {t} d_h {h} L' <= {span} rows <= {rows}": tile
            for (k, d, t, h, span, rows), tile in triton_attention.tiles_in_use().items()
        }
        lines.append(f"triton tiles (the fastest of TILES that fits, per kernel): {kept}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--spans", default="512,2048,8192")
    parser.add_argument("--persistent", default="0,1024,2048")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--impls", default="sdpa,flex,triton")
    parser.add_argument("--dropout", type=float, default=0.0, help="attention dropout p")
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
        f"all-attention op, T=512, H=8, d_h=64, batch {args.batch}, {dtype}, attention "
        f"dropout {args.dropout}, {where}, torch {torch.__version__}\n"
    )
    print(
        "| impl | L' | N | pass | ref ms | fused ms | speed-up | ref MiB | fused MiB | mem ratio |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for row in rows(args, device, dtype):
        print(row, flush=True)
    print("\n" + tiles(args.impls.split(",")))


if __name__ == "__main__":
    main()
