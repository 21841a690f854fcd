"""The whole GPU check in one command (`make gpu-check`), sized for a short GPU rental: every
part has a time budget and the whole keeps to 9 minutes on an H100/H200.

1. install: `--wheels DIR` (from `make gpu-wheels`) installs, with `pip --no-index --no-deps`,
   the wheels whose package this interpreter lacks (pydantic, deepspeed, mlflow-skinny,
   webdataset, ...): the machine has no network;
2. the CUDA tests (`pytest -m cuda` on the files that have them), their failures readable:
   no torch.compile log in pytest's report (TORCH_LOGS unset, --log-level=WARNING, captured
   output not shown), the short tracebacks and the `FAILED` lines in the report;
3. our training step: enwik8_large's model in bf16 at span fractions 1/16 and 1, at
   micro-batch 4 and at the largest micro-batch that fits (searched inside the one process:
   bench/train_step.py --batch 4,max), tokens/s and MFU; with `--reference-code DIR` (the
   user's checkout of the authors' code) the authors' step at the same shape beside it
   (float32, their AdagradWithGradClip) and "vs authors" ratios;
4. the pipeline end to end: `allattn-pipe run` for 50 steps of enwik8_large's model in bf16
   (batch 8, the config's micro-batch: auto) on the built-in python_docs corpus (no
   download), tokens/s from its log;
5. train.compile's step (bench/train_step.py --compile) at span 1/16, micro-batch 4, only if
   time is left: the measurement train.compile's default on CUDA waits for;
6. bench/attention.py, only if time is left.

It uses the interpreter it runs under (the machine's CUDA torch). A part that needs a
missing package is skipped with the reason. The report (markdown) goes to stdout and
`--report FILE`; the exit status is non-zero if any part failed.

Without a GPU it says so in one line and does a dry run: each part's command is checked to
start (test collection, the benches' and the pipeline's --dry-run) and nothing is timed;
exit 0 unless a part cannot start (a test runs this mode).
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import importlib.util
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NEEDED = ("pydantic", "deepspeed", "mlflow", "webdataset")  # what a bare CUDA image lacks

TOTAL_BUDGET = 530.0  # seconds for everything after start-up (9 minutes minus margin)
BUDGETS = {
    "install": 60,
    "tests": 120,
    "step": 240,
    "pipeline": 120,
    "compiled": 120,
    "attention": 60,
}
CONFIG = "configs/enwik8_large.yaml"
SPANS = "0.0625,1"
PIPELINE_STEPS = 50
# the environment variables that turn torch.compile's logs on: they would flood the report
LOUD = ("TORCH_LOGS", "TORCHDYNAMO_VERBOSE", "TORCH_COMPILE_DEBUG", "TORCHINDUCTOR_VERBOSE")


def quiet_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in LOUD}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run(cmd: list[str], timeout: float, cwd: Path = ROOT) -> tuple[int, str]:
    """Run ``cmd``; on timeout kill its whole process group (compile workers too) and return
    124 with what it printed so far."""
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(
            cmd,
            cwd=cwd,
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
            env=quiet_env(),
            start_new_session=True,
        )
        try:
            code = proc.wait(timeout=max(timeout, 1))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = 124
        out.seek(0)
        text = out.read()
    if code == 124:
        text += f"\n(timed out after {timeout:.0f} s)"
    return code, text


def table_lines(text: str) -> str:
    """The markdown table rows of a bench's output and the lines after them."""
    lines = text.splitlines()
    keep = [i for i, line in enumerate(lines) if line.startswith("|")]
    if not keep:
        return text[-3000:]
    return "\n".join(lines[max(keep[0] - 2, 0) :])[-6000:]


def pytest_digest(text: str, cap: int = 8000, per_failure: int = 1800) -> str:
    """What a reader needs from pytest's output: the closing line, the short test summary
    (FAILED / ERROR lines with their messages) and each failure's short traceback, its last
    ``per_failure`` characters; at most ``cap`` characters in all."""
    lines = text.rstrip().splitlines()
    closing = lines[-1] if lines else "(no output)"
    sections = re.split(
        r"^=+ (FAILURES|ERRORS|short test summary info|warnings summary) =+$", text, flags=re.M
    )
    named = dict(zip(sections[1::2], sections[2::2], strict=False))
    parts = []
    summary = named.get("short test summary info", "")
    summary = "\n".join(
        line for line in summary.splitlines() if line.startswith(("FAILED", "ERROR"))
    )
    if summary:
        parts.append(summary)
    for kind in ("FAILURES", "ERRORS"):
        body = named.get(kind, "")
        for block in re.split(r"^(?=_{3,} .* _{3,}$)", body, flags=re.M):
            block = block.strip()
            if block:
                parts.append(
                    block
                    if len(block) <= per_failure
                    else block.splitlines()[0] + "\n...\n" + block[-per_failure:]
                )
    body = "\n\n".join(parts)
    if len(body) > cap:
        body = body[:cap] + "\n... (cut)"
    return f"{closing}\n\n```\n{body}\n```" if body else closing


class Report:
    def __init__(self):
        self.parts: list[str] = []
        self.failed: list[str] = []

    def add(
        self, title: str, code: int, body: str, seconds: float | None = None, optional: bool = False
    ) -> None:
        """optional: a part that only uses the time left; cut at its budget it is not a
        failure."""
        status = "ok" if code == 0 else ("TIMED OUT" if code == 124 else f"FAILED (exit {code})")
        if optional and code == 124:
            status = "cut at its time budget (what it measured is below)"
        elif code != 0:
            self.failed.append(title)
        took = f" ({seconds:.0f} s)" if seconds is not None else ""
        self.parts.append(f"## {title}: {status}{took}\n\n{body.strip()}\n")

    def skip(self, title: str, why: str) -> None:
        self.parts.append(f"## {title}: skipped\n\n{why}\n")

    def text(self, header: str) -> str:
        summary = "all parts passed" if not self.failed else f"failed: {', '.join(self.failed)}"
        return f"# GPU check\n\n{header}\n\n" + "\n".join(self.parts) + f"\n{summary}\n"


def wheel_name(path: Path) -> str:
    return re.sub(r"[-_.]+", "-", path.name.split("-")[0]).lower()


def installed(name: str) -> bool:
    try:
        md.version(name)
        return True
    except md.PackageNotFoundError:
        return False


def missing_wheels(folder: Path) -> list[Path]:
    """The wheels in ``folder`` whose package is not installed here (the image's own
    versions are kept)."""
    return sorted(w for w in folder.glob("*.whl") if not installed(wheel_name(w)))


def install_wheels(folder: Path, timeout: float) -> tuple[int, str]:
    if not folder.is_dir():
        return 1, f"{folder}: no such folder (make gpu-wheels writes gpu-wheels/)"
    wheels = missing_wheels(folder)
    if not wheels:
        return 0, f"every package of the {len(list(folder.glob('*.whl')))} wheels is installed"
    pip = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--no-index",
        "--no-deps",
        "--disable-pip-version-check",
        "--no-compile",
    ]
    t0 = time.monotonic()
    code, out = run([*pip, *map(str, wheels)], timeout)
    where = "into the interpreter's environment"
    if code not in (0, 124):
        # a read-only environment: beside it, on PYTHONPATH for every part (and this process)
        site = Path(tempfile.gettempdir()) / "gpu-check-site"
        code, out = run(
            [*pip, "--target", str(site), *map(str, wheels)], timeout - (time.monotonic() - t0)
        )
        if code == 0:
            os.environ["PYTHONPATH"] = os.pathsep.join(
                [str(site), *filter(None, [os.environ.get("PYTHONPATH")])]
            )
            sys.path.insert(0, str(site))
            where = f"into {site} (PYTHONPATH), the environment refusing them"
    return code, (
        f"installed {len(wheels)} wheels {where}: "
        + ", ".join(wheel_name(w) for w in wheels)
        + "\n"
        + out[-1500:]
    )


def missing(*modules: str) -> list[str]:
    return [m for m in modules if importlib.util.find_spec(m) is None]


def cuda_test_files() -> list[str]:
    """The test files with `cuda`-marked tests: collecting only those keeps a bare image's
    missing packages (hypothesis, mlflow, ...) from erroring the collection of others."""
    return sorted(
        str(p.relative_to(ROOT))
        for p in (ROOT / "tests").rglob("test_*.py")
        if re.search(r"mark\.cuda\b", p.read_text())
    )


def pipeline_config(folder: Path, batch: int) -> Path:
    """enwik8_large's model in bf16 on the built-in corpus: download (builtin), preprocess,
    train for PIPELINE_STEPS steps of ``batch`` sequences, the config's micro-batch (auto:
    the largest divisor of it that fits, searched at the start); no network, no shared
    data."""
    path = folder / "gpu_check_pipeline.yaml"
    path.write_text(f"""\
extends: [{ROOT / CONFIG}]
name: gpu_check_enwik8_large
dataset: python_docs
train:
  steps: {PIPELINE_STEPS}
  batch_size: {batch}
  log_every: 10
  eval_every: {PIPELINE_STEPS}
  eval_batches: 2
  checkpoint_every: {PIPELINE_STEPS}
  deepspeed: {{bf16: true}}
stages: [download, preprocess, train]
workspace: {{root: {folder / "runs"}}}
""")
    return path


def pipeline_digest(out: str, seconds: float) -> str:
    steps = [line.strip() for line in out.splitlines() if "tok/s" in line]
    rates = [
        float(m.group(1).replace(",", ""))
        for line in steps
        if (m := re.search(r"([\d,]+) tok/s", line))
    ]
    head = (
        f"tokens/s over the last logged window: {rates[-1]:,.0f} (windows: "
        f"{', '.join(f'{r:,.0f}' for r in rates)}); the whole run {seconds:.0f} s\n\n"
        if rates
        else ""
    )
    return head + "```\n" + "\n".join(steps[-6:] or out.splitlines()[-25:]) + "\n```"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--wheels", type=Path, help="a folder of wheels for what is missing")
    parser.add_argument(
        "--reference-code",
        type=Path,
        help="a checkout of the authors' code (facebookresearch/adaptive-span): "
        "their step timed beside ours",
    )
    parser.add_argument("--report", type=Path, help="also write the report here")
    parser.add_argument(
        "--budget",
        type=float,
        default=TOTAL_BUDGET,
        help="seconds for all parts together (default %(default)g)",
    )
    parser.add_argument(
        "--pipeline-batch", type=int, default=8, help="the pipeline's batch (sequences per step)"
    )
    args = parser.parse_args()

    import torch

    start = time.monotonic()
    deadline = start + args.budget
    gpu = torch.cuda.is_available()
    report = Report()
    if not gpu:
        print(f"gpu-check: no CUDA GPU here (torch {torch.__version__}); dry run only")

    def timeout(part: str) -> float:
        return min(BUDGETS[part], deadline - time.monotonic())

    def part(
        title: str, budget: str, cmd: list[str], digest=table_lines, optional: bool = False
    ) -> None:
        limit = timeout(budget)
        if limit < 15:
            report.skip(title, f"the check's {args.budget:.0f} s were spent")
            return
        t0 = time.monotonic()
        code, out = run(cmd, limit)
        took = time.monotonic() - t0
        # a failure shows its output's end (the traceback); a time-out what it measured
        readable = code in (0, 124) or digest is pytest_digest
        report.add(title, code, digest(out) if readable else out[-4000:], took, optional)

    # 1. what the image lacks
    if args.wheels:
        if gpu:
            t0 = time.monotonic()
            code, out = install_wheels(args.wheels, timeout("install"))
            report.add(f"install from {args.wheels}", code, out, time.monotonic() - t0)
        else:
            wheels = sorted(args.wheels.glob("*.whl")) if args.wheels.is_dir() else []
            report.add(
                f"install from {args.wheels} (not run)",
                0 if wheels else 1,
                f"{len(wheels)} wheels, {len(missing_wheels(args.wheels))} of them "
                f"for packages not installed here"
                if wheels
                else f"{args.wheels}: no wheels (make gpu-wheels)",
            )
    importlib.invalidate_caches()
    absent = missing(*NEEDED)
    if absent:
        report.skip(
            "packages",
            f"{', '.join(absent)} not installed (give --wheels DIR from "
            f"`make gpu-wheels`): the parts that need them are skipped",
        )

    # 2. the CUDA tests
    files = cuda_test_files()
    tests = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-m",
        "cuda",
        *files,
        "-p",
        "no:cacheprovider",
        "--tb=short",
        "-rfEs",
        "--show-capture=no",
        "--log-level=WARNING",
    ]
    if gpu:
        part("CUDA tests", "tests", tests, digest=pytest_digest)
    else:
        code, out = run([*tests, "--collect-only"], 120)
        report.add(
            "CUDA tests (collected)", code, out.strip().splitlines()[-1] if out.strip() else ""
        )

    # 3. the training step, ours and the authors'
    step = [
        sys.executable,
        "bench/train_step.py",
        CONFIG,
        "--dtype",
        "bf16",
        "--span",
        SPANS,
        "--batch",
        "4,max",
        "--steps",
        "5",
        "--warmup",
        "2",
        "--time-budget",
        str(max(BUDGETS["step"] - 40, 30)),
    ]
    if args.reference_code:
        step += ["--reference-code", str(args.reference_code.resolve())]
    title = f"training step, {CONFIG} bf16" + (
        " vs the authors' code (fp32)" if args.reference_code else ""
    )
    if missing("pydantic"):
        report.skip(title, "needs pydantic (the config's schema): give --wheels DIR")
    elif gpu:
        part(title, "step", step)
    else:
        code, out = run([*step, "--dry-run"], 120)
        report.add(f"{title} (--dry-run)", code, out.strip()[-2000:])

    # 4. the pipeline end to end
    title = f"pipeline: allattn-pipe run, {PIPELINE_STEPS} steps, enwik8_large's model bf16"
    lacking = missing(*NEEDED)
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        cfg = pipeline_config(Path(tmp), args.pipeline_batch)
        cli = [sys.executable, "-m", "pipeline.commands.cli", "run", str(cfg)]
        if lacking:
            report.skip(title, f"needs {', '.join(lacking)}: give --wheels DIR")
        elif gpu:
            t0 = time.monotonic()
            part(
                title,
                "pipeline",
                cli,
                digest=lambda out: pipeline_digest(out, time.monotonic() - t0),
            )
        else:
            code, out = run([*cli, "--dry-run"], 120)
            report.add(f"{title} (--dry-run)", code, out.strip()[-2000:])

    # 5. train.compile's step beside the eager one of part 3 (same shape, span 1/16,
    # micro-batch 4), with what is left: the measurement train.compile's default waits for
    compiled = [
        sys.executable,
        "bench/train_step.py",
        CONFIG,
        "--dtype",
        "bf16",
        "--span",
        SPANS.split(",")[0],
        "--batch",
        "4",
        "--steps",
        "5",
        "--warmup",
        "2",
        "--compile",
    ]
    title = f"training step, {CONFIG} bf16, layers compiled (train.compile)"
    if missing("pydantic"):
        report.skip(title, "needs pydantic (the config's schema): give --wheels DIR")
    elif gpu:
        part(title, "compiled", compiled, optional=True)
    else:
        code, out = run([*compiled, "--dry-run"], 120)
        report.add(f"{title} (--dry-run)", code, out.strip()[-2000:])

    # 6. the attention kernels alone, with what is left
    attention = [
        sys.executable,
        "bench/attention.py",
        "--spans",
        "512,2048,8192",
        "--impls",
        "sdpa,flex",
    ]
    if gpu:
        part("bench/attention.py", "attention", attention, optional=True)
        report.parts.append(
            f"total {time.monotonic() - start:.0f} s of a {args.budget:.0f} s budget\n"
        )
    else:
        code, out = run([*attention, "--help"], 60)
        report.add("bench/attention.py (--help)", code, out.splitlines()[0] if out else "")

    device = torch.cuda.get_device_name() if gpu else "no GPU"
    text = report.text(f"torch {torch.__version__}, {device}, python {sys.version.split()[0]}")
    print(text)
    if args.report:
        args.report.write_text(text)
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
