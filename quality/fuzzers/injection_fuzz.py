"""The injection fuzzer: a canary command put into every value that can reach a batch script
or a remote command line must never run.

Each case gives a command a value holding a canary command (`allattn_canary`, a recorder on
PATH, or `touch $CANARY_DIR/...`) as `$( )`, backticks, `;`, `&&`, `&`, `|`, a newline, a
carriage return, a closing quote, an `#SBATCH` line: in a `--set` value (free-text keys
that validate, and others), a `--grid` value, `--seeds`, `launch slurm`'s and `sweep
--slurm`'s options, `--output` and the config's own file name. The commands:

- `launch slurm` (the script printed with --dry-run, or written with --output) and
  `sweep --slurm --dry-run`: the script is then run with bash, every array task of it, with
  sbatch, srun, scontrol, scancel, deepspeed, pdsh, ssh, allattn-pipe and the project's
  interpreter replaced by recorders (quality/fuzzers/fuzz_kit.py);
- `run` with `train.launcher.nodes: 2` and a hostfile: the real deepspeed launcher renders
  its remote command line and hands it to the pdsh recorder, which runs it with `bash -c`
  for each node as a remote shell would (the project's interpreter on it a recorder).

A case fails when a canary ran ("command ran"), when a value did not arrive byte for byte
at srun, at the sweep's task step or at each node's rank module ("mangled"), when an
`#SBATCH` line sits below the first command or was injected ("directives"), when a rendered
script fails under the recorders, on a traceback, a refusal that is not one line, or a hang.
Used by tests/system/commands/test_fuzz_classes.py and quality/fuzz.py --injection N.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from hypothesis import strategies as st

from pipeline.cluster.interpreter import RANK_MODULE
from quality.fuzzers.cli_fuzz import World
from quality.fuzzers.fuzz_kit import (
    CANARY_WORD,
    HANG_SECONDS,
    Recorders,
    derandomized,
    invoke,
    make_recorders,
)

W = CANARY_WORD
PAYLOADS = [
    f"$({W})",
    f"`{W}`",
    f";{W}",
    f"; {W} #",
    f"&&{W}",
    f"&{W}&",
    f"|{W}",
    f"||{W}",
    f"\n{W}\n",
    f"\r\n{W}",
    f"\\\n{W}",
    f"'; {W}; '",
    f'"; {W}; "',
    f"'$({W})'",
    f'"$({W})"',
    f"$({W})'\"",
    "$(touch $CANARY_DIR/touched)",
    "`touch ${CANARY_DIR}/touched`",
    f"\n#SBATCH --wrap={W}\n",
    f"x\n{W} #",
    f"a b $({W}) c",
    f"${{IFS}}{W}",
    f">({W})",
    f"<({W})",
]
payloads = st.builds(
    lambda a, p, b: a + p + b,
    st.sampled_from(["", "", "ok", "a b", "x=", "'", '"', "\\", "-"]),
    st.sampled_from(PAYLOADS),
    st.sampled_from(["", "", "x", "'", '"', " ", "\\"]),
)
# free text that validates (the values that reach a script), then keys that refuse most values
TEXT_KEYS = ["dataset.description"] * 3 + ["dataset.name"]
KEYS = TEXT_KEYS * 3 + [
    "tracking.experiment",
    "dataset.tokenizer.eos",
    "name",
    "dataset.name",
    "workspace.root",
    "workspace.cache",
    "tracking.uri",
    "dataset.url",
    "train.seed",
    "train.launcher.hostfile",
    "x.y",
]
CONFIG_NAMES = [f"c$({W}).yaml", f"c;{W};.yaml", f"c`{W}`.yaml", f"c|{W}.yaml", "a b.yaml"]


@dataclass
class Case:
    command: str
    args: list[str]
    config: str
    sets: list[str] = field(default_factory=list)  # --set values, as given
    grid: list[str] = field(default_factory=list)
    seeds: str | None = None


@dataclass
class Outcome:
    command: str
    args: list[str]
    exit_code: int | None
    seconds: float
    ran: int  # canary commands that ran
    problem: str | None
    said: str = ""  # the command's last line on stderr


def draw_case(draw, world: World, tmp: Path) -> Case:
    config = str(world.tiny)
    if draw(st.integers(0, 5)) == 0:  # the config's own name holds the canary
        copy = tmp / draw(st.sampled_from(CONFIG_NAMES))
        copy.write_text(world.tiny.read_text())
        config = str(copy)
    sets = [
        f"{draw(st.sampled_from(KEYS))}={draw(payloads)}" for _ in range(draw(st.integers(0, 2)))
    ]
    if config == str(world.tiny) and not sets:
        sets = [f"{draw(st.sampled_from(TEXT_KEYS))}={draw(payloads)}"]
    command = draw(st.sampled_from(["launch slurm"] * 5 + ["sweep --slurm"] * 4 + ["run, 2 nodes"]))
    setting = [a for s in sets for a in ("--set", s)]
    if command == "run, 2 nodes":
        hostfile = tmp / "hostfile"
        hostfile.write_text("node1 slots=1\nnode2 slots=1\n")
        sets = [*sets, "train.launcher.nodes=2", f"train.launcher.hostfile={hostfile}"]
        # a train.seed of its own: the train stage must run, so the launcher starts
        sets.append(f"train.seed={draw(st.integers(100, 10**6))}")
        setting = [a for s in sets for a in ("--set", s)]
        return Case(command, ["run", config, *setting], config, sets)
    cluster = [
        *draw(
            st.sampled_from(
                [["--gpus-per-node", "0", "--procs-per-node", "1"]] * 3 + [["--gpus-per-node", "1"]]
            )
        )
    ]
    for flag, chance in [(f, 7) for f in ("--partition", "--time", "--signal-lead")] + [
        (f, 30)
        for f in ("--account", "--job-name")  # not (yet) options: refused
    ]:
        if draw(st.integers(0, chance - 1)) == 0:
            cluster += [flag, draw(payloads | st.sampled_from(["debug", "1:00:00", "600"]))]
    if command == "launch slurm":
        args = ["launch", "slurm", config, "--nodes", "1", *cluster, *setting]
        if draw(st.booleans()):
            out = draw(st.sampled_from(["job.sbatch", f"j$({W}).sbatch", f"j;{W}.sbatch"]))
            return Case("launch slurm --output", [*args, "--output", str(tmp / out)], config, sets)
        return Case(command, [*args, "--dry-run"], config, sets)
    grid = [
        f"{draw(st.sampled_from(TEXT_KEYS + ['train.optimizer.lr']))}=a,{draw(payloads)}"
        for _ in range(draw(st.integers(0, 2)))
    ]
    seeds = draw(st.sampled_from([None, "1,2", f"1,{draw(payloads)}"])) if grid else "1,2"
    args = ["sweep", config, *setting, *[a for g in grid for a in ("--grid", g)]]
    args += (["--seeds", seeds] if seeds else []) + ["--slurm", "--dry-run", *cluster]
    return Case(command, args, config, sets, grid, seeds)


# ---------------------------------------------------------------- checking one


def _directives(script: str) -> str | None:
    """sbatch reads `#SBATCH` lines until the first command: each must be above it, one
    option with a value, and none holding a canary."""
    lines = script.splitlines()
    first = next(
        (i for i, line in enumerate(lines[1:], 1) if line.strip() and not line.startswith("#")),
        len(lines),
    )
    for i, line in enumerate(lines):
        if line.startswith("#SBATCH"):
            if i > first:
                return f"directives: {line!r} is below the first command (line {first + 1})"
            if W in line or "CANARY" in line or not re.fullmatch(r"#SBATCH --[\w-]+(=\S+)?", line):
                return f"directives: {line!r}"
    return None


def _after(argv: list[str], marker: str, records: Path) -> list[str] | None:
    """The arguments after `marker` (the rank's module), an `--args-file` read from the copy the
    python recorder kept, and the launcher's `--workdir DIR` left out."""
    # `-m MODULE` (`python -c "...run_module('MODULE'...)"` before 3.11: the code holds it)
    hits = [i for i, a in enumerate(argv) if a == marker or f"'{marker}'" in a]
    if not hits:
        return None
    rest = argv[hits[0] + 1 :]
    if rest[:1] == ["--args-file"] and len(rest) == 2:
        rest = json.loads((records / "args-file.json").read_text())["args"]
    if rest[:1] == ["--workdir"]:
        rest = rest[2:]
    return rest


def _expected_sets(case: Case, extra: list[str]) -> list[str]:
    return [a for s in [*case.sets, *extra] for a in ("--set", s)]


def _run_script(script: str, tmp: Path, rec: Recorders, task: int | None) -> str | None:
    job = tmp / "job.sh"
    job.write_text(script.replace(sys.executable, str(rec.bin / "python")))
    env = {**os.environ, **rec.env(), "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "node1"}
    if task is not None:
        env["SLURM_ARRAY_TASK_ID"] = str(task)
    try:
        done = subprocess.run(
            ["bash", str(job)], env=env, cwd=tmp, capture_output=True, timeout=HANG_SECONDS
        )
    except subprocess.TimeoutExpired:
        return "hang: the rendered script"
    if done.returncode != 0:
        return f"script failed: exit {done.returncode}: {done.stderr[-300:]!r}"
    return None


def check_script(case: Case, script: str, tmp: Path, rec: Recorders) -> str | None:
    directives = _directives(script)  # and the script is run all the same: does it run a canary?
    array = re.search(r"^#SBATCH --array=0-(\d+)", script, re.M)
    tasks = list(range(int(array.group(1)) + 1)) if array else [None]
    for task in tasks:
        problem = _run_script(script, tmp, rec, task)
        if problem or directives:
            return "; ".join(p for p in (directives, problem) if p)
    sruns = rec.calls("srun")
    if len(sruns) != len(tasks):
        return f"mangled: srun ran {len(sruns)} times for {len(tasks)} task(s)"
    if array is None:
        launcher = re.findall(r"train\.launcher\.\w+=\d+", script)
        want = ["--ranks-from-slurm", "--config", case.config, *_expected_sets(case, launcher)]
        got = [_after(call, RANK_MODULE, rec.records) for call in sruns]
        if got[0] != want:
            return f"mangled: srun got {got[0]!r}, expected {want!r}"
        return None
    want_sweep = [case.config, *_expected_sets(case, [])]
    want_sweep += [a for g in case.grid for a in ("--grid", g)]
    want_sweep += ["--seeds", case.seeds] if case.seeds else []
    steps = [c for c in rec.calls("python") if "--array-task-prepare" in c]
    if len(steps) != len(tasks):
        return f"mangled: the task step ran {len(steps)} times for {len(tasks)} task(s)"
    for task, call in zip(tasks, steps, strict=True):
        got = call[call.index("sweep") + 1 :] if "sweep" in call else call
        if got != [*want_sweep, "--array-task-prepare", str(task)]:
            return f"mangled: the task step got {got!r}, expected {want_sweep!r}"
    return None


def run_case(case: Case, world: World, tmp: Path, rec: Recorders) -> Outcome:
    rec.reset()
    inv = invoke(case.args, world.root, rec.env())
    problem = inv.problem
    start = time.monotonic()
    if problem is None and inv.exit_code == 0:
        if case.command == "run, 2 nodes":
            nodes = [c for c in rec.calls("python") if "deepspeed.launcher.launch" in c]
            want = ["--config", case.config, *_expected_sets(case, [])]
            if len(nodes) != 2:
                problem = f"mangled: {len(nodes)} node(s) started {RANK_MODULE}, not 2"
            for call in nodes:
                got = _after(call, RANK_MODULE, rec.records)
                if problem is None and got != want:
                    problem = f"mangled: a node got {got!r}, expected {want!r}"
        else:
            out = case.args[-1] if case.command == "launch slurm --output" else None
            script = Path(out).read_text() if out else inv.stdout
            problem = check_script(case, script, tmp, rec)
    ran = rec.ran()
    if ran:
        problem = f"command ran: {len(ran)} canary command(s)" + (f"; {problem}" if problem else "")
    seconds = inv.seconds + time.monotonic() - start
    said = (inv.stderr.strip().splitlines() or [""])[-1][:300]
    return Outcome(case.command, case.args, inv.exit_code, seconds, len(ran), problem, said)


def fuzz_injection(world: World, cases: int, on_outcome) -> None:
    """`cases` derandomized cases on `world` (its workspace is theirs to write), each with a
    temporary directory of its own and the recorders' records reset."""
    import tempfile

    with tempfile.TemporaryDirectory() as kit:
        rec = make_recorders(Path(kit))

        def one(draw):
            with tempfile.TemporaryDirectory() as tmp:
                case = draw_case(draw, world, Path(tmp))
                on_outcome(run_case(case, world, Path(tmp), rec))
            shutil.rmtree(world.root / "runs" / "tiny" / "slurm", ignore_errors=True)

        derandomized(cases, one)
