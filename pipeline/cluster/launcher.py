"""Many processes: the `deepspeed` launcher command that `allattn-pipe run` starts when the
spec asks for several processes. What each launched process runs is
`pipeline.commands.launched` (`launch/train.py` calls it).
"""

from __future__ import annotations

import base64
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

from pipeline.cluster import distributed
from pipeline.errors import PipelineError, Preempted

ENTRY = Path(__file__).resolve().parents[2] / "launch" / "train.py"

# With several nodes the deepspeed runner joins its command into one line that a remote shell
# runs on every node (pdsh over ssh), and its own quoting only wraps an argument holding a
# space in double quotes, where $( ), backticks and \" still act. So the pipeline's arguments
# travel as one base64 word, which no shell changes; launch/train.py decodes them.
ENCODED_ARGS = "--args-base64"

# Environment variables deepspeed's runner copies into that line (its EXPORT_ENVS and the CUDA
# accelerator's), each as export NAME="VALUE": inside double quotes these still act.
_EXPORTED_ENV = ("MLFLOW", "PYTHON", "MV2", "UCX", "NCCL")
_ACTIVE_IN_DOUBLE_QUOTES = re.compile(r'[$`"\\\x00-\x1f\x7f]')


def encode_args(args: list[str]) -> str:
    """`args` as one word of [A-Za-z0-9+/=], characters no shell treats specially, byte for
    byte (NUL cannot be in an argument)."""
    # each argument ends in a NUL: [] and [""] stay apart
    blob = b"".join(os.fsencode(a) + b"\0" for a in args)
    return base64.b64encode(blob).decode("ascii")


def decode_args(word: str) -> list[str]:
    try:
        blob = base64.b64decode(word.encode("ascii"), validate=True)
    except (ValueError, UnicodeEncodeError):
        raise PipelineError(f"{ENCODED_ARGS}: not the launcher's encoding of arguments") from None
    if blob and not blob.endswith(b"\0"):
        raise PipelineError(f"{ENCODED_ARGS}: not the launcher's encoding of arguments")
    return [os.fsdecode(a) for a in blob.split(b"\0")[:-1]]


def _remote_safe(env: dict[str, str]) -> None:
    """Refuse, in one line, what deepspeed would put raw into the remote command line: paths
    (its `cd` and the interpreter) and the environment variables it exports."""
    from pipeline.cluster.slurm import plain

    used_by = "a multi-node launch's remote command line"
    plain("working directory", Path.cwd().resolve(), used_by)
    plain("python interpreter", sys.executable, used_by)
    plain("launch script", ENTRY, used_by)
    for name, value in env.items():
        if name.startswith(_EXPORTED_ENV) and _ACTIVE_IN_DOUBLE_QUOTES.search(value):
            raise PipelineError(
                f"environment variable {name}: the deepspeed launcher passes it to every "
                f'node inside double quotes, where $ ` " \\ and control characters would run '
                f"or cut it; unset it or set it without them"
            )


def launcher_command(spec, pipeline_args: list[str], env=None) -> list[str]:
    """The `deepspeed` command that runs this pipeline on `spec.train.launcher`'s processes
    (`env`: the environment it will run in, default this process's)."""
    launcher = spec.train.launcher
    if not ENTRY.is_file():
        raise PipelineError(
            f"{ENTRY} is missing: multi-process runs need the project's "
            f"launch/ directory (a source checkout)"
        )
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner"]
    if launcher.nodes > 1 and not launcher.hostfile:
        raise PipelineError(
            f"train.launcher.nodes {launcher.nodes}: the deepspeed launcher "
            f"needs train.launcher.hostfile naming the nodes (on Slurm, "
            f"`allattn-pipe launch slurm` starts the processes instead)"
        )
    if launcher.hostfile:
        if not Path(launcher.hostfile).is_file():
            raise PipelineError(f"train.launcher.hostfile {launcher.hostfile}: no such file")
        cmd += ["--hostfile", launcher.hostfile]
    if launcher.nodes > 1:
        _remote_safe(dict(os.environ) if env is None else env)
        pipeline_args = [ENCODED_ARGS, encode_args(pipeline_args)]
    port = launcher.master_port or distributed.free_port()
    cmd += [
        "--num_nodes",
        str(launcher.nodes),
        "--num_gpus",
        str(launcher.procs_per_node),
        "--master_port",
        str(port),
        str(ENTRY),
    ]
    return cmd + pipeline_args


def run_under_launcher(spec, pipeline_args: list[str], log=print) -> None:
    """Start the launcher for `spec` and wait for it. SIGTERM / ctrl-C are passed on as
    SIGTERM to the ranks, which checkpoint together and exit 143 (`Preempted`); a second one
    as SIGINT, which stops them at once."""
    import psutil

    env = dict(os.environ)
    if env.get("DS_ACCELERATOR") == "cpu" or not _has_cuda():
        # processes on one CPU host share its cores instead of each taking all of them
        per_proc = max(1, (os.cpu_count() or 1) // spec.train.launcher.procs_per_node)
        env.setdefault("OMP_NUM_THREADS", str(per_proc))
    cmd = launcher_command(spec, pipeline_args, env)
    # the arguments as given, not their encoded word: what the user reads (and what a log's
    # masking of secrets can find)
    shown = [*cmd[:-2], *pipeline_args] if cmd[-2:-1] == [ENCODED_ARGS] else cmd
    log(f"starting {spec.train.launcher.world_size} processes: {' '.join(shown)}")
    # Its own session (so its own process group): a ctrl-C in the terminal reaches only us,
    # and we decide how the launcher's processes hear of it.
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    stopped: list[str] = []
    signalled: list = []

    def forward(signum, frame):
        # To the ranks themselves: deepspeed's launchers answer a signal by killing their
        # children (the outer one at once, the inner one 30 s later), not by waiting for a
        # checkpoint. A rank's exit 143 then travels up through both launchers.
        # Asked again: SIGINT, which a rank takes as "stop now" (a repeated SIGTERM may be
        # one preemption delivered twice; see pipeline.cluster.signals).
        to_ranks = signal.SIGINT if stopped else signal.SIGTERM
        stopped.append(signal.Signals(signum).name)
        ranks = [c for c in psutil.Process(proc.pid).children(recursive=True) if _is_rank(c)]
        for rank in ranks:
            rank.send_signal(to_ranks)
        signalled.extend(ranks)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        code = proc.wait()
        psutil.wait_procs(signalled, timeout=600)  # the ranks finish saving
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if stopped or code == Preempted.exit_code:
        raise Preempted(
            f"training stopped by {stopped[0] if stopped else 'a signal'}; "
            f"run the pipeline again to resume from its last checkpoint"
        )
    if code != 0:
        raise PipelineError(
            f"the deepspeed launcher exited with code {code} (the failing "
            f"rank's error is printed above)"
        )


def _is_rank(process) -> bool:
    import psutil

    try:
        argv = process.cmdline()
    except psutil.Error:  # already gone
        return False
    # `python -u launch/train.py ...`; the launchers run as `python -u -m deepspeed...` with
    # the script among their arguments
    return str(ENTRY) in argv and "-m" not in argv


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()
