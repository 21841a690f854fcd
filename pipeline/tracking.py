"""MLflow tracking: one parent run per `allattn-pipe run`, one nested run per stage that ran.

The MLflow client is used explicitly (no fluent global run stack), so nesting is visible in
the code. Only rank 0 tracks; other ranks get `NullTracker`. A tracking server that goes down
never stops the pipeline: records are sent by a background thread (`tracking_sender`) and,
when the server does not come back in time, kept in `<workspace>/tracking-backlog.jsonl`
for `allattn-pipe sync`.
"""

from __future__ import annotations

import base64
import logging
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path

import yaml

from pipeline.errors import PipelineError, Preempted
from pipeline.spec import PROJECT_ROOT
from pipeline.tracking_sender import RETRY_SECONDS, Delivery, Sender, is_transient, reason, replay

_MAX_PARAM = 6000       # MLflow's limit on a param value
_BATCH = 100            # params / metrics per log_batch call
BACKLOG = "tracking-backlog.jsonl"
FLUSH_SECONDS = 10.0    # a stage's end waits this long for its records to reach the server
# one try per request, answered or given up within seconds (see MlflowTracker.__init__)
_HTTP_LIMITS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "5"}


def default_tracking_uri(workspace_root: str | Path) -> str:
    return f"sqlite:///{Path(workspace_root).resolve() / 'mlflow.db'}"


def tracking_uri(spec) -> str:
    """spec `tracking.uri`, else MLFLOW_TRACKING_URI, else the embedded sqlite store."""
    return (spec.tracking.uri or os.environ.get("MLFLOW_TRACKING_URI")
            or default_tracking_uri(spec.workspace.root))


def flatten(data, prefix: str = "") -> dict[str, str]:
    """{'train': {'lr': 0.1}} -> {'train.lr': '0.1'}; lists kept whole."""
    out: dict[str, str] = {}
    if isinstance(data, dict):
        for key, value in data.items():
            out.update(flatten(value, f"{prefix}{key}."))
    else:
        out[prefix[:-1]] = str(data)[:_MAX_PARAM]
    return out


def environment_tags() -> dict[str, str]:
    tags = {
        "python": platform.python_version(),
        "host": socket.gethostname(),
        "world_size": os.environ.get("WORLD_SIZE", "1"),
        "argv": " ".join(sys.argv)[:_MAX_PARAM],
    }
    for dist in ("allattn-pipe", "torch", "deepspeed", "mlflow", "webdataset", "numpy"):
        try:
            tags[f"version.{dist}"] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    try:
        commit = subprocess.run(["git", "-C", str(PROJECT_ROOT), "rev-parse", "HEAD"],
                                capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", str(PROJECT_ROOT), "status", "--porcelain"],
                               capture_output=True, text=True, timeout=10)
        if commit.returncode == 0:
            tags["git_commit"] = commit.stdout.strip()
            tags["git_dirty"] = str(bool(dirty.stdout.strip())).lower()
    except (OSError, subprocess.SubprocessError):
        pass
    return tags


class NullStageTracker:
    run_id = None

    def log_params(self, params: dict) -> None: ...
    def log_metrics(self, metrics: dict, step: int) -> None: ...
    def log_artifact(self, path, artifact_path: str | None = None) -> None: ...
    def set_tags(self, tags: dict) -> None: ...


class NullTracker:
    run_id = None

    def check(self, spec) -> None: ...
    def start(self, spec, plan) -> None: ...
    def finish(self, status: str) -> None: ...

    @contextmanager
    def stage(self, name: str, config: dict):
        yield NullStageTracker()


class StageTracker:
    """What a stage logs to its MLflow run; every call only queues a record (`Sender`)."""

    def __init__(self, sender: Sender, key: str):
        self.sender, self.key = sender, key

    @property
    def run_id(self) -> str | None:
        """MLflow's id for the run, once the server has created it."""
        return self.sender.run_id(self.key)

    def log_params(self, params: dict) -> None:
        items = [[k, v] for k, v in flatten(params).items()]
        for i in range(0, len(items), _BATCH):
            self.sender.submit({"op": "batch", "key": self.key, "params": items[i:i + _BATCH]})

    def log_metrics(self, metrics: dict, step: int) -> None:
        now = int(time.time() * 1000)
        items = [[k, float(v), now, int(step)] for k, v in metrics.items()]
        for i in range(0, len(items), _BATCH):
            self.sender.submit({"op": "batch", "key": self.key,
                                "metrics": items[i:i + _BATCH]})

    def log_artifact(self, path, artifact_path: str | None = None) -> None:
        path = Path(path)
        self.sender.submit({"op": "artifact", "key": self.key, "name": path.name,
                            "artifact_path": artifact_path,
                            "data": base64.b64encode(path.read_bytes()).decode("ascii")})

    def set_tags(self, tags: dict) -> None:
        self.sender.submit({"op": "batch", "key": self.key,
                            "tags": [[k, str(v)] for k, v in tags.items()]})

    def end(self, status: str) -> None:
        self.sender.submit({"op": "end", "key": self.key, "status": status,
                            "time": int(time.time() * 1000)})


def is_remote(uri: str) -> bool:
    return uri.split(":", 1)[0].lower() in ("http", "https")


def backlog_path(spec) -> Path:
    return spec.workspace_dir / BACKLOG


def sync_command(spec) -> str:
    return f"allattn-pipe sync {spec.source}"


class MlflowTracker:
    """The parent run of one pipeline invocation, and a nested run per executed stage.

    Nothing here waits on the tracking server except the check in `start`: records go
    through a `Sender`. When a stage ends, the records still queued get `flush_s` seconds;
    what the server has not taken by then is written to the workspace's backlog file
    (`sync` sends it later), and so is everything logged after that."""

    def __init__(self, uri: str, retry_s: float = RETRY_SECONDS, flush_s: float = FLUSH_SECONDS,
                 warn=None):
        from mlflow.tracking import MlflowClient

        # the store's first-use schema migration logs at INFO on every new workspace
        logging.getLogger("mlflow").setLevel(logging.WARNING)
        logging.getLogger("alembic").setLevel(logging.WARNING)
        if is_remote(uri):
            # MLflow's defaults (7 retries with backoff, 120 s per request) block for minutes
            # on a dead server; the Sender retries by itself, so one short try per call
            for name, value in _HTTP_LIMITS.items():
                os.environ.setdefault(name, value)
        self.uri, self.flush_s = uri, flush_s
        self.client = MlflowClient(tracking_uri=uri)
        self.warn = warn or (lambda message: print(f"warning: {message}", file=sys.stderr))
        self.sender = Sender(Delivery(self.client), self.warn_server, retry_s)
        self.spec = None
        self.parent: StageTracker | None = None

    @property
    def run_id(self) -> str | None:
        return self.parent.run_id if self.parent else None

    def warn_server(self, message: str) -> None:
        self.warn(f"MLflow {self.uri}: {message}")

    def check(self, spec) -> None:
        """Refuse to start when the tracking server does not answer, in a few seconds."""
        if not is_remote(self.uri):
            return
        try:
            self.client.search_experiments(max_results=1)
        except Exception as e:
            if not is_transient(e):
                raise PipelineError(f"tracking server {self.uri} refused a request "
                                    f"({reason(e)})") from None
            raise PipelineError(
                f"tracking server {self.uri} is not answering ({reason(e)}); start it, or "
                f"unset tracking.uri and MLFLOW_TRACKING_URI to record runs in the local "
                f"store {default_tracking_uri(spec.workspace.root)}") from None

    def start(self, spec, plan) -> None:
        self.check(spec)
        self.spec = spec
        backlog = backlog_path(spec)
        if backlog.exists():
            self.warn(f"{backlog} holds tracking records an earlier run could not send; "
                      f"`{sync_command(spec)}` sends them")
        tags = environment_tags()
        tags.update({
            "mlflow.runName": f"{spec.name}",
            "spec": spec.source,
            "workspace": str(spec.workspace_dir.resolve()),
            "stages.run": ",".join(s.stage for s in plan if s.action == "run") or "none",
            "stages.skipped": ",".join(s.stage for s in plan if s.action != "run") or "none",
        })
        self.parent = self._create_run(tags)
        resolved = spec.resolved()
        self.parent.log_params(resolved)
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "spec.resolved.yaml"
            path.write_text(yaml.safe_dump(resolved, sort_keys=False))
            self.parent.log_artifact(path)

    def _create_run(self, tags: dict, parent: StageTracker | None = None) -> StageTracker:
        name = self.spec.tracking.experiment or self.spec.name
        location = None
        if self.uri.startswith("sqlite:"):
            location = (Path(self.spec.workspace.root) / "mlartifacts" / name).resolve().as_uri()
        key = uuid.uuid4().hex
        self.sender.submit({"op": "create", "key": key, "experiment": name,
                            "artifact_location": location, "tags": tags,
                            "parent": parent.key if parent else None,
                            "time": int(time.time() * 1000)})
        return StageTracker(self.sender, key)

    def finish(self, status: str) -> None:
        if self.parent:
            self.parent.end(status)
            self._settle()
        self.sender.stop(self._request_timeout())

    @staticmethod
    def _request_timeout() -> float:
        return float(os.environ.get("MLFLOW_HTTP_REQUEST_TIMEOUT",
                                    _HTTP_LIMITS["MLFLOW_HTTP_REQUEST_TIMEOUT"]))

    def _settle(self) -> None:
        """Give the queued records `flush_s` seconds; write what is left to the backlog."""
        if self.sender.spilled_to is not None or self.sender.flush(self.flush_s):
            return
        backlog = backlog_path(self.spec)
        count = self.sender.spill(backlog, join_s=self._request_timeout() + 1)
        self.warn(f"{count} tracking records could not be sent to {self.uri}; they are in "
                  f"{backlog}, and so will be the rest of this run's: "
                  f"`{sync_command(self.spec)}` sends them when the server is back")

    @contextmanager
    def stage(self, name: str, config: dict):
        tracker = self._create_run({"mlflow.runName": name, "stage": name},
                                   parent=self.parent)
        tracker.log_params(config)
        try:
            yield tracker
        except BaseException as e:
            tracker.end("KILLED" if isinstance(e, (KeyboardInterrupt, Preempted)) else "FAILED")
            self._settle()
            raise
        tracker.end("FINISHED")
        self._settle()


def sync(spec, log=print) -> None:
    """Send the records of the workspace's backlog file to the tracking server."""
    from pipeline.runner import WorkspaceLock

    path = backlog_path(spec)
    with WorkspaceLock(spec.workspace_dir):      # a `run` may be appending to it
        if not path.exists():
            log(f"{path}: no tracking records waiting")
            return
        tracker = MlflowTracker(tracking_uri(spec))
        tracker.check(spec)
        sent, left = replay(path, Delivery(tracker.client), tracker.warn_server)
    if left:
        raise PipelineError(f"tracking server {tracker.uri} stopped answering: {sent} records "
                            f"sent, {left} still in {path}; run `{sync_command(spec)}` again")
    log(f"{sent} tracking records sent to {tracker.uri}")


def make_tracker(spec, rank: int = 0):
    if not spec.tracking.enabled or rank != 0:
        return NullTracker()
    return MlflowTracker(tracking_uri(spec))
