"""Many processes: the `deepspeed` launcher command that `allattn-pipe run` starts when the
spec asks for several processes. Each launched process runs the module
`pipeline.commands.launched` (deepspeed's `--module`), from the installed package: no file of
a checkout is needed (the checkout's `launch/train.py` runs the same `main`).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

from pipeline.cluster import distributed
from pipeline.cluster.interpreter import RANK_MODULE, python_module, safe_environment
from pipeline.errors import PipelineError, Preempted
from pipeline.resources import project_dir

# What a launched process is told on its command line besides the pipeline's arguments:
# the directory the user ran `allattn-pipe run` in (the launcher itself runs in `launch_dir()`,
# so that neither it nor the deepspeed runner puts that directory on sys.path or into
# PYTHONPATH), and, with several nodes, the file holding the arguments and credentials.
WORKDIR = "--workdir"
ARGS_FILE = "--args-file"

# Environment variables deepspeed's runner copies into the command line a remote shell runs on
# every node (its EXPORT_ENVS and the CUDA accelerator's), each as export NAME="VALUE": inside
# double quotes these still act.
_EXPORTED_ENV = ("MLFLOW", "PYTHON", "MV2", "UCX", "NCCL")
_ACTIVE_IN_DOUBLE_QUOTES = re.compile(r'[$`"\\\x00-\x1f\x7f]')


def _carried_by_file(name: str, value: str) -> bool:
    """Whether deepspeed would print a credential on every node's command line: MLflow's
    variables (a tracking URI's password, a token) and any exported one holding a secret."""
    from pipeline.redact import is_secret_name, mask

    exported = name.startswith(_EXPORTED_ENV)
    return exported and (name.startswith("MLFLOW") or is_secret_name(name) or mask(value) != value)


def _remote_safe(env: dict[str, str]) -> None:
    """Refuse, in one line, what deepspeed would put raw into the remote command line: paths
    (its `cd`, the interpreter) and the environment variables it exports."""
    from pipeline.cluster.slurm import plain

    used_by = "a multi-node launch's remote command line"
    plain("python interpreter", sys.executable, used_by)
    plain("launcher directory", launch_dir(), used_by)  # its `cd` on every node
    for name, value in env.items():
        if name.startswith(_EXPORTED_ENV) and _ACTIVE_IN_DOUBLE_QUOTES.search(value):
            raise PipelineError(
                f"environment variable {name}: the deepspeed launcher passes it to every "
                f'node inside double quotes, where $ ` " \\ and control characters would run '
                f"or cut it; unset it or set it without them"
            )


def write_args_file(directory: Path, args: list[str], env: dict[str, str]) -> Path:
    """A file only its owner reads (0600), in `directory` (the workspace: every node sees it),
    holding a launched process's arguments and the environment variables that must not go on
    a command line. The launched process reads it (`read_args_file`)."""
    import json
    import tempfile

    directory.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=".launch-", suffix=".json", dir=directory)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump({"args": args, "env": env}, f)
    return Path(name)


def read_args_file(path: str) -> tuple[list[str], dict[str, str]]:
    import json

    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        args, env = data["args"], data["env"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise PipelineError(
            f"{ARGS_FILE} {path}: cannot read the launcher's arguments ({e})"
        ) from None
    return [str(a) for a in args], {str(k): str(v) for k, v in env.items()}


def launcher_command(spec, pipeline_args: list[str], env=None) -> list[str]:
    """The `deepspeed` runner command that runs RANK_MODULE with `pipeline_args` on
    `spec.train.launcher`'s processes (`env`: the environment it will run in, default this
    process's). Several nodes: the arguments go to every node's shell as they are, so they
    must be `[ARGS_FILE, PATH]` (`Launch` makes them so)."""
    launcher = spec.train.launcher
    cmd = python_module("deepspeed.launcher.runner")
    if launcher.nodes > 1 and not launcher.hostfile:
        raise PipelineError(
            f"train.launcher.nodes {launcher.nodes}: the deepspeed launcher "
            f"needs train.launcher.hostfile naming the nodes (on Slurm, "
            f"`allattn-pipe launch slurm` starts the processes instead)"
        )
    if launcher.hostfile:
        if not Path(launcher.hostfile).is_file():
            raise PipelineError(f"train.launcher.hostfile {launcher.hostfile}: no such file")
        cmd += ["--hostfile", os.path.abspath(launcher.hostfile)]
    if launcher.nodes > 1:
        _remote_safe(dict(os.environ) if env is None else env)
    port = launcher.master_port or distributed.free_port()
    cmd += [
        "--num_nodes",
        str(launcher.nodes),
        "--num_gpus",
        str(launcher.procs_per_node),
        "--master_port",
        str(port),
        "--module",
        RANK_MODULE,
    ]
    return cmd + pipeline_args


def launch_dir() -> Path:
    """Where the launcher starts: the package's launch/ folder, which holds no Python package
    (deepspeed's runner puts its working directory into the ranks' PYTHONPATH, and a node
    `cd`s there) and is where the package is, on every node that has it."""
    return project_dir("launch")


class Launch:
    """How `spec`'s processes are started: `cmd` run in `cwd` (`launch_dir()`, not the
    user's directory) with `env`; `shown` is the line the user reads. With several nodes,
    the arguments and the credentials in the environment travel in a 0600 file in the
    workspace, never on the command line deepspeed prints and runs on every node; `close()`
    removes it."""

    def __init__(self, spec, pipeline_args: list[str], env: dict[str, str] | None = None):
        here = Path.cwd()
        env = safe_environment(dict(os.environ) if env is None else env, here)
        args = [WORKDIR, str(here), *pipeline_args]
        self.file: Path | None = None
        if spec.train.launcher.nodes > 1:
            carried = {k: v for k, v in env.items() if _carried_by_file(k, v)}
            env = {k: v for k, v in env.items() if k not in carried}
            launcher_command(spec, [], env)  # refused before a file is written
            self.file = write_args_file(spec.workspace_dir, args, carried)
            args = [ARGS_FILE, str(self.file)]
        self.cmd = launcher_command(spec, args, env)
        self.env, self.cwd = env, launch_dir()
        # the arguments as given, not the file's name: what the user reads
        self.shown = " ".join([*self.cmd[: len(self.cmd) - len(args)], *pipeline_args])

    def close(self) -> None:
        if self.file is not None:
            self.file.unlink(missing_ok=True)
            self.file = None

    def __enter__(self) -> Launch:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _copy_masked(source, target) -> None:
    """Copy the launcher's (and the ranks') output line by line with every URL's credentials
    masked: deepspeed prints its command lines (`cmd = ...`, `spawned with command: ...`)."""
    from pipeline.redact import mask_text

    out = getattr(target, "buffer", None)
    for raw in iter(source.readline, b""):
        line = mask_text(raw.decode("utf-8", "surrogateescape"))
        data = line.encode("utf-8", "surrogateescape")
        try:
            if out is not None:  # the raw bytes through the binary buffer
                out.write(data)
                out.flush()
            else:  # a text stream (a test's capture): undecodable bytes as U+FFFD
                target.write(data.decode("utf-8", "replace"))
                target.flush()
        except (OSError, ValueError):  # our own output closed: keep draining the pipe
            pass
    source.close()


def run_under_launcher(spec, pipeline_args: list[str], log=print) -> None:
    """Start the launcher for `spec` and wait for it. SIGTERM / ctrl-C / SIGHUP are passed on as
    SIGTERM to the ranks, which checkpoint together and exit 143 (`Preempted`); a second one
    as SIGINT, which stops them at once."""
    import threading

    from pipeline.redact import mask

    env = dict(os.environ)
    if env.get("DS_ACCELERATOR") == "cpu" or not _has_cuda():
        # processes on one CPU host share its cores instead of each taking all of them
        per_proc = max(1, (os.cpu_count() or 1) // spec.train.launcher.procs_per_node)
        env.setdefault("OMP_NUM_THREADS", str(per_proc))
    with Launch(spec, pipeline_args, env) as launch:
        log(f"starting {spec.train.launcher.world_size} processes: {mask(launch.shown)}")
        for stream in (sys.stdout, sys.stderr):  # ours first: the copies write below it
            stream.flush()
        # Its own session (so its own process group): a ctrl-C in the terminal reaches only
        # us, and we decide how the launcher's processes hear of it. Its output (and the
        # ranks') comes through us, masked.
        proc = subprocess.Popen(
            launch.cmd,
            env=launch.env,
            cwd=launch.cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        pumps = [
            threading.Thread(target=_copy_masked, args=(pipe, stream), daemon=True)
            for pipe, stream in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr))
        ]
        for pump in pumps:
            pump.start()
        _wait(proc, pumps)


def _wait(proc, pumps) -> None:
    """Wait for the launcher and its output, passing signals on to the ranks."""
    import psutil

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

    # SIGHUP too (a closed terminal), as every command takes it, unless `nohup` ignores it
    taken = [signal.SIGTERM, signal.SIGINT]
    if signal.getsignal(signal.SIGHUP) != signal.SIG_IGN:
        taken.append(signal.SIGHUP)
    previous = {s: signal.signal(s, forward) for s in taken}
    try:
        code = proc.wait()
        psutil.wait_procs(signalled, timeout=600)  # the ranks finish saving
        for pump in pumps:
            pump.join(timeout=10)  # what they printed last
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
    # `python -u -m pipeline.commands.launched ...`; the launchers run as
    # `python -u -m deepspeed.launcher...` with the module among their arguments
    return "-m" in argv and argv[argv.index("-m") + 1 :][:1] == [RANK_MODULE]


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()
