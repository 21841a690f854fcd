"""The workspace's lock: one `run` (or `sync`) at a time per workspace, and a way for
readers such as `compare` to ask whether a run still holds it."""

from __future__ import annotations

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
            holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise PipelineError(
                f"workspace {self.path.parent} is in use by another run "
                f"({holder}); wait for it to finish or stop it"
            ) from None
        os.ftruncate(fd, 0)
        stamp = datetime.now(timezone.utc).isoformat(timespec="seconds")
        os.pwrite(
            fd, f"pid {os.getpid()} on host {socket.gethostname()} since {stamp}\n".encode(), 0
        )
        self._fd = fd
        return self

    def __exit__(self, *exc):
        if self._fd is not None:
            os.ftruncate(self._fd, 0)
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def lock_is_free(workspace: Path) -> bool:
    """True when no run holds `workspace`'s lock (on this host); creates nothing."""
    from pipeline.fsutil import open_regular_fd

    try:
        # a FIFO planted there is refused, not waited on
        fd = open_regular_fd(Path(workspace) / ".lock", "workspace lock file")
    except FileNotFoundError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)  # releases the shared lock at once
