"""Wall time of the quickstart as a newcomer runs it, stage by stage: the figure README.md quotes.

    python -m bench.quickstart [--runs 3] [--threads N] [--cached-corpus] [--set K=V]

Each run is `allattn-pipe run configs/quickstart.yaml` in a fresh temporary workspace, as
after a fresh clone (the install excluded): every stage runs, and the built-in corpus is built
again from the standard library into an empty user cache ($XDG_CACHE_HOME pointed at the
run's temporary folder, so matplotlib's font list is rebuilt too, as on a new machine) unless
--cached-corpus keeps the user's. "total" is the wall time of the whole command, interpreter
start and imports included; the stage columns are the `[stage] done in` times the runner
prints; "CPU time" is the user and system time of the run's processes, all threads. The
table ends with the median of each column over the runs, and shows the bpc each run
printed, so a run that trained differently stands out.

Measure on an idle machine: the stages share the cores with anything else running, so the
load averages before and after are printed with the table. On a busy machine the CPU time
still says what a run costs: with --threads 1 it is about the wall time on one idle core
(2 idle cores take less); with more threads a busy machine adds the time the threads spend
waiting for each other. DeepSpeed compiles its C++ op on the first run after an install
(cached in .venv/torch_extensions): run once before timing a fresh install. Prints tables;
asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("download", "preprocess", "train", "finetune", "evaluate")
DONE = re.compile(r"\[(\w+)\] done in ([\d.]+)s")
BPC = re.compile(r"\[evaluate\] (valid|test)\s+bpc (\d+\.\d+)")


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def load() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "?"


def run_once(config: str, overrides: list[str], threads: int | None, cached: bool) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-quickstart-") as tmp:
        env = dict(os.environ)
        env.setdefault("DS_ACCELERATOR", "cpu")
        if threads:
            env["OMP_NUM_THREADS"] = str(threads)
        if not cached:  # a machine that has never built the corpus
            env["XDG_CACHE_HOME"] = str(Path(tmp) / "cache")
        cmd = [sys.executable, "-m", "pipeline.commands.cli", "run", config]
        cmd += ["--set", f"workspace.root={Path(tmp) / 'runs'}"]
        for item in overrides:
            cmd += ["--set", item]
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        started = time.perf_counter()
        result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        total = time.perf_counter() - started
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if result.returncode != 0:
        sys.exit(f"quickstart failed (exit {result.returncode}):\n{result.stdout}\n{result.stderr}")
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    row: dict = {"total": total, "cpu": cpu}
    for name, seconds in DONE.findall(result.stdout):
        row[name] = float(seconds)
    for split, bpc in BPC.findall(result.stdout):
        row[split] = bpc
    return row


def seconds(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.1f}" if value < 100 else f"{value:.0f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--config", default="configs/quickstart.yaml")
    parser.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS for the runs")
    parser.add_argument(
        "--cached-corpus", action="store_true", help="reuse the user's built corpus if there is one"
    )
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args()

    import torch

    threads = args.threads or int(os.environ.get("OMP_NUM_THREADS", 0)) or torch.get_num_threads()
    print(
        f"{args.config}, {args.runs} run(s) in fresh workspaces; {os.cpu_count()} CPU cores "
        f"({cpu_name()}), {threads} thread(s), CPython {platform.python_version()}, "
        f"torch {torch.__version__}; corpus {'cached' if args.cached_corpus else 'built each run'}"
    )
    print(f"load average before: {load()}\n")
    rows = []
    for i in range(args.runs):
        rows.append(run_once(args.config, args.overrides, args.threads, args.cached_corpus))
        print(f"  run {i + 1}: {rows[-1]['total']:.0f} s", file=sys.stderr, flush=True)
    columns = (*STAGES, "total", "cpu")
    print(
        "| run | "
        + " | ".join(f"{c} (s)" if c != "cpu" else "CPU time (s)" for c in columns)
        + " | valid bpc | test bpc |"
    )
    print("|---|" + "---:|" * len(columns) + "---|---|")
    for i, row in enumerate(rows, 1):
        cells = [seconds(row.get(c)) for c in columns]
        print(
            f"| {i} | "
            + " | ".join(cells)
            + f" | {row.get('valid', '-')} | {row.get('test', '-')} |"
        )
    medians = []
    for c in columns:
        values = [row[c] for row in rows if c in row]
        medians.append(seconds(statistics.median(values)) if values else "-")
    print("| median | " + " | ".join(medians) + " | | |")
    total = statistics.median(row["total"] for row in rows)
    print(f"\nmedian total: {total / 60:.1f} min; load average after: {load()}")


if __name__ == "__main__":
    main()
