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
from pipeline.locks import filesystem_type
from pipeline.workspace.lock import SOFT_LOCK, WorkspaceLock, holder
from tests.fixtures.no_flock import NO_FLOCK_ERRORS, failing_flock


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


def test_a_run_tracking_to_the_default_store_works_without_flock(tmp_path, monkeypatch, calls, cfg):
    """The sqlite store's own lock took flock alone: a traceback on such a file system. One
    store for the three errnos (a new one costs seconds): each run opens it under its lock."""
    for code in NO_FLOCK_ERRORS:
        monkeypatch.setattr(fcntl, "flock", failing_flock(str(tmp_path), code))
        name = f"pipe-{errno.errorcode[code]}"
        result = CliRunner().invoke(main, ["run", str(cfg), "--set", f"name={name}"])
        assert result.exit_code == 0, result.output
        assert (tmp_path / "runs" / name / "evaluate" / "stage.json").is_file()
        assert not (tmp_path / "runs" / ".mlflow.db.lock.soft").exists()
    assert calls == ["download", "preprocess", "train", "finetune", "evaluate"] * 3
    assert (tmp_path / "runs" / "mlflow.db").is_file()


def test_a_default_store_without_any_file_locks_is_one_line(tmp_path, monkeypatch, calls, cfg):
    """Lustre `noflock` and NFS without its lock manager have no POSIX locks either, which
    sqlite keeps the store whole with: refused before anything runs, naming the file system."""
    monkeypatch.setattr(fcntl, "flock", failing_flock(str(tmp_path), errno.ENOSYS))
    monkeypatch.setattr(fcntl, "lockf", failing_flock(str(tmp_path), errno.ENOSYS, fcntl.lockf))
    result = CliRunner().invoke(main, ["run", str(cfg)])
    assert result.exit_code == 2, result.output
    store = tmp_path / "runs" / "mlflow.db"
    assert result.output.strip().splitlines()[-1] == (
        f"error: tracking store {store}: its file system ({filesystem_type(tmp_path)}) has no "
        f"file locks, which sqlite needs to keep the store whole; point tracking.uri at a "
        f"tracking server or at a store on a local disk (sqlite:////tmp/me/mlflow.db), or set "
        f"tracking.enabled: false"
    )
    assert calls == [] and not store.exists()
    assert not (tmp_path / "runs" / ".mlflow.db.lock.soft").exists()
