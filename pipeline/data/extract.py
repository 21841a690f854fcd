"""Unpacking a fetched file into a dataset's files: zip, gz, or a plain copy.

    files = extract(fetched.path, "zip", out / "files", dataset.files, name=..., label=url)

Each file streams into a hidden temporary name, its own sha256 / md5 is checked when the
dataset lists them, and only then is it renamed into place. Every failure is one line naming
the archive or file and the problem; nothing is read whole into memory.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import zipfile
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Protocol

from pipeline.data.fetch import (
    CHUNK,
    DISK_FULL,
    MD5_HEX,
    SHA256_HEX,
    Log,
    check_hex,
    open_for_write,
)
from pipeline.errors import PipelineError, write_cause, write_hint
from pipeline.fsutil import public_mode, temporary_beside

ZIP_JUNK = ("__MACOSX/",)  # resource forks in zips made on a Mac


@dataclass(frozen=True)
class Extracted:
    path: Path  # where the file now is
    sha256: str
    bytes: int
    source: str  # what it was made from: the archive member, or the fetched file


# ---------------------------------------------------------------- small public helpers


def extract(
    src: str | os.PathLike,
    archive: str,
    dest: str | os.PathLike,
    files: Mapping[str, Any] | None = None,
    *,
    name: str,
    label: str,
    log: Log = print,
) -> dict[str, Extracted]:
    """Unpack `src` into `dest` and check each file: {role: Extracted}.

    `archive`: "none" (copy), "gz" or "zip". `files`: role -> FileSpec (or a mapping with
    `path`, `sha256`, `md5`); `path` is the member of a zip, or the name to give the single
    file of a plain/gz download. Empty: role "all" named `name` (none, gz), or every regular
    member of the zip, role = its base name. Files land in `dest` under their base names.
    """
    src, dest = Path(src), Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    wanted = {role: _filespec(role, f) for role, f in (files or {}).items()}
    if archive == "zip":
        return _extract_zip(src, dest, wanted, label, log)
    if archive not in ("none", "gz"):
        raise PipelineError(f"dataset.archive '{archive}': expected none, zip or gz")
    if len(wanted) > 1:
        raise PipelineError(
            f"{label}: archive '{archive}' holds a single file, but dataset.files "
            f"names {len(wanted)} ({', '.join(wanted)}); use archive: zip or "
            f"list one file"
        )
    role, spec = next(iter(wanted.items())) if wanted else ("all", None)
    target = dest / (_base_name(spec["path"], label, role) if spec else name)
    if archive == "none":
        size = src.stat().st_size
        with open(src, "rb") as reader:
            result = write_verified(
                reader,
                target,
                label=label,
                size=size,
                source=src.name,
                role=role,
                bad_input=(OSError,),
                bad_input_is=f"cannot read {src}",
                **_sums(spec),
            )
    else:
        with gzip.open(src, "rb") as reader:
            result = write_verified(
                reader,
                target,
                label=label,
                source=src.name,
                role=role,
                bad_input=(OSError, EOFError, zlib.error),
                bad_input_is="not a valid gzip file (dataset.archive: gz)",
                **_sums(spec),
            )
    log(
        f"{target.name}: {result.bytes:,} bytes"
        + (" (checksum verified)" if spec and (spec["sha256"] or spec["md5"]) else "")
    )
    return {role: result}


def _extract_zip(src: Path, dest: Path, wanted: dict, label: str, log: Log) -> dict:
    try:
        archive = zipfile.ZipFile(src)
    except (zipfile.BadZipFile, EOFError) as e:
        raise PipelineError(
            f"{label}: not a valid zip archive ({e}); is dataset.archive right?"
        ) from None
    with archive:
        members = [i for i in archive.infolist() if not i.is_dir()]
        by_name = {i.filename: i for i in members}
        if wanted:
            chosen = {}
            for role, spec in wanted.items():
                info = by_name.get(spec["path"])
                if info is None:
                    raise PipelineError(
                        f"{label}: dataset.files.{role}.path '{spec['path']}' is not in the zip "
                        f"archive; it holds {_listing([i.filename for i in members])}"
                    )
                chosen[role] = (info, spec)
        else:
            kept = [
                i
                for i in members
                if not i.filename.startswith(ZIP_JUNK)
                and PurePosixPath(i.filename).name != ".DS_Store"
            ]
            if not kept:
                raise PipelineError(f"{label}: the zip archive holds no files")
            chosen = {PurePosixPath(i.filename).name: (i, None) for i in kept}
        targets: dict[str, str] = {}
        for role, (info, _spec) in chosen.items():
            base = _base_name(info.filename, label, role)
            if targets.setdefault(base, info.filename) != info.filename:
                raise PipelineError(
                    f"{label}: members '{targets[base]}' and '{info.filename}' "
                    f"would both be files/{base}; list the ones to use in "
                    f"dataset.files"
                )
        out = {}
        for role, (info, spec) in chosen.items():
            target = dest / _base_name(info.filename, label, role)
            try:
                reader = archive.open(info)
            except (NotImplementedError, RuntimeError, zipfile.BadZipFile) as e:
                raise PipelineError(
                    f"{label}: cannot read '{info.filename}' from the zip archive ({e})"
                ) from None
            with reader:
                out[role] = write_verified(
                    reader,
                    target,
                    label=label,
                    size=info.file_size,
                    source=info.filename,
                    role=role,
                    bad_input=(zipfile.BadZipFile, zlib.error, EOFError),
                    bad_input_is=f"a damaged zip archive (member '{info.filename}')",
                    **_sums(spec),
                )
            log(
                f"{info.filename} -> {target.name}: {out[role].bytes:,} bytes"
                + (" (checksum verified)" if spec and (spec["sha256"] or spec["md5"]) else "")
            )
    return out


class _Reader(Protocol):
    """What write_verified reads from: a file, a zip member, a gzip stream."""

    def read(self, size: int = ..., /) -> bytes: ...


def write_verified(
    reader: _Reader,
    target: str | os.PathLike,
    *,
    label: str,
    sha256: str | None = None,
    md5: str | None = None,
    size: int | None = None,
    source: str = "",
    role: str = "",
    bad_input: tuple[type[BaseException], ...] = (),
    bad_input_is: str = "unreadable",
) -> Extracted:
    """Stream `reader` into `target` through a hidden temporary file in the same directory,
    check `sha256` / `md5` when given, then rename it into place. On any failure nothing is
    left at `target` (nor the temporary). `size`, when known, goes into a disk-full message;
    `bad_input` are the reader's exceptions that mean the input is damaged."""
    target = Path(target)
    expect_sha = (
        check_hex(sha256, SHA256_HEX, f"dataset.files.{role}.sha256", "sha256") if sha256 else None
    )
    expect_md5 = check_hex(md5, MD5_HEX, f"dataset.files.{role}.md5", "md5") if md5 else None
    # an unguessable name, never one a member of the archive can have: a member
    # named like a fixed temporary would be truncated by, or renamed over, another's
    with temporary_beside(target, ".part") as (fd, tmp):  # removed unless renamed
        os.fchmod(fd, public_mode())  # published as the umask says, not 0600
        os.close(fd)
        h, m, n = hashlib.sha256(), hashlib.md5() if expect_md5 else None, 0
        what = f"{source} -> {target.name}" if source and source != target.name else target.name
        try:
            with open_for_write(tmp, "wb") as out:
                while True:
                    try:
                        block = reader.read(CHUNK)
                    except bad_input as e:
                        raise PipelineError(f"{label}: {bad_input_is}: {e}") from None
                    if not block:
                        break
                    h.update(block)
                    if m:
                        m.update(block)
                    out.write(block)
                    n += len(block)
                out.flush()
                os.fsync(out.fileno())
        except OSError as e:
            cause = write_cause(e)
            if cause:
                needed = (
                    f"; {size - n:,} more bytes were needed ({size:,} in all)"
                    if size is not None and e.errno in DISK_FULL
                    else f" ({size:,} bytes in all)"
                    if size is not None
                    else ""
                )
                raise PipelineError(
                    f"{label}: {cause} writing {target} ({e.strerror}){needed}; "
                    f"{write_hint(e)} and run again"
                ) from None
            raise
        sha256_found = h.hexdigest()
        found = {"sha256": sha256_found, "md5": m.hexdigest() if m else None}
        for algo, expected in (("sha256", expect_sha), ("md5", expect_md5)):
            if expected and found[algo] != expected.lower():
                raise PipelineError(
                    f"{label}: {what}"
                    + (f" (dataset.files.{role})" if role else "")
                    + f": {algo} mismatch: expected {expected.lower()}, found {found[algo]}; "
                    f"the file differs from the one the dataset lists"
                )
        os.replace(tmp, target)
    return Extracted(target, sha256_found, n, source or target.name)


# ---------------------------------------------------------------- internals


def _filespec(role: str, spec: Any) -> dict:
    get = spec.get if isinstance(spec, Mapping) else lambda k: getattr(spec, k, None)
    return {"path": get("path"), "sha256": get("sha256"), "md5": get("md5"), "role": role}


def _sums(spec: dict | None) -> dict:
    return {"sha256": spec["sha256"], "md5": spec["md5"]} if spec else {}


def _base_name(path: str, label: str, role: str) -> str:
    base = PurePosixPath(str(path).replace("\\", "/")).name
    if base in ("", ".", ".."):
        raise PipelineError(f"{label}: dataset.files.{role}.path '{path}' names no file")
    if len(os.fsencode(base)) > 255:  # NAME_MAX: renaming into place would fail (ENAMETOOLONG)
        raise PipelineError(
            f"{label}: dataset.files.{role}.path '{base[:40]}...': a file name of "
            f"{len(os.fsencode(base))} bytes, longer than a file system takes (255)"
        )
    return base


def _listing(names: list[str], limit: int = 20) -> str:
    if not names:
        return "no files"
    shown = ", ".join(names[:limit])
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return f"{len(names)} file(s): {shown}{more}"
