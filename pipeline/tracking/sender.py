"""Tracking records sent to MLflow by a background thread, and kept when they cannot be.

A record is one MLflow call as a JSON-able dict. Runs are named in records by a local key
until MLflow has created them (`create` binds the key to MLflow's run id), so records can
wait in memory while the server is down, be written to a backlog file, and be replayed from
it later in the same order. Metrics carry their own step and timestamp, and artifacts their
bytes (they are small: json, yaml, a tokenizer model), so a late delivery records what a
timely one would have.
"""

from __future__ import annotations

import base64
import re
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

from pipeline.cluster.signals import WAKE_S
from pipeline.tracking.backlog import Marks, append_records, compact, read_backlog

RETRY_SECONDS = 10.0  # between attempts while the server is not answering

# The experiment tag MLflow's UI reads as what an experiment is for (the key and the values
# of its `ExperimentKind`, in mlflow/server/js; its kind selector writes the same tag): a UI
# that picks an experiment's page by it opens ours on runs, not on GenAI traces. Ours train
# models. (MLflow 3.17's UI picks by its sidebar switch instead; see docs/tracking.md.)
EXPERIMENT_KIND = ("mlflow.experimentKind", "custom_model_development")


def experiment_id(client, name: str, artifact_location: str | None) -> str:
    """The id of experiment `name`, created (with our kind tag) when it does not exist. An
    existing experiment without a kind tag gets ours; a kind someone set is kept."""
    found = client.get_experiment_by_name(name)
    if found is None:
        return client.create_experiment(
            name, artifact_location=artifact_location, tags=dict([EXPERIMENT_KIND])
        )
    mark_kind(client, found)
    return found.experiment_id


def mark_kind(client, experiment) -> None:
    """Tag an existing experiment that has no kind as ours; best effort: a server that
    refuses (a user allowed to log runs but not to edit the experiment) loses only the tag."""
    if EXPERIMENT_KIND[0] in (getattr(experiment, "tags", None) or {}):
        return
    try:
        client.set_experiment_tag(experiment.experiment_id, *EXPERIMENT_KIND)
    except Exception:
        pass


def is_transient(error: BaseException) -> bool:
    """True when the server did not answer (down, unreachable, timing out) or said to come
    back later (429, 502-504): the record may go through later. False when it answered with
    an error (a 4xx, or a 500 such as MLflow's for a param logged twice with another value),
    which no retry fixes."""
    from mlflow.exceptions import MlflowException

    if not isinstance(error, MlflowException):
        return isinstance(error, OSError)  # requests' connection errors are OSErrors
    status = _answered_status(error)
    if status is None and _NO_ANSWER in str(error):
        return True
    return (status or error.get_http_status_code()) in (429, 502, 503, 504)


def never_sent(error: BaseException) -> bool:
    """True when a request failed before it reached the server: no connection was made
    (refused, no route, a name that does not resolve)."""
    text = str(error)
    return isinstance(error, ConnectionRefusedError) or any(
        words in text for words in ("NewConnectionError", "Failed to establish a new connection")
    )


# MLflow's words for a request that got no usable answer; with MLFLOW_HTTP_REQUEST_MAX_RETRIES
# at 0, an error status MLflow would retry arrives the same way, as "too many N error responses"
_NO_ANSWER = "failed with exception"


def _answered_status(error: BaseException) -> int | None:
    """The server's 5xx answer: urllib3's when it gave up retrying ("too many 500 error
    responses"), or MLflow's own error for a 500 it was handed back unretried
    (INTERNAL_ERROR), so that both say "HTTP 500"; a 4xx keeps MLflow's words."""
    m = re.search(r"too many (\d{3}) error responses", str(error))
    if m:
        return int(m.group(1))
    if getattr(error, "error_code", None) == "INTERNAL_ERROR" and hasattr(error, "json"):
        return 500  # a RestException: the server answered 500
    return None


# The tag that carries a run's key (the name tracking records give it before MLflow has made
# it): a `create` whose answer was lost (a deadline, a signal, a kill) finds its run by it
# instead of making a second one.
RUN_KEY_TAG = "allattn.run_key"
_KEY = re.compile(r"[0-9a-f]{32}")  # the keys the tracker makes (uuid4().hex)


class Delivery:
    """Performs records against one MLflow client; remembers which run each key became.

    Sending a record again does no harm: a `create` whose key may already have a run
    (`unsure`: one whose request got no answer, or any that a backlog holds) looks for it
    first; a metric's exact point (key, value, time, step) is kept once by MLflow's database
    stores; params of the same value, tags, artifacts and a run's end are written over."""

    def __init__(self, client, run_ids: dict[str, str] | None = None):
        self.client = client
        self.run_ids: dict[str, str] = dict(run_ids or {})
        self.unsure: set[str] = set()
        self._experiments: dict[str, str] = {}

    def send(self, record: dict) -> None:
        from mlflow.entities import Metric, Param, RunTag

        op = record["op"]
        if op == "create":
            self._create(record)
        elif op == "batch":
            self.client.log_batch(
                self.run_ids[record["key"]],
                metrics=[Metric(k, v, t, s) for k, v, t, s in record.get("metrics", [])],
                params=[Param(k, v) for k, v in record.get("params", [])],
                tags=[RunTag(k, v) for k, v in record.get("tags", [])],
            )
        elif op == "artifact":
            with tempfile.TemporaryDirectory() as tmp:
                path = Path(tmp) / record["name"]
                path.write_bytes(base64.b64decode(record["data"]))
                self.client.log_artifact(
                    self.run_ids[record["key"]], str(path), record["artifact_path"]
                )
        elif op == "end":
            self.client.set_terminated(
                self.run_ids[record["key"]], status=record["status"], end_time=record["time"]
            )
        else:
            raise ValueError(f"unknown tracking record {op!r}")

    def _create(self, record: dict) -> None:
        key = record["key"]
        if key in self.run_ids:
            return  # made already (a replay's bind says so)
        experiment = self._experiment(record["experiment"], record["artifact_location"])
        if key in self.unsure and (found := self._find(experiment, key)) is not None:
            self.run_ids[key] = found
            self.unsure.discard(key)
            return
        tags = {**record["tags"], RUN_KEY_TAG: key}
        if record["parent"] is not None:
            tags["mlflow.parentRunId"] = self.run_ids[record["parent"]]
        self.unsure.add(key)  # from here until the answer, the run may exist unknown to us
        try:
            run = self.client.create_run(experiment, start_time=record["time"], tags=tags)
        except Exception as e:
            if never_sent(e):
                self.unsure.discard(key)
            raise
        self.run_ids[key] = run.info.run_id
        self.unsure.discard(key)

    def _find(self, experiment: str, key: str) -> str | None:
        """The run made for `key` by an earlier request whose answer was lost, if any."""
        if not _KEY.fullmatch(key):
            return None  # no key the tracker made: no filter to quote it in
        runs = self.client.search_runs([experiment], f"tags.`{RUN_KEY_TAG}` = '{key}'")
        return runs[0].info.run_id if runs else None

    def _experiment(self, name: str, artifact_location: str | None) -> str:
        if name not in self._experiments:
            self._experiments[name] = experiment_id(self.client, name, artifact_location)
        return self._experiments[name]


def describe(record: dict) -> str:
    return f"{record['op']} record for run {record['key']}"


class Sender:
    """Sends records in order from a daemon thread, so the caller never waits on the server.

    While the server does not answer, records stay queued and the head one is retried every
    `retry_s` seconds; `warn` hears about the first failure and the recovery, once each. A
    record MLflow refuses (see `is_transient`) is reported and dropped. `spill` writes what is
    left to a backlog file, and every later record goes straight there."""

    def __init__(
        self, delivery: Delivery, warn: Callable[[str], None], retry_s: float = RETRY_SECONDS
    ):
        self.delivery, self.warn, self.retry_s = delivery, warn, retry_s
        self.pending: deque[dict] = deque()
        self.failing = False
        self.spilled_to: Path | None = None
        self.unwritten: list[dict] = []  # records neither the store nor the backlog took
        self._lost: set[str] = set()  # keys whose `create` MLflow refused
        self._hurry = False  # a flush is waiting: try now, not at _next_try
        self._next_try = 0.0
        self._stopped = False
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def run_id(self, key: str | None) -> str | None:
        return self.delivery.run_ids.get(key) if key is not None else None

    def submit(self, record: dict) -> None:
        with self._cond:
            if self.spilled_to is not None:
                self._keep([record])
                return
            self.pending.append(record)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._loop, name="mlflow-sender", daemon=True
                )
                self._thread.start()
            self._cond.notify_all()

    def flush(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for the queue to empty (trying at once even if the
        server was failing); True when everything was sent."""
        deadline = time.monotonic() + timeout
        with self._cond:
            self._hurry = True
            self._cond.notify_all()
            while self.pending and (left := deadline - time.monotonic()) > 0:
                self._cond.wait(min(left, WAKE_S))  # a signal to another thread: see WAKE_S
            self._hurry = False
            return not self.pending

    def stop(self, join_s: float) -> None:
        """Stop sending, waiting up to `join_s` for a request in flight to settle (so that
        a record is neither lost nor sent twice)."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        if self._thread is not None:
            deadline = time.monotonic() + join_s
            while self._thread.is_alive() and (left := deadline - time.monotonic()) > 0:
                self._thread.join(min(left, WAKE_S))

    def spill(self, path: Path, join_s: float) -> int:
        """Stop sending and append what is left to `path`, after the run ids known so far;
        every later record goes there too. Returns the number of records written."""
        self.stop(join_s)
        with self._cond:
            records = list(self.pending)
            self.pending.clear()
            self.spilled_to = path
            if records:
                binds = [
                    {"op": "bind", "key": k, "run_id": v} for k, v in self.delivery.run_ids.items()
                ]
                self._keep(binds + records)
            return len(records)

    def _keep(self, records: list[dict]) -> None:
        """Append to the backlog file (the caller holds `_cond`). A backlog that cannot be
        written (a full disk, a directory turned read-only) stops the run with one line,
        once: its records stay in memory (`unwritten`) for the cleanup that follows, and
        the metrics since the last checkpoint are logged again when the run resumes (the
        tracker makes them durable before every checkpoint)."""
        if self.unwritten:
            self.unwritten.extend(records)
            return
        assert self.spilled_to is not None  # spill() set it before anything is kept
        try:
            append_records(self.spilled_to, records)
        except OSError as e:
            from pipeline.errors import PipelineError

            self.unwritten.extend(records)
            raise PipelineError(
                f"tracking backlog {self.spilled_to}: cannot write it ({e.strerror or e}) "
                f"while the tracking store is not taking records either; the run stops "
                f"here: free space (or make it writable) and run again, which resumes from "
                f"the last checkpoint and logs the steps since then again"
            ) from None

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not (
                    self._stopped
                    or self.pending
                    and (self._hurry or time.monotonic() >= self._next_try)
                ):
                    self._cond.wait(
                        max(0.0, self._next_try - time.monotonic()) if self.pending else None
                    )
                if self._stopped:
                    return
                record = self.pending[0]
            try:
                if record["key"] not in self._lost:
                    self.delivery.send(record)
            except Exception as e:
                if is_transient(e):
                    self._failed(e)
                    continue
                self.warn(f"MLflow refused a {describe(record)} ({reason(e)}); dropped it")
                if record["op"] == "create":
                    self._lost.add(record["key"])
            with self._cond:
                if self._stopped and not self.pending:
                    return  # `spill` gave up waiting for this request and kept the record
                self.pending.popleft()
                if self.failing:
                    self.failing = False
                    self.warn("tracking server answers again; sending the records kept meanwhile")
                self._cond.notify_all()

    def _failed(self, error: Exception) -> None:
        with self._cond:
            if not self.failing:
                self.failing = True
                self.warn(
                    f"{not_answering(error)}; training goes on, its records are kept "
                    f"and sent when the store takes them again"
                )
            self._next_try = time.monotonic() + self.retry_s
            self._hurry = False


def replay(path: Path, delivery: Delivery, warn: Callable[[str], None]) -> tuple[int, int]:
    """Send the records waiting in a backlog file (pipeline.tracking.backlog) in order, and
    mark each in the file as it goes: a `create` by the run id it got (`bind`), any other
    record `sent`. A replay stopped anywhere, by a failure a later try could fix (it returns
    then), a signal or a kill, leaves the file so that the next sends only the rest; a record
    is sent again only when the stop fell between its request and its mark, and then MLflow
    takes it without a copy (`Delivery`: a run is found by its key before it is made again,
    a metric's point is kept once). A record MLflow refuses is reported, dropped and marked.
    Torn lines go aside first, to `torn_path(path)`, named in a warning; what was sent is
    dropped from the file then too. Removes the file when all went. Returns (records sent,
    records left)."""
    backlog = compact(path, read_backlog(path), warn)
    delivery.run_ids.update(backlog.run_ids)
    # a `create` in a backlog may have reached the store without its answer (the request a
    # kill, a signal or a deadline cut short): looked for before it is made
    delivery.unsure.update(r["key"] for _, r in backlog.waiting if r["op"] == "create")
    sent, refused = 0, set()
    with Marks(path) as marks:
        for done, (line, record) in enumerate(backlog.waiting):
            if record["key"] in refused:
                continue  # its run was never made: the next replay drops it too
            try:
                delivery.send(record)
            except Exception as e:
                if is_transient(e):
                    return sent, backlog.count() - done
                warn(f"MLflow refused a {describe(record)} ({reason(e)}); dropped it")
                if record["op"] == "create":
                    refused.add(record["key"])
                marks.sent(line)
                continue
            if record["op"] == "create":
                marks.bound(record["key"], delivery.run_ids[record["key"]])
            else:
                marks.sent(line)
            sent += 1
    path.unlink()
    return sent, 0


def reason(error: BaseException) -> str:
    """The cause in a few words, not MLflow's paragraph about the URL and retries."""
    text = str(error)
    if status := _answered_status(error):
        return f"HTTP {status}"
    if m := re.search(r"\(sqlite3\.\w+\) ([^\n\[]+)", text):  # a local store: its own words
        return m.group(1).strip()
    if m := re.search(r"\[Errno -?\d+\] ([^'\")]+)", text):
        return m.group(1).strip()
    if "timed out" in text or "timeout" in text.lower():
        return "no answer in time"
    return first_line(error)


def not_answering(error: BaseException) -> str:
    """How a failed request is reported: a server that does not answer, or a local store
    (sqlite) that answered with its own cause (locked, read-only, full)."""
    why = reason(error)
    if re.search(r"\(sqlite3\.\w+\)", str(error)):
        return f"tracking store refuses writes ({why})"
    return f"tracking server not answering ({why})"


def first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
