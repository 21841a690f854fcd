"""Getting a dataset onto the machine: fetch (resumable, cached by sha256), verify, extract.

    fetched = fetch(url, cache, sha256=..., log=print)       # a verified local file
    files = extract(fetched.path, "zip", out / "files", dataset.files, name=..., label=url)

- `http(s)://` downloads need the file's sha256: it is both the integrity check and the cache
  key. Bytes land in `<cache>/downloads/<sha256>.part`; an interrupted transfer is resumed
  with `Range: bytes=N-` (in this process a few times, then by the next run), and only a
  complete file whose sha256 matches is renamed to `<cache>/downloads/<sha256>`. A later
  fetch of the same sha256, from any run or workspace sharing the cache, makes no request
  (the cached file is re-hashed; a corrupt one is fetched again).
- `file://` sources are read where they are (a local mirror on shared storage), never
  copied into the cache; their sha256 is checked when one is given.
- Extraction streams (zip, gz, or a plain copy) into a hidden temporary name, checks the
  file's own sha256 / md5 when the dataset lists them, and only then renames it into place.

Every failure is a `PipelineError` with one line that names the URL or file and the problem.
Nothing here reads a whole file into memory.
"""

from __future__ import annotations

import contextlib
import errno
import gzip
import hashlib
import http.client
import os
import re
import time
import urllib.error
import urllib.parse
import urllib.request
import zipfile
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO

from pipeline.errors import PipelineError

CHUNK = 1 << 20                   # bytes per read/write
TIMEOUT_S = 60.0                  # socket timeout: connect, and each read
RETRIES = 2                       # in-process resumes of an interrupted http transfer
RETRY_WAIT_S = 2.0                # times the attempt number
PROGRESS_MIN_BYTES = 8 << 20      # smaller downloads log no progress lines
PROGRESS_UNKNOWN_STEP = 32 << 20  # without a Content-Length: a line every this many bytes
USER_AGENT = "allattn-pipe (python urllib)"
ZIP_JUNK = ("__MACOSX/",)         # resource forks in zips made on a Mac
_SHA256 = re.compile(r"^[0-9a-fA-F]{64}$")
_MD5 = re.compile(r"^[0-9a-fA-F]{32}$")
_DISK_FULL = {errno.ENOSPC, errno.EDQUOT}

Log = Callable[[str], None]


@dataclass(frozen=True)
class Fetched:
    url: str
    path: Path        # the verified file: in the cache (http) or the file:// source itself
    sha256: str
    bytes: int
    cached: bool      # served from the cache without a request


@dataclass(frozen=True)
class Extracted:
    path: Path        # where the file now is
    sha256: str
    bytes: int
    source: str       # what it was made from: the archive member, or the fetched file


# ---------------------------------------------------------------- small public helpers

def cache_dir(spec) -> Path:
    """The download cache of a `pipeline.spec.Spec`: workspace.cache, else <root>/cache."""
    ws = spec.workspace
    return Path(ws.cache).expanduser() if ws.cache else Path(ws.root) / "cache"


def cache_path(cache: str | os.PathLike, sha256: str) -> Path:
    """Where a file with this sha256 lives once fetched (`<cache>/downloads/<sha256>`)."""
    return Path(cache) / "downloads" / _check_hex(sha256, _SHA256, "sha256", "sha256")


def file_name(url: str, archive: str = "none") -> str:
    """The name a downloaded file gets when the dataset does not name it: the URL's last
    path component, without `.gz` for a gzip archive ('data' when there is none)."""
    name = PurePosixPath(urllib.parse.unquote(urllib.parse.urlparse(url).path)).name
    if archive == "gz":
        for suffix in (".gz", ".gzip"):
            if name.lower().endswith(suffix):
                name = name[:-len(suffix)]
                break
    return name if name not in ("", ".", "..") else "data"


def digests(path: str | os.PathLike, md5: bool = False) -> tuple[str, str | None, int]:
    """(sha256, md5 or None, size) of a file, read in chunks."""
    h, m, n = hashlib.sha256(), hashlib.md5() if md5 else None, 0
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            h.update(block)
            if m:
                m.update(block)
            n += len(block)
    return h.hexdigest(), m.hexdigest() if m else None, n


# ---------------------------------------------------------------- fetch

def fetch(url: str, cache: str | os.PathLike, *, sha256: str | None = None, log: Log = print,
          retries: int = RETRIES, timeout: float = TIMEOUT_S,
          mismatch_hint: str = "") -> Fetched:
    """A verified local copy of `url` (http(s):// or file://).

    http(s): `sha256` is required; the file is taken from the cache or downloaded into it
    (resuming a `.part` left by an earlier attempt). file://: read in place, checked against
    `sha256` when given. `mismatch_hint` is appended to a sha256 mismatch message, with
    "{found}" replaced by the sha256 found.
    """
    scheme = urllib.parse.urlparse(url).scheme.lower()
    if scheme == "file":
        return _fetch_file(url, sha256, mismatch_hint)
    if scheme not in ("http", "https"):
        raise PipelineError(f"dataset.url {url}: unsupported scheme '{scheme}' "
                            f"(use builtin://NAME, file:///path or http(s)://...)")
    if not sha256:
        raise PipelineError(
            f"dataset.url {url}: an http(s) download needs the file's sha256 (the integrity "
            f"check and the cache key): set `sha256:` in the dataset card or pass --set "
            f"dataset.sha256=<output of sha256sum FILE>, or download it by hand and use "
            f"--set dataset.url=file:///path/to/{file_name(url)}")
    key = _check_hex(sha256, _SHA256, "dataset.sha256", "sha256").lower()
    downloads = Path(cache) / "downloads"
    final = downloads / key

    hit = _cache_hit(final, key, url, log)
    if hit:
        return hit
    try:
        downloads.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise PipelineError(f"download cache {downloads}: cannot create it ({e.strerror}); "
                            f"set workspace.cache to a writable directory") from None
    with _locked(downloads / f"{key}.lock", log):
        hit = _cache_hit(final, key, url, log)   # another process may have just finished
        if hit:
            return hit
        part = downloads / f"{key}.part"
        attempt = 0
        while True:
            try:
                size = _transfer(url, part, key, log, timeout)
                break
            except _Interrupted as e:
                if attempt >= retries:
                    kept = part.stat().st_size if part.exists() else 0
                    raise PipelineError(
                        f"dataset.url {url}: download interrupted ({e}); the {kept:,} bytes "
                        f"received are kept in {part}: run again to resume") from None
                attempt += 1
                wait = RETRY_WAIT_S * attempt
                log(f"download interrupted ({e}); resuming in {wait:.0f}s "
                    f"(retry {attempt} of {retries})")
                time.sleep(wait)
        found, _, _ = digests(part)
        if found != key:
            kept = ""
            if size is not None and part.stat().st_size == size:
                # complete as the server sent it: keep it under its own checksum, so that
                # --set dataset.sha256=<found> (a repacked mirror) needs no second download
                os.replace(part, downloads / found)
                kept = f"; kept as {downloads / found}"
            else:
                part.unlink(missing_ok=True)
            raise PipelineError(f"dataset.url {url}: sha256 mismatch: expected {key}, found "
                                f"{found}{kept}{mismatch_hint.replace('{found}', found)}")
        os.replace(part, final)
    log(f"saved in the cache as {final}")
    return Fetched(url, final, key, final.stat().st_size, cached=False)


_LOCAL_SHA256: dict[tuple, str] = {}


def local_source_identity(url: str) -> dict | None:
    """The size and sha256 of a file:// source (None for other schemes, or if it cannot be
    read now): what a download of it depends on when no sha256 pins it. Hashed once per
    (path, size, mtime) in a process, since plans are made more than once."""
    parsed = urllib.parse.urlparse(url)
    if parsed.scheme.lower() != "file":
        return None
    src = Path(urllib.request.url2pathname(parsed.path))
    try:
        st = src.stat()
        key = (str(src), st.st_size, st.st_mtime_ns)
        if key not in _LOCAL_SHA256:
            _LOCAL_SHA256[key] = digests(src)[0]
    except OSError:
        return None
    return {"bytes": st.st_size, "sha256": _LOCAL_SHA256[key]}


def _fetch_file(url: str, sha256: str | None, mismatch_hint: str) -> Fetched:
    parsed = urllib.parse.urlparse(url)
    if parsed.netloc not in ("", "localhost"):
        raise PipelineError(f"dataset.url {url}: a file URL needs an absolute path, with three "
                            f"slashes: file:///{parsed.netloc}{parsed.path}")
    src = Path(urllib.request.url2pathname(parsed.path))
    if not src.exists():
        raise PipelineError(f"dataset.url {url}: no such file {src}")
    if not src.is_file():
        raise PipelineError(f"dataset.url {url}: {src} is not a regular file")
    expected = _check_hex(sha256, _SHA256, "dataset.sha256", "sha256").lower() if sha256 \
        else None
    try:
        found, _, size = digests(src)
    except OSError as e:
        raise PipelineError(f"dataset.url {url}: cannot read {src} ({e.strerror})") from None
    if expected and found != expected:
        raise PipelineError(f"dataset.url {url}: sha256 mismatch: expected {expected}, found "
                            f"{found}{mismatch_hint.replace('{found}', found)}")
    return Fetched(url, src, found, size, cached=False)


def _cache_hit(final: Path, key: str, url: str, log: Log) -> Fetched | None:
    if not final.is_file():
        return None
    found, _, size = digests(final)
    if found == key:
        log(f"cache hit: {final} ({size / 1e6:.1f} MB, sha256 verified); nothing to download")
        return Fetched(url, final, key, size, cached=True)
    log(f"warning: cached {final} is corrupt (its sha256 is {found}); downloading it again")
    final.unlink(missing_ok=True)
    return None


@contextlib.contextmanager
def _locked(path: Path, log: Log):
    """One downloader per cache entry (two jobs of an array starting together): the second
    waits, then finds the file in the cache. Where the filesystem has no locks, no lock."""
    try:
        import fcntl
    except ImportError:          # not POSIX
        yield
        return
    with open(path, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"another process is downloading into {path.parent}; waiting for it")
            fcntl.flock(handle, fcntl.LOCK_EX)
        except OSError:
            pass
        yield


class _Interrupted(Exception):
    """The transfer stopped early; what reached the .part file is kept for a resume."""


def _content_range(value: str | None) -> tuple[int | None, int | None]:
    m = re.match(r"^\s*bytes\s+(\d+)-\d+/(\d+|\*)\s*$", value or "")
    if not m:
        return None, None
    return int(m.group(1)), (None if m.group(2) == "*" else int(m.group(2)))


def _transfer(url: str, part: Path, key: str, log: Log, timeout: float) -> int | None:
    """Download into `part`, appending to what is there when the server resumes (206).
    Returns the total size when the server said it; raises _Interrupted when it was cut."""
    have = part.stat().st_size if part.exists() else 0
    request = urllib.request.Request(url, headers={"User-Agent": USER_AGENT})
    if have:
        request.add_header("Range", f"bytes={have}-")
    opener = urllib.request.build_opener()   # reads the *_proxy variables now
    try:
        response = opener.open(request, timeout=timeout)
    except urllib.error.HTTPError as e:
        e.close()
        if e.code == 416 and have:
            # the range starts at or past the end: the .part is complete, or it is longer
            # than the file (a stale one): keep it in the first case, start over in the other
            if digests(part)[0] == key:
                return have
            part.unlink()
            raise _Interrupted(f"HTTP 416 for a .part of {have:,} bytes that is not the file; "
                               f"starting over") from None
        hint = "; the file may have moved: point --set dataset.url=... at a mirror" \
            if e.code in (404, 410) else ""
        raise PipelineError(f"dataset.url {url}: HTTP {e.code} {e.reason}{hint}") from None
    except (urllib.error.URLError, http.client.HTTPException, OSError) as e:
        reason = getattr(e, "reason", None) or e
        host = urllib.parse.urlparse(url).netloc
        raise PipelineError(
            f"dataset.url {url}: cannot reach {host} ({reason}); on a machine without "
            f"internet, copy the file to local or shared storage and use --set "
            f"dataset.url=file:///path/to/{file_name(url)}") from None

    with response:
        status = response.status
        length = response.headers.get("Content-Length")
        length = int(length) if length and length.isdigit() else None
        if have and status == 206:
            start, total = _content_range(response.headers.get("Content-Range"))
            if start != have:
                part.unlink()
                raise _Interrupted(f"the server resumed at byte {start}, not {have}; "
                                   f"starting over")
            if total is None and length is not None:
                total = have + length
            mode = "ab"
            log(f"resuming {url} at {have / 1e6:.1f}"
                + (f" of {total / 1e6:.1f} MB" if total else " MB"))
        elif status == 200:
            if have:
                log("the server sent the whole file (HTTP 200, not 206): starting over")
            have, total, mode = 0, length, "wb"
            log(f"downloading {url}" + (f" ({total / 1e6:.1f} MB)" if total else ""))
        else:
            raise PipelineError(f"dataset.url {url}: unexpected HTTP {status} "
                                f"{response.reason}")

        progress = _Progress(log, have, total)
        try:
            with _open_for_write(part, mode) as out:
                while True:
                    try:
                        block = response.read(CHUNK)
                    except (OSError, http.client.HTTPException) as e:
                        out.flush()
                        raise _Interrupted(f"{type(e).__name__}: {e}".rstrip(": ")) \
                            from None
                    if not block:
                        break
                    out.write(block)
                    have += len(block)
                    progress.update(have)
                out.flush()
                os.fsync(out.fileno())
        except OSError as e:
            if e.errno in _DISK_FULL:
                kept = part.stat().st_size if part.exists() else 0   # what reached the disk
                needed = f"; {total - kept:,} more bytes were needed" if total else ""
                raise PipelineError(
                    f"dataset.url {url}: disk full writing {part} ({e.strerror}){needed}; "
                    f"free space (or set workspace.cache elsewhere) and run again to resume "
                    f"from the {kept:,} bytes kept") from None
            raise
    if total is not None and have < total:
        raise _Interrupted(f"the connection closed after {have:,} of {total:,} bytes")
    progress.done(have)
    return total


class _Progress:
    """A log line every ~10% (or every PROGRESS_UNKNOWN_STEP bytes without a size)."""

    def __init__(self, log: Log, start: int, total: int | None):
        self.log, self.start, self.total = log, start, total
        self.t0 = time.monotonic()
        self.quiet = total is not None and total < PROGRESS_MIN_BYTES
        self.step = max(total // 10, 1) if total else PROGRESS_UNKNOWN_STEP
        self.next = (start // self.step + 1) * self.step

    def _rate(self, have: int) -> float:
        return (have - self.start) / max(time.monotonic() - self.t0, 1e-6) / 1e6

    def update(self, have: int) -> None:
        if self.quiet or have < self.next or (self.total and have >= self.total):
            return
        self.next = (have // self.step + 1) * self.step
        if self.total:
            self.log(f"  {100 * have // self.total:3d}%  {have / 1e6:,.1f} of "
                     f"{self.total / 1e6:,.1f} MB  {self._rate(have):.1f} MB/s")
        else:
            self.log(f"  {have / 1e6:,.1f} MB  {self._rate(have):.1f} MB/s")

    def done(self, have: int) -> None:
        seconds = time.monotonic() - self.t0
        self.log(f"downloaded {(have - self.start) / 1e6:,.1f} MB in {seconds:.1f}s "
                 f"({self._rate(have):.1f} MB/s)")


def _open_for_write(path: Path, mode: str) -> BinaryIO:
    """Every file this module writes is opened here (the tests simulate a full disk)."""
    return open(path, mode)


# ---------------------------------------------------------------- extract

def extract(src: str | os.PathLike, archive: str, dest: str | os.PathLike,
            files: Mapping[str, Any] | None = None, *, name: str, label: str,
            log: Log = print) -> dict[str, Extracted]:
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
        raise PipelineError(f"{label}: archive '{archive}' holds a single file, but dataset.files "
                            f"names {len(wanted)} ({', '.join(wanted)}); use archive: zip or "
                            f"list one file")
    role, spec = next(iter(wanted.items())) if wanted else ("all", None)
    target = dest / (_base_name(spec["path"], label, role) if spec else name)
    if archive == "none":
        size = src.stat().st_size
        with open(src, "rb") as reader:
            result = write_verified(reader, target, label=label, size=size,
                                    source=src.name, role=role, bad_input=(OSError,),
                                    bad_input_is=f"cannot read {src}", **_sums(spec))
    else:
        with gzip.open(src, "rb") as reader:
            result = write_verified(reader, target, label=label, source=src.name, role=role,
                                    bad_input=(OSError, EOFError, zlib.error),
                                    bad_input_is="not a valid gzip file (dataset.archive: gz)",
                                    **_sums(spec))
    log(f"{target.name}: {result.bytes:,} bytes" + (" (checksum verified)" if spec and (
        spec["sha256"] or spec["md5"]) else ""))
    return {role: result}


def _extract_zip(src: Path, dest: Path, wanted: dict, label: str, log: Log) -> dict:
    try:
        archive = zipfile.ZipFile(src)
    except (zipfile.BadZipFile, EOFError) as e:
        raise PipelineError(f"{label}: not a valid zip archive ({e}); is dataset.archive "
                            f"right?") from None
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
                        f"archive; it holds {_listing([i.filename for i in members])}")
                chosen[role] = (info, spec)
        else:
            kept = [i for i in members if not i.filename.startswith(ZIP_JUNK)
                    and PurePosixPath(i.filename).name != ".DS_Store"]
            if not kept:
                raise PipelineError(f"{label}: the zip archive holds no files")
            chosen = {PurePosixPath(i.filename).name: (i, None) for i in kept}
        targets: dict[str, str] = {}
        for role, (info, spec) in chosen.items():
            base = _base_name(info.filename, label, role)
            if targets.setdefault(base, info.filename) != info.filename:
                raise PipelineError(f"{label}: members '{targets[base]}' and '{info.filename}' "
                                    f"would both be files/{base}; list the ones to use in "
                                    f"dataset.files")
        out = {}
        for role, (info, spec) in chosen.items():
            target = dest / _base_name(info.filename, label, role)
            try:
                reader = archive.open(info)
            except (NotImplementedError, RuntimeError, zipfile.BadZipFile) as e:
                raise PipelineError(f"{label}: cannot read '{info.filename}' from the zip "
                                    f"archive ({e})") from None
            with reader:
                out[role] = write_verified(
                    reader, target, label=label, size=info.file_size, source=info.filename,
                    role=role, bad_input=(zipfile.BadZipFile, zlib.error, EOFError),
                    bad_input_is=f"a damaged zip archive (member '{info.filename}')",
                    **_sums(spec))
            log(f"{info.filename} -> {target.name}: {out[role].bytes:,} bytes"
                + (" (checksum verified)" if spec and (spec["sha256"] or spec["md5"]) else ""))
    return out


def write_verified(reader: BinaryIO, target: str | os.PathLike, *, label: str,
                   sha256: str | None = None, md5: str | None = None,
                   size: int | None = None, source: str = "", role: str = "",
                   bad_input: tuple[type[BaseException], ...] = (),
                   bad_input_is: str = "unreadable") -> Extracted:
    """Stream `reader` into `target` through a hidden temporary file in the same directory,
    check `sha256` / `md5` when given, then rename it into place. On any failure nothing is
    left at `target` (nor the temporary). `size`, when known, goes into a disk-full message;
    `bad_input` are the reader's exceptions that mean the input is damaged."""
    target = Path(target)
    expect_sha = _check_hex(sha256, _SHA256, f"dataset.files.{role}.sha256", "sha256") \
        if sha256 else None
    expect_md5 = _check_hex(md5, _MD5, f"dataset.files.{role}.md5", "md5") if md5 else None
    tmp = target.with_name(f".{target.name}.part")
    h, m, n = hashlib.sha256(), hashlib.md5() if expect_md5 else None, 0
    what = f"{source} -> {target.name}" if source and source != target.name else target.name
    try:
        try:
            with _open_for_write(tmp, "wb") as out:
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
            if e.errno in _DISK_FULL:
                needed = f"; {size - n:,} more bytes were needed ({size:,} in all)" \
                    if size is not None else ""
                raise PipelineError(f"{label}: disk full writing {target} ({e.strerror})"
                                    f"{needed}") from None
            raise
        found = {"sha256": h.hexdigest(), "md5": m.hexdigest() if m else None}
        for algo, expected in (("sha256", expect_sha), ("md5", expect_md5)):
            if expected and found[algo] != expected.lower():
                raise PipelineError(
                    f"{label}: {what}" + (f" (dataset.files.{role})" if role else "")
                    + f": {algo} mismatch: expected {expected.lower()}, found {found[algo]}; "
                    f"the file differs from the one the dataset lists")
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return Extracted(target, found["sha256"], n, source or target.name)


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
    return base


def _check_hex(value: str, pattern: re.Pattern, key: str, algo: str) -> str:
    if not isinstance(value, str) or not pattern.match(value):
        raise PipelineError(f"{key}: {value!r} is not a {algo} "
                            f"({32 if algo == 'md5' else 64} hex digits)")
    return value.lower()


def _listing(names: list[str], limit: int = 20) -> str:
    if not names:
        return "no files"
    shown = ", ".join(names[:limit])
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return f"{len(names)} file(s): {shown}{more}"
