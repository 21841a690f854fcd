"""Crash-safe file writing: a reader never sees a half-written file.

Everything the pipeline publishes (shards, manifests, checkpoints, results) is written to a
temporary name in the same directory and renamed into place, which POSIX makes atomic.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path


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


def _tmp_path(path: Path) -> Path:
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    return Path(name)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_path(path)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike, obj) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def read_json(path: str | os.PathLike):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
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


def user_path(value: str | os.PathLike) -> Path:
    """A path the user gave (a CLI argument, workspace.root, workspace.cache), read the one
    way every command reads them: `~` expanded; `..` resolved against the real directories
    (so `typo/../x` is `x`, and no stray `typo` is ever created); `.` and repeated slashes
    dropped. A path without `..` keeps its form (relative stays relative)."""
    text = os.path.expanduser(os.fspath(value))
    if ".." in Path(text).parts:
        return Path(os.path.realpath(text))
    return Path(os.path.normpath(text)) if text else Path(text)


def real_destination(value: str | os.PathLike) -> Path:
    """A destination the command will replace, fully resolved: `~`, `..`, `.` and symlinks
    (a symlink to a directory names that directory), so the checks of what is there and the
    replacement act on the same directory."""
    return Path(os.path.realpath(os.path.expanduser(os.fspath(value))))


def private_temp_dir(parent: Path, name: str) -> Path:
    """A new directory in `parent` that no other process uses: its name is unique to this
    call (mkdtemp), never a guessable sibling of `name` that someone else may own."""
    return Path(tempfile.mkdtemp(prefix=f".{name[:64]}.", suffix=".tmp", dir=parent))
