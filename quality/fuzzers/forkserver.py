"""`allattn-pipe` commands as real processes without the interpreter's start-up each time: a
fork server (a "zygote") that has imported the pipeline and its heavy libraries (torch,
MLflow, DeepSpeed) once, and forks a child for each command. The child is a process of its
own, in a session of its own, with its own signal dispositions (the interpreter's defaults,
as in a fresh `allattn-pipe`), its stdout and stderr in files, and it runs the console
script's function (`pipeline.commands.cli:entry`) with the command's argv. Starting torch
in a fresh interpreter takes 3-8 s on 2 busy cores; a fork takes milliseconds, which is
what lets the stateful and signal fuzzers run hundreds of sequences.

The zygote never runs a torch operation (so no thread pool exists to be lost in a fork) and
no thread of its own. `ZYGOTE_MODULES` are what it imports before forking.

The child reports two moments on a pipe of its own, each with its time on the monotonic clock
(the same clock in every process of the machine), relayed by the zygote:
- `ready`: once the console script's signal handler is in place, its first step (signals
  are drawn from there);
- `ending`: when the command has decided its exit code (`distributed.exit_process` is
  called); a signal sent before `ending` was sent to a running command, one sent after it
  arrived at a command that had already finished (the fuzzers count it apart).

Protocol (JSON lines): the worker writes {"args", "cwd", "stdout", "stderr"} on the
zygote's stdin; the zygote answers {"pid", "ready"} and later {"ending"} (if the child got
there) and {"status"} (os.waitpid's, once the child is gone).
"""

from __future__ import annotations

import json
import os
import select
import signal
import struct
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MARK = struct.Struct("=cd")  # a child's mark: r(eady) or e(nding), and its monotonic time
# what the commands import lazily that takes seconds: torch's compiler stack (the optimizer
# imports torch._dynamo), matplotlib (evaluate's heat map), sympy; and every module of the
# project (`_project_modules`)
ZYGOTE_MODULES = (
    "torch",
    "torch._dynamo",
    "torch.distributed",
    "torch.distributed.tensor",
    "torch.onnx",
    "sympy",
    "numpy",
    "yaml",
    "mlflow",
    "mlflow.tracking",
    "mlflow.entities",
    "deepspeed",
    "safetensors.torch",
    "matplotlib.figure",
    "matplotlib.backends.backend_agg",
    "matplotlib.pyplot",
    "deepspeed.moe.ep_router",
)


@dataclass
class Ended:
    """How a command ended: its exit code (None: killed by a signal, `killed_by`), when it
    decided to end (monotonic seconds; None: it never got there), what it printed."""

    exit_code: int | None
    killed_by: int | None
    ending: float | None
    stdout: str
    stderr: str
    seconds: float
    cpu: float  # the command's CPU seconds (user and system)
    hung: bool = False

    @property
    def shell_code(self) -> int:
        """The status as a shell shows it: 128 + N for a process killed by signal N."""
        if self.exit_code is not None:
            return self.exit_code
        return 128 + (self.killed_by or 0)


class Zygote:
    """The fork server, run by this (the worker's) process; `env`: its environment, which
    every command inherits."""

    def __init__(self, env: dict[str, str]):
        self.env = env
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "quality.fuzzers.forkserver"],
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
        )
        self._pending = b""  # what was read of the answers past the last whole line
        started = self.read(600)
        if started != {"started": True}:
            raise RuntimeError(f"the fork server did not start: {started}")

    def read(self, timeout: float) -> dict | None:
        """The zygote's next answer, or None after `timeout` seconds. Read from the pipe's
        descriptor with a buffer of our own: a buffered reader's `readline` may take two
        answers that came together (a child's `ending` and its status) and leave the second
        where `select` cannot see it, which lost a command and then misread every answer."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self._pending:
            ready, _, _ = select.select([fd], [], [], max(deadline - time.monotonic(), 0))
            if not ready:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                raise RuntimeError(f"the fork server exited ({self.proc.wait()})")
            self._pending += chunk
        line, self._pending = self._pending.split(b"\n", 1)
        return json.loads(line)

    def start(self, args: list[str], cwd: Path, out_dir: Path) -> Command:
        """Fork a child running `allattn-pipe ARGS` in `cwd`; returns once it is ready."""
        assert self.proc.stdin is not None
        out_dir.mkdir(parents=True, exist_ok=True)
        request = {
            "args": [str(a) for a in args],
            "cwd": str(cwd),
            "stdout": str(out_dir / "stdout"),
            "stderr": str(out_dir / "stderr"),
        }
        self.proc.stdin.write(json.dumps(request) + "\n")
        answer = self.read(120)
        if not answer or "pid" not in answer:
            raise RuntimeError(f"the fork server did not fork: {answer}")
        return Command(self, answer["pid"], answer["ready"], out_dir)

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class Command:
    """A command the zygote forked: signal it, wait for it."""

    def __init__(self, zygote: Zygote, pid: int, ready: float, out_dir: Path):
        self.zygote, self.pid, self.ready, self.out_dir = zygote, pid, ready, out_dir
        self.ending: float | None = None
        self.status: int | None = None
        self.cpu = 0.0

    def _take(self, timeout: float) -> bool:
        """Read the zygote's next message about this command; False when none came."""
        message = self.zygote.read(timeout)
        if message is None:
            return False
        if "ending" in message:
            self.ending = message["ending"]
        if "status" in message:
            self.status, self.cpu = message["status"], message["cpu"]
        return True

    def running(self) -> bool:
        """Whether the command has not decided its exit yet (as far as the zygote said)."""
        while self.status is None and self.ending is None and self._take(0):
            pass
        return self.status is None and self.ending is None

    def signal(self, signum: int, group: bool = False) -> float:
        """Send `signum` (to its whole process group with `group`, as a terminal's ctrl-C
        reaches every process in the foreground); returns when, on the monotonic clock."""
        sent = time.monotonic()
        try:
            if group:
                os.killpg(self.pid, signum)
            else:
                os.kill(self.pid, signum)
        except ProcessLookupError:
            pass
        return sent

    def wait(self, timeout: float) -> Ended:
        """Until the command is gone, or `timeout` seconds (then its process group is
        killed and the outcome is `hung`)."""
        deadline = time.monotonic() + timeout
        hung = False
        while self.status is None:
            left = deadline - time.monotonic()
            if left <= 0 and not hung:
                hung = True
                try:
                    os.killpg(self.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                deadline = time.monotonic() + 60
                continue
            if left <= 0:
                raise RuntimeError(f"the fork server lost command {self.pid}")
            self._take(left)
        seconds = time.monotonic() - self.ready
        status = self.status
        read = lambda name: (self.out_dir / name).read_text(errors="replace")  # noqa: E731
        return Ended(
            os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
            os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
            self.ending,
            read("stdout"),
            read("stderr"),
            seconds,
            self.cpu,
            hung,
        )


# ---------------------------------------------------------------- the zygote's side


def _child(request: dict, marks: int) -> None:
    """In the forked child: become the command. Never returns."""
    code = 1
    try:
        os.setsid()
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        for fd, name in ((1, "stdout"), (2, "stderr")):
            target = os.open(request[name], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(target, fd)
            os.close(target)
        os.chdir(request["cwd"])
        sys.argv = ["allattn-pipe", *request["args"]]
        from pipeline.cluster import distributed
        from pipeline.commands import cli

        exit_process = distributed.exit_process

        def ending(code=0):
            os.write(marks, MARK.pack(b"e", time.monotonic()))
            exit_process(code)

        distributed.exit_process = ending  # type: ignore[assignment]
        _mark_ready_once_handled(marks)
        cli.entry()
        code = 0
    except SystemExit as e:  # as the interpreter ends a program: exit handlers, streams
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int | None):
            print(e.code, file=sys.stderr)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        try:
            import atexit

            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _mark_ready_once_handled(marks: int) -> None:
    """Mark `ready` as the console script's signal handler is first put in place: a signal
    before it (a child the scheduler had not yet run on, 2 busy cores) would meet the
    interpreter's default action, as in any program that is still starting, and no handler
    could be judged by it."""
    from pipeline.cluster import signals

    enter = signals.RaiseOnSignal.__enter__

    def enter_and_mark(handler):
        entered = enter(handler)
        if signals.RaiseOnSignal.__enter__ is enter_and_mark:  # the first one only
            signals.RaiseOnSignal.__enter__ = enter  # type: ignore[method-assign]
            os.write(marks, MARK.pack(b"r", time.monotonic()))
        return entered

    signals.RaiseOnSignal.__enter__ = enter_and_mark  # type: ignore[method-assign]


def _project_modules() -> list[str]:
    """Every module of the `pipeline` and `stages` packages but the ones that run something
    when imported (`__main__`)."""
    import pkgutil

    import pipeline
    import stages

    return [
        info.name
        for package in (pipeline, stages)
        for info in pkgutil.walk_packages(package.__path__, f"{package.__name__}.")
        if not info.name.endswith("__main__")
    ]


def serve() -> None:
    """The zygote: import, then fork a child for each request on stdin."""
    import importlib

    # the dispositions a fresh `allattn-pipe` starts with, whatever this process inherited
    # (a fuzzer started under nohup ignores SIGHUP)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)  # what the libraries print while importing is not the protocol
    import matplotlib

    matplotlib.use("Agg")  # what evaluate's heat map selects; headless either way
    for name in [*ZYGOTE_MODULES, *_project_modules()]:
        importlib.import_module(name)
    answers.write(json.dumps({"started": True}) + "\n")
    for line in sys.stdin:
        request = json.loads(line)
        read_end, write_end = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            os.close(read_end)
            answers.close()
            _child(request, write_end)
        os.close(write_end)
        _report(answers, pid, read_end)
        os.close(read_end)


def _report(answers, pid: int, marks: int) -> None:
    """Relay the child's marks as they come, then its status once it is gone. The marks'
    pipe is watched, not read to its end: a process the child left behind may hold it."""
    ready_sent, open_pipe = False, True
    while True:
        if open_pipe and select.select([marks], [], [], 0.05)[0]:
            mark = os.read(marks, MARK.size)
            if len(mark) < MARK.size:
                open_pipe = False
                continue
            tag, when = MARK.unpack(mark)
            if tag == b"r" and not ready_sent:
                answers.write(json.dumps({"pid": pid, "ready": when}) + "\n")
                ready_sent = True
            elif tag == b"e":
                answers.write(json.dumps({"ending": when}) + "\n")
            continue
        done, status, usage = os.wait4(pid, os.WNOHANG if open_pipe else 0)
        if done:
            break
    while open_pipe and select.select([marks], [], [], 0)[0]:  # written before the exit
        mark = os.read(marks, MARK.size)
        open_pipe = len(mark) == MARK.size
        if open_pipe and MARK.unpack(mark)[0] == b"e":
            answers.write(json.dumps({"ending": MARK.unpack(mark)[1]}) + "\n")
    if not ready_sent:
        answers.write(json.dumps({"pid": pid, "ready": time.monotonic()}) + "\n")
    cpu = usage.ru_utime + usage.ru_stime  # with the processes it waited for (points)
    answers.write(json.dumps({"status": status, "cpu": cpu}) + "\n")


if __name__ == "__main__":
    serve()
