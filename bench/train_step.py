"""Throughput and memory of one training step of a config's model, at its batch shape.

    python bench/train_step.py configs/enwik8_small.yaml [--steps 20] [--span 0,0.5,1]
        [--batch 8] [--set model.attention.impl=auto]

Spans start near 0 and grow as they are learned, and attention cost grows with them, so the
step is timed at several span fractions (of model.max_span). --batch sets the micro-batch
(default: the config's train.batch_size). On CUDA it also prints model FLOPs utilisation:
6 x parameters per token plus the attention's matmuls at the spans actually used.
Prints a table; asserts nothing.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeline.models import build_model  # noqa: E402
from pipeline.training.optim import build_optimizer  # noqa: E402
from pipeline.commands.report import vocab_size_for  # noqa: E402
from pipeline.spec import load_spec  # noqa: E402
from pipeline.cluster.device import peak_memory_mb  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("config")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--span", default="0,0.5,1", help="span fractions to time at")
    parser.add_argument("--batch", type=int, default=None, help="micro-batch size")
    parser.add_argument("--peak-tflops", type=float, default=989.0,
                        help="GPU dense bf16 peak for MFU (H100/H200 SXM: 989)")
    args = parser.parse_args()

    spec = load_spec(args.config, args.overrides)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    vocab, _ = vocab_size_for(spec)
    vocab = vocab or 256
    torch.manual_seed(0)
    model = build_model(spec.model_kind, spec.model_params, vocab).to(device)
    optimizer = build_optimizer(model.parameters(), spec.train.optimizer)
    batch, seq = args.batch or spec.train.batch_size, spec.train.seq_len
    x = torch.randint(vocab, (batch, seq), device=device)
    y = torch.randint(vocab, (batch, seq), device=device)
    params = sum(p.numel() for p in model.parameters())

    print(f"{spec.name}: {params:,} parameters, micro-batch {batch} x {seq}, {device}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"{model.describe()}\n")
    gpu = device.type == "cuda"
    print("| span frac | L' tokens | ms/step | tokens/s | peak MB |" + (" MFU |" if gpu else ""))
    print("|---|---|---|---|---|" + ("---|" if gpu else ""))
    for frac in (float(f) for f in args.span.split(",")):
        with torch.no_grad():
            for p, _, _ in model.bounded_parameters():
                p.fill_(frac)
        state = model.init_state(batch, device=device)
        for i in range(args.warmup + args.steps):
            if i == args.warmup:
                if device.type == "cuda":
                    torch.cuda.synchronize()
                start = time.perf_counter()
            out = model(x, y, state)
            loss = out.nll.mean() + model.aux_loss()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            with torch.no_grad():
                for p, _, _ in model.bounded_parameters():
                    p.fill_(frac)          # hold the span fixed while timing
            state = out.state
        if device.type == "cuda":
            torch.cuda.synchronize()
        ms = (time.perf_counter() - start) / args.steps * 1000
        span_len = max(model.span_lens())
        tokens_per_s = batch * seq / ms * 1000
        row = (f"| {frac:.2f} | {span_len} | {ms:.1f} | {tokens_per_s:,.0f} | "
               f"{peak_memory_mb(device):.0f} |")
        if gpu:
            row += f" {tokens_per_s * flops_per_token(model, seq) / args.peak_tflops / 1e12:.1%} |"
        print(row, flush=True)


def flops_per_token(model, seq: int) -> float:
    """Training FLOPs per token: 6 per weight (forward + backward) and, per layer, the
    attention's q.k, q.u and a.v products over L' context + N persistent keys (3 x 2 x 2
    FLOPs per key and model dimension, forward + backward)."""
    cfg = model.cfg
    weights = sum(p.numel() for name, p in model.named_parameters()
                  if "persistent" not in name and "pos_table" not in name and "embed" not in name)
    attn = sum(6 * 2 * cfg.d_model * (span + cfg.n_persistent) for span in model.span_lens())
    return 6 * weights + attn


if __name__ == "__main__":
    main()
