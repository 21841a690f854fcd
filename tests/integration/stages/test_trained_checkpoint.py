"""The one rule for which checkpoint holds the trained model (stages.trained_checkpoint), as
its two users read it: evaluate's `evaluate.checkpoint` (checkpoint_source) and sample's and
export's `--checkpoint latest|best` (pipeline.commands.trained_weights.checkpoint_of). Checkpoints
here are bare step directories and pointers: the choice reads nothing else."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.commands.trained_weights import checkpoint_of
from pipeline.errors import PipelineError
from pipeline.spec import load_spec
from stages import STAGES, resolve_inputs
from stages.evaluate import checkpoint_source
from tests.fixtures.runs import five_stage_config


def workspace(tmp_path: Path, best: dict[str, str], finished=("train", "finetune")) -> Path:
    """train and finetune outputs with steps 2 and 4 (train) and 6 (finetune), the `best`
    pointers given (stage -> tag), and a record (stage.json) for the `finished` ones."""
    ws = tmp_path / "runs" / "pipe"
    for stage, steps in (("train", (2, 4)), ("finetune", (6,))):
        root = ws / stage / "checkpoints"
        for step in steps:
            (root / f"step-{step:08d}").mkdir(parents=True)
        if stage in best:
            (root / "best").write_text(best[stage] + "\n")
        if stage in finished:
            (ws / stage / "stage.json").write_text("{}")
    return ws


def spec_of(tmp_path: Path, which: str, *overrides: str):
    return load_spec(
        five_stage_config(tmp_path),
        [f"evaluate.checkpoint={which}", "train.eval_every=1", *overrides],
    )


def evaluate_reads(spec, ws: Path) -> tuple[str, str | None]:
    inputs = {i: ws / i for i in resolve_inputs(STAGES["evaluate"], spec.stages)}
    return checkpoint_source(spec, inputs)


def test_latest_is_finetunes_newest(tmp_path):
    spec = spec_of(tmp_path, "latest")
    ws = workspace(tmp_path, {"train": "step-00000002", "finetune": "step-00000006"})
    assert evaluate_reads(spec, ws) == ("finetune", None)
    assert checkpoint_of(spec, "latest", print) == (
        ws / "finetune" / "checkpoints",
        None,
        "finetune (latest)",
    )


def test_best_is_finetunes_pointer_first_then_trains(tmp_path):
    spec = spec_of(tmp_path, "best")
    ws = workspace(tmp_path, {"train": "step-00000002", "finetune": "step-00000006"})
    assert evaluate_reads(spec, ws) == ("finetune", "step-00000006")
    assert checkpoint_of(spec, "best", print) == (
        ws / "finetune" / "checkpoints",
        "step-00000006",
        "finetune/step-00000006 (best)",
    )
    # finetune never beat train's best validation: it marked none
    (ws / "finetune" / "checkpoints" / "best").unlink()
    assert evaluate_reads(spec, ws) == ("train", "step-00000002")
    assert checkpoint_of(spec, "best", print) == (
        ws / "train" / "checkpoints",
        "step-00000002",
        "train/step-00000002 (best)",
    )


def test_best_with_none_marked_is_one_line_for_each(tmp_path):
    spec = spec_of(tmp_path, "best")
    # a pointer to a checkpoint that is not there marks nothing
    ws = workspace(tmp_path, {"train": "step-00000009"})
    searched = f"{ws / 'finetune' / 'checkpoints'}, {ws / 'train' / 'checkpoints'}"
    with pytest.raises(PipelineError) as refused:
        evaluate_reads(spec, ws)
    assert str(refused.value) == (
        f"evaluate.checkpoint is best, but no checkpoint is marked best under {searched} "
        f"(it is set by train.eval_every's validations)"
    )
    with pytest.raises(PipelineError) as refused:
        checkpoint_of(spec, "best", print)
    assert str(refused.value) == (
        f"--checkpoint best: no checkpoint is marked best under {searched} "
        f"(train.eval_every's validations mark it)"
    )


def test_a_command_reads_train_where_finetune_has_not_finished_or_is_not_run(tmp_path):
    spec = spec_of(tmp_path, "latest")
    ws = workspace(tmp_path, {"train": "step-00000002"}, finished=("train",))
    assert checkpoint_of(spec, "latest", print)[2] == "train (latest)"
    assert checkpoint_of(spec, "best", print)[1:] == ("step-00000002", "train/step-00000002 (best)")
    without = spec_of(tmp_path, "latest", "stages=[download,preprocess,train,evaluate]")
    assert evaluate_reads(without, ws) == ("train", None)
