"""The signal fuzzer (issue 51, item 9): SIGTERM, SIGHUP or SIGINT at a random moment in
each command, on a copy of the tracked world (quality/fuzzers/tracked_world.py), as the
commands' real processes (quality/fuzzers/forkserver.py): `run` through its stages
(download, preprocess, train, evaluate; and replaying a backlog it found), `sync`,
`compare`, `export` (native, Hugging Face, --register), `sample`, `show --estimate`, `sweep`
(points in this process, or 2 at once as processes of their own) and `validate`.

Each case is one command and one signal, drawn at a fraction of the command's usual time;
where the command ended first, the moment is drawn again inside the time it took (up to
LATE_TRIES draws), and a signal that still reaches it after it decided its exit is counted
as late, not judged. The checks (signal_checks.py, record_checks.py):
- the exit is 128 + the signal's number (143 for a training stop, which saves a
  checkpoint), with one `error:` line, no traceback, not a death by the signal itself;
- nothing half-published or left behind (temporaries, partial exports, stage files that
  differ from their record, torn backlog lines);
- the store: no run created twice, no metric logged twice at a step, no run of the command
  left RUNNING, the stages it finished recorded; after a signalled `sync` or backlog replay,
  a plain `sync` sends the rest and every run the backlog held is in the store once.
"""

from __future__ import annotations

import random
import signal
import time
from dataclasses import dataclass, field, replace

from quality.fuzzers import record_checks
from quality.fuzzers.record_checks import Store
from quality.fuzzers.signal_checks import NAMES, ending_problem, leftovers, was_late
from quality.fuzzers.tracked_world import World

SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)
HANG_S = 300  # a sweep of 2 points as processes of their own: 60 s on 2 busy cores


@dataclass(frozen=True)
class Command:
    template: str  # the world's template it starts from
    args: tuple[str, ...]  # {config} and {exports} stand for the world's paths
    typical_s: float  # its usual time on 2 busy cores: the signal is drawn within it


COMMANDS = {
    "run (every stage)": Command("clean", ("run", "{config}", "--force", "download"), 5.0),
    "run --only train": Command(
        "clean", ("run", "{config}", "--only", "train", "--force", "train"), 3.0
    ),
    "run --only evaluate": Command(
        "clean", ("run", "{config}", "--only", "evaluate", "--force", "evaluate"), 2.0
    ),
    "run, replaying a backlog": Command(
        "backlog", ("run", "{config}", "--only", "evaluate", "--force", "evaluate"), 3.0
    ),
    "sync": Command("backlog", ("sync", "{config}"), 1.2),
    "compare": Command("clean", ("compare", "{config}"), 0.6),
    "export": Command("clean", ("export", "{config}", "--out", "{exports}/e0"), 0.2),
    "export --format hf": Command(
        "clean", ("export", "{config}", "--out", "{exports}/e0", "--format", "hf"), 1.0
    ),
    "export --register": Command(
        "clean", ("export", "{config}", "--out", "{exports}/e0", "--register", "fuzz-model"), 1.5
    ),
    "sample": Command("clean", ("sample", "{config}", "--prompt", "the ", "--tokens", "40"), 0.6),
    "show --estimate": Command("clean", ("show", "{config}", "--estimate"), 6.0),
    "sweep": Command(
        "clean",
        ("sweep", "{config}", "--grid", "train.optimizer.lr=0.04,0.05", "--parallel", "1"),
        8.0,
    ),
    "sweep --parallel 2": Command(
        "clean",
        ("sweep", "{config}", "--grid", "train.optimizer.lr=0.04,0.05", "--parallel", "2"),
        30.0,
    ),
    "validate": Command("clean", ("validate", "{config}"), 0.3),
}
# how often each is drawn: the commands with more places to stop, more often. The usual
# times above were measured on 2 cores shared with other work (a fifth of the signals still
# reach a command that has ended: counted as late)
WEIGHTS = {
    "run (every stage)": 4,
    "run --only train": 3,
    "run --only evaluate": 2,
    "run, replaying a backlog": 3,
    "sync": 3,
    "compare": 2,
    "export": 2,
    "export --format hf": 1,
    "export --register": 2,
    "sample": 1,
    "show --estimate": 1,
    "sweep": 1,
    "sweep --parallel 2": 1,
    "validate": 1,
}
REPLAYS = ("sync", "run, replaying a backlog")  # a plain sync follows: nothing sent twice
LATE_TRIES = 3  # draws of a case's moment, the later ones inside the time the command took


@dataclass
class Case:
    index: int
    command: str
    signum: int
    at: float  # seconds after the command is ready

    def text(self) -> str:
        words = " ".join(COMMANDS[self.command].args).format(config="tiny.yaml", exports="exports")
        return f"allattn-pipe {words}   [{NAMES[self.signum]} at {self.at:.2f} s]"


def draw_case(seed: int, index: int) -> Case:
    draw = random.Random(f"signal:{seed}:{index}")
    names = list(WEIGHTS)
    command = draw.choices(names, [WEIGHTS[n] for n in names])[0]
    signum = draw.choice(SIGNALS)
    return Case(index, command, signum, round(draw.random() * COMMANDS[command].typical_s, 2))


@dataclass
class SignalOutcome:
    index: int
    command: str  # the command, and the stage the signal stopped (a run's)
    text: str
    signal: str
    late: bool  # the signal came after the command had decided its exit
    exit_code: int | None
    seconds: float
    cpu: float
    problems: list[str] = field(default_factory=list)
    said: str = ""  # for a bad case: the end of what it printed


def stopped_stage(stdout: str) -> str | None:
    """The stage a run was in when it stopped: the last one `running:` and not `done`."""
    started = [
        line.split("]")[0][1:]
        for line in stdout.splitlines()
        if line.startswith("[") and "] running: " in line
    ]
    done = {
        line.split("]")[0][1:]
        for line in stdout.splitlines()
        if line.startswith("[") and "] done in " in line
    }
    cut = [s for s in started if s not in done]
    return cut[-1] if cut else None


def run_case(world: World, case: Case) -> SignalOutcome:
    command = COMMANDS[case.command]
    cpu = time.process_time()
    args = [a.format(config=world.config, exports=world.exports) for a in command.args]
    # The usual times are a guess: on an idle machine a command often ends before the drawn
    # moment. Such a case is drawn again inside the time the command took, so that most
    # cases judge a signal that reached a running command, not one that came too late.
    redraw = random.Random(f"late:{case.index}:{case.at}")
    for attempt in range(LATE_TRIES):
        world.restore(command.template)
        creates = record_checks.backlog_creates(world.workspace)
        driven = world.drive(args, case.command, case.signum, case.at, None, HANG_S)
        ended = driven.ended
        late = driven.sent is None or was_late(ended, driven.sent)
        if not late or ended.ending is None or attempt == LATE_TRIES - 1:
            break
        case = replace(case, at=round(redraw.random() * max(ended.ending - driven.ready, 0), 3))
    signum = None if late else case.signum
    label = case.command
    if command.args[0] == "run":
        label += ": " + ("done" if late else stopped_stage(ended.stdout) or "between stages")
    problems = []
    if why := ending_problem(ended, signum, driven.sent):
        problems.append(why)
    problems += leftovers([world.runs, world.exports])
    store = Store(world.server.root / "server.db")
    problems += store.duplicates()
    if signum is not None and ended.killed_by is None:
        problems += store.running(world.workspace, int(driven.start * 1000))
    if command.args[0] == "run":
        inv = record_checks.invocation(
            case.index,
            world.workspace,
            (driven.start, driven.end),
            ended.stdout,
            signum is not None,
        )
        if inv is not None and not (world.workspace / "tracking-backlog.jsonl").exists():
            problems += store.lost(inv)
    if "--register" in command.args:
        versions = store.versions(int(driven.start * 1000) - 5)
        if len(versions) > 1 or (ended.exit_code == 0 and len(versions) != 1):
            problems.append(f"registered {len(versions)} versions")
    if case.command in REPLAYS:
        problems += _sync_again(world, creates)
    cpu = time.process_time() - cpu + ended.cpu
    problems = list(dict.fromkeys(problems))
    said = f"{ended.stdout[-400:]}{ended.stderr[-600:]}" if problems else ""
    return SignalOutcome(
        case.index,
        label,
        case.text(),
        NAMES[case.signum],
        late,
        ended.shell_code,
        ended.seconds,
        cpu,
        problems,
        said,
    )


def _sync_again(world: World, creates) -> list[str]:
    """After a signalled backlog replay: a plain sync sends what is left; then every run
    the backlog held is in the store exactly once."""
    driven = world.drive(["sync", str(world.config)], "sync-again")
    ended = driven.ended
    if ended.exit_code != 0:
        return [f"the sync after it: exit {ended.shell_code}: {ended.stderr[-300:]!r}"]
    store = Store(world.server.root / "server.db")
    return store.duplicates() + store.missing_creates(creates)


def fuzz_signals(world: World, seed: int, indices, on_outcome) -> None:
    """The cases `indices` of `seed`, one after another."""
    for index in indices:
        on_outcome(run_case(world, draw_case(seed, index)))
