"""The workspace's lock: one `run` (or `sync`) at a time per workspace, and a way for
readers such as `compare` to ask whether a run still holds it.

The lock is `<workspace>/.lock` taken with pipeline.locks: a flock, which the kernel releases
however its holder dies, or on a file system without flock the lock file `SOFT_LOCK`, which a
later run on the same host takes over when its holder is gone, and which a run killed on
another host leaves behind until it is removed. `.lock` names the holder either way.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import socket
from datetime import datetime, timezone
from pathlib import Path

from pipeline.errors import PipelineError
from pipeline.locks import NO_FLOCK, Held, soft_path, stale_hint, try_lock

SOFT_LOCK = soft_path(Path(".lock")).name
"""In the workspace, where its file system has no flock: held while a run is active."""


class WorkspaceLock:
    """The exclusive lock of `<workspace>/.lock` (pipeline.locks: a flock, released by the
    kernel if we die, or the lock file `SOFT_LOCK` where there is none). `.lock` names the
    holder."""

    def __init__(self, workspace: Path):
        self.path = Path(workspace) / ".lock"
        self._fd: int | None = None
        self._held: Held | None = None

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
            held = try_lock(fd, self.path, f"workspace {self.path.parent}")
        except BaseException:
            os.close(fd)
            raise
        if held is None:
            holder = _holder_line(fd)
            os.close(fd)
            raise PipelineError(busy_message(self.path.parent, holder))
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
            held.release()
            os.close(fd)
            raise PipelineError(
                f"workspace {self.path.parent}: cannot write its lock file {self.path}: "
                f"{e.strerror or e}"
            ) from None
        self._fd, self._held = fd, held
        return self

    def __exit__(self, *exc):
        if self._fd is not None and self._held is not None:
            os.ftruncate(self._fd, 0)
            self._held.release()
            os.close(self._fd)
            self._fd = self._held = None


def busy_message(workspace: Path, holder: str) -> str:
    """The one line a run on a workspace another run holds is refused with. Where the lock is
    the file `SOFT_LOCK` (no flock there), which a run killed on another host leaves behind,
    it says how to be rid of it."""
    line = (
        f"workspace {workspace} is in use by another run ({holder}); "
        f"wait for it to finish or stop it"
    )
    hint = stale_hint(Path(workspace) / ".lock", "run")
    return f"{line}; {hint}" if hint else line


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
    except OSError as e:
        if e.errno not in NO_FLOCK:
            raise PipelineError(
                f"workspace {workspace}: cannot tell whether a run holds it: {e.strerror or e}"
            ) from None
        return _soft_holder(Path(workspace), fd)
    finally:
        os.close(fd)  # releases the shared lock at once


def _soft_holder(workspace: Path, fd: int) -> str | None:
    """`holder` where the file system has no flock: the lock file's run, unless that run
    was on this host and is gone (the next run takes its lock over)."""
    if not (workspace / SOFT_LOCK).exists():
        return None
    line = _holder_line(fd)
    found = re.match(r"pid (\d+) on host (\S+) ", line)
    if found and found[2] == socket.gethostname() and not _alive(int(found[1])):
        return None
    return line


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


def lock_is_free(workspace: Path) -> bool:
    """True when no run holds `workspace`'s lock (on this host); creates nothing."""
    return holder(workspace) is None
