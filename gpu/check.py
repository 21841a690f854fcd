"""The whole GPU check in one command (`make gpu-check`), sized for a short GPU rental: every
part has a time budget, and the parts run in this order, the most wanted first. One call runs
the essentials (parts 1-6), whose budgets add up to the 9 minutes (530 s) one call on an
H100/H200 has; the report ends with the exact command of the second call, for the rest
(parts 7-11) and any essential the budget did not reach. `--parts` runs a chosen few
(`make gpu-check PARTS=...`), `--parts all` all of them.

1. install: `--wheels DIR` (from `make gpu-wheels`) installs, with `pip --no-index --no-deps`,
   the wheels whose package this interpreter lacks (pydantic, deepspeed, mlflow-skinny,
   webdataset, ...): the machine has no network;
2. `nan`: gpu/nan_check.py, what stops the fast path (triton + bf16 + CUDA graphs) on a
   non-finite update: each Triton tile forced in bf16 against the reference in float64,
   enwik8_small's model trained 25 updates by hand with triton and with the reference, the
   CUDA graphs' recordings counted; its last line names the cause;
3. `tests`: the CUDA tests (`pytest -m cuda` on the files that have them: the Triton
   kernels in bf16 against float64 among them; flex's are part 9), their failures
   readable: no torch.compile log in pytest's report (TORCH_LOGS unset,
   --log-level=WARNING, captured output not shown), the short tracebacks and the `FAILED`
   lines in the report;
4. `learning`: gpu/learning_check.py, enwik8_small's model trained 300 updates with the
   Triton kernels, bf16 and CUDA graphs against the reference op in float32 from the same
   weights and batches, and a second float32 seed for the spread, the three side by side;
5. `step`: our training step with the Triton kernels (attention.impl triton), eager:
   enwik8_large's model in bf16 at span fractions 1/16 and 1, at micro-batch 4 and at the
   largest that fits (bench/train_step.py --batch 4,max), tokens/s and MFU; with
   `--reference-code DIR` (the user's checkout of the authors' code) the authors' step at
   the same shape beside it (float32, their AdagradWithGradClip) and "vs authors" ratios;
6. `attention`: the op alone (bench/attention.py: the reference and triton, fwd+bwd with
   dropout 0.4, N 2048, spans 1024 and 8192): time and peak memory;
7. `graphs`: the step of part 5 with the layers compiled and replayed as CUDA graphs
   (train.compile: graphs), at micro-batch 4;
8. `pipeline`: `allattn-pipe run` for 50 steps of enwik8_large's model in bf16 with the
   Triton kernels and CUDA graphs under the DeepSpeed engine (batch 8, the config's
   micro-batch: auto) on the built-in python_docs corpus (no download), tokens/s from its
   log;
9. `fused-tests`: flex's CUDA tests (FUSED_TESTS), a torch.compile each;
10. `flex`: part 6 with flex in place of triton;
11. `reference`: today's path for comparison, the reference op's eager step at micro-batch 4.

It uses the interpreter it runs under (the machine's CUDA torch). A part that needs a
missing package is skipped with the reason. The report (markdown) goes to stdout and
`--report FILE`; the exit status is non-zero if any part failed.

Without a GPU it says so in one line and does a dry run: each part's command is checked to
start (test collection, the benches' and the pipeline's --dry-run, the nan part at a tiny
shape in Triton's interpreter) and nothing is timed; exit 0 unless a part cannot start (a
test runs this mode).
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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NEEDED = ("pydantic", "deepspeed", "mlflow", "webdataset")  # what a bare CUDA image lacks

TOTAL_BUDGET = 530.0  # seconds for one call's parts after start-up (9 minutes minus margin)
# Each part's own limit, in the order the parts run. The essentials' budgets add up to
# TOTAL_BUDGET (tests/system/cluster/test_gpu_check.py holds it): one call on an H100 reaches every
# essential even when each takes all of its budget. The estimates are the first GPU check's
# (docs/benchmarks.md) where it measured them.
BUDGETS = {
    # pip --no-index --no-deps of up to ~50 local wheels (26 MB), nothing compiled: ~15-25 s
    "install": 40,
    # (a) 4 tiles x 4 kernels compiled in bf16, (b) the corpus (~8 s), the same 16 again with
    # dropout for the timed choice and 2 x 25 eager updates, (c) a child compiling the layers
    # in CUDA graphs (~30-40 s); ~1.2 s a Triton compile (the first check's CUDA tests);
    # gpu/nan_check.py stops at 10 s less; its compiles are cached on disk for what follows
    "nan": 125,
    # the Triton and bf16 cases (~24, a few compiles each at ~1.2 s) and a model traced;
    # flex's, a torch.compile each (~20 s), are in the second call (FUSED_TESTS)
    "tests": 115,
    # three 300-update runs side by side; the fast run's start-up and compile in graphs
    # (partly cached by the nan part) hold it; the runs get 10 s less
    "learning": 120,
    # enwik8_large eager at 2 spans x micro-batch 4, then the largest that fits searched and
    # timed; no row starts after 60 s
    "step": 90,
    # reference and triton at spans 1024 and 8192: Triton's compile and tile timing (~25 s);
    # cut, it is not a failure
    "attention": 40,
    # the second call (REST): compiles in CUDA graphs (~40 s a span); DeepSpeed's start-up,
    # the corpus and 50 steps; flex's CUDA tests (4 compiles); flex's compile per span
    # (~30 s); two eager rows
    "graphs": 100,
    "pipeline": 90,
    "fused-tests": 100,
    "flex": 70,
    "reference": 50,
}
ESSENTIALS = ("install", "nan", "tests", "learning", "step", "attention")
REST = tuple(k for k in BUDGETS if k not in ESSENTIALS)
CONFIG = "configs/enwik8_large.yaml"
SPANS = "0.0625,1"
PIPELINE_STEPS = 50
# flex's CUDA cases: the tests part runs the others, the second call these
FUSED_TESTS = "tests/unit/ops/test_attention_fused.py"
NAN_REPORT = 24000  # characters of the nan part's report kept: its tables end in the cause
# the environment variables that turn torch.compile's logs on: they would flood the report
LOUD = ("TORCH_LOGS", "TORCHDYNAMO_VERBOSE", "TORCH_COMPILE_DEBUG", "TORCHINDUCTOR_VERBOSE")


def quiet_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in LOUD}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def start(cmd: list[str], out, cwd: Path = ROOT) -> subprocess.Popen:
    """Start ``cmd`` in a process group of its own, its output (stdout and stderr) to the
    open file ``out``, torch.compile's logs off."""
    return subprocess.Popen(
        cmd,
        cwd=cwd,
        stdout=out,
        stderr=subprocess.STDOUT,
        text=True,
        env=quiet_env(),
        start_new_session=True,
    )


def finish(proc: subprocess.Popen, timeout: float) -> int:
    """Wait for ``proc``; on timeout kill its whole process group (compile workers too) and
    return 124."""
    try:
        return proc.wait(timeout=max(timeout, 1))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return 124


def run(cmd: list[str], timeout: float, cwd: Path = ROOT) -> tuple[int, str]:
    """Run ``cmd`` (``start``, ``finish``): its exit status, 124 on timeout, and what it
    printed so far."""
    with tempfile.TemporaryFile("w+") as out:
        code = finish(start(cmd, out, cwd), timeout)
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
    """enwik8_large's model in bf16 with the Triton kernels and CUDA graphs on the built-in
    corpus: download (builtin), preprocess, train for PIPELINE_STEPS steps of ``batch``
    sequences, the config's micro-batch (auto: the largest divisor of it that fits, searched
    at the start); no network, no shared data."""
    path = folder / "gpu_check_pipeline.yaml"
    path.write_text(f"""\
extends: [{ROOT / CONFIG}]
name: gpu_check_enwik8_large
dataset: python_docs
model: {{attention: {{impl: triton}}}}
train:
  compile: graphs
  steps: {PIPELINE_STEPS}
  optimizer: {{warmup_steps: {PIPELINE_STEPS // 5}}}  # the paper's 32,000 outlast a short run
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


def digest_tests(out: str, seconds: float) -> str:
    return pytest_digest(out)


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


@dataclass
class Part:
    """One part of the check: what it runs on a GPU and, without one, what checks it starts."""

    key: str  # its name in BUDGETS and --parts
    title: str
    cmd: list[str]
    dry: list[str]  # the no-GPU run: --dry-run, --help or test collection
    needs: tuple[str, ...] = ()  # modules it cannot start without
    digest: Callable[[str, float], str] = lambda out, seconds: table_lines(out)
    optional: bool = False  # cut at its budget, it is not a failure


def commands(args, folder: Path) -> dict[str, list[str]]:
    """What each part after the install runs on a GPU, by its key."""
    py = sys.executable
    pytest = [
        py, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider", "--tb=short", "-rfEs",
        "--show-capture=no", "--log-level=WARNING",
    ]  # fmt: skip
    step = [py, "-m", "bench.train_step", CONFIG, "--dtype", "bf16", "--steps", "5"]
    step += ["--warmup", "2"]
    triton = ["--set", "model.attention.impl=triton"]
    authors = (
        ["--reference-code", str(args.reference_code.resolve())] if args.reference_code else []
    )
    eager = [*step, *triton, "--span", SPANS, "--batch", "4,max", *authors]
    eager += ["--time-budget", str(BUDGETS["step"] - 30)]  # no row started past it
    # the three trainings side by side on the one GPU, within the part's budget
    learning = [py, "-m", "gpu.learning_check", "--jobs", "3"]
    learning += ["--budget", str(BUDGETS["learning"] - 10)]
    learning += ["--timeout", str(BUDGETS["learning"] - 10)]
    attention = [
        py, "-m", "bench.attention", "--spans", "1024,8192", "--persistent", "2048",
        "--dropout", "0.4",
    ]  # fmt: skip
    pipeline = [py, "-m", "pipeline.commands.cli", "run"]
    return {
        "nan": [py, "-m", "gpu.nan_check", "--budget", str(BUDGETS["nan"] - 10)],
        "tests": [*pytest, *(f for f in cuda_test_files() if f != FUSED_TESTS)],
        "learning": learning,
        "step": eager,
        "attention": [*attention, "--impls", "triton"],
        "graphs": [*step, *triton, "--graphs", "--span", SPANS, "--batch", "4"],
        "pipeline": [*pipeline, str(pipeline_config(folder, args.pipeline_batch))],
        "fused-tests": [*pytest, FUSED_TESTS],
        "flex": [*attention, "--impls", "flex"],
        "reference": [
            *step, "--set", "model.attention.impl=reference", "--span", SPANS, "--batch", "4",
        ],
    }  # fmt: skip


def plan(args, folder: Path) -> list[Part]:
    """The parts after the install, in the order they run (BUDGETS')."""
    cmd = commands(args, folder)
    vs = " vs the authors' code (fp32)" if args.reference_code else ""
    op = "the op alone: bench/attention.py, {} against the reference, bf16, dropout 0.4, N 2048"
    nan_dry = [*cmd["nan"][:3], "--dry-run"]
    digest_nan = lambda out, seconds: out[-NAN_REPORT:]  # noqa: E731  (markdown, cause last)
    return [
        Part("nan", "nan: what stops triton + bf16 + CUDA graphs on a non-finite update "
             "(gpu/nan_check.py)", cmd["nan"], nan_dry, needs=("pydantic",), digest=digest_nan),
        Part("tests", "CUDA tests", cmd["tests"], [*cmd["tests"], "--collect-only"],
             digest=digest_tests),
        Part("learning", "learning check: triton + bf16 + CUDA graphs against the reference "
             "in float32, 300 updates of enwik8_small's model", cmd["learning"],
             [*cmd["learning"], "--dry-run"], needs=NEEDED),
        Part("step", f"training step, {CONFIG} bf16, attention triton, eager{vs}", cmd["step"],
             [*cmd["step"], "--dry-run"], needs=("pydantic",)),
        Part("attention", op.format("triton"), cmd["attention"], [*cmd["attention"], "--help"],
             optional=True),
        Part("graphs", f"training step, {CONFIG} bf16, attention triton, layers in CUDA graphs "
             "(train.compile: graphs)", cmd["graphs"], [*cmd["graphs"], "--dry-run"],
             needs=("pydantic",)),
        Part("pipeline", f"pipeline: allattn-pipe run, {PIPELINE_STEPS} steps, enwik8_large's "
             "model bf16, attention triton, CUDA graphs", cmd["pipeline"],
             [*cmd["pipeline"], "--dry-run"], needs=NEEDED, digest=pipeline_digest),
        Part("fused-tests", f"CUDA tests of flex ({FUSED_TESTS})", cmd["fused-tests"],
             [*cmd["fused-tests"], "--collect-only"], digest=digest_tests),
        Part("flex", op.format("flex"), cmd["flex"], [*cmd["flex"], "--help"], optional=True),
        Part("reference", f"training step, {CONFIG} bf16, the reference op, eager (the "
             "path these replace)", cmd["reference"], [*cmd["reference"], "--dry-run"],
             needs=("pydantic",), optional=True),
    ]  # fmt: skip


def parse_args(argv=None) -> argparse.Namespace:
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
    parser.add_argument(
        "--parts",
        help="which parts to run, comma-separated, in their fixed order; all: every part "
        f"(default: the essentials, {', '.join(ESSENTIALS)}; the report prints the call "
        "for the rest)",
    )
    args = parser.parse_args(argv)
    if args.parts in (None, "all"):
        args.chosen = list(ESSENTIALS if args.parts is None else BUDGETS)
    else:
        args.chosen = args.parts.split(",")
        unknown = set(args.chosen) - set(BUDGETS)
        if unknown:
            parser.error(
                f"--parts: no part {', '.join(sorted(unknown))}; parts: {', '.join(BUDGETS)}, "
                "or all"
            )
    return args


def second_call(args, unreached: list[str]) -> str:
    """The command for what this call did not run: after the essentials (the default) the
    rest, and the parts this call's budget did not reach; "" when there is none."""
    left = set(unreached) | (set(REST) if args.parts is None else set())
    if not left:
        return ""
    given = [f"WHEELS={args.wheels}"] if args.wheels else []
    given += [f"REFERENCE={args.reference_code}"] if args.reference_code else []
    parts = ",".join(k for k in BUDGETS if k in left)
    return f"second call, for the parts this one did not run: make gpu-check PARTS={parts}" + (
        "".join(f" {g}" for g in given)
    )


def main() -> int:
    args = parse_args()

    import torch

    start = time.monotonic()
    deadline = start + args.budget
    gpu = torch.cuda.is_available()
    report = Report()
    if not gpu:
        print(f"gpu-check: no CUDA GPU here (torch {torch.__version__}); dry run only")
    if args.wheels:
        install(args.wheels, gpu, report, min(BUDGETS["install"], args.budget))
    importlib.invalidate_caches()
    absent = missing(*NEEDED)
    if absent:
        report.skip(
            "packages",
            f"{', '.join(absent)} not installed (give --wheels DIR from "
            f"`make gpu-wheels`): the parts that need them are skipped",
        )
    unreached = []
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        for part in plan(args, Path(tmp)):
            if part.key in args.chosen:
                limit = min(BUDGETS[part.key], deadline - time.monotonic())
                if not run_part(part, gpu, report, limit):
                    unreached.append(part.key)
    if gpu:
        report.parts.append(
            f"total {time.monotonic() - start:.0f} s of a {args.budget:.0f} s budget\n"
        )
    device = torch.cuda.get_device_name() if gpu else "no GPU"
    text = report.text(f"torch {torch.__version__}, {device}, python {sys.version.split()[0]}")
    if then := second_call(args, unreached):
        text += f"\n{then}\n"
    print(text)
    if args.report:
        args.report.write_text(text)
    return 1 if report.failed else 0


def install(wheels: Path, gpu: bool, report: Report, limit: float) -> None:
    """Install what the image lacks (on a GPU), or say what would be installed."""
    if gpu:
        t0 = time.monotonic()
        code, out = install_wheels(wheels, limit)
        report.add(f"install from {wheels}", code, out, time.monotonic() - t0)
        return
    found = sorted(wheels.glob("*.whl")) if wheels.is_dir() else []
    report.add(
        f"install from {wheels} (not run)",
        0 if found else 1,
        f"{len(found)} wheels, {len(missing_wheels(wheels))} of them for packages not "
        "installed here"
        if found
        else f"{wheels}: no wheels (make gpu-wheels)",
    )


def run_part(part: Part, gpu: bool, report: Report, limit: float) -> bool:
    """Run one part within ``limit`` seconds (on a GPU), or check that it starts; False
    where the check's budget no longer reaches it."""
    lacking = missing(*part.needs)
    if lacking:
        report.skip(part.title, f"needs {', '.join(lacking)}: give --wheels DIR")
        return True
    if not gpu:
        code, out = run(part.dry, 120)
        kind = "collected" if "--collect-only" in part.dry else part.dry[-1]
        body = out.strip().splitlines()[-1] if kind == "collected" and out.strip() else out
        report.add(f"{part.title} ({kind})", code, body.strip()[-2000:])
        return True
    if limit < 15:
        report.skip(part.title, "the check's time budget was spent before it")
        return False
    t0 = time.monotonic()
    code, out = run(part.cmd, limit)
    took = time.monotonic() - t0
    # a failure shows its output's end (the traceback); a time-out what it measured; pytest's
    # digest keeps a failure's traceback itself
    readable = code in (0, 124) or part.digest is digest_tests
    body = part.digest(out, took) if readable else out[-4000:]
    report.add(part.title, code, body, took, part.optional)
    return True


if __name__ == "__main__":
    sys.exit(main())
