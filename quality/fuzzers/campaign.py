"""Campaigns of the stateful and signal fuzzers (state_fuzz.py, signal_fuzz.py) over
several workers: each worker is a process with a world of its own (tracked_world.py: the
tiny pipeline, its MLflow server, its fork server), built on its first case, under one
temporary directory that the campaign removes. A case is drawn from (seed, index) alone,
so which worker runs it does not matter, and `--first INDEX` replays one.
"""

from __future__ import annotations

import multiprocessing
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

from quality.fuzzers import signal_fuzz, state_fuzz
from quality.fuzzers.signal_checks import NAMES
from quality.fuzzers.tracked_world import NAME, World, build_world
from quality.fuzzers.true_scores import Scorer

# the worker's world, built on its first case: (world, scorer, seconds the build took)
_worker: dict = {}


def worker_world(base: Path, jobs: int) -> tuple[World, Scorer]:
    if "world" not in _worker:
        start = time.monotonic()
        root = Path(tempfile.mkdtemp(prefix="world-", dir=base))
        world = build_world(root, jobs, log=lambda message: None)
        _worker["world"] = world
        _worker["scorer"] = Scorer(
            world.config, world.templates["clean"] / "runs" / NAME / "preprocess"
        )
        _worker["built"] = time.monotonic() - start
    return _worker["world"], _worker["scorer"]


def _sequence(job: tuple) -> tuple[state_fuzz.SequenceOutcome, float]:
    base, jobs, seed, index, length = job
    world, scorer = worker_world(base, jobs)
    seq = state_fuzz.draw_sequence(seed, index, length)
    try:
        outcome = state_fuzz.run_sequence(world, scorer, seq)
    except Exception:  # the fuzzer's own failure: reported as the sequence's, the rest go on
        outcome = state_fuzz.SequenceOutcome(index, seq.template)
        outcome.steps.append(
            state_fuzz.StepOutcome(
                "fuzzer", "(the fuzzer)", None, 0, 0, None, [f"the fuzzer failed: {_last_lines()}"]
            )
        )
    return outcome, _worker.pop("built", 0.0)


def _signal_case(job: tuple) -> tuple[signal_fuzz.SignalOutcome, float]:
    base, jobs, seed, index = job
    world, _ = worker_world(base, jobs)
    case = signal_fuzz.draw_case(seed, index)
    try:
        outcome = signal_fuzz.run_case(world, case)
    except Exception:
        outcome = signal_fuzz.SignalOutcome(
            index,
            case.command,
            case.text(),
            NAMES[case.signum],
            False,
            None,
            0,
            0,
            [f"the fuzzer failed: {_last_lines()}"],
        )
    return outcome, _worker.pop("built", 0.0)


def _last_lines() -> str:
    import traceback

    return " | ".join(traceback.format_exc().strip().splitlines()[-3:])


def run_campaign(
    kind: str, indices: range, jobs: int, seed: int, length: int, on_outcome
) -> list[float]:
    """Every case of `indices` (kind "stateful" or "signals"), on `jobs` workers;
    `on_outcome(outcome)` as each ends. Returns the seconds each world took to build."""
    base = Path(tempfile.mkdtemp(prefix="allattn-fuzz-"))
    builds: list[float] = []
    work, jobs_of = (
        (_sequence, lambda i: (base, jobs, seed, i, length))
        if kind == "stateful"
        else (_signal_case, lambda i: (base, jobs, seed, i))
    )
    done = 0

    def take(outcome, built: float) -> None:
        nonlocal done
        done += 1
        builds.extend([built] if built else [])
        on_outcome(outcome)
        if done % max(1, len(indices) // 10) == 0:
            print(f"  ... {kind}: {done}/{len(indices)}", file=sys.stderr, flush=True)

    try:
        if jobs == 1:
            for i in indices:
                take(*work(jobs_of(i)))
        else:
            with multiprocessing.get_context("spawn").Pool(jobs) as pool:
                for result in pool.imap_unordered(work, [jobs_of(i) for i in indices]):
                    take(*result)
    finally:
        if "world" in _worker:
            _worker.pop("world").close()
            _worker.clear()
        shutil.rmtree(base, ignore_errors=True)
    return builds


# what each problem is, in the words of issue 51's defects
CLASSES = [
    (r"^score: compare", "compare: a score beside other weights"),
    (
        r"^score: evaluate's lines",
        "run: evaluate's lines (printed or reprinted) beside other weights",
    ),
    (r"^score: (registered|export run)", "export --register: scores of other weights"),
    (r"^score: model card", "export: a model card's score of other weights"),
    (r"^signal: killed by \w+ without a word", "signal: killed without a line (no handler)"),
    (r"^signal: .* swallowed", "signal: swallowed (exit 0)"),
    (r"^signal:", "signal: another exit or more lines"),
    (r"^duplicated: run", "tracking: a run created twice"),
    (r"^duplicated: \d+ metric values", "tracking: a metric logged twice at a step"),
    (r"^duplicated: the", "tracking: a run created twice"),
    (r"^lost:", "tracking: a record lost"),
    (r"^half-written: run", "tracking: a run left RUNNING after a handled signal"),
    (r"^(leftover|half-published|half-written)", "files: left half-done"),
    (r"^registered", "export --register: versions registered"),
    (r"^traceback", "traceback"),
    (r"^hang", "hang"),
    (r"^not one error line", "not one error line"),
    (r"^the sync after it", "sync: the sync after a signal failed"),
]


def problem_class(problem: str) -> str:
    return next((label for pattern, label in CLASSES if re.search(pattern, problem)), problem)


# ---------------------------------------------------------------- the reports


def _headline(label: str, n: int, args, seconds: float, builds: list[float], cpu: float) -> None:
    build = f" (+ {max(builds):.0f} s to build each world)" if builds else ""
    print(
        f"{label} {n:,}, seed {args.seed}, {args.jobs} worker{'s' * (args.jobs > 1)}: "
        f"{seconds:,.0f} s{build}; CPU {cpu:,.0f} s"
    )


def _classes(cases: list[list[str]], unit: str) -> None:
    """How many steps (or cases) had a problem of each class."""
    counts: dict[str, int] = {}
    for problems in cases:
        for label in {problem_class(p) for p in problems}:
            counts[label] = counts.get(label, 0) + 1
    if counts:
        print(f"{unit} with a problem, by class:")
        for label, n in sorted(counts.items(), key=lambda item: -item[1]):
            print(f"  {n:>5}  {label}")


def stateful_campaign(args) -> int:
    """Run and print the stateful fuzzer's campaign; 1 if a sequence went wrong."""
    outcomes: list[state_fuzz.SequenceOutcome] = []
    start = time.monotonic()
    indices = range(args.first, args.first + args.stateful)
    builds = run_campaign("stateful", indices, args.jobs, args.seed, args.steps, outcomes.append)
    seconds = time.monotonic() - start
    steps = [s for o in outcomes for s in o.steps]
    _headline(
        "stateful sequences", len(outcomes), args, seconds, builds, sum(o.cpu for o in outcomes)
    )
    signalled = [s for s in steps if s.signal]
    print(
        f"  {args.steps} drawn steps each (+ {len(steps) - args.steps * len(outcomes)} settling "
        f"steps in all): {len(steps):,} steps, commands' CPU {sum(s.cpu for s in steps):,.0f} s"
    )
    print(
        f"  signals {len(signalled)} ({sum(s.signal.endswith('late') for s in signalled)} late: "
        f"the command had ended), server outages {sum('[server down' in s.text for s in steps)}, "
        f"scores checked {sum(s.scores_checked for s in steps):,}"
    )
    bad = [o for o in outcomes if o.problems]
    print(f"  bad sequences {len(bad)}, bad steps {sum(bool(s.problems) for s in steps)}")
    _classes([s.problems for s in steps], "steps")
    print(f"\n{'step':<10}" + _columns("steps", "exit 0", "exit 2", "128+n", "bad", "max s"))
    for kind in sorted({s.kind for s in steps}):
        group = [s for s in steps if s.kind == kind]
        print(
            f"{kind:<10}"
            + _columns(
                len(group),
                sum(s.exit_code == 0 for s in group),
                sum(s.exit_code == 2 for s in group),
                sum((s.exit_code or 0) > 128 for s in group),
                sum(bool(s.problems) for s in group),
                f"{max(s.seconds for s in group):.1f}",
            )
        )
    for o in sorted(bad, key=lambda o: o.index)[: args.show_bad]:
        print(
            f"\nsequence {o.index} (from the {o.template} world; replay: python -m quality.fuzz "
            f"--stateful 1 --first {o.index} --seed {args.seed} --steps {args.steps} -j 1)"
        )
        for n, s in enumerate(o.steps):
            print(f"  {'>' if s.problems else ' '} {n:>2} exit {s.exit_code}  {s.text}")
            for p in s.problems:
                print(f"         {p}")
            if s.said:
                print(_indented(s.said, "         | "))
    return 1 if bad else 0


def signal_campaign(args) -> int:
    """Run and print the signal fuzzer's campaign; 1 if a case went wrong."""
    outcomes: list[signal_fuzz.SignalOutcome] = []
    start = time.monotonic()
    indices = range(args.first, args.first + args.signals)
    builds = run_campaign("signals", indices, args.jobs, args.seed, 0, outcomes.append)
    seconds = time.monotonic() - start
    print()
    _headline("signal cases", len(outcomes), args, seconds, builds, sum(o.cpu for o in outcomes))
    bad = [o for o in outcomes if o.problems]
    print(f"  late {sum(o.late for o in outcomes)} (the command had ended), bad {len(bad)}")
    _classes([o.problems for o in outcomes], "cases")
    width = max(len(o.command) for o in outcomes)
    print(f"\n{'command':<{width}}" + _columns("cases", "late", "128+n", "143", "bad", "max s"))
    for command in sorted({o.command for o in outcomes}):
        group = [o for o in outcomes if o.command == command]
        signalled = [o for o in group if not o.late]
        print(
            f"{command:<{width}}"
            + _columns(
                len(group),
                len(group) - len(signalled),
                sum(_own_exit(o) for o in signalled),
                sum(o.exit_code == 143 and o.signal != "SIGTERM" for o in signalled),
                sum(bool(o.problems) for o in group),
                f"{max(o.seconds for o in group):.1f}",
            )
        )
    for o in sorted(bad, key=lambda o: o.index)[: args.show_bad]:
        print(
            f"\ncase {o.index}: {o.text}  (exit {o.exit_code}; replay: python -m quality.fuzz "
            f"--signals 1 --first {o.index} --seed {args.seed} -j 1)"
        )
        for p in o.problems:
            print(f"    {p}")
        if o.said.strip():
            print(_indented(o.said, "    | "))
    return 1 if bad else 0


def _indented(text: str, prefix: str) -> str:
    """The last lines of a command's output, progress lines left out."""
    lines = [line for line in text.splitlines() if "tok/s" not in line and line.strip()]
    return "\n".join(prefix + line for line in lines[-8:])


def _columns(*cells) -> str:
    return "".join(f" {cell!s:>6}" for cell in cells)


def _own_exit(outcome) -> bool:
    """Exit 128 + the signal's own number."""
    return outcome.exit_code == 128 + {"SIGTERM": 15, "SIGHUP": 1, "SIGINT": 2}[outcome.signal]
