"""Resuming a checkpoint on another number of processes (pipeline/training/reshard.py).

On DeepSpeed engines (tests/fixtures/workers/reshard_worker.py): checkpoints of ZeRO 0, 1 and 2
(fp32 and bf16)
written by 1 process resume in 2 and the other way round, continuing as the run that wrote
them would have; ZeRO 3 is refused with a message.

Model states: each old rank's rows of the model's state (the Transformer-XL cache) land on the
new rank and micro-batch that own those global batch rows, from files written before models had
a state of their own too; the span plan (and its overflow count) goes to every new rank.

Through the pipeline: a 2-process ZeRO-2 run with the paper's optimizer (Adagrad, step clipped
per tensor) and adaptive span, preempted after step 4, resumes in 1 process with the losses of
the uninterrupted 2-process run (to rtol 1e-5: the ranks' gradients are summed in another
order).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pipeline.cluster.distributed import free_port
from pipeline.training.engine_checkpoints import read_trainer_file
from pipeline.training.reshard import trainer_state
from quality.tiny_training import cli, tiny_config
from tests.fixtures.runs import ROOT, metric_history

STEPS = 8  # checkpoints at steps 4 and 8 (tiny_config)
STEPS_TOY, SAVE = 4, 2  # tests/fixtures/workers/reshard_worker.py's


# an adaptive-span model's plan_state(): the L' in force, requested values not yet read, and
# the overflows counted so far (a metric of the run)
PLAN = {"planned": [40, 64], "pending": [[0.3, 0.5]], "overflows": 3}


def write_trainer_states(ckpt: Path, writers: int, accum: int, batch: int, key: str) -> None:
    """trainer-rank<r>.pt files whose model states (two tensors) hold their global row index,
    under `key`: "states", or "caches" as written before models had a state of their own."""
    micro = batch // (writers * accum)
    for r in range(writers):
        states = []
        for i in range(accum):
            rows = r * accum * micro + i * micro + torch.arange(micro, dtype=torch.float32)
            states.append(
                [rows.view(micro, 1, 1).expand(micro, length, 3).clone() for length in (2, 5)]
            )
        torch.save(
            {
                "step": 7,
                "valid": {"best": 1.5, "since_best": 1},
                "rng": f"rank {r}",
                "plan": PLAN,
                key: states,
            },
            ckpt / f"trainer-rank{r}.pt",
        )


@pytest.mark.parametrize("key", ["states", "caches"])
@pytest.mark.parametrize("writers, world_size", [(2, 1), (1, 2), (4, 2)])
def test_cache_rows_go_to_the_rank_and_micro_batch_that_own_them(
    tmp_path, writers, world_size, key
):
    accum, batch = 2, 8
    write_trainer_states(tmp_path, writers, accum, batch, key)
    old = [read_trainer_file(tmp_path / f"trainer-rank{r}.pt") for r in range(writers)]
    micro = batch // (world_size * accum)
    for rank in range(world_size):
        state = trainer_state(old, rank, world_size, accum, tmp_path)
        assert state["step"] == 7 and state["valid"] == {"best": 1.5, "since_best": 1}
        assert state["rng"] == (f"rank {rank}" if rank < writers else None)
        assert state["plan"] == PLAN
        assert len(state["states"]) == accum
        for i, cache in enumerate(state["states"]):
            first = rank * accum * micro + i * micro
            assert [tuple(t.shape) for t in cache] == [(micro, 2, 3), (micro, 5, 3)]
            for t in cache:
                assert t[:, 0, 0].tolist() == list(range(first, first + micro))
                assert (t == t[:, :1, :1]).all()


def launch(world: int, out: Path, ckpts: Path, *phases: str) -> dict:
    """tests/fixtures/workers/reshard_worker.py in `world` CPU processes; rank 0's results."""
    env = os.environ | {
        "WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "DS_ACCELERATOR": "cpu",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(ROOT / "tests" / "fixtures" / "workers" / "reshard_worker.py"),
                str(out),
                str(ckpts),
                *phases,
            ],
            env=env | {"RANK": str(r), "LOCAL_RANK": str(r)},
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]
    logs = [p.communicate(timeout=600)[0] for p in procs]
    for p, log in zip(procs, logs, strict=False):
        assert p.returncode == 0, log[-5000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """{"in 1": ..., "in 2": ...}: every configuration run fresh in that many processes and
    resumed there from the other world size's checkpoint."""
    tmp = tmp_path_factory.mktemp("reshard")
    one = launch(1, tmp / "one.json", tmp / "ckpts", "fresh")
    two = launch(2, tmp / "two.json", tmp / "ckpts", "fresh", "resume")
    back = launch(1, tmp / "back.json", tmp / "ckpts", "resume")
    return {"in 1": {name: one[name] | back[name] for name in one}, "in 2": two}


@pytest.mark.parametrize("world", ["in 1", "in 2"])
@pytest.mark.parametrize("config", ["zero0", "zero1", "zero2", "zero0_bf16", "zero2_bf16"])
def test_a_checkpoint_of_another_world_size_continues_its_run(resumed, world, config):
    """The fp32 masters after each resumed step equal those of the uninterrupted run in the
    writers' world size (rtol 1e-5, atol 1e-7: the ranks' gradients are averaged in
    another order)."""
    other = {"in 1": "in 2", "in 2": "in 1"}[world]
    uninterrupted = resumed[other][config]["fresh"][SAVE:]
    got = resumed[world][config]["resume"]
    assert len(got) == len(uninterrupted) == STEPS_TOY - SAVE
    for step, (want, have) in enumerate(zip(uninterrupted, got, strict=False), SAVE + 1):
        for name in want:
            assert have[name] == pytest.approx(want[name], rel=1e-5, abs=1e-7), (step, name)


@pytest.mark.parametrize("world", ["in 1", "in 2"])
def test_zero_3_is_refused_on_another_world_size(resumed, world):
    refusal = resumed[world]["zero3"]
    assert "resume" not in refusal
    assert refusal["refused"].endswith(
        ": resuming a ZeRO 3 checkpoint on another number of "
        "processes is not supported; resume with the "
        "train.launcher it was written with"
    )


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


def test_two_processes_resume_in_one_with_the_uninterrupted_losses(tmp_path):
    zero = 2
    two = tiny_config(tmp_path, procs=2, zero=zero, steps=STEPS)
    one = tiny_config(tmp_path, procs=1, zero=zero, steps=STEPS)
    workspace, runs = tmp_path / "runs" / "dist", tmp_path / "runs"
    cli("run", two)
    uninterrupted = losses(runs, f"procs2-zero{zero}-span1")
    assert sorted(uninterrupted) == list(range(1, STEPS + 1))

    preempt_at(workspace, 4)
    out = cli("run", one).stdout
    assert "resuming from step 4" in out
    assert (
        "resuming a 2-process checkpoint on 1 process: optimizer partitions and caches "
        "redistributed; random streams are per process, so dropout differs from a run "
        "that stayed on 2 processes\n"
    ) in out
    in_one = losses(runs, f"procs1-zero{zero}-span1")
    assert sorted(in_one) == list(range(5, STEPS + 1))
    for step in in_one:
        assert in_one[step] == pytest.approx(uninterrupted[step], rel=1e-5), step
