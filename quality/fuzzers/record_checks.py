"""What the tracking store holds, read straight from the server's sqlite file (MLflow's own
tables: runs, tags, metrics, model_versions), and the checks on it that the stateful and
signal fuzzers share: no run created twice, no metric logged twice at a step, and every run
a command started (or a backlog held) there once its workspace has nothing left to send.

A run's identity across a backlog's replay is its start time (the `create` record carries
it) with its name and stage: two runs alike in all three are one run created twice.
"""

from __future__ import annotations

import json
import sqlite3
from collections import Counter
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Invocation:
    """A `run` that started tracking: its workspace, its window (ms since the epoch), the
    stages that finished and the one cut short (by a signal or a refusal)."""

    step: int
    workspace: str
    start_ms: int
    end_ms: int
    finished: list[str]
    cut: str | None
    signalled: bool


def invocation(
    step: int, workspace: Path, window: tuple[float, float], stdout: str, signalled: bool
) -> Invocation | None:
    """The run a command's output says it tracked (a stage `running:`), or None."""
    started = [
        line.split("]")[0][1:]
        for line in stdout.splitlines()
        if line.startswith("[") and "] running: " in line
    ]
    if not started:
        return None
    finished = [
        line.split("]")[0][1:]
        for line in stdout.splitlines()
        if line.startswith("[") and "] done in " in line
    ]
    cut = next((s for s in started if s not in finished), None)
    return Invocation(
        step,
        str(workspace.resolve()),
        int(window[0] * 1000) - 5,
        int(window[1] * 1000) + 5,
        finished,
        cut,
        signalled,
    )


def backlog_creates(workspace: Path) -> list[tuple[int, str, str | None]]:
    """(start time, name, stage) of every run a workspace's backlog will create."""
    path = workspace / "tracking-backlog.jsonl"
    found = []
    if path.is_file():
        for line in path.read_text(errors="replace").splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and record.get("op") == "create":
                tags = record.get("tags") or {}
                found.append((record["time"], tags.get("mlflow.runName"), tags.get("stage")))
    return found


@dataclass
class Store:
    """One read of the store in `db`."""

    db: Path
    runs: dict[str, dict] = field(default_factory=dict)  # run id -> status, start, tags

    def __post_init__(self):
        with closing(self._connect()) as conn:
            for run_id, status, start, end in conn.execute(
                "SELECT run_uuid, status, start_time, end_time FROM runs "
                "WHERE lifecycle_stage = 'active'"
            ):
                self.runs[run_id] = {"status": status, "start": start, "end": end, "tags": {}}
            for key, value, run_id in conn.execute("SELECT key, value, run_uuid FROM tags"):
                if run_id in self.runs:
                    self.runs[run_id]["tags"][key] = value
            self.metric_repeats = conn.execute(
                "SELECT run_uuid, key, step, COUNT(*) FROM metrics GROUP BY run_uuid, key, step "
                "HAVING COUNT(*) > 1"
            ).fetchall()
            self.series_repeats = conn.execute(
                "SELECT t.value, m.key, m.step, COUNT(DISTINCT m.run_uuid) FROM metrics m "
                "JOIN tags t ON t.run_uuid = m.run_uuid AND t.key = 'series' "
                "GROUP BY t.value, m.key, m.step HAVING COUNT(DISTINCT m.run_uuid) > 1"
            ).fetchall()

    def _connect(self) -> sqlite3.Connection:
        return sqlite3.connect(f"file:{self.db}?mode=ro", uri=True, timeout=60)

    def identity(self, run_id: str) -> tuple[int, str | None, str | None]:
        run = self.runs[run_id]
        return run["start"], run["tags"].get("mlflow.runName"), run["tags"].get("stage")

    def name(self, run_id: str) -> str:
        return self.runs.get(run_id, {}).get("tags", {}).get("mlflow.runName", run_id)

    def duplicates(self) -> list[str]:
        """Runs created twice, metrics logged twice at one step (in a run, or in two
        attempts of one stage's output)."""
        counts = Counter(self.identity(r) for r in self.runs)
        found = [
            f"duplicated: run {name}{f' ({stage})' if stage else ''} started at {start} is "
            f"in the store {n} times"
            for (start, name, stage), n in counts.items()
            if n > 1
        ]
        by_run = Counter(run for run, _key, _step, _n in self.metric_repeats)
        found += [
            f"duplicated: {n} metric values of run {self.name(run)} logged more than once at "
            f"one step"
            for run, n in by_run.items()
        ]
        by_series = Counter(series for series, _key, _step, _n in self.series_repeats)
        found += [
            f"duplicated: {n} metric values logged at the same step by two attempts of one "
            f"stage output (series {series})"
            for series, n in by_series.items()
        ]
        return found

    def lost(self, inv: Invocation) -> list[str]:
        """What of `inv`'s runs the store lacks (or holds twice), once nothing of its
        workspace waits in a backlog."""
        parents = [
            r
            for r, run in self.runs.items()
            if run["tags"].get("workspace") == inv.workspace
            and "spec" in run["tags"]
            and inv.start_ms <= run["start"] <= inv.end_ms
        ]
        if len(parents) != 1:
            return [
                f"lost: the pipeline run of step {inv.step} is in the store {len(parents)} times"
            ]
        children = Counter(
            run["tags"].get("stage")
            for run in self.runs.values()
            if run["tags"].get("mlflow.parentRunId") == parents[0]
        )
        found = [
            f"lost: the {stage} run of step {inv.step} is in the store {children[stage]} times"
            for stage in inv.finished
            if children[stage] != 1
        ]
        if inv.cut is not None and (
            children[inv.cut] > 1 or (children[inv.cut] == 0 and not inv.signalled)
        ):
            found.append(
                f"lost: the {inv.cut} run of step {inv.step} is in the store "
                f"{children[inv.cut]} times"
            )
        return found

    def missing_creates(self, creates: list[tuple[int, str, str | None]]) -> list[str]:
        """The runs a backlog held that the store lacks (twice: `duplicates`)."""
        counts = Counter(self.identity(r) for r in self.runs)
        return [
            f"lost: run {name}{f' ({stage})' if stage else ''} started at {start}, from a "
            f"backlog, is not in the store"
            for start, name, stage in creates
            if counts[(start, name, stage)] == 0
        ]

    def running(self, workspace: Path, since_ms: int) -> list[str]:
        """Runs of `workspace` started since `since_ms` that MLflow still has as running."""
        ws = str(workspace.resolve())
        parents = {
            r
            for r, run in self.runs.items()
            if run["tags"].get("workspace") == ws and run["start"] >= since_ms
        }
        return [
            f"half-written: run {run['tags'].get('mlflow.runName')} left RUNNING"
            for r, run in self.runs.items()
            if run["status"] == "RUNNING"
            and (r in parents or run["tags"].get("mlflow.parentRunId") in parents)
        ]

    def versions(self, since_ms: int) -> list[dict]:
        """Model versions registered since `since_ms`: name, version, source, run, tags,
        description, the export run's metrics."""
        out = []
        with closing(self._connect()) as conn:
            rows = conn.execute(
                "SELECT name, version, source, run_id, description FROM model_versions "
                "WHERE creation_time >= ?",
                (since_ms,),
            ).fetchall()
            for name, version, source, run_id, description in rows:
                tags = dict(
                    conn.execute(
                        "SELECT key, value FROM model_version_tags WHERE name = ? AND version = ?",
                        (name, version),
                    ).fetchall()
                )
                metrics = dict(
                    conn.execute(
                        "SELECT key, value FROM latest_metrics WHERE run_uuid = ?", (run_id,)
                    ).fetchall()
                )
                out.append(
                    {
                        "name": name,
                        "version": version,
                        "source": source,
                        "run_id": run_id,
                        "tags": tags,
                        "description": description,
                        "run_metrics": metrics,
                    }
                )
        return out
