"""The whole GPU check in one command (`make gpu-check`), for the rare call on a GPU machine:

1. the CUDA tests (`pytest -m cuda`): flex attention forward/backward with dropout against the
   reference, bf16 span mask, bf16 training step, the nccl single-rank process group;
2. `bench/attention.py`: reference vs sdpa vs flex at spans 512 / 2048 / 8192;
3. `bench/train_step.py` on enwik8_small and enwik8_large at the largest micro-batch that fits,
   the reference attention and `impl: auto`.

It uses the interpreter it runs under (the machine's CUDA torch). `--wheels DIR` installs
what that machine lacks (deepspeed, mlflow, webdataset, ...) from wheels built elsewhere,
`pip install --no-index`; without them every part that needs only torch runs, and the report
names what was skipped and why. The report (markdown) goes to stdout and `--report FILE`;
the exit status is non-zero if any part failed.

Without a GPU it says so in one line and does a dry run: each part's command is checked to
start (`--help`, test collection) and nothing is timed; exit 0 (a test runs this mode).
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OPTIONAL = ("deepspeed", "mlflow", "webdataset")
BATCHES = (64, 48, 32, 24, 16, 12, 8, 4, 2, 1)     # micro-batches tried, largest first


def run(cmd: list[str], timeout: float) -> tuple[int, str]:
    try:
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        return done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as e:
        return 124, f"timed out after {timeout:.0f} s\n{e.stdout or ''}{e.stderr or ''}"


def table_lines(text: str) -> str:
    """The markdown table rows (and the line before them) of a bench's output."""
    lines = text.splitlines()
    keep = [i for i, line in enumerate(lines) if line.startswith("|")]
    if not keep:
        return text[-2000:]
    return "\n".join(lines[max(keep[0] - 2, 0):keep[-1] + 1])


class Report:
    def __init__(self):
        self.parts: list[str] = []
        self.failed: list[str] = []

    def add(self, title: str, code: int, body: str) -> None:
        status = "ok" if code == 0 else f"FAILED (exit {code})"
        if code != 0:
            self.failed.append(title)
        self.parts.append(f"## {title}: {status}\n\n{body.strip()}\n")

    def skip(self, title: str, why: str) -> None:
        self.parts.append(f"## {title}: skipped\n\n{why}\n")

    def text(self, header: str) -> str:
        summary = ("all parts passed" if not self.failed
                   else f"failed: {', '.join(self.failed)}")
        return f"# GPU check\n\n{header}\n\n" + "\n".join(self.parts) + f"\n{summary}\n"


def install_wheels(wheels: Path, report: Report) -> None:
    code, out = run([sys.executable, "-m", "pip", "install", "--no-index", "--find-links",
                     str(wheels), *OPTIONAL], timeout=600)
    report.add(f"install from {wheels}", code, out[-1500:])


def largest_batch_row(config: str, impl_sets: list[str], timeout: float) -> tuple[int, str]:
    """bench/train_step.py at the largest micro-batch of BATCHES that fits in memory."""
    last = ""
    for batch in BATCHES:
        code, out = run([sys.executable, "bench/train_step.py", config, "--batch", str(batch),
                         "--span", "1.0", *impl_sets], timeout)
        if code == 0:
            return 0, f"micro-batch {batch} (the largest that fits)\n\n{table_lines(out)}"
        last = out
        if "OutOfMemoryError" not in out and "out of memory" not in out:
            return code, out[-3000:]
    return 1, f"no micro-batch of {BATCHES} fits\n{last[-2000:]}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--wheels", type=Path, help="a folder of wheels for what is missing")
    parser.add_argument("--report", type=Path, help="also write the report here")
    parser.add_argument("--part-timeout", type=float, default=240)
    args = parser.parse_args()

    import torch

    gpu = torch.cuda.is_available()
    report = Report()
    if not gpu:
        print(f"gpu-check: no CUDA GPU here (torch {torch.__version__}); dry run only")
    if gpu and args.wheels:
        install_wheels(args.wheels, report)
    missing = [m for m in OPTIONAL if importlib.util.find_spec(m) is None]
    if missing:
        report.skip("tests that need " + ", ".join(missing),
                    f"{', '.join(missing)} not installed (give --wheels DIR): the CUDA tests "
                    f"that import them skip, the rest run")

    tests = [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "tests", "-p", "no:cacheprovider"]
    attention = [sys.executable, "bench/attention.py", "--spans", "512,2048,8192",
                 "--impls", "sdpa,flex"]
    steps = [(cfg, impl) for cfg in ("configs/enwik8_small.yaml", "configs/enwik8_large.yaml")
             for impl in ([], ["--set", "model.attention.impl=auto"])]
    if not gpu:
        # the same parts, started but not timed: they must at least collect and parse
        code, out = run([*tests, "--collect-only"], args.part_timeout)
        report.add("CUDA tests (collected)", code, out.strip().splitlines()[-1] if out else "")
        for title, cmd in [("bench/attention.py", attention),
                           ("bench/train_step.py", [sys.executable, "bench/train_step.py"])]:
            code, out = run([*cmd, "--help"], 60)
            report.add(f"{title} (--help)", code, out.splitlines()[0] if out else "")
    else:
        start = time.monotonic()
        code, out = run(tests, args.part_timeout)
        report.add("CUDA tests", code, "\n".join(out.strip().splitlines()[-15:]))
        code, out = run(attention, args.part_timeout)
        report.add("bench/attention.py", code, table_lines(out) if code == 0 else out[-3000:])
        for cfg, impl in steps:
            code, body = largest_batch_row(cfg, impl, args.part_timeout)
            report.add(f"bench/train_step.py {cfg} {' '.join(impl) or '(reference)'}", code,
                       body)
        report.parts.append(f"total {time.monotonic() - start:.0f} s\n")

    device = torch.cuda.get_device_name() if gpu else "no GPU"
    text = report.text(f"torch {torch.__version__}, {device}, python "
                       f"{sys.version.split()[0]}")
    print(text)
    if args.report:
        args.report.write_text(text)
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
