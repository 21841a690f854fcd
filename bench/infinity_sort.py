"""The sorting task at CPU scale: the ∞-former against a Transformer-XL with the same
short-term memory, at doubling lengths, several seeds; prints the sorted output's accuracy.

    python bench/infinity_sort.py [--lengths 64,128,256] [--seeds 0,1,2] [--steps 2000]
                                  [--segment 32] [--threads 1]

Each document (pipeline/data/frequency_sort.py: vocabulary 20, input, separator, the 20
symbols by decreasing count) is read in segments of --segment tokens; the short-term memory
is one segment (mem_len = segment) and the state (cache and LTM) carries across a document's
segments and starts afresh for each document. Only the targets after the separator are
scored and trained on (the authors' code backpropagates the final segment's loss only; the
state is detached between segments). Accuracy is teacher-forced: token accuracy of the 20
target symbols and the share of documents with all 20 right, on 64 held-out documents.
This is the issue's acceptance bench in miniature, run in-process, through the same
pipeline.training.document_passes.run_documents as the trainer's document mode. Prints a markdown table;
asserts nothing.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeline.data.frequency_sort import generate_split  # noqa: E402
from pipeline.training.document_passes import run_documents  # noqa: E402
from pipeline.models import build_model  # noqa: E402

VOCAB = 20
MODEL = dict(d_model=64, n_layers=2, n_heads=4, ff_dim=128, dropout=0.0, n_basis=64,
             n_samples=64)


def train_and_score(ltm: bool, length: int, seed: int, args) -> tuple[float, float]:
    torch.manual_seed(seed)
    model = build_model("infinity_former", dict(MODEL, mem_len=args.segment, ltm=ltm),
                        VOCAB + 2)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, args.steps)
    train = torch.from_numpy(generate_split(seed, "train", args.steps * args.batch, VOCAB,
                                            length, (1, 9)))
    test = torch.from_numpy(generate_split(seed, "test", 64, VOCAB, length, (1, 9)))
    model.train()
    for step in range(args.steps):
        out = run_documents(model, train[step * args.batch:(step + 1) * args.batch],
                            args.segment, length, True)
        opt.zero_grad()
        (out.nll.mean() + out.aux).backward()
        opt.step()
        sched.step()
    model.eval()
    right = run_documents(model, test, args.segment, length, False).predictions \
        == test[:, length + 1:]
    return float(right.float().mean()), float(right.all(1).float().mean())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="64,128,256")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--segment", type=int, default=32)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    seeds = [int(s) for s in args.seeds.split(",")]
    print(f"{args.steps} steps x {args.batch} documents, segment = mem_len = {args.segment}, "
          f"model {MODEL}, seeds {seeds}\n")
    print("| length | model | token accuracy (mean ± sd) | exact match | minutes |")
    print("|---:|---|---:|---:|---:|")
    for length in (int(s) for s in args.lengths.split(",")):
        for name, ltm in (("Transformer-XL", False), ("∞-former", True)):
            start = time.perf_counter()
            scores = [train_and_score(ltm, length, seed, args) for seed in seeds]
            acc = np.array([s[0] for s in scores])
            exact = np.mean([s[1] for s in scores])
            print(f"| {length} | {name} | {acc.mean():.3f} ± {acc.std():.3f} | {exact:.3f} | "
                  f"{(time.perf_counter() - start) / 60:.1f} |", flush=True)


if __name__ == "__main__":
    main()
