"""Slurm batch scripts for multi-node training: `launch/slurm.sbatch` with its blanks filled
(the template ships inside the package: `pipeline.resources`).

The script starts every rank with srun, from the installed package (the contract of
`pipeline.commands.launched`), with the job's directory off sys.path:

    srun python -P -m pipeline.commands.launched --ranks-from-slurm --config CFG [--set ...]

It lives next to `pipeline.spec` rather than under `launch/` because it is engine code the CLI
calls (validation against the spec, errors as `PipelineError`); `launch/` holds the template.
"""

from __future__ import annotations

import re
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

from pipeline.cluster.interpreter import RANK_MODULE, python_module
from pipeline.errors import PipelineError, shown
from pipeline.resources import project_dir
from pipeline.spec import load_spec
from pipeline.spec.schema import Spec


def template_path() -> Path:
    """The batch script's template: the package's launch/slurm.sbatch."""
    return project_dir("launch") / "slurm.sbatch"


# Seconds between Slurm's time-limit warning (USR1) and the limit: a step to finish, a
# checkpoint to write (rank 0 writes the whole model and optimizer state with ZeRO stage 0).
SIGNAL_LEAD_S = 300

# Slurm delivers a port chosen by job id; see the comment above MASTER_PORT in the template.
PORT_FROM_JOB_ID = "$((20000 + SLURM_JOB_ID % 10000))"

# Paths go into #SBATCH lines, which Slurm splits on whitespace, and into a pdsh command run
# by a remote shell: accept the characters that need no quoting in either (the set deepspeed's
# multinode_runner.add_export also leaves unquoted) rather than quote for two parsers.
_PLAIN_PATH = re.compile(r"[\w@%+=:,./-]+")

# Slurm's --time formats (sbatch(1)) and the unit of each number in them. ASCII digits only:
# `\d` and int() also take other scripts' digits ("١٢"), which sbatch refuses.
_N = "([0-9]+)"
_TIME_FORMATS = [
    (re.compile(_N), ("m",)),
    (re.compile(f"{_N}:{_N}"), ("m", "s")),
    (re.compile(f"{_N}:{_N}:{_N}"), ("h", "m", "s")),
    (re.compile(f"{_N}-{_N}"), ("d", "h")),
    (re.compile(f"{_N}-{_N}:{_N}"), ("d", "h", "m")),
    (re.compile(f"{_N}-{_N}:{_N}:{_N}"), ("d", "h", "m", "s")),
]
_SECONDS = {"d": 86400, "h": 3600, "m": 60, "s": 1}

# sbatch --signal=[{R|B}:]<sig_num>[@sig_time]: sig_time is at most 65535 seconds (sbatch(1)).
MAX_SIGNAL_LEAD_S = 65535

# The first line of every script this renders: `launch slurm --output` and `sweep --slurm`
# replace a file only when it holds this line, so they never overwrite one they did not write
# (the config, a hand-edited script kept under another name).
MARKER = "# allattn-pipe rendered this Slurm script: re-rendering it replaces this file"

# A control character (newline, CR, NUL, tab, the other C0 and C1 codes, DEL) in a value would
# end a comment or a line of the script, or change what sbatch reads: refused, never quoted.
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")

# An account or QOS name, as sacctmgr makes them: ASCII letters, digits and _.- only, so it
# needs no quoting in an #SBATCH line (which Slurm splits on whitespace).
_SLURM_NAME = re.compile(r"[A-Za-z0-9_.-]+")

# --cpus-per-task when sinfo cannot say what a node has (no sinfo here, no controller): Slurm's
# own default. A rank reads its data in its own process (pipeline/data/stream.py: no loader
# workers), so 1 runs; `--cpus-per-task` gives it more.
FALLBACK_CPUS_PER_TASK = 1
SINFO_TIMEOUT_S = 10


def refuse_control(flag: str, value: str) -> str:
    """`value`, given as `flag`, if it can go into a script's line; else a one-line error."""
    if _CONTROL.search(value):
        raise PipelineError(
            f"{flag} {shown(value)}: control characters (newline, tab, ...) cannot go into "
            f"a Slurm script; write the value without them"
        )
    return value


def script_values(overrides: Sequence[str], grid: Sequence[str] = (), seeds: str | None = None):
    """Refuse, in one line, a --set, --grid or --seeds value that cannot go into a script."""
    for flag, values in (("--set", overrides), ("--grid", grid), ("--seeds", [seeds or ""])):
        for v in values:
            refuse_control(flag, v)


def is_rendered(text: str) -> bool:
    """Whether a file's text is a script this module rendered (its marker line)."""
    return MARKER in text.splitlines()[:3]


def time_limit_seconds(text: str) -> int:
    """Seconds in a Slurm time limit: 90, 90:00, 24:00:00, 1-00, 1-00:00, 1-00:00:00."""
    for pattern, units in _TIME_FORMATS:
        match = pattern.fullmatch(text)
        if match:
            return sum(int(n) * _SECONDS[u] for n, u in zip(match.groups(), units, strict=False))
    raise PipelineError(
        f"--time {text!r}: not a Slurm time limit; use minutes (90), "
        f"minutes:seconds, hours:minutes:seconds (24:00:00) or "
        f"days-hours[:minutes[:seconds]] (1-00:00:00)"
    )


def slurm_dir(spec: Spec) -> Path:
    """Where a pipeline's Slurm files live: script and logs (absolute)."""
    return (Path.cwd() / spec.workspace_dir / "slurm").resolve()


def plain(what: str, path: str | Path, used_by: str = "the Slurm script") -> str:
    """`path` if it needs no quoting in a shell or an #SBATCH line; else a one-line error."""
    text = str(path)
    if not _PLAIN_PATH.fullmatch(text):
        raise PipelineError(
            f"{what} {text!r}: only letters, digits and _@%+=:,./- are "
            f"supported in paths {used_by} uses (move or link it)"
        )
    return text


def directive_path(what: str, path: str | Path) -> str:
    """`path` as an #SBATCH filename pattern names it: `plain`, with every `%` doubled. sbatch
    expands `%j`, `%x`, `%A`... anywhere in an --output path, directories included, and
    `%%` is its `%`: a project under `exp%j/` would otherwise log to `exp123/`, a directory
    that does not exist (Slurm writes no log then)."""
    return plain(what, path).replace("%", "%%")


def _fill(template: str, values: dict[str, str]) -> str:
    # the command that rendered the script goes into a comment: one line, whatever it holds
    values = {**values, "marker": MARKER, "rendered_by": _comment(values["rendered_by"])}

    def value(match: re.Match) -> str:
        return values[match.group(1)]

    missing = set(re.findall(r"{{ (\w+) }}", template)) - values.keys()
    if missing:
        raise PipelineError(f"{template_path()}: no value for {', '.join(sorted(missing))}")
    return re.sub(r"{{ (\w+) }}", value, template)


def _comment(text: str) -> str:
    """`text` as the rest of a comment line: anything that could end the line escaped (its
    values are refused before they get here; this keeps the comment one line regardless)."""
    return _CONTROL.sub(lambda m: repr(m.group())[1:-1], text)


def slurm_name(flag: str, value: str, what: str) -> str:
    """`value` if it can be a Slurm account / QOS name in an #SBATCH line; else one line."""
    refuse_control(flag, value)
    if not _SLURM_NAME.fullmatch(value):
        raise PipelineError(
            f"{flag} {value!r}: not a Slurm {what} name; only ASCII letters, digits and _.- "
            f"are supported"
        )
    return value


def partition_nodes(partition: str | None) -> list[tuple[int, int]] | None:
    """(CPUs, GPUs) of each kind of node in `partition` (the cluster's default partition when
    None), as sinfo reports them; None when sinfo is not here or cannot say."""
    import shutil
    import subprocess

    sinfo = shutil.which("sinfo")
    if sinfo is None:
        return None
    command = [sinfo, "--noheader", "--format=%P %c %G"]
    if partition is not None:
        command.append(f"--partition={partition}")
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=SINFO_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError):
        return None
    if done.returncode != 0:
        return None
    nodes = []
    for line in done.stdout.splitlines():
        fields = line.split()
        # the default partition is the one sinfo marks with *; "64+": at least 64 CPUs
        if len(fields) != 3 or (partition is None and not fields[0].endswith("*")):
            continue
        cpus = re.fullmatch(r"([0-9]+)\+?", fields[1])
        if cpus is None:
            continue
        # Gres such as gpu:8, gpu:a100:8(S:0-1) or gpu:a100:4,gpu:v100:2 ((null): none)
        gpus = sum(int(n) for n in re.findall(r"gpu(?::[^:,(]+)?:([0-9]+)", fields[2]))
        nodes.append((int(cpus.group(1)), gpus))
    return nodes or None


def cpus_per_task(
    given: int | None, partition: str | None, gpus_per_node: int, procs: int
) -> tuple[int, str]:
    """CPUs for each training process, and where the number comes from: `given`
    (--cpus-per-task), else the node's CPUs per GPU (per process on a CPU partition) on the
    partition's smallest kind of node, as sinfo reports it, else FALLBACK_CPUS_PER_TASK."""
    if given is not None:
        if given < 1:
            raise PipelineError(f"--cpus-per-task must be at least 1, got {given}")
        return given, "--cpus-per-task"
    nodes = partition_nodes(partition)
    where = f"partition {partition}" if partition else "the default partition"
    if nodes is None:
        return FALLBACK_CPUS_PER_TASK, (
            f"Slurm's default; sinfo could not say what {where}'s nodes have "
            f"(--cpus-per-task N sets it)"
        )
    per_node = [
        (cpus // gpus, f"{cpus} CPUs / {gpus} GPUs")
        if gpus_per_node and gpus
        else (cpus // procs, f"{cpus} CPUs / {procs} processes")
        for cpus, gpus in nodes
    ]
    cpus, how = min(per_node)
    return max(1, cpus), f"{how} per node of {where} (sinfo)"


def _resources(nodes: int, gpus_per_node: int, procs_per_node: int | None) -> int:
    """Processes per node: one per GPU, or --procs-per-node on a CPU partition."""
    if nodes < 1:
        raise PipelineError(f"--nodes must be at least 1, got {nodes}")
    if gpus_per_node < 0:
        raise PipelineError(
            f"--gpus-per-node must be 0 (a CPU partition) or more, got {gpus_per_node}"
        )
    if procs_per_node is None:
        if gpus_per_node == 0:
            raise PipelineError(
                "--gpus-per-node 0 (a CPU partition) needs --procs-per-node: "
                "how many training processes each node runs"
            )
        return gpus_per_node
    if procs_per_node < 1:
        raise PipelineError(f"--procs-per-node must be at least 1, got {procs_per_node}")
    if gpus_per_node and procs_per_node != gpus_per_node:
        raise PipelineError(
            f"--procs-per-node {procs_per_node} with --gpus-per-node "
            f"{gpus_per_node}: each process trains on one GPU; give one of "
            f"the two, or --gpus-per-node 0 for a CPU partition"
        )
    return procs_per_node


def _directives(
    gpus_per_node: int,
    procs: int,
    partition: str | None,
    time: str | None,
    signal_lead: int,
    *,
    cpus: int | None,
    account: str | None,
    qos: str | None,
    extra: Sequence[str] = (),
) -> str:
    """The #SBATCH lines a job's options ask for (None: not asked, the cluster's default;
    `cpus`: derived, see `cpus_per_task`)."""
    directives = [*extra]
    if gpus_per_node:
        directives.append(f"#SBATCH --gpus-per-node={gpus_per_node}")
    if partition is not None:
        if not re.fullmatch(r"[A-Za-z0-9_.,-]+", partition):  # ASCII, as Slurm names are
            raise PipelineError(
                f"--partition {partition!r}: not a partition name (or a "
                f"comma-separated list of them)"
            )
        directives.append(f"#SBATCH --partition={partition}")
    per_task, source = cpus_per_task(cpus, partition, gpus_per_node, procs)
    directives.append(f"# CPUs per training process: {_comment(source)}")
    directives.append(f"#SBATCH --cpus-per-task={per_task}")
    if account is not None:
        directives.append(f"#SBATCH --account={slurm_name('--account', account, 'account')}")
    if qos is not None:
        directives.append(f"#SBATCH --qos={slurm_name('--qos', qos, 'QOS')}")
    if signal_lead < 1:
        raise PipelineError(f"--signal-lead must be at least 1 second, got {signal_lead}")
    if signal_lead > MAX_SIGNAL_LEAD_S:
        raise PipelineError(
            f"--signal-lead {signal_lead}: sbatch's --signal takes at most "
            f"{MAX_SIGNAL_LEAD_S} seconds"
        )
    if time is not None:
        if time_limit_seconds(time) <= signal_lead:
            raise PipelineError(
                f"--time {time}: the job is asked to checkpoint "
                f"{signal_lead} s before its time limit, which leaves "
                f"no time to train; give it longer (or a shorter "
                f"--signal-lead)"
            )
        directives.append(f"#SBATCH --time={time}")
    return "".join(d + "\n" for d in directives)


def _environment(gpus_per_node: int) -> str:
    # srun of Slurm 22.05 to 23.02 does not take --cpus-per-task from the job: say it again
    cpus = "export SRUN_CPUS_PER_TASK=${SLURM_CPUS_PER_TASK:-1}\n"
    if gpus_per_node:
        return cpus
    # DeepSpeed would look for a GPU; OpenMP threads default to the cores Slurm gave a task
    return (
        cpus + "export DS_ACCELERATOR=cpu\n"
        "export OMP_NUM_THREADS=${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-1}}\n"
    )


def _launcher_sets(nodes: int, procs_per_node: int) -> list[str]:
    # The job's spec records its real world size (train.launcher; not part of the train
    # stage's fingerprint); pipeline.training.reshard resumes a checkpoint of another world size.
    return [f"train.launcher.nodes={nodes}", f"train.launcher.procs_per_node={procs_per_node}"]


def _set_args(sets: list[str]) -> str:
    return "".join(f" \\\n    --set {shlex.quote(kv)}" for kv in sets)


def _common_values(
    config_path: str | Path,
    nodes: int,
    procs: int,
    gpus_per_node: int,
    signal_lead: int,
    master_port: int | None,
) -> dict[str, str]:
    """The template's values that a single job and a sweep's array share."""
    return {
        "config": plain("config", config_path),
        "nodes": str(nodes),
        "procs_per_node": str(procs),
        "signal_lead": str(signal_lead),
        "workdir": plain("working directory", Path.cwd().resolve()),
        "environment": _environment(gpus_per_node),
        "master_port": str(master_port) if master_port else PORT_FROM_JOB_ID,
        "rank_command": _command(RANK_MODULE),
    }


def _command(module: str) -> str:
    """`python -m module` as a line of the script: this interpreter (a path no shell or
    #SBATCH line splits), the job's directory off sys.path (`python_module`)."""
    plain("python interpreter", sys.executable)
    return " ".join(shlex.quote(a) for a in python_module(module))


def render_sbatch(
    config_path: str | Path,
    spec: Spec,
    nodes: int,
    gpus_per_node: int,
    procs_per_node: int | None = None,
    partition: str | None = None,
    time: str | None = None,
    signal_lead: int = SIGNAL_LEAD_S,
    overrides: tuple[str, ...] | list[str] = (),
    cpus_per_task: int | None = None,
    account: str | None = None,
    qos: str | None = None,
) -> str:
    """The batch script that trains `spec` (loaded from `config_path` with `overrides`) on
    `nodes` x processes per node. The job must be submitted from the current directory's
    project: the script `cd`s here, so relative paths mean the same there."""
    procs = _resources(nodes, gpus_per_node, procs_per_node)
    script_values(overrides)
    if "train" not in spec.stages:
        raise PipelineError(
            f"{config_path}: the pipeline {spec.name} has no train stage, "
            f"so nothing to run on {nodes} x {procs} processes"
        )
    sets = [*overrides, *_launcher_sets(nodes, procs)]
    # the spec refuses a train.batch_size that does not split over the job's processes
    job_spec = load_spec(config_path, sets)
    assert job_spec.train is not None  # checked above: a train stage runs
    port = job_spec.train.launcher.master_port
    command = (
        f"allattn-pipe launch slurm {config_path} --nodes {nodes} "
        f"--gpus-per-node {gpus_per_node}"
        + (f" --procs-per-node {procs}" if not gpus_per_node else "")
    )
    return _fill(
        template_path().read_text(encoding="utf-8"),
        {
            **_common_values(config_path, nodes, procs, gpus_per_node, signal_lead, port),
            "name": job_spec.name,
            "rendered_by": command,
            "optional_directives": _directives(
                gpus_per_node,
                procs,
                partition,
                time,
                signal_lead,
                cpus=cpus_per_task,
                account=account,
                qos=qos,
            ),
            "log_dir": directive_path("log directory", slurm_dir(spec) / "logs"),
            "log_name": "%x-%j.out",
            "point_setup": "",
            "point_finish": "",
            "train_args": _set_args(sets),
        },
    )


def render_sweep_array(
    config_path: str | Path,
    overrides: list[str],
    grid: list[str],
    seeds: str | None,
    points: list,
    nodes: int,
    gpus_per_node: int,
    procs_per_node: int | None = None,
    partition: str | None = None,
    time: str | None = None,
    signal_lead: int = SIGNAL_LEAD_S,
    max_parallel: int | None = None,
    cpus_per_task: int | None = None,
    account: str | None = None,
    qos: str | None = None,
) -> tuple[str, Spec]:
    """A job array that runs every point of `allattn-pipe sweep CONFIG --grid ... --seeds ...`
    as one task (at most `max_parallel` at once), each on `nodes` x processes per node.
    `points` are the sweep's points as `pipeline.commands.sweep.plan_sweep` plans them.
    Returns the script and the sweep's base spec (where the script's files go)."""
    procs = _resources(nodes, gpus_per_node, procs_per_node)
    script_values(overrides, grid, seeds)
    if max_parallel is not None and max_parallel < 1:
        raise PipelineError(f"--max-parallel must be at least 1, got {max_parallel}")
    launcher_sets = _launcher_sets(nodes, procs)
    for p in points:
        if "train" not in p.spec.stages:
            raise PipelineError(
                f"{config_path}: sweep point {p.name} has no train stage, so "
                f"nothing to run on {nodes} x {procs} processes"
            )
        load_spec(config_path, [*p.overrides, *launcher_sets])  # the batch splits over them
    base = load_spec(config_path, overrides)
    # the working directory off sys.path, as for every Python process a run starts
    cli = _command("pipeline.commands.cli")
    sweep_args = " ".join(
        shlex.quote(a)
        for a in [
            plain("config", config_path),
            *(x for o in overrides for x in ("--set", o)),
            *(x for g in grid for x in ("--grid", g)),
            *(["--seeds", seeds] if seeds else []),
        ]
    )
    cases = "".join(
        f"    {i}) POINT=({' '.join('--set ' + shlex.quote(o) for o in p.overrides)}) ;;\n"
        for i, p in enumerate(points)
    )
    task = '"$SLURM_ARRAY_TASK_ID"'
    setup = (
        f"# This task's point of the sweep, and its shared stages: built once, by the\n"
        f"# first task to get here, and linked into the point's workspace.\n"
        f'case "$SLURM_ARRAY_TASK_ID" in\n{cases}'
        f'    *) echo "no sweep point $SLURM_ARRAY_TASK_ID" >&2; exit 1 ;;\nesac\n'
        f"{cli} sweep {sweep_args} --array-task-prepare {task}\n"
    )
    finish = (
        f"# The point's runs under the sweep's MLflow run.\n"
        f'if [ "$status" -eq 0 ]; then\n'
        f"    {cli} sweep {sweep_args} --array-task-finish {task}\n"
        f"fi\n"
    )
    limit = f"%{max_parallel}" if max_parallel else ""
    array = [f"#SBATCH --array=0-{len(points) - 1}{limit}"]
    rendered_by = (
        f"allattn-pipe sweep {sweep_args} --slurm --nodes {nodes} "
        f"--gpus-per-node {gpus_per_node}"
        + (f" --procs-per-node {procs}" if not gpus_per_node else "")
    )
    port = base.train.launcher.master_port if base.train else None
    script = _fill(
        template_path().read_text(encoding="utf-8"),
        {
            **_common_values(config_path, nodes, procs, gpus_per_node, signal_lead, port),
            "name": f"{base.name}-sweep",
            "rendered_by": rendered_by,
            "optional_directives": _directives(
                gpus_per_node,
                procs,
                partition,
                time,
                signal_lead,
                cpus=cpus_per_task,
                account=account,
                qos=qos,
                extra=array,
            ),
            "log_dir": directive_path("log directory", slurm_dir(base) / "logs"),
            "log_name": "%x-%A_%a.out",
            "point_setup": setup,
            "point_finish": finish,
            "train_args": ' \\\n    "${POINT[@]}"' + _set_args(launcher_sets),
        },
    )
    return script, base


def submit(script_path: Path) -> str:
    """`sbatch` the script; returns the job id."""
    import shutil
    import subprocess

    if shutil.which("sbatch") is None:
        raise PipelineError(f"sbatch not found: submit {script_path} from a Slurm login node")
    done = subprocess.run(
        ["sbatch", "--parsable", str(script_path)], capture_output=True, text=True
    )
    if done.returncode != 0:
        raise PipelineError(f"sbatch {script_path} failed: {done.stderr.strip()}")
    return done.stdout.strip().split(";")[0]
