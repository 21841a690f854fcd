"""The stateful fuzzer (issue 51, item 9): random sequences of commands on one workspace and
its sweep points (quality/fuzzers/tracked_world.py), tracked to a real MLflow server that
goes down now and then, with SIGTERM, SIGHUP and SIGINT at random moments; after every step
the oracles of the issue:

- every score shown equals the true score of the weights shown (score_checks.py, computed
  by true_scores.py's own loop): compare's rows, evaluate's lines and the results a re-run
  reprints, `export --register`'s version (tags, description, its run's metrics) and an
  export's model card; a score that is not the weights' must read `stale`, not a number;
- no record lost or duplicated (record_checks.py): each run created once, each metric once
  a step; every run a command tracked, and every run a backlog held, in the store once the
  workspace has nothing left to send (each sequence ends by syncing every backlog);
- every signal ended its command with its exit code and one line, every command ended as
  the CLI's convention says, nothing half-published or left behind (signal_checks.py).

The steps: `run` (--only, --force, --set train.steps / train.optimizer.lr / train.seed,
--point), evaluate (`run --only evaluate`), `compare` (table, csv, json; --point), `export`
(--register, --point, --format hf, into a new directory or an earlier export) and `sync`
(the workspace's or a point's backlog). A sequence starts from the world's `clean` or
`backlog` template. Each sequence is drawn from its own `random.Random(seed, index)`: any one
replays alone with the same draws (the moments a signal lands are times, and land where the
machine's speed puts them).
"""

from __future__ import annotations

import random
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

from quality.fuzzers import record_checks, score_checks
from quality.fuzzers.record_checks import Invocation, Store
from quality.fuzzers.signal_checks import NAMES, ending_problem, leftovers, was_late
from quality.fuzzers.tracked_world import NAME, World

SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)
POINTS = {"lr0.02": "tiny-lr0.02", "lr0.03": "tiny-lr0.03"}
# how long a step takes on 2 busy cores: a signal or an outage is drawn within it
TYPICAL_S = {"run": 4.0, "evaluate": 1.5, "compare": 0.5, "export": 0.6, "sync": 0.6}
KINDS = ["run"] * 6 + ["evaluate"] * 3 + ["compare"] * 5 + ["export"] * 4 + ["sync"] * 2
HANG_S = 180  # the slowest step takes 20 s on 2 busy cores
REGISTERED = "fuzz-model"


@dataclass
class Step:
    kind: str
    args: list[str]  # {config} and {exports} stand for the world's paths
    workspace: str  # the workspace it works on, under the world's runs/
    signum: int | None = None
    signal_at: float = 0.0
    down_at: float | None = None
    fmt: str = "table"  # compare's
    out: str | None = None  # export's directory, under {exports}

    def text(self) -> str:
        words = " ".join(self.args).format(config="tiny.yaml", exports="exports")
        if self.signum is not None:
            words += f"   [{NAMES[self.signum]} at {self.signal_at:.2f} s]"
        if self.down_at is not None:
            words += f"   [server down at {self.down_at:.2f} s]"
        return "allattn-pipe " + words


@dataclass
class Sequence:
    index: int
    template: str
    steps: list[Step]


def draw_sets(draw: random.Random) -> list[str]:
    sets = []
    if draw.random() < 0.4:
        sets.append(f"train.steps={draw.choice(['2', '4', '6', '6'])}")
    if draw.random() < 0.4:
        sets.append(f"train.optimizer.lr={draw.choice(['0.005', '0.01', '0.02'])}")
    if draw.random() < 0.1:
        sets.append(f"train.seed={draw.choice(['1234', '7'])}")
    return [a for s in sets for a in ("--set", s)]


def draw_step(draw: random.Random, exports: list[str]) -> Step:
    kind = draw.choice(KINDS)
    point = draw.choice(list(POINTS)) if draw.random() < 0.25 else None
    where = ["--point", point] if point else []
    workspace = POINTS[point] if point else NAME
    step = Step(kind, [], workspace)
    if kind == "run":
        only = draw.choice([None, "train", "train", "evaluate", "train,evaluate", "preprocess"])
        force = draw.choice([None, None, "train", "train", "evaluate", "preprocess", "download"])
        step.args = [
            "run",
            "{config}",
            *draw_sets(draw),
            *where,
            *(["--only", only] if only else []),
            *(["--force", force] if force else []),
        ]
    elif kind == "evaluate":
        forced = ["--force", "evaluate"] if draw.random() < 0.3 else []
        step.args = ["run", "{config}", "--only", "evaluate", *forced, *draw_sets(draw), *where]
    elif kind == "compare":
        step.fmt = draw.choice(["table", "table", "table", "csv", "json"])
        step.args = ["compare", "{config}", "--format", step.fmt, *where]
        step.workspace = NAME
    elif kind == "export":
        if exports and draw.random() < 0.3:
            step.out = draw.choice(exports)  # into an earlier export
        else:
            step.out = f"e{len(exports)}"
            exports.append(step.out)
        step.args = [
            "export",
            "{config}",
            "--out",
            "{exports}/" + step.out,
            *where,
            *(["--register", REGISTERED] if draw.random() < 0.6 else []),
            *(["--format", "hf"] if draw.random() < 0.2 else []),
        ]
    else:
        sync_point = draw.choice(list(POINTS)) if draw.random() < 0.3 else None
        step.args = ["sync", "{config}"]
        if sync_point:
            step.workspace = POINTS[sync_point]
            step.args += ["--set", f"name={POINTS[sync_point]}"]
    if draw.random() < 0.2:
        step.signum = draw.choice(SIGNALS)
        step.signal_at = round(draw.random() * TYPICAL_S[kind], 2)
    if draw.random() < (0.1 if kind in ("run", "evaluate") else 0.03):
        step.down_at = round(draw.random() * TYPICAL_S[kind] * 0.6, 2)
    return step


def draw_sequence(seed: int, index: int, length: int) -> Sequence:
    """`length` steps; now and then one repeats the last `run` as it was given (what a user
    does to see the results again: a run with nothing to do reprints them)."""
    draw = random.Random(f"state:{seed}:{index}")
    template = "backlog" if draw.random() < 0.3 else "clean"
    exports: list[str] = []
    steps: list[Step] = []
    for _ in range(length):
        runs = [s for s in steps if s.kind in ("run", "evaluate")]
        if runs and draw.random() < 0.12:
            steps.append(Step(runs[-1].kind, list(runs[-1].args), runs[-1].workspace))
        else:
            steps.append(draw_step(draw, exports))
    return Sequence(index, template, steps)


# ---------------------------------------------------------------- running one


@dataclass
class StepOutcome:
    kind: str
    text: str
    exit_code: int | None
    seconds: float
    cpu: float
    signal: str | None  # "SIGTERM", "SIGTERM late" (after the command had ended), None
    problems: list[str]
    scores_checked: int = 0
    said: str = ""  # for a bad step: the end of what it printed


@dataclass
class SequenceOutcome:
    index: int
    template: str
    steps: list[StepOutcome] = field(default_factory=list)
    seconds: float = 0.0
    worker_cpu: float = 0.0  # this process's CPU seconds: the checks, the server, restoring

    @property
    def cpu(self) -> float:
        """CPU seconds in all: the commands' and the worker's."""
        return self.worker_cpu + sum(s.cpu for s in self.steps)

    @property
    def problems(self) -> list[str]:
        return [p for s in self.steps for p in s.problems]


@dataclass
class Memory:
    """What a sequence has seen so far: the runs it tracked, the runs its backlogs held,
    the problems of the world already reported (each at the step that showed it first)."""

    invocations: list[Invocation] = field(default_factory=list)
    creates: set[tuple[str, tuple]] = field(default_factory=set)  # (workspace, identity)
    reported: set[str] = field(default_factory=set)


def run_sequence(world: World, scorer, seq: Sequence) -> SequenceOutcome:
    started, cpu = time.monotonic(), time.process_time()
    world.restore(seq.template)
    memory = Memory()
    outcome = SequenceOutcome(seq.index, seq.template)

    def play(index: int, step: Step) -> None:
        _remember_backlogs(world, memory)
        driven = world.drive(
            [a.format(config=world.config, exports=world.exports) for a in step.args],
            step.kind,
            step.signum,
            step.signal_at,
            step.down_at,
            HANG_S,
        )
        outcome.steps.append(judge_step(world, scorer, memory, index, step, driven))

    for index, step in enumerate(seq.steps):
        play(index, step)
    for index, step in enumerate(settling_steps(world), len(seq.steps)):
        play(index, step)
    outcome.seconds = time.monotonic() - started
    outcome.worker_cpu = time.process_time() - cpu
    return outcome


def settling_steps(world: World) -> list[Step]:
    """A sequence's last steps: `sync` for every workspace with a backlog, then a compare
    of every row in json (each run's numbers at full precision)."""
    out = []
    for backlog in sorted(world.runs.glob("*/tracking-backlog.jsonl")):
        name = backlog.parent.name
        sets = [] if name == NAME else ["--set", f"name={name}"]
        out.append(Step("sync", ["sync", "{config}", *sets], name))
    out.append(Step("compare", ["compare", "{config}", "--format", "json"], NAME, fmt="json"))
    return out


def _remember_backlogs(world: World, memory: Memory) -> None:
    for ws in world.runs.iterdir():
        for create in record_checks.backlog_creates(ws):
            memory.creates.add((ws.name, create))


def judge_step(world: World, scorer, memory: Memory, index: int, step: Step, driven) -> StepOutcome:
    """The step's own problems (its ending, the scores it showed), every time; then the
    world's (leftovers, the store's records), each the first time it is seen."""
    ended = driven.ended
    late = was_late(ended, driven.sent)
    signum = step.signum if driven.sent is not None and not late else None
    label = None
    if step.signum is not None:
        label = NAMES[step.signum] + (" late" if late or driven.sent is None else "")
    own = [why] if (why := ending_problem(ended, signum, driven.sent)) else []
    store = Store(world.server.root / "server.db")
    shown = _scores_shown(world, step, driven, store, signum, own)
    own += [p for s in shown if (p := score_checks.problem(s, scorer))]
    _remember_backlogs(world, memory)
    if step.kind in ("run", "evaluate"):
        inv = record_checks.invocation(
            index,
            world.runs / step.workspace,
            (driven.start, driven.end),
            ended.stdout,
            signum is not None,
        )
        if inv is not None:
            memory.invocations.append(inv)
    seen = leftovers([world.runs, world.exports]) + _record_problems(world, memory, store)
    if signum is not None and ended.killed_by is None and step.down_at is None:
        seen += store.running(world.runs / step.workspace, int(driven.start * 1000))
    new = [p for p in dict.fromkeys(seen) if p not in memory.reported]
    memory.reported.update(new)
    problems = own + new
    said = f"{ended.stdout[-400:]}{ended.stderr[-600:]}" if problems else ""
    return StepOutcome(
        step.kind,
        step.text(),
        ended.shell_code,
        ended.seconds,
        ended.cpu,
        label,
        problems,
        len(shown),
        said,
    )


def _scores_shown(world: World, step: Step, driven, store: Store, signum, own: list[str]):
    """The scores the step showed: evaluate's lines, compare's rows, a registered version
    and an export's card (and, into `own`, a registration counted wrong)."""
    ended = driven.ended
    workspace = world.runs / step.workspace
    shown: list[score_checks.Shown] = []
    if step.kind in ("run", "evaluate"):
        shown += score_checks.evaluate_lines(ended.stdout, workspace, "evaluate's lines")
    if step.kind == "compare" and ended.exit_code == 0:
        shown += score_checks.compare_output(ended.stdout, step.fmt, world.runs)
    if step.kind == "export":
        out = world.exports / (step.out or "")
        versions = store.versions(int(driven.start * 1000) - 5)
        for version in versions:
            shown += score_checks.registered(version, out)
        if out.is_dir():
            shown += score_checks.model_card(out)
        if "--register" in step.args:
            wanted = (1,) if ended.exit_code == 0 and signum is None else (0, 1)
            if len(versions) not in wanted:
                own.append(f"registered {len(versions)} versions (expected {wanted})")
    return shown


def _record_problems(world: World, memory: Memory, store: Store) -> list[str]:
    """Runs or metrics doubled; and, for each workspace with nothing left to send, the runs
    the sequence tracked or its backlogs held that the store lacks."""
    settled = {
        ws.name for ws in world.runs.iterdir() if not (ws / "tracking-backlog.jsonl").exists()
    }
    found = store.duplicates()
    for inv in memory.invocations:
        if Path(inv.workspace).name in settled:
            found += store.lost(inv)
    return found + store.missing_creates([create for ws, create in memory.creates if ws in settled])


def fuzz_state(world: World, scorer, seed: int, indices, length: int, on_outcome) -> None:
    """The sequences `indices` of `seed`, each `length` drawn steps, one after another."""
    for index in indices:
        on_outcome(run_sequence(world, scorer, draw_sequence(seed, index, length)))
