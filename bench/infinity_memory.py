"""Cost of one segment against the number of segments already stored: the ∞-former (a
short-term memory of one segment plus the continuous LTM) versus a Transformer-XL whose cache
keeps the same context (mem_len = segments stored × segment length).

    python -m bench.infinity_memory [--segments 1,4,16,64] [--seg-len 128] [--repeat 5]
                                    [--device cpu|cuda] [--threads 1]

For each number of segments stored, both models stream that many segments (no grad), then one
more segment is timed, forward + backward as in training (the fastest of --repeat from the
same state, after two warm-up steps: the least disturbed by other work on a shared machine;
CPU threads default to 1 for the same reason). Columns: ms per segment, the state carried
(MB), forward FLOPs (torch's FlopCounterMode) and, on CUDA, the peak memory of the timed
step above what was allocated before it. Model: d 128, 2 layers, 4 heads, FF 256; LTM 128
basis functions, 128 samples.
Prints a markdown table; asserts nothing.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.utils.flop_counter import FlopCounterMode

from pipeline.models import build_model

VOCAB = 256
BASE = dict(d_model=128, n_layers=2, n_heads=4, ff_dim=256, dropout=0.0, n_basis=128, n_samples=128)


def stream_to(model, n_segments, seg_len, device, gen):
    """The state after ``n_segments`` random segments, and one more segment to time."""
    state = model.init_state(1, device)
    with torch.no_grad():
        for _ in range(n_segments):
            tokens = torch.randint(0, VOCAB, (1, seg_len), generator=gen).to(device)
            state = model(tokens, None, state).state
    return state, torch.randint(0, VOCAB, (1, seg_len), generator=gen).to(device)


def measure(model, n_segments, seg_len, device, repeat):
    state, tokens = stream_to(model, n_segments, seg_len, device, torch.Generator().manual_seed(0))

    def step():
        out = model(tokens, tokens, state)
        (out.nll.mean() + model.aux_loss()).backward()

    step()  # warm-up: the fit matrices, kernels' first calls, allocator
    step()
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(tokens, tokens, state)
    peak = None
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    if device.type == "cuda":
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    state_mb = sum(t.numel() * t.element_size() for t in state) / 2**20
    return min(times) * 1e3, state_mb, counter.get_total_flops(), peak


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--segments", default="1,4,16,64")
    ap.add_argument("--seg-len", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    segments = [int(s) for s in args.segments.split(",")]
    print(
        f"segment {args.seg_len} tokens, {device.type} ({args.threads} CPU threads); "
        f"∞-former: mem_len {args.seg_len} + LTM {BASE['n_basis']} RBFs; "
        f"Transformer-XL: mem_len = stored × {args.seg_len}\n"
    )
    print("| segments stored | model | ms / segment | state MB | GFLOP fwd | peak MB |")
    print("|---:|---|---:|---:|---:|---:|")
    for n in segments:
        rows = [
            ("∞-former", dict(BASE, mem_len=args.seg_len, ltm=True)),
            ("Transformer-XL", dict(BASE, mem_len=n * args.seg_len, ltm=False)),
        ]
        for name, cfg in rows:
            torch.manual_seed(0)
            model = build_model("infinity_former", cfg, VOCAB).to(device)
            ms, state_mb, flops, peak = measure(model, n, args.seg_len, device, args.repeat)
            shown = "-" if peak is None else f"{peak:.1f}"
            print(
                f"| {n} | {name} | {ms:.1f} | {state_mb:.2f} | {flops / 1e9:.3f} | {shown} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
