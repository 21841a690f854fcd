"""The directories an export writes before it publishes: made, claimed while in use, and
removed when an export that was stopped before it could remove them (kill -9, a second
signal, a lost node) left them behind.

A new `--out DIR` is built beside it, in `.<name>.allattn-export-partial.<random>.tmp`, and
renamed to DIR when whole; an export into an existing DIR stages inside it
(pipeline.commands.export's STAGING). Either holds a lock file, `LOCK`, that its export keeps
locked (flock) from the directory's creation to its removal. A later export removes such a
directory only when it can prove that it is an abandoned one of this user's: its name is one
an export makes, it is a real directory owned by this user, and its lock file is there and
no process holds it. A directory without its lock file (made by an older version, or caught
by a kill in the instant between the lock's removal and the rename that publishes) is left
as it is, and so is any other user's.
"""

from __future__ import annotations

import fcntl
import os
import re
import stat
from pathlib import Path

PARTIAL = "allattn-export-partial"
LOCK = ".allattn-export.lock"
_PARTIAL_NAME = re.compile(r"\..{1,40}\." + re.escape(PARTIAL) + r"\.[a-z0-9_]+\.tmp", re.DOTALL)


def partial_name(target: str) -> str:
    """The name (before mkdtemp's suffix) of the directory a new export `target` is built in."""
    return f"{target[:40]}.{PARTIAL}"


def make_claimed(parent: Path, name: str) -> tuple[Path, int | None]:
    """A new private directory in `parent` named `.<name>.<random>.tmp`, and the descriptor
    holding its lock (`claim`); a signal in between leaves no directory without its lock."""
    from pipeline.fsutil import private_temp_dir

    directory = private_temp_dir(parent, name)
    try:
        return directory, claim(directory)
    except BaseException:
        (directory / LOCK).unlink(missing_ok=True)
        directory.rmdir()
        raise


def claim(directory: Path) -> int | None:
    """Create `directory`'s lock file and lock it for as long as this process keeps the
    returned descriptor open: while it does, no other export takes the directory for an
    abandoned one. None where the file system has no locks: nobody can prove it abandoned."""
    from pipeline.fsutil import open_lock_file

    fd = open_lock_file(directory / LOCK, "export lock file")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def release(fd: int | None) -> None:
    if fd is not None:
        os.close(fd)  # and with it the lock


def is_partial(path: Path) -> bool:
    return bool(_PARTIAL_NAME.fullmatch(path.name))


def take_abandoned(directory: Path) -> int | None:
    """The descriptor holding the lock of `directory` when it is provably an abandoned export
    directory of this user's (see the module's docstring; its name the caller checked), for
    the caller to hold while it removes it; None otherwise."""
    try:
        st = directory.lstat()
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
            return None
        fd = os.open(directory / LOCK, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None  # no lock file (or a link in its place): not provably ours
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError("not a lock file")
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # held: an export at work in it; or no locks on this file system
        os.close(fd)
        return None
    return fd


def remove_abandoned(parent: Path, remove) -> None:
    """Remove (`remove(directory)`: its files, then itself) every abandoned partial export
    directory of this user's in `parent`."""
    try:
        found = [p for p in parent.iterdir() if is_partial(p)]
    except OSError:
        return  # an unreadable parent: the export's own writes say why, if it matters
    for directory in found:
        fd = take_abandoned(directory)
        if fd is not None:
            try:
                remove(directory)
            finally:
                release(fd)
