"""Exclusive locks between processes, on any file system a workspace, a cache or a tracking
store may be on.

A lock is a flock on an open lock file, which the kernel releases however its holder dies.
Some cluster file systems have no flock (Lustre mounted `noflock`, some FUSE and NFS mounts:
the call fails with ENOSYS, EOPNOTSUPP or ENOLCK); there the file `<lock file>.soft` stands in
(filelock's SoftFileLock: created exclusively, removed on release). A process on the same host
takes such a file over when its holder is gone; one whose holder was killed on another host
stays until it is removed, and the lines that wait or refuse on it say so (`stale_hint`).

Every lock of the pipeline is taken here: the workspace's, the tracking store's, a sweep's,
a download's, DeepSpeed's op builds.
"""

from __future__ import annotations

import errno
import fcntl
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from pipeline.errors import PipelineError

# what flock fails with where the file system has no locks: Lustre mounted `noflock` (ENOSYS),
# FUSE and some NFS mounts (EOPNOTSUPP / ENOTSUP), NFS without its lock manager (ENOLCK)
NO_FLOCK = frozenset({errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOLCK})

POLL_S = 0.2  # how often a waiting process tries a held lock again


def soft_path(path: Path) -> Path:
    """The lock file that stands in for a flock on `path` where its file system has none."""
    return path.with_name(path.name + ".soft")


class Held:
    """A lock this process holds on the lock file open as `fd`: a flock, or where there is
    none the lock file `soft` (a SoftFileLock). `release()` ends it; the descriptor stays the
    caller's to close."""

    def __init__(self, fd: int, soft=None, soft_file: Path | None = None):
        self.fd, self._soft = fd, soft
        self.soft = soft_file
        """The lock file standing in for flock, or None where the lock is a flock."""

    def release(self) -> None:
        if self._soft is not None:
            self._soft.release()
            self._soft = None
        else:
            fcntl.flock(self.fd, fcntl.LOCK_UN)


def try_lock(fd: int, path: Path, what: str) -> Held | None:
    """The exclusive lock of the lock file `path`, open as `fd`, taken without waiting; None
    where another process holds it. A PipelineError beginning with `what` ("workspace DIR")
    where flock fails otherwise, or the lock file standing in for it cannot be made."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return Held(fd)
    except BlockingIOError:
        return None
    except OSError as e:
        if e.errno not in NO_FLOCK:
            raise PipelineError(f"{what}: cannot lock {path}: {e.strerror or e}") from None
    from filelock import SoftFileLock, Timeout

    soft = SoftFileLock(soft_path(path), timeout=0, is_singleton=False)
    try:
        soft.acquire()
    except Timeout:
        return None
    except OSError as e:
        raise PipelineError(
            f"{what}: its file system ({filesystem_type(path.parent)}) has no flock, and its "
            f"lock file {soft_path(path)} cannot be made: {e.strerror or e}"
        ) from None
    return Held(fd, soft, soft_path(path))


def wait_lock(
    fd: int,
    path: Path,
    what: str,
    wait_s: float | None = None,
    waiting: Callable[[], None] | None = None,
) -> Held | None:
    """`try_lock`, tried again every POLL_S while another process holds the lock: the lock,
    or None once `wait_s` seconds have passed (None: wait as long as it takes). `waiting()`
    is called once, when the first try finds the lock held."""
    deadline = None if wait_s is None else time.monotonic() + wait_s
    said = False
    while True:
        held = try_lock(fd, path, what)
        if held is not None:
            return held
        if deadline is not None and time.monotonic() >= deadline:
            return None
        if not said and waiting is not None:
            waiting()
        said = True
        time.sleep(POLL_S)


@contextmanager
def holding(
    fd: int, path: Path, what: str, waiting: Callable[[], None] | None = None
) -> Iterator[Held]:
    """`wait_lock` with no deadline, as a context: the lock is held inside it."""
    held = wait_lock(fd, path, what, None, waiting)
    assert held is not None  # no deadline: it returns once the lock is held
    try:
        yield held
    finally:
        held.release()


def stale_hint(path: Path, holder: str) -> str | None:
    """Where the lock of `path` is held as its lock file (no flock there), which a `holder`
    ("run", "process") killed on another host leaves behind: the words that say how to be rid
    of it. None where it is a flock, which the kernel releases."""
    soft = soft_path(path)
    if not soft.exists():
        return None
    return (
        f"its file system ({filesystem_type(path.parent)}) has no flock, so the lock is the "
        f"file {soft}: if that {holder} is gone (killed on another host), remove it"
    )


def filesystem_type(path: Path) -> str:
    """The type of the file system `path` is on, as the kernel's mount table names it
    ("lustre", "nfs4", "fuse.sshfs"), or "unknown" where that table cannot be read."""
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            mounts = [line.split() for line in f]
    except OSError:
        return "unknown"
    target = os.path.realpath(path)
    best, kind = "", "unknown"
    for fields in mounts:
        # ID PARENT MAJ:MIN ROOT MOUNT-POINT OPTIONS [OPTIONAL...] - TYPE SOURCE SUPER
        if "-" not in fields or len(fields) < 5:
            continue
        point = fields[4].replace("\\040", " ")
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, kind = point, fields[fields.index("-") + 1]
    return kind
