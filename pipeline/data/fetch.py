"""Getting a dataset's file onto the machine: fetch (resumable, cached by sha256), verified.
What is in it is unpacked by `pipeline.data.extract`.

    fetched = fetch(url, cache, sha256=..., log=print)       # a verified local file

- `http(s)://` downloads need the file's sha256: it is both the integrity check and the cache
  key. Bytes land in `<cache>/downloads/<sha256>.part`; an interrupted transfer is resumed
  with `Range: bytes=N-` (in this process a few times, then by the next run), and only a
  complete file whose sha256 matches is renamed to `<cache>/downloads/<sha256>`. A later
  fetch of the same sha256, from any run or workspace sharing the cache, makes no request
  (the cached file is re-hashed; a corrupt one is fetched again).
- `file://` sources are read where they are (a local mirror on shared storage), never
  copied into the cache; their sha256 is checked when one is given.

Every failure is a `PipelineError` with one line that names the URL or file and the problem.
Nothing here reads a whole file into memory.
"""

from __future__ import annotations

import base64
import contextlib
import errno
import hashlib
import http.client
import os
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import IO, Any

from pipeline import fsutil
from pipeline.errors import PipelineError, shown, write_cause, write_hint
from pipeline.redact import PLACEHOLDER, mask, scrub

CHUNK = 1 << 20  # bytes per read/write
TIMEOUT_S = 60.0  # socket timeout: connect, and each read
RETRIES = 2  # in-process resumes of an interrupted http transfer
RETRY_WAIT_S = 2.0  # times the attempt number
PROGRESS_MIN_BYTES = 8 << 20  # smaller downloads log no progress lines
PROGRESS_UNKNOWN_STEP = 32 << 20  # without a Content-Length: a line every this many bytes
USER_AGENT = "allattn-pipe (python urllib)"
SHA256_HEX = re.compile(r"^[0-9a-fA-F]{64}$")
MD5_HEX = re.compile(r"^[0-9a-fA-F]{32}$")
DISK_FULL = {errno.ENOSPC, errno.EDQUOT}

Log = Callable[[str], None]


@dataclass(frozen=True)
class Fetched:
    url: str
    path: Path  # the verified file: in the cache (http) or the file:// source itself
    sha256: str
    bytes: int
    cached: bool  # served from the cache without a request


def cache_dir(spec) -> Path:
    """The download cache of a `pipeline.spec.Spec`: workspace.cache, else <root>/cache."""
    ws = spec.workspace
    # validate expanded a `~` (refusing one that names no directory); a spec built otherwise
    # gets the same one line, not Path.expanduser's RuntimeError
    return fsutil.user_path(ws.cache) if ws.cache else Path(ws.root) / "cache"


def file_name(url: str, archive: str = "none") -> str:
    """The name a downloaded file gets when the dataset does not name it: the URL's last
    path component, without `.gz` for a gzip archive ('data' when there is none)."""
    name = PurePosixPath(urllib.parse.unquote(urllib.parse.urlparse(url).path)).name
    if archive == "gz":
        for suffix in (".gz", ".gzip"):
            if name.lower().endswith(suffix):
                name = name[: -len(suffix)]
                break
    return name if name not in ("", ".", "..") else "data"


def digests(path: str | os.PathLike, md5: bool = False) -> tuple[str, str | None, int]:
    """(sha256, md5 or None, size) of a file, read in chunks."""
    h, m, n = hashlib.sha256(), hashlib.md5() if md5 else None, 0
    with fsutil.open_regular_for_read(path, "file") as f:  # a FIFO is refused, not waited on
        while block := f.read(CHUNK):
            h.update(block)
            if m:
                m.update(block)
            n += len(block)
    return h.hexdigest(), m.hexdigest() if m else None, n


# ---------------------------------------------------------------- a URL that can never be fetched

FETCHED_SCHEMES = ("builtin", "file", "http", "https")
SCHEMES_HINT = "use builtin://NAME, file:///path or http(s)://..."


def url_problem(url: str, schemes: tuple[str, ...] = FETCHED_SCHEMES) -> str | None:
    """What makes `url` one that no request can be made with, in words, or None.

    urllib.parse accepts a port that is no number or past 65535, an unbalanced `[`, an empty
    host and a host name with an empty label; it raises only when the request is made, deep
    in a run. Spec validation asks this first, and so does `fetch`. A host and port written
    as an `${env:NAME}` placeholder are checked after it is filled in, by `fetch`."""
    if not isinstance(url, str):
        return None
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError as e:
        if str(e) == "Invalid IPv6 URL":
            return "unbalanced [ ] around the host (an IPv6 address is written http://[::1]:80/)"
        if "[" in url:
            return f"the host in [ ] is not an IPv6 address ({e})"
        return f"not a URL that can be read ({e})"
    scheme = parts.scheme.lower()
    if scheme not in schemes:
        said = f"unsupported scheme '{scheme}'" if scheme else "no scheme"
        hint = SCHEMES_HINT if schemes == FETCHED_SCHEMES else "use " + " or ".join(schemes)
        return f"{said} ({hint})"
    if scheme not in ("http", "https"):
        return None
    if any(c.isspace() or not c.isprintable() for c in url):
        return "it holds a space or a control character (percent-encode it, e.g. %20)"
    host_port = parts.netloc.rpartition("@")[2]
    if PLACEHOLDER.search(host_port):
        return None
    if not parts.hostname:
        return f"no host name ({scheme}://HOST/...)"
    try:
        port = parts.port
    except ValueError:
        given = host_port.rpartition("]")[2] if host_port.startswith("[") else host_port
        return f"port '{given.partition(':')[2]}' is not a number from 1 to 65535"
    if port == 0:
        return "port 0 is not a port a server listens on (1 to 65535)"
    if not host_port.startswith("["):
        try:
            parts.hostname.encode("idna")
        except UnicodeError:
            return (
                f"host name '{parts.hostname}' is not valid (an empty label, or one longer "
                f"than 63 characters)"
            )
    return None


def check_url(url: str, key: str = "dataset.url") -> None:
    """`url_problem` as a one-line PipelineError naming `key`; the URL's secrets masked."""
    problem = url_problem(url)
    if problem:
        raise PipelineError(f"{key} {shown(mask(url))}: {problem}")


# ---------------------------------------------------------------- fetch


def fetch(
    url: str,
    cache: str | os.PathLike,
    *,
    sha256: str | None = None,
    log: Log = print,
    retries: int = RETRIES,
    timeout: float = TIMEOUT_S,
    mismatch_hint: str = "",
) -> Fetched:
    """A verified local copy of `url` (http(s):// or file://).

    http(s): `sha256` is required; the file is taken from the cache or downloaded into it
    (resuming a `.part` left by an earlier attempt). file://: read in place, checked against
    `sha256` when given. `mismatch_hint` is appended to a sha256 mismatch message, with
    "{found}" replaced by the sha256 found.
    """
    check_url(url)
    scheme = urllib.parse.urlparse(url).scheme.lower()
    if scheme == "file":
        return _fetch_file(url, sha256, mismatch_hint)
    if scheme not in ("http", "https"):
        raise PipelineError(f"dataset.url {url}: unsupported scheme '{scheme}' ({SCHEMES_HINT})")
    filled = url_problem(expand_env(url))
    if filled:  # a host or port given as ${env:NAME}: its value is not shown
        raise PipelineError(f"dataset.url {url}: with its ${{env:...}} values filled in, {filled}")
    if not sha256:
        raise PipelineError(
            f"dataset.url {url}: an http(s) download needs the file's sha256 (the integrity "
            f"check and the cache key): set `sha256:` in the dataset card or pass --set "
            f"dataset.sha256=<output of sha256sum FILE>, or download it by hand and use "
            f"--set dataset.url=file:///path/to/{file_name(url)}"
        )
    key = check_hex(sha256, SHA256_HEX, "dataset.sha256", "sha256").lower()
    downloads = Path(cache) / "downloads"
    final = downloads / key

    hit = _cache_hit(final, key, url, log)
    if hit:
        return hit
    try:
        downloads.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise PipelineError(
            f"download cache {downloads}: cannot create it ({e.strerror}); "
            f"set workspace.cache to a writable directory"
        ) from None
    with _locked(downloads / f"{key}.lock", log):
        hit = _cache_hit(final, key, url, log)  # another process may have just finished
        if hit:
            return hit
        part = downloads / f"{key}.part"
        # a link planted there would be resumed from, written through and renamed into the
        # cache: refused, as anything but a regular file is
        fsutil.refuse_link(part, "partial download")
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
                        f"received are kept in {part}: run again to resume"
                    ) from None
                attempt += 1
                wait = RETRY_WAIT_S * attempt
                log(
                    f"download interrupted ({e}); resuming in {wait:.0f}s "
                    f"(retry {attempt} of {retries})"
                )
                time.sleep(wait)
        found, _, _ = digests(part)
        if found != key:
            kept_as = ""
            if size is not None and part.stat().st_size == size:
                # complete as the server sent it: keep it under its own checksum, so that
                # --set dataset.sha256=<found> (a repacked mirror) needs no second download
                os.replace(part, downloads / found)
                kept_as = f"; kept as {downloads / found}"
            else:
                part.unlink(missing_ok=True)
            raise PipelineError(
                f"dataset.url {url}: sha256 mismatch: expected {key}, found "
                f"{found}{kept_as}{mismatch_hint.replace('{found}', found)}"
            )
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
        raise PipelineError(
            f"dataset.url {url}: a file URL needs an absolute path, with three "
            f"slashes: file://{_as_path(parsed.netloc)}{parsed.path}"
        )
    src = Path(urllib.request.url2pathname(urllib.parse.urlparse(expand_env(url)).path))
    if not src.exists():
        raise PipelineError(f"dataset.url {url}: no such file {src}")
    if not src.is_file():
        raise PipelineError(f"dataset.url {url}: {src} is not a regular file")
    expected = check_hex(sha256, SHA256_HEX, "dataset.sha256", "sha256").lower() if sha256 else None
    try:
        found, _, size = digests(src)
    except OSError as e:
        raise PipelineError(f"dataset.url {url}: cannot read {src} ({e.strerror})") from None
    if expected and found != expected:
        raise PipelineError(
            f"dataset.url {url}: sha256 mismatch: expected {expected}, found "
            f"{found}{mismatch_hint.replace('{found}', found)}"
        )
    return Fetched(url, src, found, size, cached=False)


def _as_path(netloc: str) -> str:
    """A file URL's host part read as the first directory of its path (a `user:pw@` left
    out: it is no part of a path, and it may be a secret)."""
    host = netloc.rpartition("@")[2]
    return f"/{host}" if host else ""


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
    waits, then finds the file in the cache. Where the file system has no flock, the lock is
    a lock file (pipeline.locks), which a download killed on another host leaves behind: the
    line that says a download waits names it."""
    from pipeline.locks import holding, stale_hint

    def waiting() -> None:
        hint = stale_hint(path, "download")
        log(
            f"another process is downloading into {path.parent}; waiting for it"
            + (f" ({hint})" if hint else "")
        )

    # never through a link planted there (it would create or lock the file it names)
    with (
        fsutil.open_for_write(path, "download lock file", append=True) as handle,
        holding(handle.fileno(), path, f"download cache {path.parent}", waiting),
    ):
        yield


def expand_env(url: str) -> str:
    """`url` with each `${env:NAME}` replaced by that environment variable's value, as is:
    how a secret reaches the request without being written in a config. Done only for the
    request; every record and message keeps the placeholder."""

    def value(match: re.Match) -> str:
        name = match.group(1)
        if name not in os.environ:
            raise PipelineError(
                f"dataset.url {url}: the environment variable {name} that it names is not set"
            )
        return os.environ[name]

    return PLACEHOLDER.sub(value, url)


def _basic_auth(url: str) -> tuple[str, str | None]:
    """The URL to request and its Authorization header: a `user:password@` is taken out of
    the URL (urllib would read it as part of the host name) and sent as HTTP basic auth."""
    parts = urllib.parse.urlsplit(url)
    userinfo, at, host = parts.netloc.rpartition("@")
    if not at:
        return url, None
    user, _, password = userinfo.partition(":")
    pair = f"{urllib.parse.unquote(user)}:{urllib.parse.unquote(password)}"
    token = base64.b64encode(pair.encode("utf-8")).decode("ascii")
    return urllib.parse.urlunsplit(parts._replace(netloc=host)), f"Basic {token}"


def _origin(url: str) -> tuple[str, str | None, int | None]:
    parts = urllib.parse.urlsplit(url)
    return parts.scheme.lower(), parts.hostname, parts.port


class _Redirected(Exception):
    """The server redirected to a scheme the downloader does not fetch."""

    def __init__(self, target: str, scheme: str):
        super().__init__(target)
        self.target, self.scheme = target, scheme


class _Redirects(urllib.request.HTTPRedirectHandler):
    """urllib's redirects, with two rules of ours: a target that is not http(s) is refused
    naming it (urllib would follow ftp:// and report the first host, or fail on file:// as
    an HTTP error); the basic-auth header goes only to the origin it was given for. `url`
    is where the last request went, for messages."""

    def __init__(self, url: str, auth: str | None):
        self.url, self.auth, self.origin = url, auth, _origin(url)

    def http_error_302(self, req, fp, code, msg, headers):
        location = headers.get("location") or headers.get("uri")
        if location:
            target = urllib.parse.urljoin(req.full_url, location)
            scheme = urllib.parse.urlsplit(target).scheme.lower()
            if scheme not in ("http", "https"):
                fp.close()
                raise _Redirected(target, scheme)
        return super().http_error_302(req, fp, code, msg, headers)

    http_error_301 = http_error_303 = http_error_307 = http_error_308 = http_error_302

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        if new is not None:
            self.url = newurl
            if self.auth and _origin(newurl) == self.origin:
                new.add_unredirected_header("Authorization", self.auth)
        return new


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
    full = expand_env(url)
    target, auth = _basic_auth(full)
    request = urllib.request.Request(target, headers={"User-Agent": USER_AGENT})
    if auth:  # not copied onto a redirect's request: _Redirects decides
        request.add_unredirected_header("Authorization", auth)
    if have:
        request.add_header("Range", f"bytes={have}-")
    redirects = _Redirects(target, auth)
    opener = urllib.request.build_opener(redirects)  # reads the *_proxy variables now
    try:
        response = opener.open(request, timeout=timeout)
    except _Redirected as e:
        raise PipelineError(
            f"dataset.url {url}: the server redirected to {scrub(e.target, full)}, a "
            f"{e.scheme}:// URL, which the downloader does not fetch (only http:// and https://)"
        ) from None
    except urllib.error.HTTPError as e:
        e.close()
        if e.code == 416 and have:
            # the range starts at or past the end: the .part is complete, or it is longer
            # than the file (a stale one): keep it in the first case, start over in the other
            if digests(part)[0] == key:
                return have
            part.unlink()
            raise _Interrupted(
                f"HTTP 416 for a .part of {have:,} bytes that is not the file; starting over"
            ) from None
        hint = (
            "; the file may have moved: point --set dataset.url=... at a mirror"
            if e.code in (404, 410)
            else ""
        )
        reason = scrub(str(e.reason), full)
        raise PipelineError(f"dataset.url {url}: HTTP {e.code} {reason}{hint}") from None
    except (urllib.error.URLError, http.client.HTTPException, OSError) as e:
        # http.client quotes the request's path and query without the scheme (InvalidURL:
        # a token holding a space): every secret value of the URL goes, wherever it stands
        reason = scrub(str(getattr(e, "reason", None) or e), full)
        host = urllib.parse.urlsplit(redirects.url).netloc.rpartition("@")[2]  # the last asked
        raise PipelineError(
            f"dataset.url {url}: cannot reach {host} ({reason}); on a machine without "
            f"internet, copy the file to local or shared storage and use --set "
            f"dataset.url=file:///path/to/{file_name(url)}"
        ) from None

    with response:
        status = response.status
        length = response.headers.get("Content-Length")
        length = int(length) if length and length.isdigit() else None
        if have and status == 206:
            start, total = _content_range(response.headers.get("Content-Range"))
            if start != have:
                part.unlink()
                raise _Interrupted(f"the server resumed at byte {start}, not {have}; starting over")
            if total is None and length is not None:
                total = have + length
            mode = "ab"
            log(
                f"resuming {url} at {have / 1e6:.1f}"
                + (f" of {total / 1e6:.1f} MB" if total else " MB")
            )
        elif status == 200:
            if have:
                log("the server sent the whole file (HTTP 200, not 206): starting over")
            have, total, mode = 0, length, "wb"
            log(f"downloading {url}" + (f" ({total / 1e6:.1f} MB)" if total else ""))
        else:
            raise PipelineError(f"dataset.url {url}: unexpected HTTP {status} {response.reason}")

        progress = _Progress(log, have, total)
        try:
            with open_for_write(part, mode) as out:
                while True:
                    try:
                        block = response.read(CHUNK)
                    except (OSError, http.client.HTTPException) as e:
                        out.flush()
                        said = scrub(f"{type(e).__name__}: {e}".rstrip(": "), full)
                        raise _Interrupted(said) from None
                    if not block:
                        break
                    out.write(block)
                    have += len(block)
                    progress.update(have)
                out.flush()
                os.fsync(out.fileno())
        except OSError as e:
            cause = write_cause(e)
            if cause:
                kept = part.stat().st_size if part.exists() else 0  # what reached the disk
                needed = f"; {total - kept:,} more bytes were needed" if total else ""
                hint = (
                    "free space (or set workspace.cache elsewhere)"
                    if e.errno in DISK_FULL
                    else f"{write_hint(e)} (or set workspace.cache elsewhere)"
                )
                raise PipelineError(
                    f"dataset.url {url}: {cause} writing {part} ({e.strerror}){needed}; "
                    f"{hint} and run again to resume from the {kept:,} bytes kept"
                ) from None
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
            self.log(
                f"  {100 * have // self.total:3d}%  {have / 1e6:,.1f} of "
                f"{self.total / 1e6:,.1f} MB  {self._rate(have):.1f} MB/s"
            )
        else:
            self.log(f"  {have / 1e6:,.1f} MB  {self._rate(have):.1f} MB/s")

    def done(self, have: int) -> None:
        seconds = time.monotonic() - self.t0
        self.log(
            f"downloaded {(have - self.start) / 1e6:,.1f} MB in {seconds:.1f}s "
            f"({self._rate(have):.1f} MB/s)"
        )


def open_for_write(path: Path, mode: str) -> IO[Any]:
    """Every file this module writes is opened here (the tests simulate a full disk): never
    through a symlink, never anything but a regular file (fsutil.open_for_write)."""
    what = "partial download" if path.suffix == ".part" else "file"
    return fsutil.open_for_write(path, what, append="a" in mode, text="b" not in mode)


# ---------------------------------------------------------------- extract


def check_hex(value: str, pattern: re.Pattern, key: str, algo: str) -> str:
    if not isinstance(value, str) or not pattern.match(value):
        raise PipelineError(
            f"{key}: {value!r} is not a {algo} ({32 if algo == 'md5' else 64} hex digits)"
        )
    return value.lower()
