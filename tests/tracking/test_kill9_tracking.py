"""Metrics and checkpoints agree after kill -9: a tiny training with tracking on, killed at
random moments (most right after a checkpoint is published, while its metrics may still be
queued) and resumed after each, leaves in MLflow every step's training loss exactly once,
with the values of an uninterrupted run, and every killed attempt marked KILLED.
quality/kill9_tracking.py runs the same with 20 kills and prints the figure."""

from __future__ import annotations

import os
import random
import signal
import time
from collections import Counter
from pathlib import Path

import pytest

from tests.cluster.test_distributed import ADAM, cli, tiny_config

STEPS = 40
EXPERIMENT = "procs1-zero0-span1"


def config(tmp: Path) -> Path:
    tmp.mkdir(parents=True, exist_ok=True)
    return tiny_config(tmp, procs=1, zero=0, optimizer=ADAM, steps=STEPS)  # a checkpoint every 4


def loss_records(root: Path) -> tuple[list[tuple[int, float]], list[str]]:
    """Every (step, loss) over all train runs of the experiment, and the runs' statuses,
    oldest first."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")
    exp = client.get_experiment_by_name(EXPERIMENT)
    runs = client.search_runs(
        [exp.experiment_id], "tags.stage = 'train'", order_by=["attributes.start_time ASC"]
    )
    return (
        [
            (m.step, m.value)
            for run in runs
            for m in client.get_metric_history(run.info.run_id, "loss")
        ],
        [run.info.status for run in runs],
    )


def kill_and_resume(tmp: Path, kills: int, seed: int) -> dict:
    """Run, kill -9 at `kills` random moments (resuming after each), finish; compare the
    losses in MLflow with those of an uninterrupted run. Returns the figure."""
    rng = random.Random(seed)
    whole = config(tmp / "whole")
    cli("run", whole)
    reference = dict(loss_records(tmp / "whole" / "runs")[0])
    cfg = config(tmp / "killed")
    latest = tmp / "killed" / "runs" / "dist" / "train.partial" / "checkpoints" / "latest"
    done = 0
    while done < kills:
        before = latest.read_text() if latest.exists() else None
        proc = cli("run", cfg, start_new_session=True)
        # the next checkpoint published, then a random moment within a few steps of it
        while proc.poll() is None and (not latest.exists() or latest.read_text() == before):
            time.sleep(0.002)
        time.sleep(rng.uniform(0, 0.15))
        if proc.poll() is not None:
            break  # finished before the kill: enough steps?
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
        done += 1
    cli("run", cfg)
    records, statuses = loss_records(tmp / "killed" / "runs")
    counts = Counter(step for step, _ in records)
    return {
        "kills": done,
        "steps": STEPS,
        "lost": sum(1 for s in range(1, STEPS + 1) if s not in counts),
        "doubled": sum(1 for c in counts.values() if c > 1),
        "wrong": sum(1 for s, v in records if v != reference.get(s)),
        "killed_runs": statuses[:-1].count("KILLED"),
        "runs": len(statuses),
        "last": statuses[-1],
    }


@pytest.mark.slow
def test_kill_9_after_checkpoints_loses_and_doubles_no_logged_step(tmp_path):
    figure = kill_and_resume(tmp_path, kills=4, seed=20)
    assert figure == {
        "kills": 4,
        "steps": STEPS,
        "lost": 0,
        "doubled": 0,
        "wrong": 0,
        "killed_runs": 4,
        "runs": 5,
        "last": "FINISHED",
    }
