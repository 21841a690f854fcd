"""Slurm batch scripts for multi-node training: `launch/slurm.sbatch` with its blanks filled.

The script runs one `deepspeed` launcher per job (the contract of `launch/train.py`):

    deepspeed --hostfile H --num_nodes N --num_gpus G --master_addr A --master_port P \
        launch/train.py --config CFG [--set KEY=VALUE ...]

It lives next to `pipeline.spec` rather than under `launch/` because it is engine code the CLI
calls (validation against the spec, errors as `PipelineError`); `launch/` holds what runs on
the cluster.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from pipeline.errors import PipelineError
from pipeline.schema import Spec
from pipeline.spec import PROJECT_ROOT, load_spec

TEMPLATE = PROJECT_ROOT / "launch" / "slurm.sbatch"

# Seconds between Slurm's time-limit warning (USR1) and the limit: a step to finish, a
# checkpoint to write (rank 0 writes the whole model and optimizer state with ZeRO stage 0).
SIGNAL_LEAD_S = 300

# Slurm delivers a port chosen by job id; see the comment above MASTER_PORT in the template.
PORT_FROM_JOB_ID = "$((20000 + SLURM_JOB_ID % 10000))"

# Paths go into #SBATCH lines, which Slurm splits on whitespace, and into a pdsh command run
# by a remote shell: accept the characters that need no quoting in either (the set deepspeed's
# multinode_runner.add_export also leaves unquoted) rather than quote for two parsers.
_PLAIN_PATH = re.compile(r"[\w@%+=:,./-]+")

# Slurm's --time formats (sbatch(1)) and the unit of each number in them.
_TIME_FORMATS = [
    (re.compile(r"(\d+)"), ("m",)),
    (re.compile(r"(\d+):(\d+)"), ("m", "s")),
    (re.compile(r"(\d+):(\d+):(\d+)"), ("h", "m", "s")),
    (re.compile(r"(\d+)-(\d+)"), ("d", "h")),
    (re.compile(r"(\d+)-(\d+):(\d+)"), ("d", "h", "m")),
    (re.compile(r"(\d+)-(\d+):(\d+):(\d+)"), ("d", "h", "m", "s")),
]
_SECONDS = {"d": 86400, "h": 3600, "m": 60, "s": 1}


def time_limit_seconds(text: str) -> int:
    """Seconds in a Slurm time limit: 90, 90:00, 24:00:00, 1-00, 1-00:00, 1-00:00:00."""
    for pattern, units in _TIME_FORMATS:
        match = pattern.fullmatch(text)
        if match:
            return sum(int(n) * _SECONDS[u] for n, u in zip(match.groups(), units))
    raise PipelineError(f"--time {text!r}: not a Slurm time limit; use minutes (90), "
                        f"minutes:seconds, hours:minutes:seconds (24:00:00) or "
                        f"days-hours[:minutes[:seconds]] (1-00:00:00)")


def slurm_dir(spec: Spec) -> Path:
    """Where a pipeline's Slurm files live: script, hostfile, logs (absolute)."""
    return (Path.cwd() / spec.workspace_dir / "slurm").resolve()


def _plain(what: str, path: str | Path) -> str:
    text = str(path)
    if not _PLAIN_PATH.fullmatch(text):
        raise PipelineError(f"{what} {text!r}: only letters, digits and _@%+=:,./- are "
                            f"supported in paths the Slurm script uses (move or link it)")
    return text


def _ere_escape(text: str) -> str:
    """`text` as a literal in a POSIX extended regex (what pkill -f takes)."""
    return re.sub(r"([.\[\]()*+?{}|^$\\])", r"\\\1", text)


def _fill(template: str, values: dict[str, str]) -> str:
    def value(match: re.Match) -> str:
        return values[match.group(1)]

    missing = set(re.findall(r"{{ (\w+) }}", template)) - values.keys()
    if missing:
        raise PipelineError(f"{TEMPLATE}: no value for {', '.join(sorted(missing))}")
    return re.sub(r"{{ (\w+) }}", value, template)


def render_sbatch(config_path: str | Path, spec: Spec, nodes: int, gpus_per_node: int,
                  partition: str | None = None, time: str | None = None,
                  overrides: tuple[str, ...] | list[str] = ()) -> str:
    """The batch script that trains `spec` (loaded from `config_path` with `overrides`) on
    `nodes` x `gpus_per_node` processes. The job must be submitted from the current
    directory's project: the script `cd`s here, so relative paths mean the same there."""
    if nodes < 1:
        raise PipelineError(f"--nodes must be at least 1, got {nodes}")
    if gpus_per_node < 1:
        raise PipelineError(f"--gpus-per-node must be at least 1, got {gpus_per_node}")
    if "train" not in spec.stages:
        raise PipelineError(f"{config_path}: the pipeline {spec.name} has no train stage, "
                            f"so nothing to run on {nodes} x {gpus_per_node} GPUs")
    directives = []
    if partition is not None:
        if not re.fullmatch(r"[\w.,-]+", partition):
            raise PipelineError(f"--partition {partition!r}: not a partition name (or a "
                                f"comma-separated list of them)")
        directives.append(f"#SBATCH --partition={partition}")
    if time is not None:
        if time_limit_seconds(time) <= SIGNAL_LEAD_S:
            raise PipelineError(f"--time {time}: the job is asked to checkpoint "
                                f"{SIGNAL_LEAD_S} s before its time limit, which leaves "
                                f"no time to train; give it longer")
        directives.append(f"#SBATCH --time={time}")

    files = slurm_dir(spec)
    hostfile = _plain("hostfile", files / "hostfile")
    # The job's spec records its real world size (train.launcher; not part of the train
    # stage's fingerprint); pipeline.reshard resumes a checkpoint of another world size.
    launcher_sets = [f"train.launcher.nodes={nodes}",
                     f"train.launcher.procs_per_node={gpus_per_node}",
                     f"train.launcher.hostfile={hostfile}"]
    # the spec refuses a train.batch_size that does not split over the job's processes
    job_spec = load_spec(config_path, [*overrides, *launcher_sets])
    train = job_spec.train

    port = train.launcher.master_port
    train_args = "".join(f" \\\n    --set {shlex.quote(kv)}"
                         for kv in [*overrides, *launcher_sets])
    return _fill(TEMPLATE.read_text(encoding="utf-8"), {
        "name": job_spec.name,
        "config": _plain("config", config_path),
        "nodes": str(nodes),
        "gpus_per_node": str(gpus_per_node),
        "optional_directives": "".join(d + "\n" for d in directives),
        "log_dir": _plain("log directory", files / "logs"),
        "signal_lead": str(SIGNAL_LEAD_S),
        "workdir": _plain("working directory", Path.cwd().resolve()),
        "hostfile": hostfile,
        "master_port": str(port) if port else PORT_FROM_JOB_ID,
        "ranks_pattern": shlex.quote(r"[l]aunch/train\.py --local_rank=.*"
                                     r"train\.launcher\.hostfile=" + _ere_escape(hostfile)),
        "train_args": train_args,
    })
