"""Metrics and checkpoints agree after kill -9: a tiny training with tracking on, killed at
random moments (most right after a checkpoint is published, while its metrics may still be
queued) and resumed after each, leaves in MLflow every step's training loss exactly once,
with the values of an uninterrupted run, and every killed attempt marked KILLED.
`python -m quality.kill9_tracking` runs the same with 20 kills and prints the figure."""

from __future__ import annotations

from quality.kill9_tracking import kill_and_resume

STEPS = 40


def test_kill_9_after_checkpoints_loses_and_doubles_no_logged_step(tmp_path):
    figure = kill_and_resume(tmp_path, kills=4, seed=20, steps=STEPS)
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
