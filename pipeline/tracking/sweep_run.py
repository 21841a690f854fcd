"""The MLflow run of a `sweep`: the parent of its points' pipeline runs.

A sweep's points are pipeline runs of their own (`tracker.MlflowTracker`); this run groups
them. It is found again by its `sweep.id` tag when the same sweep runs again, and a Slurm
array's tasks each open it. Like every tracking record, it never stops the sweep: a store
that refuses, or a server that does not answer a request in time (store.bound_requests), is
one warning, and the points' own runs are still recorded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline.redact import mask
from pipeline.tracking.sender import experiment_id, is_transient, reason
from pipeline.tracking.store import SERVER_HINT, check_server, open_store
from pipeline.tracking.tracker import artifact_location, experiment_name, tracking_uri


class SweepRun:
    """The sweep's MLflow run: found by its `sweep.id` tag or created; each point's
    pipeline runs are made its children (`mlflow.parentRunId`) as they appear."""

    def __init__(self, spec, ident: str, description: str, warn):
        self.warn = warn
        self.client: Any = None  # an MlflowClient; None: not recorded
        self.run_id: str | None = None
        if not spec.tracking.enabled:
            return
        try:
            uri = tracking_uri(spec)
            self.client = open_store(uri, warn, make_parent=True)
            # as `run` does: a server that does not answer is one line in seconds, not
            # minutes of MLflow's retries
            check_server(self.client, uri, SERVER_HINT)
            exp_id = experiment_id(self.client, experiment_name(spec), artifact_location(spec, uri))
            self.experiment_id = exp_id
            found = self.client.search_runs([exp_id], f"tags.`sweep.id` = '{ident}'")
            if found:
                self.run_id = found[0].info.run_id
                self.client.update_run(self.run_id, "RUNNING")
            else:
                run = self.client.create_run(
                    exp_id,
                    run_name=f"{spec.name}-sweep",
                    tags={"sweep.id": ident, "sweep.points": description},
                )
                self.run_id = run.info.run_id
        except Exception as e:  # tracking never stops the pipeline
            self._give_up(e)

    def _give_up(self, e: Exception) -> None:
        # once: a server that does not answer is not asked again (each request waits)
        why = mask(reason(e)) if is_transient(e) else f"{type(e).__name__}: {mask(str(e))}"
        self.warn(f"the sweep's MLflow run is not recorded ({why}); the points' own runs are")
        self.forget()

    def forget(self) -> None:
        """Record nothing more in the sweep's run (its server stopped answering)."""
        self.client = self.run_id = None

    def adopt(self, workspaces: list[Path]) -> None:
        """Make the pipeline runs of these workspaces children of the sweep's run."""
        if self.run_id is None:
            return
        try:
            for ws in workspaces:
                filt = f"tags.workspace = '{ws.resolve()}'"
                for run in self.client.search_runs([self.experiment_id], filt):
                    if run.data.tags.get("mlflow.parentRunId") != self.run_id:
                        self.client.set_tag(run.info.run_id, "mlflow.parentRunId", self.run_id)
        except Exception as e:
            self._give_up(e)

    def end(self, status: str) -> None:
        if self.run_id is not None:
            try:
                self.client.set_terminated(self.run_id, status)
            except Exception as e:
                self._give_up(e)
