"""Does the fast GPU path learn like the float32 reference? Three short trainings of a
config's model on the built-in corpus, their loss curves side by side and a verdict.

    .venv/bin/python -m gpu.learning_check [--config configs/enwik8_small.yaml]
        [--steps 300] [--batch 8] [--seq-len 256] [--log-every 25] [--warmup 30]
        [--seeds 1234,4321] [--set K=V]... [--fast-set K=V]... [--ref-set K=V]...
        [--timeout 240] [--budget S] [--jobs 1] [--tolerance 0.02] [--plot FILE.png]
        [--workdir DIR] [--dry-run]

The runs, each `allattn-pipe run` in a subprocess (download, preprocess and train on the
python_docs corpus: no network, no shared data), one after the other in one workspace
(download and preprocess run once; train is forced each time), or with --jobs 3 all at once,
each in a workspace of its own (a workspace takes one run at a time): on one GPU the three
small trainings fit side by side, and the check takes the time of its slowest run:

- **fast**: `model.attention.impl=triton`, `train.deepspeed.bf16=true`,
  `train.compile=graphs`, seed A;
- **ref A**: `model.attention.impl=reference`, float32 (`train.deepspeed.bf16=false`),
  `train.compile=false`, seed A: the same initial weights and the same batches as fast;
- **ref B**: ref A with seed B: the run-to-run spread of the float32 reference.

`--set` applies to all three, `--fast-set` / `--ref-set` to fast / both references (after the
defaults above, which they replace key by key), `train.seed` last.

**PASS** when at every logged step the fast loss is within --tolerance (2%) of ref A's,
relatively, and fast's mean absolute gap to ref A over the logged steps is no larger than
ref A's to ref B (two seeds of the reference); otherwise **FAIL**, naming the worst step.
Exit status 0 on PASS, 1 on FAIL, 2 when a run crashed, timed out or logged too few steps
(its output's tail is printed).

The defaults, sized for one H100 inside gpu/check.py's 9 minutes: enwik8_small's model
(18 layers, d 512, N 1024, span up to 8192, attention dropout 0.3) at batch 8 x 256 tokens
(micro-batch 8, no accumulation and no micro-batch search), 300 updates, the loss logged
every 25 (a mean over 25 x 2,048 tokens: the window evens out the dropout's noise), no
validation, one checkpoint at the end. The learned spans start at 0 and stay short (span
mean 6, max 24 after 30 updates at --warmup 30, measured on a CPU), so the 1,024 persistent
vectors and the segment itself are most of the attention's columns; half of the paper's
512-token segments halves each update. Estimated for an H100, not yet measured there: 300
float32 updates of ~0.6 TFLOP each in 20-30 s, a reference run 40-60 s with the start-up
and the final checkpoint, the fast run that plus its compilation. --warmup 30 replaces the
paper's 32,000 warm-up updates, over which the lr would stay below 1% of its peak for all
300 updates and the curves would barely leave the initial loss whatever the kernel did; at
30 the reference learns steadily (4.07, 3.59, 3.36, 3.39, 3.24 at updates 10-50, batch 4 x
128, CPU). Dropout draws different masks in each backend (the Triton kernel hashes its
own), so fast and ref A are the same training only in distribution: hence the comparison
with the spread of two seeds.

`--dry-run` checks the three configs (`allattn-pipe run --dry-run`) and prints the plan;
nothing trains. `--plot FILE.png` draws the three curves. The workspace is a temporary folder
unless --workdir keeps it (the config, each run's log and its MLflow records). Prints tables;
asserts nothing.
"""

from __future__ import annotations

import argparse
import math
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from gpu import check as gpu_check  # its process-group start and finish

ROOT = Path(__file__).resolve().parent.parent
CONFIG = "configs/enwik8_small.yaml"
FAST = {
    "model.attention.impl": "triton",
    "train.deepspeed.bf16": "true",
    "train.compile": "graphs",
}
REFERENCE = {
    "model.attention.impl": "reference",
    "train.deepspeed.bf16": "false",
    "train.compile": "false",
}
TOLERANCE = 0.02
# the trainer's report: `step     25/300  loss 4.1234  bpc ...` (pipeline/training/trainer.py)
STEP_LINE = re.compile(r"\bstep\s+(\d+)/(\d+)\s+loss\s+(\S+)")
TAIL = 3000  # characters of a crashed run's output shown


@dataclass
class Run:
    label: str
    seed: int
    overrides: dict[str, str]
    losses: dict[int, float] = field(default_factory=dict)
    code: int | None = None
    seconds: float = 0.0
    output: str = ""

    def sets(self) -> list[str]:
        return [f"{k}={v}" for k, v in {**self.overrides, "train.seed": self.seed}.items()]


def key_value(item: str) -> tuple[str, str]:
    key, eq, value = item.partition("=")
    if not eq or not key.strip():
        raise argparse.ArgumentTypeError(f"{item!r}: expected KEY=VALUE")
    return key.strip(), value


def plan(args) -> list[Run]:
    """fast, ref A, ref B: the role's defaults, then --set, then the role's own flags."""
    common = dict(args.set)
    fast = {**FAST, **common, **dict(args.fast_set)}
    ref = {**REFERENCE, **common, **dict(args.ref_set)}
    seed_a, seed_b = args.seeds
    return [Run("fast", seed_a, fast), Run("ref A", seed_a, ref), Run("ref B", seed_b, ref)]


def write_config(folder: Path, args) -> Path:
    """The base config's model on the built-in corpus: download, preprocess, train for
    --steps updates of --batch x --seq-len tokens, no validation, a checkpoint at the end."""
    base = Path(args.config) if Path(args.config).is_file() else ROOT / args.config
    path = folder / "learning_check.yaml"
    path.write_text(f"""\
extends: [{base.resolve()}]
name: learning_check
dataset: python_docs
train:
  steps: {args.steps}
  batch_size: {args.batch}
  micro_batch_size: {args.batch}
  seq_len: {args.seq_len}
  optimizer: {{warmup_steps: {args.warmup}}}
  log_every: {args.log_every}
  eval_every: 0
  checkpoint_every: 0
stages: [download, preprocess, train]
workspace: {{root: {folder / "runs"}}}
""")
    return path


def command(cfg: Path, run: Run, dry_run: bool = False, own_workspace: bool = False) -> list[str]:
    sets = [item for s in run.sets() for item in ("--set", s)]
    if own_workspace:
        sets += ["--set", f"workspace.root={cfg.parent / 'runs' / run.label.replace(' ', '_')}"]
    cli = [sys.executable, "-m", "pipeline.commands.cli", "run", str(cfg), *sets]
    return [*cli, "--force", "train", *(["--dry-run"] if dry_run else [])]


def start(cmd: list[str], log: Path) -> subprocess.Popen:
    """Start ``cmd`` from the project directory, its output to ``log`` (gpu_check.start)."""
    with log.open("w") as out:  # the child keeps its own handle
        return gpu_check.start(cmd, out)


def finish(proc: subprocess.Popen, log: Path, timeout: float) -> int:
    """gpu_check.finish (124 after a timeout, its process group killed), the time-out noted
    at the end of ``log``."""
    code = gpu_check.finish(proc, timeout)
    if code == 124:
        with log.open("a") as out:
            out.write(f"\n(timed out after {max(timeout, 1):.0f} s)\n")
    return code


def execute(cmd: list[str], log: Path, timeout: float) -> int:
    return finish(start(cmd, log), log, timeout)


def parse_losses(text: str) -> dict[int, float]:
    """step -> training loss from the trainer's report lines (a step logged twice, as after
    a resume, keeps its last value; `loss nan` is kept as nan)."""
    losses = {}
    for m in STEP_LINE.finditer(text):
        try:
            losses[int(m.group(1))] = float(m.group(3))
        except ValueError:
            continue
    return losses


def train(runs: list[Run], cfg: Path, args) -> Run | None:
    """Run them, --jobs at a time; the first that crashed, timed out or stopped early, else
    None (after a failure, the runs not yet started are not)."""
    deadline = time.monotonic() + (math.inf if args.budget is None else args.budget)
    for first in range(0, len(runs), args.jobs):
        group = runs[first : first + args.jobs]
        t0 = time.monotonic()
        started = []
        for run in group:
            log = cfg.parent / f"{run.label.replace(' ', '_')}.log"
            cmd = command(cfg, run, own_workspace=args.jobs > 1)
            started.append((run, log, start(cmd, log)))
        for run, log, proc in started:
            run.code = finish(proc, log, min(args.timeout - (time.monotonic() - t0),
                                             deadline - time.monotonic()))  # fmt: skip
            run.seconds = time.monotonic() - t0
            run.output = log.read_text(errors="replace")
            run.losses = parse_losses(run.output)
            last = max(run.losses, default=0)
            print(
                f"[{run.label}] exit {run.code} after {run.seconds:.0f} s, "
                f"{len(run.losses)} losses logged, the last at step {last}",
                flush=True,
            )
        for run, _, _ in started:
            if run.code != 0 or max(run.losses, default=0) < args.steps:
                return run
    return None


def crash_report(run: Run, steps: int) -> str:
    last = max(run.losses, default=0)
    why = {0: f"exited 0 with its last loss logged at step {last} of {steps}", 124: "timed out"}
    return (
        f"\n[{run.label}] {why.get(run.code or 0, f'crashed (exit {run.code})')}, after "
        f"{run.seconds:.0f} s; its output's tail:\n\n{run.output[-TAIL:]}"
    )


def gap(a: float, b: float) -> float:
    """|a - b|, inf where either is not finite."""
    return abs(a - b) if math.isfinite(a) and math.isfinite(b) else math.inf


def relative(a: float, ref: float) -> float:
    g = gap(a, ref)
    return g / abs(ref) if ref and math.isfinite(g) else math.inf


def verdict(
    fast: dict[int, float],
    ref_a: dict[int, float],
    ref_b: dict[int, float],
    tolerance: float = TOLERANCE,
) -> tuple[bool, str]:
    """PASS when fast is within ``tolerance`` of ref A (relative) at every step the three
    curves share and its mean |fast - ref A| is no larger than the mean |ref A - ref B|;
    the line says why, with the worst step."""
    steps = sorted(set(fast) & set(ref_a) & set(ref_b))
    if not steps:
        return False, "FAIL: the three curves share no logged step"
    rel = {s: relative(fast[s], ref_a[s]) for s in steps}
    worst = max(steps, key=lambda s: (rel[s], -s))  # the first of equal gaps
    mean_fast = sum(gap(fast[s], ref_a[s]) for s in steps) / len(steps)
    mean_seed = sum(gap(ref_a[s], ref_b[s]) for s in steps) / len(steps)
    at_worst = (
        f"step {worst}: fast {fast[worst]:.4f} vs ref A {ref_a[worst]:.4f} ({_pct(rel[worst])})"
    )
    means = (
        f"mean |fast - ref A| {mean_fast:.4f} vs mean |ref A - ref B| {mean_seed:.4f} "
        f"over {len(steps)} steps"
    )
    if rel[worst] > tolerance:
        return False, (
            f"FAIL at step {worst}: fast is {_pct(rel[worst])} from ref A, more than "
            f"{_pct(tolerance)} ({at_worst}); {means}"
        )
    if not mean_fast <= mean_seed:
        return False, (
            f"FAIL: fast is further from ref A than the seed spread ({means}); the worst {at_worst}"
        )
    return True, (
        f"PASS: fast within {_pct(tolerance)} of ref A at every logged step (worst "
        f"{at_worst}) and {means}"
    )


def _pct(x: float) -> str:
    return f"{100 * x:.2f}%" if math.isfinite(x) else "inf"


def _loss(x: float | None) -> str:
    return "-" if x is None else f"{x:.4f}"


def table(fast: dict[int, float], ref_a: dict[int, float], ref_b: dict[int, float]) -> str:
    lines = [
        "| step | fast | ref A | ref B | \\|fast-refA\\|/refA | \\|refA-refB\\|/refA |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for s in sorted(set(fast) | set(ref_a) | set(ref_b)):
        f, a, b = fast.get(s), ref_a.get(s), ref_b.get(s)
        fa = _pct(relative(f, a)) if f is not None and a is not None else "-"
        ab = _pct(relative(b, a)) if b is not None and a is not None else "-"
        lines.append(f"| {s} | {_loss(f)} | {_loss(a)} | {_loss(b)} | {fa} | {ab} |")
    return "\n".join(lines)


def plot(runs: list[Run], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for run, style in zip(runs, ("-", "--", ":"), strict=False):
        steps = sorted(run.losses)
        ax.plot(steps, [run.losses[s] for s in steps], style, marker=".", label=run.label)
    ax.set_xlabel("update")
    ax.set_ylabel("training loss (nats per token)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def header(runs: list[Run], args) -> str:
    lines = [
        f"learning check: {args.config}'s model, {args.steps} updates of {args.batch} x "
        f"{args.seq_len} tokens on python_docs, warm-up {args.warmup}, loss logged every "
        f"{args.log_every}"
    ]
    lines += [f"  {run.label:<6} {' '.join(run.sets())}" for run in runs]
    return "\n".join(lines)


def dry_run(runs: list[Run], cfg: Path, timeout: float) -> int:
    """Check each run's config and print its plan; 2 if one is refused."""
    worst = 0
    for run in runs:
        log = cfg.parent / f"{run.label.replace(' ', '_')}.dry-run.log"
        code = execute(command(cfg, run, dry_run=True), log, timeout)
        print(f"\n[{run.label}] --dry-run: {'ok' if code == 0 else f'refused (exit {code})'}")
        print(log.read_text(errors="replace").strip()[-TAIL:])
        worst = max(worst, 0 if code == 0 else 2)
    return worst


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=CONFIG, help="the base config (%(default)s)")
    parser.add_argument("--steps", type=int, default=300, help="updates per run")
    parser.add_argument("--batch", type=int, default=8, help="sequences per update")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per sequence")
    parser.add_argument("--log-every", type=int, default=25, help="updates per logged loss")
    parser.add_argument(
        "--warmup", type=int, default=30, help="train.optimizer.warmup_steps (%(default)s)"
    )
    parser.add_argument(
        "--seeds",
        default="1234,4321",
        type=lambda s: tuple(int(x) for x in s.split(",")),
        help="seed A (fast and ref A), seed B (ref B)",
    )
    for flag, who in (("--set", "all three runs"), ("--fast-set", "fast"), ("--ref-set", "ref")):
        parser.add_argument(
            flag,
            action="append",
            default=[],
            type=key_value,
            metavar="K=V",
            dest=flag[2:].replace("-", "_"),
            help=f"override a key for {who}; repeatable",
        )
    parser.add_argument("--timeout", type=float, default=240, help="seconds per run")
    parser.add_argument(
        "--budget",
        type=float,
        help="seconds for the three runs together: a run gets at most what is left",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=1,
        choices=(1, 2, 3),
        help="runs at a time (more than one: a workspace each)",
    )
    parser.add_argument("--tolerance", type=float, default=TOLERANCE)
    parser.add_argument("--plot", type=Path, help="draw the three curves into FILE.png")
    parser.add_argument("--workdir", type=Path, help="keep the config, logs and runs here")
    parser.add_argument(
        "--dry-run", action="store_true", help="check the three configs, print the plan"
    )
    args = parser.parse_args(argv)
    if len(args.seeds) != 2:
        parser.error("--seeds takes two seeds, A,B")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    runs = plan(args)
    print(header(runs, args), flush=True)
    with tempfile.TemporaryDirectory(prefix="learning-check-") as tmp:
        folder = args.workdir.resolve() if args.workdir else Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        cfg = write_config(folder, args)
        if args.dry_run:
            return dry_run(runs, cfg, args.timeout)
        crashed = train(runs, cfg, args)
    fast, ref_a, ref_b = (run.losses for run in runs)
    if fast or ref_a or ref_b:  # after a crash, what the runs logged so far
        print("\n" + table(fast, ref_a, ref_b) + "\n")
    if crashed is not None:
        print(crash_report(crashed, args.steps))
        return 2
    ok, line = verdict(fast, ref_a, ref_b, args.tolerance)
    print(line)
    if args.plot:
        plot(runs, args.plot, f"{args.config}: fast vs float32 reference")
        print(f"plot: {args.plot}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
