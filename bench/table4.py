"""The active-memory paper's Table 4 on our pipeline: the longest length each operator solves
by the length curriculum, mean over seeds, beside the paper's numbers (PAPERS.md §2).

    python bench/table4.py [--problems add,mult,remember,reverse]
                           [--mixers self_attention,conv,sa+conv] [--seeds 1,2,3]
                           [--epochs 100] [--steps 100] [--jobs 1] [--device auto]
                           [--results FILE.jsonl]

Each cell runs configs/active_memory/<problem>.yaml (the paper's task model and curriculum)
through the curriculum stage itself, in process, with model.mixer, train.seed and the
generator's seed set per run (seed s: both s), without MLflow, in a temporary workspace.
The default is the full protocol (100 epochs of 100 steps); --epochs / --steps shorten it,
which lowers every score: compare operators within one table, and with the paper's only at
the full protocol. The paper's ordering to look for: conv above self-attention on add and
mult, self-attention above conv on remember and reverse.

A benchmark: it prints a table (and the per-run scores and times) and asserts nothing.
--jobs runs that many curricula at once, one thread each. --results keeps every finished
curriculum as a line of FILE (with its protocol): running again with the same file runs only
the cells it lacks, so the full protocol (hours on a CPU) can be done in several sittings.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# Table 4 of the paper (PAPERS.md §2): mean longest length solved over 3 runs
PAPER = {
    "self_attention": {"reverse": 41.0, "sort": 14.0, "add": 7.0, "mult": 7.0, "not": 104,
                       "remember": 57.0},
    "conv": {"reverse": 17.7, "sort": 20.7, "add": 41.0, "mult": 17.0, "not": 104,
             "remember": 36.0},
    "persistent_conv": {"reverse": 25.0, "sort": 20.3, "add": 38.3, "mult": 16.3, "not": 104,
                        "remember": 35.0},
    "highway_conv": {"reverse": 19.7, "sort": 16.7, "add": 35.7, "mult": 13.7, "not": 104,
                     "remember": 33.0},
    "cgru": {"reverse": 7.7, "sort": 5.7, "add": 16.3, "mult": 9.0, "not": 104,
             "remember": 9.0},
    "sa+conv": {"reverse": 41.0, "sort": 23.3, "add": 36.3, "mult": 12.3, "not": 104,
                "remember": 26.0},
    "sa+persistent_conv": {"reverse": 43.7, "sort": 23.3, "add": 35.0, "mult": 12.3,
                           "not": 104, "remember": 27.0},
    "sa+highway_conv": {"reverse": 41.0, "sort": 20.0, "add": 34.3, "mult": 11.7, "not": 104,
                        "remember": 24.7},
}


def one_run(problem: str, mixer: str, seed: int, epochs: int, steps: int,
            device: str, threads: int) -> tuple[int, list[int], float]:
    """(score, per-epoch lengths, seconds) of one curriculum."""
    import torch

    from pipeline.fsutil import read_json
    from pipeline.spec import load_spec
    from pipeline.tracking import NullStageTracker
    from stages import StageContext, curriculum

    torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory() as tmp:
        cur = "dataset.generator.algorithmic.curriculum"
        spec = load_spec(ROOT / "configs" / "active_memory" / f"{problem}.yaml", [
            f"model.mixer={mixer}", f"train.seed={seed}", f"dataset.generator.seed={seed}",
            f"train.device={device}", f"{cur}.epochs={epochs}",
            f"{cur}.steps_per_epoch={steps}", f"workspace.root={tmp}"])
        ctx = StageContext(spec=spec, out_dir=Path(tmp) / "out", inputs={},
                           tracker=NullStageTracker(), log=lambda m: None)
        ctx.out_dir.mkdir()
        started = time.time()
        summary = curriculum.run(ctx)
        seconds = time.time() - started
        history = read_json(ctx.out_dir / curriculum.RESULT)["history"]
    return summary["score"], [h["length"] for h in history], seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--problems", default="add,mult,remember,reverse")
    ap.add_argument("--mixers", default="self_attention,conv,sa+conv")
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--steps", type=int, default=100, help="steps per epoch")
    ap.add_argument("--jobs", type=int, default=1, help="curricula run at once")
    ap.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    ap.add_argument("--results", type=Path, help="finished cells, kept across invocations")
    args = ap.parse_args()
    problems, mixers = args.problems.split(","), args.mixers.split(",")
    seeds = [int(s) for s in args.seeds.split(",")]
    threads = 1 if args.jobs > 1 else os.cpu_count()
    cells = [(p, m, s) for p in problems for m in mixers for s in seeds]
    protocol = {"epochs": args.epochs, "steps": args.steps}
    results = earlier_results(args.results, protocol) if args.results else {}
    for cell in cells:
        if cell in results:
            show(cell, results[cell], "(earlier)")
    todo = [cell for cell in cells if cell not in results]
    started = time.time()
    # spawned workers: a forked one can hang in OpenMP that its parent's torch started
    with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {cell: pool.submit(one_run, *cell, args.epochs, args.steps, args.device,
                                     threads) for cell in todo}
        for cell, future in futures.items():
            results[cell] = future.result()
            show(cell, results[cell])
            if args.results:
                with args.results.open("a") as f:
                    f.write(json.dumps({"cell": cell, "protocol": protocol,
                                        "result": results[cell]}) + "\n")
    total = time.time() - started
    print(f"\nTable 4, {args.epochs} epochs x {args.steps} steps, seeds {args.seeds}: mean "
          f"longest length solved, ours / paper's")
    print(f"{'operator':<16}" + "".join(f"{p:>16}" for p in problems))
    for mixer in mixers:
        row = f"{mixer:<16}"
        for problem in problems:
            ours = sum(results[(problem, mixer, s)][0] for s in seeds) / len(seeds)
            row += f"{ours:>8.1f} / {PAPER[mixer][problem]:<5}"
        print(row)
    print(f"\n{len(todo)} curricula run in {total / 60:.1f} min ({args.jobs} at a time); "
          f"{len(cells) - len(todo)} from {args.results}; their own times: "
          f"{sum(results[c][2] for c in cells) / 3600:.1f} h in all")


def show(cell, result, note: str = "") -> None:
    score, lengths, seconds = result
    print(f"{cell[0]:<9} {cell[1]:<15} seed {cell[2]}: score {score:>3}  "
          f"({seconds:.0f} s; lengths {lengths[0]}..{lengths[-1]}) {note}", flush=True)


def earlier_results(path: Path, protocol: dict) -> dict:
    """{(problem, mixer, seed): (score, lengths, seconds)} of the cells `path` holds for this
    protocol (a cell run under other epochs/steps is not this table's)."""
    if not path.exists():
        return {}
    found = {}
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        entry = json.loads(line)
        if entry["protocol"] == protocol:
            found[tuple(entry["cell"])] = tuple(entry["result"])
    return found


if __name__ == "__main__":
    main()
