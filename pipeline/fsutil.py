"""Crash-safe file writing: a reader never sees a half-written file.

Everything the pipeline publishes (shards, manifests, checkpoints, results) is written to a
temporary name in the same directory and renamed into place, which POSIX makes atomic.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import secrets
import stat
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any


def writable_dir(path: str | os.PathLike, what: str) -> Path:
    """`path`, created if missing; a directory that cannot be created or written (a read-only
    file system, no permission) is one line naming `what` it is for."""
    from pipeline.errors import PipelineError

    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=path).close()
    except OSError as e:
        # mkdir's "File exists" for a file at `path` means it is not a directory
        why = "Not a directory" if isinstance(e, FileExistsError) else e.strerror or e
        raise PipelineError(f"{what} {path}: cannot write there: {why}") from None
    return path


# ---------------------------------------------------------------- modes and planted links
#
# A workspace, a cache or an --out directory may sit in a group-writable place on a shared
# filesystem, where anyone can plant a symlink or a FIFO at a name we are about to open. So
# every file we create or truncate there is opened with O_NOFOLLOW (a link is refused, never
# followed to the file it names), every file we read is opened non-blocking and checked to be
# a regular file before a byte is read (a FIFO or a device would block or never end), and
# what we publish gets the modes the user's umask asks for.

_UMASK_LOCK = threading.Lock()


def current_umask() -> int:
    """The process's umask, read without a window in which another thread creates files
    under a wrong one: from /proc where Linux says it, else set-and-restore under a lock,
    with the most private mask set in between (a file made meanwhile is private, never
    public)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    with _UMASK_LOCK:
        mask = os.umask(0o077)
        os.umask(mask)
    return mask


def public_mode(directory: bool = False) -> int:
    """The mode `open`/`mkdir` would give a new file (0666) or directory (0777) under the
    current umask: what everything the pipeline publishes gets, so a shared group can read
    it exactly as the user's umask says."""
    return (0o777 if directory else 0o666) & ~current_umask()


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def _refusal(path, what: str, mode: int, writing: bool):
    from pipeline.errors import PipelineError, shown

    where = f"{what} {shown(os.fspath(path))}"
    if stat.S_ISLNK(mode) and writing:
        return PipelineError(f"{where} is a symbolic link; refusing to write through it")
    return PipelineError(f"{where} is {_kind(mode)}, not a regular file")


def _open_regular(path, what: str, flags: int, mode: int = 0o666) -> int:
    """A descriptor of the regular file `path`, opened with `flags` plus O_NONBLOCK (a FIFO
    opens at once, to be refused) and, when writing, O_NOFOLLOW (a planted link is refused,
    the file it names untouched). Anything else is a one-line PipelineError; other OSErrors
    (missing, no permission, disk full) are the caller's to word."""
    writing = bool(flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))
    flags |= os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0) | (os.O_NOFOLLOW if writing else 0)
    try:
        fd = os.open(path, flags, mode)
    except OSError as e:
        # ELOOP: the link O_NOFOLLOW refused; ENXIO: a FIFO with no reader, opened to
        # write; EISDIR: a directory. Say what is there.
        try:
            st_mode = os.lstat(path).st_mode
        except OSError:
            raise e from None
        if stat.S_ISREG(st_mode):
            raise
        raise _refusal(path, what, st_mode, writing) from None
    st_mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(st_mode):
        os.close(fd)
        raise _refusal(path, what, st_mode, writing)
    os.set_blocking(fd, True)
    return fd


def open_for_write(
    path: str | os.PathLike,
    what: str,
    *,
    append: bool = False,
    private: bool = False,
    text: bool = False,
) -> IO[Any]:
    """`path` opened to write (truncated, or `append`ed to), created if missing with the
    umask's mode (0600 when `private`), never through a symlink and never anything but a
    regular file: those are refused in one line naming `what` the file is. The file is
    truncated only once it is known to be ours to truncate."""
    fd = _open_regular(
        path,
        what,
        os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else 0),
        0o600 if private else 0o666,
    )
    if not append:
        os.ftruncate(fd, 0)
    mode = ("a" if append else "w") + ("" if text else "b")
    return os.fdopen(fd, mode, encoding="utf-8" if text else None)


def open_lock_file(path: str | os.PathLike, what: str) -> int:
    """A read-write descriptor of the lock file `path` (created if missing, never
    truncated here), refused in one line if a link or anything but a regular file is there."""
    return _open_regular(path, what, os.O_RDWR | os.O_CREAT, 0o666)


def open_regular_fd(path: str | os.PathLike, what: str) -> int:
    """A read-only descriptor of `path`, refused in one line (not blocked on) when it is a
    FIFO, a device, a socket or a directory. A symlink to a regular file is read: reading
    through it changes nothing."""
    return _open_regular(path, what, os.O_RDONLY)


def open_regular_for_read(path: str | os.PathLike, what: str, text: bool = False) -> IO[Any]:
    """`open_regular_fd` as a file object, bytes or UTF-8 `text`."""
    fd = open_regular_fd(path, what)
    return os.fdopen(fd, "r" if text else "rb", encoding="utf-8" if text else None)


def read_bytes(path: str | os.PathLike, what: str = "file") -> bytes:
    with open_regular_for_read(path, what) as f:
        return f.read()


def read_text(path: str | os.PathLike, what: str = "file") -> str:
    return read_bytes(path, what).decode("utf-8")


def refuse_link(path: str | os.PathLike, what: str, directory: bool = False) -> None:
    """Refuse in one line a symlink (or, for a file, anything but a regular file; for a
    `directory`, anything but a directory) at `path`; nothing there is fine. For names we
    are about to rename into place, make, or write below, which O_NOFOLLOW cannot cover."""
    try:
        st_mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    ok = stat.S_ISDIR(st_mode) if directory else stat.S_ISREG(st_mode)
    if not ok:
        raise _refusal(path, what, st_mode, writing=True)


def refuse_special(path: str | os.PathLike, what: str) -> None:
    """Refuse in one line a FIFO, device, socket or directory at `path` (links followed), for
    a file that a library opens by name (torch.load, safetensors), where a FIFO would block."""
    try:
        st_mode = os.stat(path).st_mode
    except OSError:
        return  # the reader's own error names what is missing
    if not stat.S_ISREG(st_mode):
        raise _refusal(path, what, st_mode, writing=False)


# ---------------------------------------------------------------- what another user wrote
#
# A cache or a workspace root may be shared (a group's project space, $XDG_CACHE_HOME under
# /tmp). What is read back from one as our own (a cached corpus, a sweep's point records) is
# read only where no other user can have written it, the rule ssh keeps for authorized_keys
# and git for safe.directory: owned by this user or root, and writable by no one else.


def not_ours(target: str | os.PathLike | int) -> str | None:
    """Why the file or directory `target` (a path, links followed, or an open descriptor,
    whose fstat cannot be raced) may hold what another user wrote, in words that follow its
    name ("owned by uid 65534 (nobody), not by this user"), or None where only this user or
    root can have written it. Group-writable is this user's alone where the group is the
    user's private group (named after the user, no other member), as a umask of 002 makes it
    on distributions that give each user one. OSError (missing, no permission) is the
    caller's."""
    st = os.fstat(target) if isinstance(target, int) else os.stat(target)
    me = os.geteuid()
    if st.st_uid not in (me, 0):
        return f"owned by uid {st.st_uid}{_account(st.st_uid)}, not by this user"
    mode = f"mode {stat.S_IMODE(st.st_mode):04o}"
    if st.st_mode & stat.S_IWOTH:
        return f"writable by every user ({mode})"
    if st.st_mode & stat.S_IWGRP and not _private_group(st.st_gid, st.st_uid):
        return f"writable by group {_group_name(st.st_gid)} ({mode})"
    return None


def _account(uid: int) -> str:
    import pwd

    try:
        return f" ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return ""


def _group_name(gid: int) -> str:
    import grp

    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)


def _private_group(gid: int, uid: int) -> bool:
    """Whether `gid` is the private group of the user `uid`: that user's primary group,
    named after them, with no one else listed in it."""
    import grp
    import pwd

    try:
        user, group = pwd.getpwuid(uid), grp.getgrgid(gid)
    except KeyError:
        return False
    return (
        user.pw_gid == gid and group.gr_name == user.pw_name and set(group.gr_mem) <= {user.pw_name}
    )


def read_ours(path: str | os.PathLike, what: str) -> bytes:
    """The bytes of the regular file `path`, where `not_ours` finds nothing against it (on
    the descriptor read, so that nothing swapped in between is read); else a one-line
    PipelineError naming the file and why. OSError is the caller's."""
    from pipeline.errors import PipelineError, shown

    fd = open_regular_fd(path, what)
    with os.fdopen(fd, "rb") as f:
        if why := not_ours(fd):
            raise PipelineError(f"{what} {shown(os.fspath(path))} is {why}")
        return f.read()


@contextmanager
def temporary_beside(path: Path, suffix: str = ".tmp") -> Iterator[tuple[int, Path]]:
    """A new file in `path`'s directory, opened for writing (0600) under a name no one can
    guess (as mkstemp's), and removed on the way out unless it was renamed by then. The name
    is chosen before the file is made, so a signal that stops the command between the two
    still finds it removed (with mkstemp the name reaches the caller only once the file
    exists: the signal fuzzer found temporaries left in a stopped stage's directory)."""
    tmp = None
    try:
        while True:
            tmp = path.parent / f".{path.name[:64]}.{secrets.token_hex(6)}{suffix}"
            try:
                flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
                fd = os.open(tmp, flags, 0o600)
                break
            except FileExistsError:
                tmp = None  # another's: never removed
        yield fd, tmp
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):  # FileNotFoundError: renamed into place
                os.unlink(tmp)


def temporary_dir_failure(error: BaseException) -> OSError | None:
    """Why no temporary directory could be used, when `error` is tempfile's "No usable
    temporary directory found" (gettempdir, which torch, dill and MLflow call, some at import,
    writes a few bytes in each candidate and keeps no reason): the first candidate's own
    failure, found by writing there again, as an OSError naming it (EFBIG past `ulimit -f`,
    ENOSPC on a full /tmp). None for any other error, or where a candidate takes a write
    now."""
    if not isinstance(error, FileNotFoundError) or "No usable temporary directory" not in str(
        error
    ):
        return None
    candidates = [os.environ.get(v) for v in ("TMPDIR", "TEMP", "TMP")]
    candidates += ["/tmp", "/var/tmp", "/usr/tmp", os.getcwd()]  # as tempfile tries them
    first: OSError | None = None
    for directory in filter(None, candidates):
        try:
            with tempfile.TemporaryFile(dir=directory) as f:  # no name: nothing left behind
                f.write(b"blat")
                f.flush()
            return None
        except OSError as e:
            failure = OSError(e.errno, e.strerror, directory)
            if e.errno not in (errno.ENOENT, errno.ENOTDIR):  # a candidate that exists
                return failure
            first = first or failure
    return first


def atomic_write_bytes(path: str | os.PathLike, data: bytes, private: bool = False) -> None:
    """`data` published at `path`: written to an unguessable name beside it (never reopened
    by name, so nothing can be swapped in), given the umask's mode unless `private`, and
    renamed over `path` (which replaces a symlink there, never writing through it)."""
    from pipeline.errors import write_cause

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with temporary_beside(path) as (fd, tmp), os.fdopen(fd, "wb") as f:
            if not private:
                os.fchmod(f.fileno(), public_mode())
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
            os.replace(tmp, path)
    except OSError as e:
        if write_cause(e):  # full, or too large: named as the file it was for, not the temporary
            raise OSError(e.errno, e.strerror, os.fspath(path)) from None
        raise


def atomic_write_text(path: str | os.PathLike, text: str, private: bool = False) -> None:
    atomic_write_bytes(path, text.encode("utf-8"), private)


def atomic_write_json(path: str | os.PathLike, obj, private: bool = False) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n", private)


def read_json(path: str | os.PathLike, what: str = "record"):
    with open_regular_for_read(path, what, text=True) as f:
        return json.load(f)


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open_regular_for_read(path, "file") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def file_checksum(path: str | os.PathLike, chunk: int = 1 << 20) -> dict:
    """{"sha256", "bytes"} of a file, as checksum lists (a checkpoint's checksums.json, a
    stage record's outputs) record it."""
    return {"sha256": sha256_file(path, chunk), "bytes": os.stat(path).st_size}


def file_mismatch(
    path: str | os.PathLike, name: str, expected: dict, chunk: int = 1 << 20, read: bool = True
) -> str | None:
    """Why the file `path` (called `name` in the message) is not the one `file_checksum`
    recorded as `expected`, or None when it is. `read=False` checks only that it is there
    with its size, for a caller that has another reason to trust its content."""
    path = Path(path)
    if not path.is_file():
        return f"{name} is missing"
    size = path.stat().st_size
    if size != expected["bytes"]:
        return f"{name} has {size:,} bytes, {expected['bytes']:,} were written"
    if read and sha256_file(path, chunk) != expected["sha256"]:
        return f"{name} does not match its checksum"
    return None


# What no path on Linux can hold: the kernel refuses a path of PATH_MAX bytes or more, and
# every common file system a file or folder name past 255 bytes.
PATH_MAX = 4096
NAME_MAX = 255


def path_problem(text: str) -> str | None:
    """What makes `text` a path that no file system can hold, or none given on purpose (only
    whitespace: `blank_problem`), in words ("it holds a NUL byte"), or None: checked when a
    config is validated, before anything is written."""
    import sys

    from pipeline.errors import shown

    if "\x00" in text:
        return "it holds a NUL byte, which no path can hold"
    if problem := blank_problem(text):
        return problem
    try:
        raw = os.fsencode(text)
    except UnicodeEncodeError as e:
        return (
            f"it holds {text[e.start]!r}, which no path can hold in this system's "
            f"encoding ({sys.getfilesystemencoding()})"
        )
    if len(raw) >= PATH_MAX:
        return f"it is {len(raw):,} bytes long; a path has fewer than {PATH_MAX:,}"
    part = next((p for p in raw.split(b"/") if len(p) > NAME_MAX), None)
    if part is not None:
        start = shown(part[:20].decode("utf-8", "replace"))
        return (
            f"its part '{start}...' is {len(part):,} bytes long; a file or folder name has "
            f"at most {NAME_MAX}"
        )
    return None


def blank_problem(text: str) -> str | None:
    """Why `text` is no path given on purpose, in words, or None: it, or a part of it between
    slashes, is only whitespace and control characters (`--out "$DIR"` where DIR held a
    newline), which a file system would take as a name no one can see or type. A name that
    holds such characters among others (`hosts\\nnewline`) is odd, but taken."""
    from pipeline.errors import shown

    for part in text.split("/"):
        if part and all(c.isspace() or not c.isprintable() for c in part):
            which = "it is" if part == text else f"its part '{shown(part)}' is"
            whole = f" ('{shown(part)}')" if part == text else ""
            return (
                f"{which} only whitespace or control characters{whole}, no name a file is "
                f"given on purpose"
            )
    return None


def home_problem(text: str) -> str | None:
    """Why the `~` or `~user` that `text` begins with names no directory (a container's user
    with no HOME and no passwd entry, a user that does not exist), in words; None where it
    does, or `text` has none. os.path.expanduser leaves such a `~` as it is, which would make
    a directory named `~` here, and Path.expanduser raises RuntimeError."""
    if not text.startswith("~") or not os.path.expanduser(text).startswith("~"):
        return None
    head = text.split("/", 1)[0]
    if head == "~":
        return (
            f"`~` stands for the home directory, and this user has none (HOME is unset and "
            f"uid {os.getuid()} has no passwd entry): give the full path"
        )
    return (
        f"`{head}` stands for the home directory of the user {head[1:]}, and there is no such "
        f"user: give the full path"
    )


def expand_home(text: str) -> str:
    """`text` with the `~` or `~user` it begins with expanded; one line (PipelineError) where
    that names no directory (`home_problem`)."""
    if problem := home_problem(text):
        from pipeline.errors import PipelineError, shown

        raise PipelineError(f"{shown(text)}: {problem}")
    return os.path.expanduser(text)


def user_path(value: str | os.PathLike) -> Path:
    """A path the user gave (a CLI argument, workspace.root, workspace.cache), read the one
    way every command reads them: `~` expanded (`expand_home`); `..` resolved against the
    real directories (so `typo/../x` is `x`, and no stray `typo` is ever created); `.` and
    repeated slashes dropped. A path without `..` keeps its form (relative stays relative)."""
    text = expand_home(os.fspath(value))
    if ".." in Path(text).parts:
        return Path(os.path.realpath(text))
    return Path(os.path.normpath(text)) if text else Path(text)


def real_destination(value: str | os.PathLike) -> Path:
    """A destination the command will replace, fully resolved: `~`, `..`, `.` and symlinks
    (a symlink to a directory names that directory), so the checks of what is there and the
    replacement act on the same directory."""
    return Path(os.path.realpath(expand_home(os.fspath(value))))


def private_temp_dir(parent: Path, name: str) -> Path:
    """A new directory in `parent` that no other process uses: its name is unique to this
    call (mkdtemp), never a guessable sibling of `name` that someone else may own."""
    return Path(tempfile.mkdtemp(prefix=f".{name[:64]}.", suffix=".tmp", dir=parent))
