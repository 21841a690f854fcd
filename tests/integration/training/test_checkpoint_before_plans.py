"""A checkpoint written before the training plans (issue 53) resumes with today's code to
the weights of an uninterrupted run, bit for bit: the loop's state a checkpoint carries did
not change with the plans (tests/fixtures/train_checkpoint_before_plans/README.md says how it was
made). Two train stages of 4 steps on the tiny corpus, in this process: about 10 s."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from pipeline.spec import load_spec
from pipeline.training.checkpoint_dirs import read_checkpoint_file
from stages import STAGES, StageContext
from stages.base import NullStageTracker
from tests.fixtures.tiny_corpus import tiny_corpus

KEPT = Path(__file__).resolve().parents[2] / "fixtures" / "train_checkpoint_before_plans"
EDITS = [
    "train.steps=4",
    "train.checkpoint_every=2",
    "train.keep_checkpoints=2",
    "train.log_every=1",
]
MODEL = "mp_rank_00_model_states.pt"


def train(spec, pre: Path, out: Path) -> list[str]:
    lines: list[str] = []
    ctx = StageContext(spec, out, {"preprocess": pre}, NullStageTracker(), lines.append)
    STAGES["train"].run(ctx)
    return lines


def test_a_checkpoint_from_before_the_plans_resumes_to_the_uninterrupted_weights(tmp_path):
    cfg, pre = tiny_corpus(tmp_path)
    spec = load_spec(cfg, EDITS)
    uninterrupted = train(spec, pre, tmp_path / "whole")

    resumed_out = tmp_path / "resumed"
    shutil.copytree(KEPT, resumed_out, ignore=shutil.ignore_patterns("*.md", "*.py"))
    resumed = train(spec, pre, resumed_out)

    assert "resuming from step 2" in resumed
    # steps 3 and 4 report the same losses, and the runs end with the same weights
    steps = [line for line in uninterrupted if line.startswith(("step      3/4", "step      4/4"))]
    assert len(steps) == 2
    assert [line.split("lr")[0] for line in steps] == [
        line.split("lr")[0]
        for line in resumed
        if line.startswith(("step      3/4", "step      4/4"))
    ]
    final = "checkpoints/step-00000004/" + MODEL
    whole = read_checkpoint_file(tmp_path / "whole" / final)["module"]
    again = read_checkpoint_file(resumed_out / final)["module"]
    assert whole.keys() == again.keys()
    for name in whole:
        assert torch.equal(whole[name], again[name]), name
