"""The ∞-former's sorting result at CPU scale: Transformer-XL, the ∞-former and the ∞-former
with sticky memories, the same short-term memory, at doubling lengths, several seeds; prints
the sorted output's accuracy per length and how much each model loses as the input grows.

    python -m reproduce.infinity_sort [--lengths 32,64,128,256] [--seeds 0,1,2]
        [--models xl,infinity,sticky] [--base-steps 6000] [--steps 400] [--jobs 2]
        [--results FILE.jsonl] [--plot FILE.png] [--table-only]

Each document (pipeline/data/frequency_sort.py: vocabulary 20, the drifting mixture, input,
separator, the 20 symbols by decreasing count) is read in segments of --segment tokens; the
short-term memory is one segment (mem_len = segment) and the state (cache and LTM) carries
across a document's segments and starts afresh for each document. Only the targets after the
separator are scored and trained on, through pipeline.training.document_passes.run_documents
(the trainer's document mode: the state is detached between segments, as in the authors'
sorting trainer). Accuracy is teacher-forced: token accuracy of the 20 target symbols and
the share of documents with all 20 right, on --test held-out documents. A model that only
learns never to repeat a symbol already output scores (1/20) sum_k 1/(20 - k) = 0.18.

The curriculum: per seed, one model learns the task at the shortest length (--base-steps
updates, each document read whole in one segment); each model then continues from it at each
longer length (--steps updates, in segments of --segment tokens, a fresh warm-up and cosine
decay). At the shortest length the input fits the short-term memory and the LTM is still empty
when the targets are read, so the ∞-former there computes exactly Transformer-XL's function
(its LTM weights get no gradient): the base is one Transformer-XL, and the ∞-former starts
from its weights with its LTM weights freshly drawn. Its rows at the shortest length are the
base's.

Why this protocol (issue 28):
- Segment = STM = 32 and the shortest length 32: the document (32 + 1 + 20 tokens) is two
  segments, and the second (separator and targets) reads the whole input from the STM. The
  longest length, 256, is 8x the STM: there Transformer-XL sees the last 32 input tokens of
  256 (the end of the drift), the ∞-former those and its LTM of the rest.
- The base reads each document whole. In segments, the input's segment runs without a graph
  (the authors' trainer: the gradient stops at the carried state), so no layer learns to
  compute, over the input, what sorting needs (counts, and the first appearance that breaks
  ties: at length 32 most counts tie). Read whole, the base computes the same function (the
  STM holds the whole input; checked on the held-out documents after each base), and learns
  far faster: seed 0, 2,000 updates, 0.84 token accuracy read whole against 0.74 in segments
  (0.79 in segments after 11,000 updates on a GPU). The longer lengths, where only the
  memory differs between the models, train in segments as in the paper.
- The model, 3 layers of d 128 (8 heads, feed-forward 256), is one that learns the task on a
  CPU budget: a 2-layer d-64 model stayed at 0.18 (never repeating a symbol, no counting)
  after 2,000 updates even with the whole document in one segment, and d 256 learned no
  faster per update (0.75-0.77 after 11,000, in segments). The paper's is 3 layers of d 300.
- Training from scratch at every length costs an update at length 256 about 2x one at 32
  for Transformer-XL and 5x for the ∞-former (9 segments, the LTM refit in each): 6,000
  updates at each length would take some 2 hours per ∞-former run. The curriculum spends
  the long updates only on what differs between lengths, reading the memory.
- Adam 1e-3 (5e-4 when continuing), 100 warm-up updates (20 when continuing), cosine decay to
  0 (the paper: Adam, cosine decay), batch 32 documents, no dropout; the LTM: 64 basis
  functions (centres on half, widths 0.01 and 0.05 as in the paper), 64 samples, tau 0.75;
  sticky memories: 32 bins.

--jobs N trains N runs at once in separate processes (each --threads threads). --results
keeps each finished run as a line of JSON and each base model beside it (FILE.base-SEED.pt);
a later invocation with the same file runs only the runs it lacks, and --table-only prints
the table (and --plot draws it) from the file. Prints a markdown table; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import tempfile
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from pathlib import Path

import numpy as np
import torch

from pipeline.data.frequency_sort import generate_split
from pipeline.models import build_model
from pipeline.training.document_passes import run_documents

VOCAB = 20
WEIGHTS = (1, 9)  # the paper's integer mixture weights
MODEL = dict(
    d_model=128,
    n_layers=3,
    n_heads=8,
    ff_dim=256,
    dropout=0.0,
    n_basis=64,
    n_samples=64,
    sticky_bins=32,
)
MODELS = {
    "xl": ("Transformer-XL", dict(ltm=False)),
    "infinity": ("∞-former", dict(ltm=True)),
    "sticky": ("∞-former, sticky memories", dict(ltm=True, sticky=True)),
}


def train_and_score(
    model_key: str,
    length: int,
    seed: int,
    args: dict,
    base: Path | None = None,
    save: Path | None = None,
) -> dict:
    """One run: a model trained on `length`-token inputs (from scratch, or continuing from
    the weights at `base`), scored on held-out documents; its weights saved to `save`."""
    torch.set_num_threads(args["threads"])
    torch.manual_seed(seed)
    start = time.perf_counter()
    model = build_model(
        "infinity_former", dict(MODEL, mem_len=args["segment"], **MODELS[model_key][1]), VOCAB + 2
    )
    if base is None:
        # the base reads each document whole, so that its gradient reaches the input's
        # states too (see the module doc); scored below in segments like every run
        steps, lr, warmup, segment = args["base_steps"], args["lr"], 100, length + VOCAB
    else:
        steps, lr, warmup, segment = args["steps"], args["lr"] / 2, 20, args["segment"]
        loaded = model.load_state_dict(torch.load(base, weights_only=True), strict=False)
        # only the LTM's own weights are new to an ∞-former continuing from the base
        assert not loaded.unexpected_keys and all(".ltm." in k for k in loaded.missing_keys)
    opt = torch.optim.Adam(model.parameters(), lr=lr)

    def lr_factor(step: int) -> float:
        return min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * step / steps))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    batch = args["batch"]
    # a continuing run draws other documents than its base (split seed offset by the length)
    data_seed = seed if base is None else seed * 1000 + length
    train = torch.from_numpy(
        generate_split(data_seed, "train", steps * batch, VOCAB, length, WEIGHTS)
    )
    test = torch.from_numpy(generate_split(seed, "test", args["test"], VOCAB, length, WEIGHTS))
    model.train()
    parent = multiprocessing.parent_process()
    for step in range(steps):
        if step % 50 == 0 and parent is not None and not parent.is_alive():
            # the invocation was killed: a run of many minutes would go on for no one (and
            # an exception would only be sent back to it, the worker then idling forever)
            print(f"infinity_sort: the parent of run {model_key}/{length} is gone", flush=True)
            os._exit(1)
        out = run_documents(model, train[step * batch : (step + 1) * batch], segment, length, True)
        opt.zero_grad()
        (out.nll.mean() + out.aux).backward()
        opt.step()
        sched.step()
    if save is not None:
        torch.save(model.state_dict(), save)
    model.eval()
    with torch.no_grad():
        scored = run_documents(model, test, args["segment"], length, False)
        if base is None:
            # with the STM holding the whole input, reading in segments is the same function
            # as reading whole; only the gradient differed
            whole = run_documents(model, test, segment, length, False)
            assert torch.allclose(scored.nll, whole.nll, atol=1e-4), "segments differ from whole"
    right = scored.predictions == test[:, length + 1 :]
    return dict(
        model=model_key,
        length=length,
        seed=seed,
        accuracy=float(right.float().mean()),
        exact=float(right.all(1).float().mean()),
        seconds=round(time.perf_counter() - start, 1),
        base=base is None,
        settings=protocol(args),
    )


def protocol(args: dict) -> dict:
    """What a stored result must share with this invocation to be reused."""
    return {k: args[k] for k in ("base_steps", "steps", "batch", "segment", "lr", "test")} | {
        "model": MODEL,
        "base_reads": "whole documents",
    }


def load_results(path: Path | None) -> list[dict]:
    if path is None or not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def runs_of(results: list[dict], key: str, length: int, shortest: int) -> list[dict]:
    """The runs that stand for model `key` at `length`: at the shortest length every model
    is the base (see the module doc)."""
    if length == shortest:
        return [r for r in results if r["base"] and r["length"] == length]
    return [r for r in results if r["model"] == key and r["length"] == length]


def table(results: list[dict], lengths: list[int], models: list[str]) -> str:
    lo, hi = min(lengths), max(lengths)

    def runs(key, length):
        return runs_of(results, key, length, lo)

    lines = [
        "| length | model | token accuracy (mean ± sd) | exact match (mean ± sd) | seeds "
        "| minutes per run |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for length in lengths:
        for key in models:
            rs = runs(key, length)
            if not rs:
                continue
            acc, exact = np.array([r["accuracy"] for r in rs]), np.array([r["exact"] for r in rs])
            minutes = np.mean([r["seconds"] for r in rs]) / 60
            lines.append(
                f"| {length} | {MODELS[key][0]} | {acc.mean():.3f} ± {acc.std():.3f} | "
                f"{exact.mean():.3f} ± {exact.std():.3f} | {len(rs)} | {minutes:.1f} |"
            )
    lines += [
        "",
        f"| model | accuracy lost from length {lo} to {hi} (mean ± sd over seeds) |",
        "|---|---:|",
    ]
    for key in models:
        by_seed = {r["seed"]: r["accuracy"] for r in runs(key, lo)}
        drops = np.array(
            [by_seed[r["seed"]] - r["accuracy"] for r in runs(key, hi) if r["seed"] in by_seed]
        )
        if len(drops):
            lines.append(f"| {MODELS[key][0]} | {drops.mean():.3f} ± {drops.std():.3f} |")
    return "\n".join(lines)


def plot(results: list[dict], lengths: list[int], models: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for key in models:
        xs, mean, sd = [], [], []
        for length in lengths:
            acc = [r["accuracy"] for r in runs_of(results, key, length, min(lengths))]
            if acc:
                xs.append(length)
                mean.append(np.mean(acc))
                sd.append(np.std(acc))
        ax.errorbar(xs, mean, yerr=sd, marker="o", capsize=3, label=MODELS[key][0])
    ax.axhline(0.18, color="grey", linestyle=":", label="never repeating a symbol (0.18)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(lengths, [str(n) for n in lengths])
    ax.set_xlabel("input length (tokens; short-term memory 32)")
    ax.set_ylabel("token accuracy of the sorted output")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv=None) -> argparse.Namespace:
    """The options, with lengths, seeds and models as lists."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="32,64,128,256")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument(
        "--models", default="xl,infinity,sticky", help=f"comma-separated: {', '.join(MODELS)}"
    )
    ap.add_argument(
        "--base-steps",
        type=int,
        default=6000,
        help="updates of the base model at the shortest length",
    )
    ap.add_argument(
        "--steps",
        type=int,
        default=400,
        help="updates of each model continuing at each longer length",
    )
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--segment", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--test", type=int, default=128, help="held-out documents per run")
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--results", type=Path, help="JSON lines: finished runs, kept and reused")
    ap.add_argument("--plot", type=Path, help="PNG: accuracy against length, per model")
    ap.add_argument(
        "--table-only",
        action="store_true",
        help="print the table (and draw --plot) from --results, train nothing",
    )
    args = ap.parse_args(argv)
    lengths = sorted(int(s) for s in args.lengths.split(","))
    seeds = [int(s) for s in args.seeds.split(",")]
    models = args.models.split(",")
    unknown = sorted(set(models) - set(MODELS))
    if unknown:
        ap.error(f"--models: unknown {', '.join(unknown)}; known: {', '.join(MODELS)}")
    if lengths[0] > args.segment:
        # else the base, trained reading documents whole, is not the model scored in segments
        ap.error(
            f"--lengths: the shortest, {lengths[0]}, must fit the short-term memory "
            f"(--segment {args.segment}): the base learns from whole documents"
        )
    if args.table_only and args.results is None:
        ap.error("--table-only reads --results FILE")
    if args.plot and args.plot.suffix.lower() != ".png":
        ap.error(f"--plot {args.plot}: a .png file")
    args.lengths, args.seeds, args.models = lengths, seeds, models
    return args


def base_path(args, folder: Path, seed: int) -> Path:
    stem = args.results.name if args.results else "infinity_sort"
    return folder / f"{stem}.base-{seed}.pt"


def to_train(args, done: set, folder: Path) -> tuple[list[int], dict[int, list]]:
    """The seeds whose base is (re)trained, and each seed's continuing runs still to do."""
    shortest = args.lengths[0]
    bases = [
        s
        for s in args.seeds
        if ("xl", shortest, s, True) not in done or not base_path(args, folder, s).exists()
    ]
    # a base trained again makes its seed's continuing runs stale: they run again too
    continuing = {
        s: [
            (m, n, s)
            for n in args.lengths[1:]
            for m in args.models
            if s in bases or (m, n, s, False) not in done
        ]
        for s in args.seeds
    }
    return bases, continuing


def record(args, results: list[dict], result: dict) -> None:
    results.append(result)
    if args.results:
        with args.results.open("a") as f:
            f.write(json.dumps(result) + "\n")
    print(
        f"  {'base' if result['base'] else MODELS[result['model']][0]}, length "
        f"{result['length']}, seed {result['seed']}: accuracy "
        f"{result['accuracy']:.3f}, exact {result['exact']:.3f} "
        f"({result['seconds'] / 60:.1f} min)",
        flush=True,
    )


def train_all(args, settings, results, bases, continuing, folder: Path) -> None:
    """Each base first, then its seed's continuing runs, --jobs at a time."""
    shortest = args.lengths[0]
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(args.jobs, mp_context=context) as pool:

        def submit_continuing(seed: int) -> list:
            # longest first: the slowest runs start early, so the jobs end together
            jobs = sorted(continuing[seed], key=lambda job: -job[1])
            base = base_path(args, folder, seed)
            return [pool.submit(train_and_score, *job, settings, base) for job in jobs]

        pending = {
            pool.submit(
                train_and_score, "xl", shortest, s, settings, None, base_path(args, folder, s)
            ): s
            for s in bases
        }
        pending |= {f: None for s in args.seeds if s not in bases for f in submit_continuing(s)}
        while pending:
            finished, _ = wait(pending, return_when=FIRST_COMPLETED)
            for future in finished:
                seed = pending.pop(future)
                record(args, results, future.result())
                if seed is not None:  # a base: its continuing runs can start
                    pending |= {f: None for f in submit_continuing(seed)}


def main() -> None:
    args = parse_args()
    lengths, seeds, models = args.lengths, args.seeds, args.models
    settings = vars(args).copy()
    settings.update(
        lengths=",".join(map(str, lengths)),
        seeds=",".join(map(str, seeds)),
        models=",".join(models),
    )
    shortest = lengths[0]
    results = [r for r in load_results(args.results) if r["settings"] == protocol(settings)]
    done = {(r["model"], r["length"], r["seed"], r["base"]) for r in results}
    folder = Path(tempfile.mkdtemp()) if args.results is None else args.results.parent
    bases, continuing = to_train(args, done, folder)
    todo = len(bases) + sum(map(len, continuing.values()))
    print(
        f"base: {args.base_steps} updates at length {shortest}; then {args.steps} updates per "
        f"model and longer length; x {args.batch} documents, segment = mem_len = "
        f"{args.segment}, model {MODEL}, seeds {seeds}; {len(results)} runs from "
        f"{args.results}, {0 if args.table_only else todo} to train\n",
        flush=True,
    )
    start = time.perf_counter()
    if todo and not args.table_only:
        results = [r for r in results if r["seed"] not in bases]
        train_all(args, settings, results, bases, continuing, folder)
        print(
            f"\ntrained {todo} runs in {(time.perf_counter() - start) / 60:.0f} min at "
            f"--jobs {args.jobs}\n"
        )
    print(table(results, lengths, models))
    if args.plot:
        plot(results, lengths, models, args.plot)
        print(f"\nplot: {args.plot}")


if __name__ == "__main__":
    main()
