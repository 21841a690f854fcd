"""`show --estimate` on every config under configs/, one at a time: exit status, peak resident
memory against the memory available when it started, wall time, and what it printed of the
memory plan, the timing and the GPU time.

    python -m bench.estimate_configs [--configs configs] [--only NAME,...]

Each runs as `allattn-pipe show CONFIG --estimate` in a fresh process with a temporary
workspace; its peak resident set is the kernel's (os.wait4's ru_maxrss), the memory available
is psutil's (or the cgroup's room, as the estimate reads it) just before it starts. The
acceptance of issue 52: exit 0 and a peak under half of what was available, the plan and the
GPU time printed. The bases under configs/base/ are no configs of their own: the loader
refuses them in one line (exit 2), which the table shows. Prints a table; asserts nothing."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def run_one(config: Path) -> dict:
    from pipeline.training.memory_plan import available_memory

    available, _ = available_memory()
    with tempfile.TemporaryDirectory() as tmp:
        command = [
            sys.executable, "-m", "pipeline.commands.cli", "show", str(config), "--estimate",
            "--set", f"workspace.root={tmp}",
        ]  # fmt: skip
        start = time.monotonic()
        with open(Path(tmp) / "out", "w+") as out:
            proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
            _, status, usage = os.wait4(proc.pid, 0)
            proc.returncode = os.waitstatus_to_exitcode(status)
            out.seek(0)
            text = out.read()
    return {
        "exit": proc.returncode,
        "peak": usage.ru_maxrss * 1024,
        "available": available,
        "seconds": time.monotonic() - start,
        "text": text,
    }


def what_was_timed(text: str) -> str:
    """The estimate's own words on its timing, shortened for the table."""
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("time here: not timed"):
            return "not timed: " + line.split("not timed: ", 1)[1][:70]
        if line.startswith("update time here:"):
            rows = re.search(r"(\d+) of the update's (\d+) rows", line)
            return f"{rows[1]} of {rows[2]} rows, scaled" if rows else "the run's update"
    return ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default="configs")
    parser.add_argument("--only", default="", help="comma-separated config stems")
    args = parser.parse_args()
    configs = sorted(Path(args.configs).rglob("*.yaml"))
    if args.only:
        configs = [c for c in configs if c.stem in args.only.split(",")]
    print("| config | exit | peak RSS GiB | available GiB | peak / available | wall s | "
          "plan | GPU time | timed |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---|---|---|")
    for config in configs:
        r = run_one(config)
        text = r["text"]
        plan = "yes" if "memory plan per GPU" in text else "no"
        gpu = "yes" if "H100 time" in text else "no"
        print(
            f"| {config.relative_to(args.configs)} | {r['exit']} | {r['peak'] / 2**30:.2f} | "
            f"{r['available'] / 2**30:.1f} | {r['peak'] / r['available']:.2f} | "
            f"{r['seconds']:.0f} | {plan} | {gpu} | {what_was_timed(text)} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
