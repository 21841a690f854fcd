"""Throughput and memory of one training step of a config's model, at its batch shape.

    python bench/train_step.py configs/quickstart.yaml [--steps 20] [--span 0,0.5,1]

Spans start near 0 and grow as they are learned, and attention cost grows with them, so the
step is timed at several span fractions (of model.max_span). Prints a table; asserts nothing.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeline.models import build_model  # noqa: E402
from pipeline.optim import build_optimizer  # noqa: E402
from pipeline.report import vocab_size_for  # noqa: E402
from pipeline.spec import load_spec  # noqa: E402
from pipeline.trainer import peak_memory_mb  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("config")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--span", default="0,0.5,1", help="span fractions to time at")
    args = parser.parse_args()

    spec = load_spec(args.config, args.overrides)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    vocab, _ = vocab_size_for(spec)
    vocab = vocab or 256
    torch.manual_seed(0)
    model = build_model(spec.model_kind, spec.model_params, vocab).to(device)
    optimizer = build_optimizer(model.parameters(), spec.train.optimizer)
    batch, seq = spec.train.batch_size, spec.train.seq_len
    x = torch.randint(vocab, (batch, seq), device=device)
    y = torch.randint(vocab, (batch, seq), device=device)
    params = sum(p.numel() for p in model.parameters())

    print(f"{spec.name}: {params:,} parameters, batch {batch} x {seq}, {device}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"{'span frac':>9} {'L′ tokens':>10} {'ms/step':>9} {'tokens/s':>11} {'peak MB':>9}")
    for frac in (float(f) for f in args.span.split(",")):
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "span" in name:
                    p.fill_(frac)
        cache = model.init_cache(batch, device=device)
        for i in range(args.warmup + args.steps):
            if i == args.warmup:
                if device.type == "cuda":
                    torch.cuda.synchronize()
                start = time.perf_counter()
            out = model(x, y, cache)
            loss = out.nll.mean() + model.span_loss()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if "span" in name:
                        p.fill_(frac)          # hold the span fixed while timing
            cache = out.cache
        if device.type == "cuda":
            torch.cuda.synchronize()
        ms = (time.perf_counter() - start) / args.steps * 1000
        span_len = max(model.span_lens()) if hasattr(model, "span_lens") else 0
        print(f"{frac:>9.2f} {span_len:>10} {ms:>9.1f} {batch * seq / ms * 1000:>11,.0f} "
              f"{peak_memory_mb(device):>9.0f}")


if __name__ == "__main__":
    main()
