"""MLflow tracking: one parent run per `allattn-pipe run`, one nested run per stage that ran.

The MLflow client is used explicitly (no fluent global run stack), so nesting is visible in
the code. Only rank 0 tracks; other ranks get `NullTracker`. A tracking server that goes down
never stops the pipeline: records are sent by a background thread (`tracking_sender`) and,
when the server does not come back in time, kept in `<workspace>/tracking-backlog.jsonl`
for `allattn-pipe sync`.
"""

from __future__ import annotations

import base64
import os
import platform
import re
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path
from typing import Any

import yaml

from pipeline.cluster.signals import stop_words
from pipeline.errors import Interrupted, PipelineError, Preempted, shown
from pipeline.fsutil import read_bytes
from pipeline.redact import mask
from pipeline.spec import PROJECT_ROOT
from pipeline.tracking.sender import RETRY_SECONDS, Delivery, Sender, reason, replay
from pipeline.tracking.store import (
    bound_requests,
    check_server,
    check_writable,
    open_store,
    request_limit_s,
    sqlite_path,
)
from stages.base import NullStageTracker

_MAX_PARAM = 6000  # MLflow's limit on a param value
LOG_BATCH_SIZE = 100  # params / metrics per log_batch call
BACKLOG = "tracking-backlog.jsonl"
FLUSH_SECONDS = 10.0  # a stage's end waits this long for its records to reach the server
# artifacts read as text, so that the URLs in them are masked (pipeline.redact)
_TEXT_ARTIFACTS = (".json", ".yaml", ".yml", ".txt", ".csv", ".md", ".log")


def default_tracking_uri(workspace_root: str | Path) -> str:
    return f"sqlite:///{Path(workspace_root).resolve() / 'mlflow.db'}"


def tracking_uri(spec) -> str:
    """spec `tracking.uri`, else MLFLOW_TRACKING_URI, else the embedded sqlite store."""
    return (
        spec.tracking.uri
        or os.environ.get("MLFLOW_TRACKING_URI")
        or default_tracking_uri(spec.workspace.root)
    )


def experiment_name(spec) -> str:
    return spec.tracking.experiment or spec.name


def artifact_location(spec, uri: str) -> str | None:
    """Where the experiment's artifacts go: beside the embedded sqlite store (under
    workspace.root) for it, the server's default otherwise."""
    if not uri.startswith("sqlite:"):
        return None
    return (Path(spec.workspace.root) / "mlartifacts" / experiment_name(spec)).resolve().as_uri()


def flatten(data, prefix: str = "") -> dict[str, str]:
    """{'train': {'lr': 0.1}} -> {'train.lr': '0.1'}; lists kept whole."""
    out: dict[str, str] = {}
    if isinstance(data, dict):
        for key, value in data.items():
            out.update(flatten(value, f"{prefix}{key}."))
    else:
        out[prefix[:-1]] = mask(str(data))[:_MAX_PARAM]  # masked whole, then cut
    return out


def environment_tags() -> dict[str, str]:
    tags = {
        "python": platform.python_version(),
        "host": socket.gethostname(),
        "world_size": os.environ.get("WORLD_SIZE", "1"),
        # masked before it is cut: a cut inside `user:password@` would hide the URL's shape
        # from the masking and store the password
        "argv": mask(" ".join(sys.argv))[:_MAX_PARAM],
    }
    for dist in ("allattn-pipe", "torch", "deepspeed", "mlflow", "webdataset", "numpy"):
        try:
            tags[f"version.{dist}"] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    tags.update(source_commit(PROJECT_ROOT))
    return tags


# a file of this package, as it sits in the project's own checkout
OWN_SOURCE = "pipeline/spec/yaml_reading.py"


def source_commit(root: Path) -> dict[str, str]:
    """{git_commit, git_dirty} of the code running, when `root` (the package's source tree)
    is itself the top of a git checkout of this project; {} otherwise. Git looks for a
    repository in every parent directory, and GIT_DIR names one from anywhere: a package
    installed in a virtual environment inside the user's own repository was tagged with that
    repository's commit, which is not the code that ran."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}

    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10, env=env
        )

    try:
        found = git("rev-parse", "--show-toplevel", "HEAD")
        if found.returncode != 0:
            return {}
        top, commit = found.stdout.splitlines()
        own = Path(top).resolve() == Path(root).resolve()
        if not own or git("ls-files", "--error-unmatch", "--", OWN_SOURCE).returncode != 0:
            return {}
        status = git("status", "--porcelain")
    except (OSError, ValueError, subprocess.SubprocessError):
        return {}
    tags = {"git_commit": commit}
    if status.returncode == 0:  # else unknown, not said to be clean
        tags["git_dirty"] = str(bool(status.stdout.strip())).lower()
    return tags


class NullTracker:
    run_id = None

    def check(self, spec) -> None: ...
    def start(self, spec, plan) -> None: ...
    def finish(self, status: str) -> None: ...

    @contextmanager
    def stage(self, name: str, config: dict, series: str | None = None, resumed: bool = False):
        yield NullStageTracker()


class StageTracker:
    """What a stage logs to its MLflow run; every call only queues a record (`Sender`).

    `recorded`: metric -> the last step that earlier attempts of this stage's run (those a
    resumed run continues) have in MLflow; the resumed run, which recomputes those steps
    exactly, does not log them twice. `settle`: makes what is queued durable."""

    def __init__(
        self, sender: Sender, key: str, recorded: dict[str, int] | None = None, settle=None
    ):
        self.sender, self.key = sender, key
        self.recorded = recorded or {}
        self.settle = settle

    @property
    def run_id(self) -> str | None:
        """MLflow's id for the run, once the server has created it."""
        return self.sender.run_id(self.key)

    def log_params(self, params: dict) -> None:
        items = [[k, mask(v)] for k, v in flatten(params).items()]
        for i in range(0, len(items), LOG_BATCH_SIZE):
            self.sender.submit(
                {"op": "batch", "key": self.key, "params": items[i : i + LOG_BATCH_SIZE]}
            )

    def log_metrics(self, metrics: dict, step: int) -> None:
        now = int(time.time() * 1000)
        items = [
            [k, float(v), now, int(step)]
            for k, v in metrics.items()
            if step > self.recorded.get(k, -1)
        ]
        for i in range(0, len(items), LOG_BATCH_SIZE):
            self.sender.submit(
                {"op": "batch", "key": self.key, "metrics": items[i : i + LOG_BATCH_SIZE]}
            )

    def log_artifact(self, path, artifact_path: str | None = None) -> None:
        path = Path(path)
        data = read_bytes(path, "artifact")
        if path.suffix.lower() in _TEXT_ARTIFACTS:
            try:
                data = mask(data.decode("utf-8")).encode("utf-8")
            except UnicodeDecodeError:
                pass  # not text after all: kept as it is
        self.sender.submit(
            {
                "op": "artifact",
                "key": self.key,
                "name": path.name,
                "artifact_path": artifact_path,
                "data": base64.b64encode(data).decode("ascii"),
            }
        )

    def set_tags(self, tags: dict) -> None:
        self.sender.submit(
            {"op": "batch", "key": self.key, "tags": [[k, mask(str(v))] for k, v in tags.items()]}
        )

    def make_durable(self) -> None:
        """Before a checkpoint is published: what was logged so far reaches the server, or
        the backlog that the next run replays, within a bounded wait. A kill after the
        checkpoint then loses no step that the resumed run will not log again."""
        if self.settle is not None:
            self.settle()

    def end(self, status: str) -> None:
        self.sender.submit(
            {"op": "end", "key": self.key, "status": status, "time": int(time.time() * 1000)}
        )


def backlog_path(spec) -> Path:
    return spec.workspace_dir / BACKLOG


def sync_command(spec) -> str:
    return f"allattn-pipe sync {spec.source}"


def replaying(spec) -> str:
    """What a signal that stops the replay of the workspace's backlog left (`Interrupted`):
    what was sent is marked sent in the file (pipeline.tracking.sender.replay), the rest
    waits there."""
    return (
        f"it was sending the tracking records an earlier run left; those not sent stay in "
        f"{shown(backlog_path(spec))} for the next `{shown(sync_command(spec))}` or run"
    )


class MlflowTracker:
    """The parent run of one pipeline invocation, and a nested run per executed stage.

    Nothing here waits on the tracking server except the check in `start`: records go
    through a `Sender`. When a stage ends, the records still queued get `flush_s` seconds;
    what the server has not taken by then is written to the workspace's backlog file
    (`sync` sends it later), and so is everything logged after that."""

    def __init__(
        self,
        uri: str,
        retry_s: float = RETRY_SECONDS,
        flush_s: float = FLUSH_SECONDS,
        warn=None,
        sweep_run_id: str | None = None,
    ):
        # one short try per request (MLflow's defaults wait minutes on a dead server): the
        # Sender retries by itself
        bound_requests(uri)
        self.uri, self.flush_s = uri, flush_s
        said = warn or (lambda message: print(f"warning: {message}", file=sys.stderr))
        self.warn = lambda message: said(mask(message))  # a URI's password, MLflow's words
        from mlflow.exceptions import MlflowException

        try:
            self.client = open_store(uri, self.warn)
        except MlflowException as e:  # a store MLflow refuses (file: without its opt-in)
            raise PipelineError(
                f"tracking store {shown(mask(uri))}: MLflow refuses it: "
                f"{_first_sentence(e.message)}"
            ) from None
        self.sender = Sender(Delivery(self.client), self.warn_server, retry_s)
        self.spec: Any = None  # the Spec, from start() on
        self.parent: StageTracker | None = None
        # a sweep's run, whose child the pipeline run is from its creation (`start`)
        self.sweep_run_id = sweep_run_id

    @property
    def run_id(self) -> str | None:
        return self.parent.run_id if self.parent else None

    def warn_server(self, message: str) -> None:
        self.warn(f"MLflow {self.uri}: {message}")

    def check(self, spec) -> None:
        """Refuse to start when the tracking server does not answer, in a few seconds, or
        when a local store cannot take a write (read-only, or locked by another process for
        longer than STORE_WAIT_S: a run waits that long, saying so)."""
        if sqlite_path(self.uri) is not None:
            check_writable(self.uri, self.warn)
            return
        check_server(
            self.client,
            self.uri,
            f"start it, or unset tracking.uri and MLFLOW_TRACKING_URI to record runs in the "
            f"local store {default_tracking_uri(spec.workspace.root)}",
        )

    def start(self, spec, plan) -> None:
        self.check(spec)
        self.spec = spec
        self._replay_backlog(spec)
        self._end_dead_attempts(spec)
        # The tags that file the run come first: a file store writes a create's tags one
        # file each, in this order, so a run a kill -9 cut short during its creation has
        # its sweep parent and its workspace (by which `_end_dead_attempts` and a sweep's
        # `adopt` find it) before it has anything else, `spec` included. Before, they came
        # after the environment's tags and `spec`: a sweep killed between the `spec` and
        # `workspace` files left a pipeline run that no later sweep could file under it.
        tags = {"mlflow.parentRunId": self.sweep_run_id} if self.sweep_run_id else {}
        tags.update(
            {
                "workspace": str(spec.workspace_dir.resolve()),
                "spec": spec.source,
                "mlflow.runName": f"{spec.name}",
                "stages.run": ",".join(s.stage for s in plan if s.action == "run") or "none",
                "stages.skipped": ",".join(s.stage for s in plan if s.action != "run") or "none",
            }
        )
        tags.update(environment_tags())
        self.parent = self._create_run(tags)
        resolved = spec.resolved()
        self.parent.log_params(resolved)
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "spec.resolved.yaml"
            path.write_text(yaml.safe_dump(resolved, sort_keys=False))
            self.parent.log_artifact(path)

    def _replay_backlog(self, spec) -> None:
        """Send what earlier runs of this workspace could not (the caller holds its lock)."""
        backlog = backlog_path(spec)
        if not backlog.exists():
            return
        try:
            with stop_words(f"no stage had started, {replaying(spec)}"):
                sent, left = replay(backlog, Delivery(self.client), self.warn_server)
        except PipelineError as e:  # not a file we may read (a planted FIFO, a link)
            self.warn(f"the tracking backlog was left unread: {e}")
            return
        except Exception as e:  # the server failed in another way: sync can retry
            sent, left = 0, None
            self.warn_server(f"sending the backlog failed ({reason(e)})")
        if left != 0:
            self.warn(
                f"{backlog} holds tracking records an earlier run could not send; "
                f"`{sync_command(spec)}` sends them"
            )
        elif sent:
            self.warn(f"sent {sent} tracking records that an earlier run left in {backlog}")

    def _end_dead_attempts(self, spec) -> None:
        """This run holds the workspace's lock, so a run of the workspace that MLflow still
        has as RUNNING died without a word (kill -9, a lost node): mark it and its stage
        runs KILLED, ended at their last record."""
        try:
            exp = self.client.get_experiment_by_name(spec.tracking.experiment or spec.name)
            if exp is None:
                return
            workspace = str(spec.workspace_dir.resolve())
            for run in self.client.search_runs(
                [exp.experiment_id], "attributes.status = 'RUNNING'"
            ):
                if run.data.tags.get("workspace") != workspace:
                    continue
                children = self.client.search_runs(
                    [exp.experiment_id], f"tags.mlflow.parentRunId = '{run.info.run_id}'"
                )
                end = last_activity(self.client, run, children)
                for r in [*children, run]:
                    if r.info.status == "RUNNING":
                        self.client.set_terminated(r.info.run_id, "KILLED", end_time=end)
        except Exception as e:
            self.warn_server(f"could not mark the runs of a killed attempt KILLED ({reason(e)})")

    def _recorded(self, experiment: str, series: str | None) -> dict[str, int]:
        """metric -> the last step the earlier stage runs of `series` have in MLflow."""
        out: dict[str, int] = {}
        if series is None:
            return out
        try:
            exp = self.client.get_experiment_by_name(experiment)
            runs = (
                self.client.search_runs([exp.experiment_id], f"tags.series = '{series}'")
                if exp is not None
                else []
            )
            for run in runs:
                for key in run.data.metrics:
                    steps = [m.step for m in self.client.get_metric_history(run.info.run_id, key)]
                    out[key] = max([out.get(key, -1), *steps])
        except Exception as e:
            self.warn_server(
                f"could not read what an earlier attempt logged ({reason(e)}); "
                f"the steps since its checkpoint may appear twice"
            )
        return out

    def _create_run(
        self, tags: dict, parent: StageTracker | None = None, recorded: dict[str, int] | None = None
    ) -> StageTracker:
        key = uuid.uuid4().hex
        self.sender.submit(
            {
                "op": "create",
                "key": key,
                "experiment": experiment_name(self.spec),
                "artifact_location": artifact_location(self.spec, self.uri),
                "tags": mask(tags),  # argv: the command line may hold a secret URL
                "parent": parent.key if parent else None,
                "time": int(time.time() * 1000),
            }
        )
        return StageTracker(self.sender, key, recorded, settle=self._settle)

    def finish(self, status: str) -> None:
        if self.parent:
            self.parent.end(status)
            self._settle()
        self.sender.stop(self._request_timeout())

    @staticmethod
    def _request_timeout() -> float:
        return request_limit_s()

    def _settle(self) -> None:
        """Give the queued records `flush_s` seconds; write what is left to the backlog."""
        if self.sender.spilled_to is not None or self.sender.flush(self.flush_s):
            return
        if not self.sender.failing:  # a request still waiting: the sender has not said so
            self.warn(
                f"tracking {'store' if sqlite_path(self.uri) else 'server'} not "
                f"answering (nothing taken in {self.flush_s:g} s)"
            )
        backlog = backlog_path(self.spec)
        count = self.sender.spill(backlog, join_s=self._request_timeout() + 1)
        self.warn(
            f"{count} tracking records could not be sent to {mask(self.uri)}; they are in "
            f"{backlog}, and so will be the rest of this run's: "
            f"`{sync_command(self.spec)}` sends them when the server is back"
        )

    @contextmanager
    def stage(self, name: str, config: dict, series: str | None = None, resumed: bool = False):
        """The stage's run. `series` names the stage's output in the making: a run that
        resumes it (`resumed`) shares it with the attempts before (see
        StageTracker.recorded); a first attempt has none to ask the server about."""
        tags = {"mlflow.runName": name, "stage": name}
        if series is not None:
            tags["series"] = series
        recorded = (
            self._recorded(self.spec.tracking.experiment or self.spec.name, series)
            if resumed
            else {}
        )
        tracker = self._create_run(tags, parent=self.parent, recorded=recorded)
        tracker.log_params(config)
        try:
            yield tracker
        except BaseException as e:
            stopped = isinstance(e, (KeyboardInterrupt, Preempted, Interrupted))
            tracker.end("KILLED" if stopped else "FAILED")
            self._settle()
            raise
        tracker.end("FINISHED")
        self._settle()


def sync(spec, log=print) -> None:
    """Send the records of the workspace's backlog file to the tracking server."""
    from pipeline.workspace.lock import WorkspaceLock

    path = backlog_path(spec)
    with WorkspaceLock(spec.workspace_dir):  # a `run` may be appending to it
        if not path.exists():
            log(f"{path}: no tracking records waiting")
            return
        tracker = MlflowTracker(tracking_uri(spec))
        tracker.check(spec)
        with stop_words(replaying(spec)):
            sent, left = replay(path, Delivery(tracker.client), tracker.warn_server)
    if left:
        raise PipelineError(
            f"tracking server {mask(tracker.uri)} stopped answering: {sent} records "
            f"sent, {left} still in {path}; run `{sync_command(spec)}` again"
        )
    log(f"{sent} tracking records sent to {mask(tracker.uri)}")


def last_activity(client, run, children) -> int:
    """When a run that never ended (killed) last recorded anything, in ms: its stage runs'
    start and end times and the times of their last losses."""
    times = [run.info.start_time or 0]
    for child in children:
        times += [child.info.start_time or 0, child.info.end_time or 0]
        if "loss" in child.data.metrics:
            times += [m.timestamp for m in client.get_metric_history(child.info.run_id, "loss")]
    return max(times)


def _first_sentence(text: str) -> str:
    """MLflow's messages run to paragraphs: the first sentence, and the variable it names as
    the way out, if any."""
    first = " ".join(text.split()).split(". ")[0].rstrip(".")
    way_out = re.search(r"MLFLOW_[A-Z_]+=\w+", text)
    return first + (f" (its opt-out: {way_out.group()})" if way_out else "")


# The sweep's MLflow run id, in the environment of a point run as a process of its own
# (`sweep --parallel`): the point's pipeline run is created as its child.
SWEEP_RUN_ENV = "ALLATTN_SWEEP_RUN_ID"


def make_tracker(spec, rank: int = 0, sweep_run_id: str | None = None):
    """Rank 0's tracker (the others': `NullTracker`). `sweep_run_id` (else $ALLATTN_SWEEP_RUN_ID):
    the pipeline run is created as that sweep run's child, in the same create."""
    if not spec.tracking.enabled or rank != 0:
        return NullTracker()
    return MlflowTracker(
        tracking_uri(spec), sweep_run_id=sweep_run_id or os.environ.get(SWEEP_RUN_ENV) or None
    )
