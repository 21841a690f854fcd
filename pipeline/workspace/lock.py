"""The workspace's lock: one `run` (or `sync`) at a time per workspace, and a way for
readers such as `compare` to ask whether a run still holds it."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
from datetime import datetime, timezone
from pathlib import Path

from pipeline.errors import PipelineError


class WorkspaceLock:
    """An exclusive flock on `<workspace>/.lock`; released by the kernel if we die."""

    def __init__(self, workspace: Path):
        self.path = Path(workspace) / ".lock"
        self._fd: int | None = None

    def __enter__(self):
        from pipeline.fsutil import open_lock_file, writable_dir

        # one line for a workspace that cannot be made (a dangling symlink or a file on the
        # way, a name too long, a read-only place), as `run` gives before it locks
        writable_dir(self.path.parent, "workspace")
        try:
            # never through a link planted there: truncating it would empty what it names
            fd = open_lock_file(self.path, "workspace lock file")
        except OSError as e:
            raise PipelineError(
                f"workspace {self.path.parent}: cannot create its lock file "
                f"{self.path}: {e.strerror or e}"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder_line(fd)
            os.close(fd)
            raise PipelineError(busy_message(self.path.parent, holder)) from None
        stamp = datetime.now(timezone.utc).isoformat(timespec="seconds")
        line = f"pid {os.getpid()} on host {socket.gethostname()} since {stamp}\n".encode()
        try:
            os.ftruncate(fd, 0)
            written = os.pwrite(fd, line, 0)
            if written != len(line):  # a short write is what a full disk can also do
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError as e:
            # no half-written holder left for the next run to show, and no lock held
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
            os.close(fd)  # releases the flock
            raise PipelineError(
                f"workspace {self.path.parent}: cannot write its lock file {self.path}: "
                f"{e.strerror or e}"
            ) from None
        self._fd = fd
        return self

    def __exit__(self, *exc):
        if self._fd is not None:
            os.ftruncate(self._fd, 0)
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def busy_message(workspace: Path, holder: str) -> str:
    """The one line a run on a workspace another run holds is refused with."""
    return (
        f"workspace {workspace} is in use by another run ({holder}); "
        f"wait for it to finish or stop it"
    )


def _holder_line(fd: int) -> str:
    return os.pread(fd, 4096, 0).decode(errors="replace").strip() or "holder unknown"


def holder(workspace: Path) -> str | None:
    """Who holds `workspace`'s lock ("pid N on host H since T"), or None when no run holds it
    (on this host); creates nothing, waits on nothing. A run asks this before its slow
    start (MLflow's store, the launcher's processes) so that a busy workspace is refused at
    once; the lock itself is still what keeps two runs apart."""
    from pipeline.fsutil import open_regular_fd

    try:
        # a FIFO planted there is refused, not waited on
        fd = open_regular_fd(Path(workspace) / ".lock", "workspace lock file")
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return None
    except BlockingIOError:
        return _holder_line(fd)
    finally:
        os.close(fd)  # releases the shared lock at once


def lock_is_free(workspace: Path) -> bool:
    """True when no run holds `workspace`'s lock (on this host); creates nothing."""
    return holder(workspace) is None
