"""Resuming a checkpoint on another number of processes (pipeline/reshard.py).

A 2-process run with the paper's optimizer (Adagrad, step clipped per tensor) and adaptive
span, preempted after step 4, resumes in 1 process; that run, preempted after step 8, resumes
in 2 processes again. The losses after each resume are those of the uninterrupted 2-process
run (to rtol 1e-5: the ranks' gradients are summed in another order).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from test_distributed import cli, metric_history, tiny_config

STEPS = 12
KEEP = ("--set", "train.keep_checkpoints=3")     # steps 4, 8 and 12 survive

pytestmark = pytest.mark.slow


def preempt_at(workspace: Path, step: int) -> None:
    """Turn the finished train stage in `workspace` into the one a preemption right after its
    checkpoint at `step` leaves behind: the partial directory, `latest` at that step."""
    done, partial = workspace / "train", workspace / "train.partial"
    fingerprint = json.loads((done / "stage.json").read_text())["fingerprint"]
    os.rename(done, partial)
    (partial / "stage.json").unlink()
    (partial / "partial.json").write_text(json.dumps({"fingerprint": fingerprint}))
    ckpts = partial / "checkpoints"
    tag = f"step-{step:08d}"
    for later in [p for p in ckpts.glob("step-*") if p.name > tag]:
        shutil.rmtree(later)
    (ckpts / "latest").write_text(tag + "\n")


def losses(root: Path, experiment: str) -> dict[int, float]:
    return metric_history(root, experiment, "train", "loss")


@pytest.mark.parametrize("zero", [2])
def test_two_processes_resume_in_one_and_back_with_the_uninterrupted_losses(tmp_path, zero):
    two = tiny_config(tmp_path, procs=2, zero=zero, steps=STEPS)
    one = tiny_config(tmp_path, procs=1, zero=zero, steps=STEPS)
    workspace, runs = tmp_path / "runs" / "dist", tmp_path / "runs"
    cli("run", two, *KEEP)
    uninterrupted = losses(runs, f"procs2-zero{zero}-span1")
    assert sorted(uninterrupted) == list(range(1, STEPS + 1))

    preempt_at(workspace, 4)
    out = cli("run", one, *KEEP).stdout
    assert "resuming from step 4" in out
    assert ("resuming a 2-process checkpoint on 1 process: optimizer partitions and caches "
            "redistributed; random streams are per process, so dropout differs from a run "
            "that stayed on 2") in out
    in_one = losses(runs, f"procs1-zero{zero}-span1")
    assert sorted(in_one) == list(range(5, STEPS + 1))
    for step in in_one:
        assert in_one[step] == pytest.approx(uninterrupted[step], rel=1e-5), step

    preempt_at(workspace, 8)         # a checkpoint the 1-process run wrote
    out = cli("run", two, *KEEP, "--set", "tracking.experiment=back-in-two").stdout
    assert "resuming a 1-process checkpoint on 2 processes" in out
    back = losses(runs, "back-in-two")
    assert sorted(back) == list(range(9, STEPS + 1))
    for step in back:
        assert back[step] == pytest.approx(uninterrupted[step], rel=1e-5), step
