"""A workspace on a file system without flock (Lustre mounted `noflock`, some FUSE and NFS
mounts): the workspace lock falls back to a lock file, so `run` works there, a second run is
refused in one line that says how to be rid of a lock a killed run left, and a lock whose
holder died on this host is taken over.

No such mount can be made here (it needs root on a Lustre client, or a FUSE daemon); flock is
made to fail as those file systems make it fail, with the errno each gives, for the files
under the test's directory only."""

from __future__ import annotations

import errno
import fcntl
import os
import signal
import socket
import subprocess
import sys
import textwrap

import pytest
from click.testing import CliRunner

from pipeline.commands.cli import main
from pipeline.errors import PipelineError
from pipeline.workspace.lock import SOFT_LOCK, WorkspaceLock, filesystem_type, holder

REAL_FLOCK = fcntl.flock
# Lustre `noflock`, FUSE without locks, NFS without its lock manager
NO_FLOCK_ERRORS = [errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOLCK]


def failing_flock(under: str, code: int):
    def flock(fd, operation):
        number = fd if isinstance(fd, int) else fd.fileno()
        if os.readlink(f"/proc/self/fd/{number}").startswith(under):
            raise OSError(code, os.strerror(code))
        return REAL_FLOCK(fd, operation)

    return flock


@pytest.fixture(params=NO_FLOCK_ERRORS, ids=errno.errorcode.get)
def no_flock(request, tmp_path, monkeypatch):
    """flock fails under tmp_path as a file system without it fails; the errno."""
    monkeypatch.setattr(fcntl, "flock", failing_flock(str(tmp_path), request.param))
    return request.param


def busy_line(ws, line: str) -> str:
    return (
        f"workspace {ws} is in use by another run ({line}); wait for it to finish or stop "
        f"it; its file system ({filesystem_type(ws)}) has no flock, so the lock is the file "
        f"{ws / SOFT_LOCK}: if that run is gone (killed on another host), remove it"
    )


def test_the_lock_falls_back_to_a_lock_file(tmp_path, no_flock):
    ws = tmp_path / "ws"
    with WorkspaceLock(ws):
        line = (ws / ".lock").read_text().strip()
        assert line.startswith(f"pid {os.getpid()} on host {socket.gethostname()} since ")
        assert (ws / SOFT_LOCK).exists()
        assert holder(ws) == line
        with pytest.raises(PipelineError) as refused:
            WorkspaceLock(ws).__enter__()
        assert str(refused.value) == busy_line(ws, line)
    assert not (ws / SOFT_LOCK).exists() and holder(ws) is None
    with WorkspaceLock(ws):  # the next run takes it
        assert holder(ws) is not None


def test_a_run_works_on_a_workspace_without_flock(tmp_path, no_flock, calls, cfg):
    """`run` took the workspace lock with flock alone: a traceback on such a file system."""
    result = CliRunner().invoke(main, ["run", str(cfg), "--set", "tracking.enabled=false"])
    assert result.exit_code == 0, result.output
    assert calls == ["download", "preprocess", "train", "finetune", "evaluate"]
    assert not (tmp_path / "runs" / "pipe" / SOFT_LOCK).exists()


HOLD = """
import errno, fcntl, os, sys, time
def flock(fd, op):
    raise OSError(errno.ENOSYS, os.strerror(errno.ENOSYS))
fcntl.flock = flock
from pipeline.workspace.lock import WorkspaceLock
with WorkspaceLock(sys.argv[1]):
    print("held", flush=True)
    time.sleep(600)
"""


def test_a_lock_file_whose_run_was_killed_on_this_host_is_taken_over(tmp_path, no_flock):
    ws = tmp_path / "ws"
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(HOLD), str(ws)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline() == "held\n"
        line = holder(ws)
        assert line is not None and line.startswith(f"pid {proc.pid} on host ")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert (ws / SOFT_LOCK).exists()  # left behind: no kernel releases a lock file
    assert holder(ws) is None  # its run is gone
    with WorkspaceLock(ws):
        assert (ws / ".lock").read_text().startswith(f"pid {os.getpid()} ")


def test_a_lock_file_of_a_run_on_another_host_holds(tmp_path, no_flock):
    ws = tmp_path / "ws"
    ws.mkdir()
    line = "pid 1234 on host elsewhere-node since 2026-01-01T00:00:00+00:00"
    (ws / ".lock").write_text(line + "\n")
    with WorkspaceLock(ws):
        pass  # released: no lock file left
    (ws / SOFT_LOCK).write_text("1234\nelsewhere-node\n")
    (ws / ".lock").write_text(line + "\n")
    assert holder(ws) == line
    with pytest.raises(PipelineError) as refused:
        WorkspaceLock(ws).__enter__()
    assert str(refused.value) == busy_line(ws, line)


def test_flock_failing_otherwise_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(fcntl, "flock", failing_flock(str(tmp_path), errno.EIO))
    ws = tmp_path / "ws"
    with pytest.raises(PipelineError) as refused:
        WorkspaceLock(ws).__enter__()
    assert str(refused.value) == (
        f"workspace {ws}: cannot lock {ws / '.lock'}: {os.strerror(errno.EIO)}"
    )


def test_the_file_system_is_named_from_the_mount_table(tmp_path):
    with open("/proc/self/mountinfo") as f:
        root = next(line.split() for line in f if line.split()[4] == "/")
    assert filesystem_type(tmp_path.anchor) == root[root.index("-") + 1]
