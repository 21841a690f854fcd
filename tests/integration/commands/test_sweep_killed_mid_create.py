"""A sweep killed with kill -9 while MLflow creates a point's pipeline run: that run is the
sweep run's child all the same (issue 44 item 2).

test_sweep.py's kill -9 case once left a pipeline run without `mlflow.parentRunId`. The cause:
a point's pipeline run was made the sweep's child only afterwards, by `SweepRun.adopt`, which
finds it by its `workspace` tag; MLflow's file store writes a create's tags one file each, and
`workspace` came after `spec` (and the environment's tags). A kill between those two files
left a pipeline run that no later sweep could find. Here the kill lands at exactly that moment
(tests/fixtures/workers/sweep_worker.py, $SWEEP_KILL_AFTER_TAG), not by chance."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures.runs import five_stage_config

ROOT = Path(__file__).resolve().parents[3]
WORKER = ROOT / "tests" / "fixtures" / "workers" / "sweep_worker.py"
NAMES = ["pipe-lr0.001-seed1", "pipe-lr0.002-seed1"]


@pytest.fixture
def cfg(tmp_path):
    return five_stage_config(tmp_path, steps=2, tracking=True)


def sweep(cfg, tmp_path, **env) -> subprocess.CompletedProcess:
    """`allattn-pipe sweep` of two points with stand-in stages, in a process of its own."""
    return subprocess.run(
        [sys.executable, str(WORKER), "sweep", str(cfg), "--grid",
         "train.optimizer.lr=0.001,0.002", "--seeds", "1"],
        env={
            **os.environ,
            "MLFLOW_ALLOW_FILE_STORE": "true",
            "DS_ACCELERATOR": "cpu",
            "SWEEP_CALLS": str(tmp_path / "calls.jsonl"),
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
            **env,
        },
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def test_a_kill_9_while_a_points_pipeline_run_is_created_leaves_it_under_the_sweep(
    cfg, tmp_path, monkeypatch
):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    # the first pipeline run with a `spec` tag builds what both points share; the second is
    # the first point's own: the sweep dies right after the store wrote that run's `spec`
    killed = sweep(cfg, tmp_path, SWEEP_KILL_AFTER_TAG="spec:2")
    assert killed.returncode == -9, killed.stdout + killed.stderr

    done = sweep(cfg, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 of 2 points done" in done.stdout

    from mlflow.tracking import MlflowClient

    client = MlflowClient((tmp_path / "store").as_uri())
    exp = client.get_experiment_by_name("pipe")
    sweeps = client.search_runs([exp.experiment_id], "tags.`sweep.id` != ''")
    assert len(sweeps) == 1
    pipelines = [r for r in client.search_runs([exp.experiment_id]) if "spec" in r.data.tags]
    # the run the kill cut short is there, its later tags never written
    cut = [r for r in pipelines if "stages.skipped" not in r.data.tags]
    assert len(cut) == 1, [r.data.tags for r in pipelines]
    assert {r.info.run_id: r.data.tags.get("mlflow.parentRunId") for r in pipelines} == {
        r.info.run_id: sweeps[0].info.run_id for r in pipelines
    }
    # and the runs of the workspace it belongs to are filed as the sweep's
    assert cut[0].data.tags["workspace"] == str((tmp_path / "runs" / NAMES[0]).resolve())
