"""Tokens/s of the evaluate stage's scoring beside a training step's, for the same model.

    python -m bench.evaluate [CONFIG ...] [--span 0.5] [--rounds 5] [--set K=V]

Each config's model (default: the quickstart, and the quickstart shrunk to the tests' tiny
model) is built as bench/train_step.py builds it, its span held at --span of model.max_span,
and timed in alternating rounds, so that a busy machine slows both alike: a training update
at train.batch_size x train.seq_len (forward, backward, optimizer step; bench.train_step's
update), and pipeline.training.evaluation.evaluate_nll over random tokens at
evaluate.batch_size x seq_len, streamed with the cache as the stage scores (--eval-batches
batches per round). Each figure is the median over rounds. Prints a table; asserts nothing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np
import torch

from bench.train_step import Ours, sync
from pipeline.commands.report import vocab_size_for
from pipeline.spec import load_spec
from pipeline.training.evaluation import evaluate_nll

TINY = (
    "model.d_model=32",
    "model.n_layers=2",
    "model.n_heads=2",
    "model.n_persistent=8",
    "model.max_span=64",
)
"""The quickstart test's model (tests/system/stages/test_quickstart.py): tens of thousands of
parameters."""

DEFAULT_MODELS = (("configs/quickstart.yaml", ()), ("configs/quickstart.yaml", TINY))


def time_train(ours: Ours, batch: int, frac: float, steps: int) -> float:
    """tokens/s of `steps` training updates (one warm-up update first)."""
    step = ours.prepare(batch, frac)
    step()
    sync(ours.device)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    sync(ours.device)
    return steps * batch * ours.seq / (time.perf_counter() - start)


def time_evaluate(ours: Ours, tokens: np.ndarray, batch: int, seq: int, batches: int) -> float:
    """tokens/s of evaluate_nll over the first `batches` batches (one warm-up batch first)."""
    evaluate_nll(ours.model, tokens, batch, seq, ours.device, max_batches=1)
    sync(ours.device)
    start = time.perf_counter()
    _, count = evaluate_nll(ours.model, tokens, batch, seq, ours.device, max_batches=batches)
    sync(ours.device)
    return count / (time.perf_counter() - start)


def measure(config: str, overrides, args, device) -> dict:
    spec = load_spec(config, [*overrides, *args.overrides])
    vocab = vocab_size_for(spec)[0] or 256
    ours = Ours(spec, vocab, device, torch.float32)
    train_batch, seq = spec.train.batch_size, spec.train.seq_len
    eval_batch = spec.evaluate.batch_size
    eval_seq = spec.evaluate.seq_len or seq
    n_tokens = eval_batch * eval_seq * args.eval_batches + 1
    tokens = np.random.default_rng(0).integers(0, vocab, n_tokens).astype(np.int64)
    train, evaluate = [], []
    for _ in range(args.rounds):
        train.append(time_train(ours, train_batch, args.span, args.train_steps))
        ours.prepare(train_batch, args.span)  # the span held for scoring too
        evaluate.append(time_evaluate(ours, tokens, eval_batch, eval_seq, args.eval_batches))
    params = sum(p.numel() for p in ours.model.parameters())
    ours.close()
    return {
        "model": f"{spec.name}{' (tiny)' if overrides else ''}, {params:,} parameters",
        "train": statistics.median(train),
        "evaluate": statistics.median(evaluate),
        "shapes": f"{train_batch} x {seq} / {eval_batch} x {eval_seq}",
    }


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("configs", nargs="*", help="default: the quickstart, full and tiny")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--span", type=float, default=0.5, help="span fraction held")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--train-steps", type=int, default=4, help="updates per round")
    parser.add_argument("--eval-batches", type=int, default=16, help="batches per round")
    return parser.parse_args(argv)


def main() -> int:
    args = parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    models = [(c, ()) for c in args.configs] or list(DEFAULT_MODELS)
    print(
        f"{device}, torch {torch.__version__}, {torch.get_num_threads()} threads; span "
        f"{args.span:g} of max_span; median of {args.rounds} alternating rounds\n"
    )
    print("| model | train / eval batch | train step tok/s | evaluate tok/s | ratio |")
    print("|---|---|---|---|---|")
    for config, overrides in models:
        r = measure(config, overrides, args, device)
        print(
            f"| {r['model']} | {r['shapes']} | {r['train']:,.0f} | {r['evaluate']:,.0f} | "
            f"{r['evaluate'] / r['train']:.1f}x |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
