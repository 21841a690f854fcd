"""The command-line fuzzer: every `allattn-pipe` command, invoked in process with random and
bad flags and values, damaged configs (quality/fuzzers/spec_damage.py) and damaged workspaces.

Every case must end in exit 0, or exit 2 with `error: ...` lines, each naming where (a file, `--set`
or a flag); never a traceback, never a hang; and a refused command, or one that only reads, leaves
every file it found as it was. Used by tests/system/commands/test_cli_fuzz.py (asserting) and
quality/fuzz.py (counting).

The commands that would train get a tiny, already trained pipeline (`World`): `run` on it
skips, or redoes a few steps. A damaged or overridden config is only ever run with
--dry-run, so no case trains a model the fuzzer made large.
"""

from __future__ import annotations

import hashlib
import re
import shutil
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

from click.testing import CliRunner
from hypothesis import strategies as st

from pipeline.commands.cli import main
from pipeline.errors import shown
from quality.fuzzers.fuzz_kit import crash_problem, derandomized, working_directory
from quality.fuzzers.spec_damage import CONFIGS, damaged_config, raw_values, tagged

HANG_SECONDS = 30
STAGES = ["download", "preprocess", "train", "finetune", "evaluate", "curriculum"]
# the commands that only read what they find (besides files the case names for output)
READ_ONLY = {
    "validate",
    "show",
    "run --dry-run",
    "sweep",
    "compare",
    "sample",
    "export",
    "stages",
    "junk",
    "launch slurm --dry-run",
}

TINY = """\
name: tiny
dataset: python_docs
model: {{kind: allattn, d_model: 16, n_layers: 1, n_heads: 2, n_persistent: 4, max_span: 16,
        adaptive_span: true, span_ramp: 4}}
train: {{steps: 4, batch_size: 2, seq_len: 16, log_every: 2, checkpoint_every: 4,
        eval_every: 4, eval_batches: 1,
        optimizer: {{type: adam, lr: 0.01, warmup_steps: 1, clip: global, clip_norm: 1.0}}}}
finetune: {{steps: 2, lr_divisor: 10}}
evaluate: {{splits: [valid], batch_size: 256}}
workspace: {{root: {root}}}
stages: [download, preprocess, train, finetune, evaluate]
"""


@dataclass
class World:
    """A directory with a tiny trained pipeline: tiny.yaml and its workspace root runs/
    (MLflow store included). Commands run with it as the working directory."""

    root: Path

    @property
    def tiny(self) -> Path:
        return self.root / "tiny.yaml"


def build_world(root: Path) -> World:
    root.mkdir(parents=True, exist_ok=True)
    world = World(root)
    world.tiny.write_text(TINY.format(root=root / "runs"))
    with working_directory(root):
        result = CliRunner().invoke(main, ["run", str(world.tiny)])
    assert result.exit_code == 0, result.output
    return world


def copy_world(world: World, to: Path) -> World:
    shutil.copytree(world.root, to, symlinks=True)
    copy = World(to)
    copy.tiny.write_text(TINY.format(root=to / "runs"))
    return copy


# ---------------------------------------------------------------- values

numbers = st.sampled_from(
    [
        "nan",
        "inf",
        "-inf",
        "-1",
        "0",
        "1",
        "2",
        "3",
        "1e999",
        str(2**64),
        "-" + str(2**63),
        "",
        " ",
        "abc",
        "1.5",
        "0x10",
        "1_000",
        "٣",
        "1\n2",
    ]
) | st.integers().map(str)
texts = st.text(max_size=20) | st.sampled_from(["", "\x00", "a\nb", "é☃", "-", "--", "x" * 300])
junk_flags = st.lists(
    st.sampled_from(
        [
            "--bogus",
            "--set",
            "--from",
            "--only",
            "-x",
            "--",
            "-h",
            "--dry-run",
            "--dry-run=1",
            "--nodes",
            "extra-arg",
            "--format",
            "--debugx",
        ]
    )
    | texts,
    max_size=2,
)


def odd_paths(tmp: Path):
    (tmp / "a_dir").mkdir(exist_ok=True)
    (tmp / "binary.yaml").write_bytes(b"\x00\xff\xfe" * 10)
    (tmp / "empty.yaml").write_bytes(b"")
    return st.sampled_from(
        [
            "",
            "-",
            ".",
            "/",
            "/proc/x",
            "/proc/self/mem",
            "/dev/null",
            "/dev/zero",
            "a\x00b",
            "x" * 5000,
            str(tmp / "missing.yaml"),
            str(tmp / "a_dir"),
            str(tmp / "binary.yaml"),
            str(tmp / "empty.yaml"),
            str(tmp / "a_dir" / "missing" / "x"),
            "~/x.yaml",
            "\n",
        ]
    )


def overrides(draw, keys: list[str]) -> list[str]:
    out = []
    for _ in range(draw(st.integers(0, 2))):
        key = draw(st.sampled_from(keys) | texts)
        value = draw(raw_values | numbers | texts)
        out.append(draw(st.sampled_from([f"{key}={value}", key, f"={value}"])))
    return [item for o in out for item in ("--set", o)]


TINY_KEYS = [
    "name",
    "dataset",
    "model.d_model",
    "model.kind",
    "train.steps",
    "train.seed",
    "train.optimizer.lr",
    "train.batch_size",
    "workspace.root",
    "workspace.cache",
    "tracking.uri",
    "tracking.enabled",
    "stages",
    "evaluate.splits",
    "finetune.steps",
    "dataset.url",
    "model",
    "train",
    "train.deepspeed.zero_stage",
    "x.y.z",
]


def option(draw, flag: str, values, chance: int = 2) -> list[str]:
    """`flag VALUE`, one time in `chance`."""
    return [flag, draw(values)] if draw(st.integers(0, chance - 1)) == 0 else []


# ---------------------------------------------------------------- cases


@dataclass
class Case:
    command: str
    args: list[str]
    watched: list[Path] = field(default_factory=list)  # what must survive unchanged


def draw_config(draw, world: World, tmp: Path) -> tuple[str, list[str]]:
    """A CONFIG argument and --set overrides: the tiny pipeline, a real config, a damaged
    copy of one, or a path that is no config."""
    kind = draw(st.sampled_from(["tiny", "tiny", "real", "damaged", "damaged", "odd"]))
    sets = overrides(draw, TINY_KEYS) if draw(st.integers(0, 2)) == 0 else []
    if kind == "tiny":
        return str(world.tiny), sets
    if kind == "real":
        return str(draw(st.sampled_from(CONFIGS))), sets
    if kind == "damaged":
        config, raw = damaged_config(draw, tmp)
        return str(config), [item for o in raw for item in ("--set", o)]
    return draw(odd_paths(tmp)), sets


def damage_workspace(draw, world: World) -> None:
    """One odd thing in a (copied) workspace: a file truncated, filled with junk, removed
    or made a directory, or a directory made a file."""
    files = sorted(p for p in (world.root / "runs").rglob("*") if p.is_file())
    dirs = sorted(p for p in (world.root / "runs").rglob("*") if p.is_dir())
    kind = draw(
        st.sampled_from(["truncate", "junk", "remove", "file to dir", "dir to file", "backlog"])
    )
    # by index: the world gains files as the cases run it, and what is drawn must not
    # depend on that (hypothesis replays the same draws)
    candidates = dirs if kind == "dir to file" else files
    target = candidates[draw(st.integers(0, 10_000)) % len(candidates)]
    if kind == "truncate":
        data = target.read_bytes()
        target.write_bytes(data[: draw(st.integers(0, 10_000)) % max(1, len(data))])
    elif kind == "junk":
        target.write_bytes(draw(st.binary(max_size=64)))
    elif kind == "remove":
        target.unlink()
    elif kind == "file to dir":
        target.unlink()
        target.mkdir()
    elif kind == "dir to file":
        shutil.rmtree(target)
        target.write_bytes(b"junk")
    else:
        backlog = world.root / "runs" / "tiny" / "tracking-backlog.jsonl"
        backlog.write_text(
            draw(
                st.sampled_from(
                    [
                        "{}\n",
                        "not json\n",
                        '{"op": "log_metric"}\n',
                        "[1, 2]\n",
                        '{"op": null}\n',
                        "\x00\n",
                        '{"op": "set_terminated", "run_id": "x" }\n',
                    ]
                )
            )
            + draw(texts)
        )


def draw_case(draw, world: World, tmp: Path) -> Case:
    command = draw(
        st.sampled_from(
            [
                "validate",
                "show",
                "run --dry-run",
                "run",
                "sweep",
                "compare",
                "sample",
                "export",
                "sync",
                "launch slurm",
                "stages",
                "junk",
            ]
        )
    )
    if (
        command in ("run", "run --dry-run", "sample", "export", "sync", "compare")
        and draw(st.integers(0, 3)) == 0
    ):
        world = copy_world(world, tmp / "world")
        damage_workspace(draw, world)
    config, sets = draw_config(draw, world, tmp)
    watched = [world.root] + (
        [Path(config).parent] if str(tmp) in config and Path(config).parent != tmp else []
    )
    if command in ("validate", "show"):
        args = [command, config, *sets]
    elif command in ("run", "run --dry-run"):
        stage = st.sampled_from(STAGES) | texts
        args = [
            "run",
            config,
            *sets,
            *option(draw, "--from", stage),
            *option(draw, "--only", stage),
            *option(draw, "--force", stage, 3),
        ]
        # only the tiny pipeline as it is trains for real; anything else plans
        if command == "run --dry-run" or config != str(world.tiny) or sets:
            args.append("--dry-run")
            command = "run --dry-run"
    elif command == "sweep":
        grid = st.builds(
            lambda key, values: f"{key}={values}",
            st.sampled_from(TINY_KEYS) | texts,
            st.lists(numbers | texts | tagged, max_size=3).map(",".join),
        )
        args = [
            "sweep",
            config,
            *sets,
            *[item for g in draw(st.lists(grid, max_size=2)) for item in ("--grid", g)],
            *option(draw, "--seeds", st.sampled_from(["1,2", "1,1", "", "a", "-1"]) | texts),
            *option(draw, "--parallel", numbers, 4),
            "--dry-run",
        ]
        if draw(st.booleans()):
            args += [
                "--slurm",
                *option(draw, "--nodes", numbers, 3),
                *option(draw, "--gpus-per-node", numbers, 3),
                *option(draw, "--procs-per-node", numbers, 3),
                *option(draw, "--partition", texts, 3),
                *option(draw, "--time", texts, 3),
                *option(draw, "--signal-lead", numbers, 3),
                *option(draw, "--max-parallel", numbers, 3),
            ]
        else:
            args += option(
                draw, draw(st.sampled_from(["--nodes", "--time", "--partition"])), numbers, 4
            )
    elif command == "compare":
        target = (
            st.sampled_from([config, "tiny", "quickstart", "0" * 32, "f" * 32, "", "."]) | texts
        )
        plot = st.sampled_from(
            [
                str(tmp / "curves.png"),
                str(tmp / "curves.pdf"),
                str(tmp / "curves.xyz"),
                str(tmp / "curves"),
                "/proc/x.png",
                str(tmp / "a_dir"),
                "",
                str(tmp / "no" / "dir" / "c.png"),
            ]
        )
        filters = (
            st.sampled_from(
                [
                    "params.train.seed = '1234'",
                    "metrics.valid_bpc < 10",
                    "x",
                    "params.",
                    "'",
                    "metrics.valid_bpc < 'a'",
                    "tags.x = 1",
                    "attributes.status = 'FINISHED'",
                ]
            )
            | texts
        )
        args = [
            "compare",
            *draw(st.lists(target, max_size=3)),
            *sets,
            *option(draw, "--metric", st.sampled_from(["valid_bpc", "loss"]) | texts),
            *option(draw, "--filter", filters),
            *option(draw, "--format", st.sampled_from(["table", "markdown", "csv", "json", "xml"])),
            *option(draw, "--plot", plot, 3),
        ]
    elif command in ("sample", "export"):
        checkpoint = (
            st.sampled_from(
                [
                    "latest",
                    "best",
                    "",
                    str(tmp / "a_dir"),
                    "/proc",
                    str(world.root / "runs"),
                    str(world.root / "runs" / "tiny" / "train" / "checkpoints"),
                ]
            )
            | texts
        )
        args = [command, config, *sets, *option(draw, "--checkpoint", checkpoint, 3)]
        if command == "sample":
            args += [
                *option(draw, "--prompt", texts | st.just("def "), 8),
                *option(draw, "--tokens", st.sampled_from(["1", "5", "0", "100001"]) | numbers),
                *option(draw, "--temperature", numbers),
                *option(draw, "--top-k", numbers),
                *option(draw, "--seed", numbers, 3),
            ]
            if "--prompt" not in args and draw(st.integers(0, 7)):
                args += ["--prompt", "def "]
            if "--tokens" not in args:
                args += ["--tokens", "3"]
        else:
            (tmp / "full_dir").mkdir(exist_ok=True)
            (tmp / "full_dir" / "mine.txt").write_text("mine")
            (tmp / "a_file").write_text("mine")
            out = st.sampled_from(
                [
                    str(tmp / "export"),
                    str(tmp / "full_dir"),
                    str(tmp / "a_file"),
                    str(tmp / "a" / "b" / "c"),
                    str(world.root / "runs"),
                    str(world.tiny),
                ]
            ) | odd_paths(tmp)
            args += option(draw, "--out", out, 8) or ["--out", str(tmp / "export")]
            watched += [tmp / "full_dir", tmp / "a_file"]
    elif command == "sync":
        args = ["sync", config, *sets]
    elif command == "launch slurm":
        args = [
            "launch",
            "slurm",
            config,
            *sets,
            *option(draw, "--nodes", numbers, 8),
            *option(draw, "--gpus-per-node", numbers, 8),
            *option(draw, "--procs-per-node", numbers, 3),
            *option(draw, "--partition", texts, 3),
            *option(draw, "--time", texts),
            *option(draw, "--signal-lead", numbers, 3),
        ]
        args += [
            a for flag in ("--nodes", "--gpus-per-node") if flag not in args for a in (flag, "1")
        ][: draw(st.sampled_from([0, 2, 4, 4, 4]))]
        if draw(st.integers(0, 2)):
            args.append("--dry-run")
            command = "launch slurm --dry-run"
        else:
            args += option(
                draw,
                "--output",
                st.sampled_from([str(tmp / "job.sbatch"), str(tmp / "a_dir")]) | odd_paths(tmp),
                1,
            )
    elif command == "stages":
        args = ["stages"]
    else:  # the group itself: unknown commands and options, nothing at all
        args = draw(
            st.lists(
                st.sampled_from(["launch", "--debugx", "nope", "run1", "-"]) | texts, max_size=2
            )
        )
    if command != "junk" and draw(st.integers(0, 5)) == 0:
        args += draw(junk_flags)
    return Case(command, args, watched)


# ---------------------------------------------------------------- running one


@dataclass
class Outcome:
    command: str
    args: list[str]
    exit_code: int | None
    seconds: float
    problem: str | None  # None: the case ended as it must


def fingerprint(paths: list[Path]) -> dict[str, str]:
    """Every file and directory under `paths` with a hash of its bytes."""
    out = {}
    for top in paths:
        if not top.exists():
            continue
        for p in sorted([top, *top.rglob("*")]) if top.is_dir() else [top]:
            if p.is_symlink() or not p.is_file():
                out[str(p)] = "dir" if p.is_dir() else "other"
            else:
                out[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def _hang(signum, frame):
    raise TimeoutError(f"still running after {HANG_SECONDS} s")


# a place an error line names: a file, --set, a flag or an argument, or what the case gave
PLACE = re.compile(
    r"(/|[\w.-]+\.ya?ml\b|--[a-z]|'[A-Z_]+'|missing command|No such command"
    r"|runs/)"
)


def run_case(case: Case, cwd: Path) -> Outcome:
    before = fingerprint(case.watched)
    previous = signal.signal(signal.SIGALRM, _hang)
    signal.alarm(HANG_SECONDS)
    start = time.monotonic()
    try:
        with working_directory(cwd):
            result = CliRunner().invoke(main, case.args)
    except TimeoutError as e:
        return Outcome(case.command, case.args, None, time.monotonic() - start, f"hang: {e}")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    seconds = time.monotonic() - start
    code = result.exit_code
    problem = crash_problem(result, TimeoutError)
    if problem is None and code == 2:
        lines = result.stderr.splitlines()
        if not lines or not all(line.startswith("error: ") for line in lines[:1]):
            problem = f"not 'error: ...': {result.stderr[-500:]!r}"
        elif any(
            not PLACE.search(line) and not any(arg and shown(arg) in line for arg in case.args)
            for line in lines
        ):
            problem = f"an error line names no place: {result.stderr[-500:]!r}"
        elif "Traceback" in result.output:
            problem = "a traceback in the output"
    if problem is None and (code == 2 or case.command in READ_ONLY):
        after = fingerprint(case.watched)
        changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
        if changed:
            problem = f"exit {code} changed files it found: {changed[:5]}"
    return Outcome(case.command, case.args, code, seconds, problem)


def fuzz(world: World, cases: int, on_outcome) -> None:
    """`cases` cases drawn the same way on every call (derandomized), each in a fresh
    temporary directory; `on_outcome(outcome)` sees each (it may raise, to fail the case)."""
    import tempfile

    def one_case(draw):
        with tempfile.TemporaryDirectory() as tmp:
            case = draw_case(draw, world, Path(tmp))
            on_outcome(run_case(case, world.root))

    derandomized(cases, one_case)
