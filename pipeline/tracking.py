"""MLflow tracking: one parent run per `allattn-pipe run`, one nested run per stage that ran.

The MLflow client is used explicitly (no fluent global run stack), so nesting is visible in
the code. Only rank 0 tracks; other ranks get `NullTracker`.
"""

from __future__ import annotations

import logging
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path

import yaml

from pipeline.errors import Preempted
from pipeline.spec import PROJECT_ROOT

_MAX_PARAM = 6000       # MLflow's limit on a param value
_BATCH = 100            # params / metrics per log_batch call


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

    def start(self, spec, plan) -> None: ...
    def finish(self, status: str) -> None: ...

    @contextmanager
    def stage(self, name: str, config: dict):
        yield NullStageTracker()


class StageTracker:
    def __init__(self, client, run_id: str):
        self.client, self.run_id = client, run_id

    def log_params(self, params: dict) -> None:
        from mlflow.entities import Param
        items = [Param(k, v) for k, v in flatten(params).items()]
        for i in range(0, len(items), _BATCH):
            self.client.log_batch(self.run_id, params=items[i:i + _BATCH])

    def log_metrics(self, metrics: dict, step: int) -> None:
        from mlflow.entities import Metric
        now = int(time.time() * 1000)
        items = [Metric(k, float(v), now, int(step)) for k, v in metrics.items()]
        for i in range(0, len(items), _BATCH):
            self.client.log_batch(self.run_id, metrics=items[i:i + _BATCH])

    def log_artifact(self, path, artifact_path: str | None = None) -> None:
        self.client.log_artifact(self.run_id, str(path), artifact_path)

    def set_tags(self, tags: dict) -> None:
        for k, v in tags.items():
            self.client.set_tag(self.run_id, k, str(v))


class MlflowTracker:
    """The parent run of one pipeline invocation, and a nested run per executed stage."""

    def __init__(self, uri: str):
        from mlflow.tracking import MlflowClient

        # the store's first-use schema migration logs at INFO on every new workspace
        logging.getLogger("mlflow").setLevel(logging.WARNING)
        logging.getLogger("alembic").setLevel(logging.WARNING)
        self.uri = uri
        self.client = MlflowClient(tracking_uri=uri)
        self.run_id: str | None = None
        self.experiment_id: str | None = None

    def _experiment(self, name: str, artifact_root: Path) -> str:
        found = self.client.get_experiment_by_name(name)
        if found is not None:
            return found.experiment_id
        location = None
        if self.uri.startswith("sqlite:"):
            location = (artifact_root / "mlartifacts" / name).resolve().as_uri()
        return self.client.create_experiment(name, artifact_location=location)

    def start(self, spec, plan) -> None:
        self.experiment_id = self._experiment(spec.tracking.experiment or spec.name,
                                              Path(spec.workspace.root))
        tags = environment_tags()
        tags.update({
            "mlflow.runName": f"{spec.name}",
            "spec": spec.source,
            "workspace": str(spec.workspace_dir.resolve()),
            "stages.run": ",".join(s.stage for s in plan if s.action == "run") or "none",
            "stages.skipped": ",".join(s.stage for s in plan if s.action != "run") or "none",
        })
        run = self.client.create_run(self.experiment_id, tags=tags)
        self.run_id = run.info.run_id
        resolved = spec.resolved()
        StageTracker(self.client, self.run_id).log_params(resolved)
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "spec.resolved.yaml"
            path.write_text(yaml.safe_dump(resolved, sort_keys=False))
            self.client.log_artifact(self.run_id, str(path))

    def finish(self, status: str) -> None:
        if self.run_id:
            self.client.set_terminated(self.run_id, status=status)

    @contextmanager
    def stage(self, name: str, config: dict):
        run = self.client.create_run(self.experiment_id, tags={
            "mlflow.parentRunId": self.run_id, "mlflow.runName": name, "stage": name})
        tracker = StageTracker(self.client, run.info.run_id)
        tracker.log_params(config)
        try:
            yield tracker
        except BaseException as e:
            status = "KILLED" if isinstance(e, (KeyboardInterrupt, Preempted)) else "FAILED"
            self.client.set_terminated(run.info.run_id, status=status)
            raise
        self.client.set_terminated(run.info.run_id, status="FINISHED")


def make_tracker(spec, rank: int = 0):
    if not spec.tracking.enabled or rank != 0:
        return NullTracker()
    return MlflowTracker(tracking_uri(spec))
