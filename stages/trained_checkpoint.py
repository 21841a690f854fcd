"""Which checkpoint holds a pipeline's trained model: the one rule by which evaluate picks what
it scores (`evaluate.checkpoint`) and `sample` and `export` what they load (`--checkpoint
latest|best`). Not a stage kind: no entry point names this module.

The stages whose checkpoints hold the model, and which is read first, come from the stage
graph: evaluate's inputs besides its data, "the last of train/finetune that the pipeline
runs", then train (stages.base.resolve_inputs).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from pipeline.training.checkpoint_dirs import CHECKPOINTS, read_pointer
from stages.base import resolve_inputs


def trained_stages(order: list[str]) -> list[str]:
    """The stages of the pipeline `order` whose checkpoints hold its trained model, the one
    `latest` reads first: the last of them to run (finetune continues train's weights), then
    the ones `best` looks in next (finetune starts from train's best validation and marks its
    own best only where one beats it)."""
    from stages import STAGES

    evaluate = STAGES["evaluate"]
    # evaluate's first input is the data it scores; the others are the checkpoints' stages
    weights = replace(evaluate, inputs=evaluate.inputs[1:])
    return resolve_inputs(weights, [*(s for s in order if s != evaluate.name), evaluate.name])


def trained_checkpoint(which: str, outputs: dict[str, Path]) -> tuple[str, Path, str | None] | None:
    """(the stage, its checkpoints folder, the tag: None for the newest intact checkpoint)
    that `which` (latest or best) names among `outputs`, the output folders of the trained
    stages to choose from, in trained_stages' order: latest is the first one's newest, best
    the first checkpoint that one of them marks best. None when `which` is best and none is
    marked: the caller says so in its own words."""
    if which == "latest":
        stage = next(iter(outputs))
        return stage, outputs[stage] / CHECKPOINTS, None
    for stage, folder in outputs.items():
        if tag := read_pointer(folder / CHECKPOINTS / "best"):
            return stage, folder / CHECKPOINTS, tag
    return None
