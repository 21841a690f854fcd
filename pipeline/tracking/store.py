"""The one way into the MLflow tracking store: every command opens it here.

A store is a local sqlite database (the default, `<workspace root>/mlflow.db`), a `file:`
store, or a tracking server (`http(s)://`). `open_store` opens one to record in (`run`,
`sweep`, `export --register`): a local store is created on first use, one process at a
time. `open_existing_store` opens one to read (`compare`): a local store must already hold
MLflow's tables. Every request to a server, from the first (`check_server`) to the last,
gets one try that ends, answered or not, within seconds (`bound_requests`, `request_limit_s`:
a deadline for the whole request, not MLflow's minutes of retries nor `requests`' wait
between two bytes), and a command stops at the first one that gets no answer (`answering`).
A tracking variable MLflow cannot read is named before any request (`check_environment`).
Every refusal is one line, a URI's password masked (pipeline.redact).
"""

from __future__ import annotations

import contextvars
import errno
import logging
import os
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from pipeline.cluster.signals import WAKE_S
from pipeline.errors import WRITE_FAILURES, PipelineError, shown
from pipeline.redact import mask
from pipeline.tracking.sender import is_transient, reason

# one try per request, answered or given up within seconds; MLflow's defaults (120 s a try,
# 7 retries with backoff) hold a command for 16 minutes and more on a server that hangs
HTTP_LIMITS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "5"}
STORE_WAIT_S = 60.0  # a run waits this long for another process to free a local store
# what to do when the server that should hold the runs does not answer
SERVER_HINT = (
    "start it, or point MLFLOW_TRACKING_URI (or the config's tracking.uri) at the store "
    "that holds the runs"
)


def is_remote(uri: str) -> bool:
    return uri.split(":", 1)[0].lower() in ("http", "https")


class ServerNotAnswering(PipelineError):
    """A tracking server that did not answer a request in time (or said to come back
    later): every request after it would wait the same, so a command stops here."""


def bound_requests(uri: str) -> None:
    """From here to the end of the process, every request to a tracking server gets one
    try (HTTP_LIMITS): MLflow reads both variables at each request; a user's own settings
    stand. MLflow's timeout is a wait between two bytes: the whole request's deadline is
    `request_limit_s`, which the client `open_store` and `open_existing_store` give holds
    every call to. First, the tracking variables the user set are checked
    (`check_environment`)."""
    check_environment(uri)
    if is_remote(uri):
        for name, value in HTTP_LIMITS.items():
            os.environ.setdefault(name, value)
        # MLflow ends each run with one more request, to print the run's link on stdout:
        # a URL that holds the URI's password, after a wait on a server that hangs
        os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")


MIB = 2**20


def request_limit_s(upload_bytes: int = 0) -> float:
    """The deadline of one request to a tracking server once `bound_requests` ran, whole:
    its tries times MLFLOW_HTTP_REQUEST_TIMEOUT, the backoff MLflow sleeps between them, and
    for an upload the same again per MiB it carries (a transfer slower than 1 MiB a try's
    wait is taken for a server that does not answer)."""
    from mlflow.environment_variables import (
        MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR,
        MLFLOW_HTTP_REQUEST_BACKOFF_JITTER,
    )

    limits = {name: os.environ.get(name) or value for name, value in HTTP_LIMITS.items()}
    retries = int(limits["MLFLOW_HTTP_REQUEST_MAX_RETRIES"])
    wait = float(limits["MLFLOW_HTTP_REQUEST_TIMEOUT"]) * (retries + 1)
    # urllib3 sleeps factor * 2^(n-1) before the n-th retry after the first (at most 120 s)
    factor = MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR.get()
    backoff = sum(min(factor * 2 ** (n - 1), 120) for n in range(2, retries + 1))
    return (
        wait * (1 + upload_bytes / MIB)
        + backoff
        + retries * MLFLOW_HTTP_REQUEST_BACKOFF_JITTER.get()
    )


class RequestDeadline(TimeoutError):
    """A request to a tracking server that was not answered, whole, by its deadline."""

    def __init__(self, seconds: float):
        super().__init__(f"request timed out: no whole answer within {seconds:g} s")


def within_deadline(seconds: float, call, *args, **kwargs):
    """`call(*args, **kwargs)`, or RequestDeadline once `seconds` have passed without its
    return. It runs in a thread of its own (in this thread's context), which is left to
    finish or fail by itself after the deadline: a request has no other way to be cut
    short. What it sent may still reach the server then; the records (sender.py) are made
    so that sending one again does no harm."""
    done, outcome = threading.Event(), []
    context = contextvars.copy_context()

    def request() -> None:
        try:
            outcome.append((True, context.run(call, *args, **kwargs)))
        except BaseException as e:  # handed to the caller, who decides
            outcome.append((False, e))
        finally:
            done.set()

    threading.Thread(target=request, name="mlflow-request", daemon=True).start()
    deadline = time.monotonic() + seconds
    while not done.wait(min(WAKE_S, max(0.0, deadline - time.monotonic()))):
        if time.monotonic() >= deadline:
            raise RequestDeadline(seconds)
    answered, value = outcome[0]
    if answered:
        return value
    raise value


class _WithinDeadline:
    """An MlflowClient whose every call ends within `request_limit_s` (`within_deadline`):
    `requests` waits MLFLOW_HTTP_REQUEST_TIMEOUT between two bytes, so a server that
    trickles one every few seconds held a command for as long as it liked."""

    def __init__(self, client):
        self._client = client

    def __getattr__(self, name: str):
        attribute = getattr(self._client, name)
        if not callable(attribute):
            return attribute

        def call(*args, **kwargs):
            limit = request_limit_s(_upload_bytes(name, args, kwargs))
            return within_deadline(limit, attribute, *args, **kwargs)

        return call


def _upload_bytes(method: str, args, kwargs) -> int:
    """The bytes a `log_artifact(s)` call uploads (its local file or directory), else 0."""
    if method not in ("log_artifact", "log_artifacts"):
        return 0
    local = kwargs.get("local_path", kwargs.get("local_dir", args[1] if len(args) > 1 else None))
    if local is None:
        return 0
    root = Path(local)
    try:
        if root.is_file():
            return root.stat().st_size
        return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
    except OSError:
        return 0


def _bounded(client, uri: str):
    """`client` as every command gets it: for a tracking server (or a registry at one),
    every call within its deadline."""
    registry = os.environ.get("MLFLOW_REGISTRY_URI") or ""
    return _WithinDeadline(client) if is_remote(uri) or is_remote(registry) else client


def check_environment(uri: str) -> None:
    """Refuse, in one line naming it, a tracking variable the user set that MLflow cannot
    read (a number that is none, a boolean that is neither) and, for a server, one that it
    would refuse at the first request or take for a silence (a timeout of 0, more retries
    than it allows, a certificate that is not there, a URI no request can use). MLflow's
    error for those arrives as a failed request: it was reported as the server's."""
    import mlflow.environment_variables as variables

    remote = is_remote(uri)
    for variable in vars(variables).values():
        name = getattr(variable, "name", None)
        if not (isinstance(name, str) and hasattr(variable, "get_raw")):
            continue  # not one of MLflow's variables
        raw = variable.get_raw()
        if raw is None:
            continue
        try:
            value = variable.get()
        except Exception:
            _refuse(name, raw, _EXPECTED.get(variable.type, "another value"))
        expected = _http_expectation(name, value) if remote else None
        if expected:
            _refuse(name, raw, expected)
    for name, given in (("MLFLOW_REGISTRY_URI", os.environ.get("MLFLOW_REGISTRY_URI")), ("", uri)):
        if given and is_remote(given) and (why := _unusable_url(given)):
            if not name:  # the tracking URI: the variable's, or the config's tracking.uri
                from_variable = os.environ.get("MLFLOW_TRACKING_URI") == given
                name = "MLFLOW_TRACKING_URI" if from_variable else "tracking.uri"
            raise PipelineError(
                f"{name} {shown(mask(given))}: not a URL a request can use ({why}); fix it"
            )


_EXPECTED = {int: "a whole number", float: "a number", bool: "true, false, 1 or 0"}


def _http_expectation(name: str, value) -> str | None:
    """What a request to a server needs of MLflow variable `name` that `value` is not."""
    from mlflow.environment_variables import _MLFLOW_HTTP_REQUEST_MAX_RETRIES_LIMIT

    if name == "MLFLOW_HTTP_REQUEST_TIMEOUT" and value <= 0:
        return "a number of seconds above 0"
    if name == "MLFLOW_HTTP_REQUEST_MAX_RETRIES":
        limit = _MLFLOW_HTTP_REQUEST_MAX_RETRIES_LIMIT.get()
        if not 0 <= value <= limit:
            return f"a number of retries from 0 to MLflow's limit, {limit}"
    if name == "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR" and not 0 <= value <= 120:
        return "a number of seconds from 0 to 120"
    if name == "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER" and value < 0:
        return "a number of seconds from 0 up"
    if name.endswith("_CERT_PATH") and value and not os.path.isfile(value):
        return "a certificate file; there is none at that path"
    return None


def _refuse(name: str, raw: str, expected: str):
    raise PipelineError(
        f"{name}={shown(mask(raw))}: MLflow cannot use this value (expected {expected}); "
        f"fix or unset it"
    )


def _unusable_url(uri: str) -> str | None:
    """Why a server's URI cannot be requested (no host, a port that is no number), or None."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(uri)
        parts.port  # noqa: B018 (raises for a port that is no number, or out of range)
    except ValueError as e:
        return str(e)
    return None if parts.hostname else "no host in it"


@contextmanager
def answering(uri: str, hint: str = SERVER_HINT):
    """Within, a request the server at `uri` does not answer ends the command: one line
    naming the server (its password masked), after one request's wait. MLflow's other
    errors are the caller's."""
    try:
        yield
    except Exception as e:
        if isinstance(e, PipelineError) or not is_remote(uri) or not is_transient(e):
            raise
        raise ServerNotAnswering(
            f"tracking server {mask(uri)} is not answering ({mask(reason(e))}); {hint}"
        ) from None


def check_server(client, uri: str, hint: str) -> None:
    """What every command that talks to a tracking server does first: one request, answered
    in seconds, or one line (`hint`: what to do when it does not answer). The URI's
    password is masked. Nothing to do for a local store."""
    if not is_remote(uri):
        return
    bound_requests(uri)
    with answering(uri, hint):
        try:
            client.search_experiments(max_results=1)
        except Exception as e:
            if is_transient(e):
                raise
            raise PipelineError(
                f"tracking server {mask(uri)} refused a request ({mask(reason(e))})"
            ) from None


def sqlite_path(uri: str) -> Path | None:
    """The database file of a `sqlite:` tracking URI (its `file:` URI form too), else None."""
    if not uri.lower().startswith("sqlite:"):
        return None
    from urllib.parse import urlparse

    from sqlalchemy.engine import make_url

    try:
        database = make_url(uri).database
    except Exception:
        return None
    if not database or database == ":memory:":
        return None
    return Path(urlparse(database).path if database.startswith("file:") else database)


def mlflow_uri(uri: str) -> str:
    """The URI to give MLflow for ``uri``: the same store. A sqlite URI in SQLite's own URI
    form (``sqlite:///file:/abs/mlflow.db?mode=ro&uri=true``: a read-only store, another
    vfs) is given with its driver named, ``sqlite+pysqlite:``, which is what SQLAlchemy runs
    for ``sqlite:`` anyway. MLflow makes the parent directory of what follows a plain
    ``sqlite:///`` and reads ``file:/abs`` as a relative path: without this, opening such a
    store made a ``file:`` directory in the working directory. The store's real directory
    is made here (``open_store``'s make_parent), from ``sqlite_path``."""
    if not uri.lower().startswith("sqlite:///file:"):
        return uri
    from sqlalchemy.engine import make_url
    from sqlalchemy.util import asbool

    try:
        as_uri = asbool(make_url(uri).query.get("uri", False))
    except Exception:
        return uri  # MLflow's own error names what is wrong with it
    # without uri=true, SQLAlchemy opens a file at the relative path "file:/abs/...", whose
    # directory MLflow is right to make
    return "sqlite+pysqlite:///" + uri[len("sqlite:///") :] if as_uri else uri


@contextmanager
def store_lock(uri: str, warn):
    """Opening a local sqlite store, one process at a time: on first use MLflow creates the
    store's tables and runs its migrations, and two processes doing that at once break each
    other (two `run`s started together on a new workspace). The lock is a file beside the
    store (pipeline.locks: a flock, or where there is none a lock file); a process that finds
    it held waits, saying so, up to STORE_WAIT_S. Where the file system has no flock, the
    store is refused unless it has the POSIX locks sqlite itself keeps the store whole with."""
    from pipeline.locks import stale_hint, wait_lock

    path = sqlite_path(uri)
    if path is None or not path.parent.is_dir():
        yield  # MLflow's own error names what is missing
        return
    lock = path.parent / f".{path.name}.lock"
    try:
        from pipeline.fsutil import open_lock_file

        fd = open_lock_file(lock, "tracking store lock file")  # never through a planted link
    except OSError as e:
        raise PipelineError(
            f"tracking store {shown(path)}: cannot create its lock file "
            f"{shown(lock)}: {e.strerror or e}"
        ) from None
    try:
        held = wait_lock(
            fd,
            lock,
            f"tracking store {shown(path)}",
            STORE_WAIT_S,
            lambda: warn(f"waiting for another process that is opening the tracking store {path}"),
        )
        if held is None:
            hint = stale_hint(lock, "process")
            raise PipelineError(
                f"tracking store {shown(path)}: another process has held {lock} for "
                f"{STORE_WAIT_S:g} s; let it finish, or stop it, and run again"
                + (f"; {hint}" if hint else "")
            )
        try:
            if held.soft is not None:
                _refuse_without_posix_locks(fd, path)
            yield
        finally:
            held.release()
    finally:
        os.close(fd)  # and with it a flock


def _refuse_without_posix_locks(fd: int, path: Path) -> None:
    """Where flock is missing, sqlite may lack the POSIX locks it keeps a store whole with
    (Lustre `noflock` and NFS without its lock manager have neither): it would then call
    every open "disk I/O error" or "database is locked". One line naming the file system
    instead. The lock tried is on the store's lock file (open as `fd`), never on the store."""
    import fcntl

    from pipeline.locks import NO_FLOCK, filesystem_type

    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in NO_FLOCK:
            raise PipelineError(
                f"tracking store {shown(path)}: its file system ({filesystem_type(path.parent)}) "
                f"has no file locks, which sqlite needs to keep the store whole; point "
                f"tracking.uri at a tracking server or at a store on a local disk "
                f"(sqlite:////tmp/me/mlflow.db), or set tracking.enabled: false"
            ) from None
        return  # held by another process: the file system has them
    fcntl.lockf(fd, fcntl.LOCK_UN)


def open_store(uri: str, warn=None, make_parent: bool = False):
    """An MlflowClient to record in: a local sqlite store is created on first use, under
    `store_lock` (its creation is not safe to race), with its directory when `make_parent`;
    its refusals are one line (`_on_local_store`). A server is not asked anything here: the
    caller decides when `check_server` runs; every request it gets is bounded
    (`bound_requests`)."""
    warn = warn or _warn_on_stderr
    _quiet_mlflow()
    bound_requests(uri)
    path = sqlite_path(uri)
    if make_parent and path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise PipelineError(
                f"tracking store {shown(path)}: cannot make its directory: {e.strerror or e}"
            ) from None
    with store_lock(uri, warn):
        client = _on_local_store(lambda: _client(uri), uri, warn)
    return _bounded(client, uri)


def registry_uri(uri: str) -> str:
    """The model registry of the tracking store at `uri`: MLFLOW_REGISTRY_URI's, else the
    store's own."""
    return os.environ.get("MLFLOW_REGISTRY_URI") or uri


def _client(uri: str):
    """An MlflowClient of the store at `uri` and of its registry (`registry_uri`), both named,
    with the store made MLflow's default for the rest of the process (`_as_default`)."""
    from mlflow.tracking import MlflowClient

    _as_default(uri)
    return MlflowClient(tracking_uri=mlflow_uri(uri), registry_uri=mlflow_uri(registry_uri(uri)))


def _as_default(uri: str) -> None:
    """Make the store at `uri` the one MLflow opens for a client that names none, and with it
    (unless MLFLOW_REGISTRY_URI names another) the default registry. MLflow makes such
    clients inside its own calls: its file-store registry in every `create_model_version`,
    its database registry for a model's id; and their default is a store in the working
    directory (`./mlflow.db`, `./mlruns`), which `export --register` against a `file:` store
    created there. MLflow's setter also exports MLFLOW_TRACKING_URI, which a config without
    `tracking.uri` and every process started from here would read as the user's choice: it
    is put back as it was."""
    import mlflow

    before = os.environ.get("MLFLOW_TRACKING_URI")
    mlflow.set_tracking_uri(mlflow_uri(uri))
    if before is None:
        os.environ.pop("MLFLOW_TRACKING_URI", None)
    else:
        os.environ["MLFLOW_TRACKING_URI"] = before


def open_existing_store(uri: str, hint: str = SERVER_HINT, warn=None):
    """An MlflowClient to read from. A local store that does not exist is refused (opening
    it would create an empty one), and so is a file that is not a sound MLflow store; a
    server must answer (`check_server`, `hint`: what to do when it does not). No lock file
    is made: a store in a directory this user cannot write is still read."""
    warn = warn or _warn_on_stderr
    _quiet_mlflow()
    bound_requests(uri)
    path = sqlite_path(uri)
    if path is not None:
        if not path.is_file():
            raise PipelineError(
                f"no tracking store at {path}: no pipeline has run with it "
                f"(name a CONFIG, or set MLFLOW_TRACKING_URI)"
            )
        _check_mlflow_database(path)
    client = _bounded(_on_local_store(lambda: _client(uri), uri, warn), uri)
    check_server(client, uri, hint)
    return _Answering(client, uri, hint) if is_remote(uri) else client


class _Answering:
    """An MlflowClient whose every call is made `answering`: a reader (`compare`) stops at
    the first request its server does not answer, in one line. The errors it raises are no
    MlflowException, so a caller's `except MlflowException` (a run that is not there, a
    filter MLflow refuses) does not word a silence as one of those."""

    def __init__(self, client, uri: str, hint: str):
        self._client, self._uri, self._hint = client, uri, hint

    def __getattr__(self, name: str):
        attribute = getattr(self._client, name)
        if not callable(attribute):
            return attribute

        def call(*args, **kwargs):
            with answering(self._uri, self._hint):
                return attribute(*args, **kwargs)

        return call


def check_writable(uri: str, warn) -> None:
    """Refuse, in one line, a local store that cannot take a write (read-only, on a full or
    read-only file system); one locked by another process is waited for (STORE_WAIT_S)."""
    _on_local_store(lambda: _probe_write(uri), uri, warn)


def _warn_on_stderr(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr)


def _quiet_mlflow() -> None:
    # the store's first-use schema migration logs at INFO on every new workspace
    logging.getLogger("mlflow").setLevel(logging.WARNING)
    logging.getLogger("alembic").setLevel(logging.WARNING)
    # a local store's refusals (locked, read-only, full) are ours to report in one line;
    # MLflow's session wrapper logs each with a traceback first
    logging.getLogger("mlflow.store.db.utils").setLevel(logging.CRITICAL)


def _check_mlflow_database(path: Path) -> None:
    """Refuse, in one line, a file that is not an MLflow store that MLflow would otherwise
    fail on with a traceback (damaged) or give a schema (empty): reading writes nothing."""
    import sqlite3

    try:
        with sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True) as db:
            problems = [row[0] for row in db.execute("PRAGMA quick_check")]
            tables = {
                row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
            }
        db.close()
    except sqlite3.DatabaseError as e:
        raise PipelineError(f"{path}: not a readable MLflow tracking store ({e})") from None
    if problems != ["ok"]:
        raise PipelineError(f"{path}: the MLflow tracking store is damaged ({problems[0]})")
    if not {"experiments", "runs", "alembic_version"} <= tables:
        raise PipelineError(
            f"{path}: not an MLflow tracking store (no experiments or runs "
            f"tables); no pipeline has run with it"
        )


def _probe_write(uri: str) -> None:
    """Begin a write transaction on a local store and roll it back: a store that is
    read-only, on a read-only or full file system, or locked fails here, before the run."""
    import sqlalchemy

    engine = sqlalchemy.create_engine(uri, connect_args={"timeout": 1.0})
    try:
        raw = engine.raw_connection()
        try:
            cursor = raw.cursor()
            cursor.execute("BEGIN IMMEDIATE")
            try:  # a write: a read-only store refuses only those
                cursor.execute("CREATE TABLE allattn_write_probe (x)")
            finally:
                # sqlite ends the transaction itself when a write fails on I/O (a journal
                # past `ulimit -f`): a ROLLBACK then fails, and its error would hide the cause
                if getattr(raw.driver_connection, "in_transaction", True):
                    cursor.execute("ROLLBACK")
        finally:
            raw.close()
    finally:
        engine.dispose()


def _file_size_limit(path: Path) -> int | None:
    """The largest file this process may write where the store at `path` may have met it:
    sqlite words a write past `ulimit -f` (or FAT32's 4 GiB) as a bare "disk I/O error",
    its errno lost. None where no such limit is near."""
    import resource

    soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if soft != resource.RLIM_INFINITY:
        return soft
    fat32 = 2**32 - 1
    return fat32 if path.is_file() and path.stat().st_size >= fat32 else None


def _on_local_store(action, uri: str, warn):
    """`action()` on a local store, its refusals as one line with sqlite's cause; while
    another process holds the store locked, retried for up to STORE_WAIT_S, saying so."""
    from mlflow.exceptions import MlflowException

    path = sqlite_path(uri)
    if path is None:
        return action()
    deadline = None  # from the first refusal: an attempt may block
    error: Exception
    while True:
        try:
            return action()
        except MlflowException as e:
            if "sqlite3" not in str(e):
                raise  # MLflow's own refusal, for the caller to word
            error = e
        except Exception as e:  # sqlalchemy's, raised before MLflow's wrapper
            error = e
        why = reason(error)
        if "locked" in why and (deadline is None or time.monotonic() < deadline):
            if deadline is None:
                deadline = time.monotonic() + STORE_WAIT_S
                warn(
                    f"tracking store {path} is locked by another process; waiting up to "
                    f"{STORE_WAIT_S:g} s for it"
                )
            time.sleep(0.5)
            continue
        limit = _file_size_limit(path) if "disk I/O error" in why else None
        if limit is not None:
            why = f"{why}, most likely a {WRITE_FAILURES[errno.EFBIG][0]} ({limit:,} bytes)"
        hint = (
            "another process holds it (an sqlite3 shell, a stuck process?): close it and run again"
            if "locked" in why
            else f"{WRITE_FAILURES[errno.ENOSPC][1]} and run again"
            if "full" in why
            else f"{WRITE_FAILURES[errno.EFBIG][1]}, and run again"
            if limit is not None
            else "make it and its directory writable, or point tracking.uri elsewhere, or "
            "set tracking.enabled: false"
        )
        raise PipelineError(f"tracking store {shown(path)}: {why}; {hint}") from None
