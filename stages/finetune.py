"""finetune: the paper's LR-drop phase.

Continues from the train stage's final checkpoint with the optimizer state kept, the
learning rate divided by `finetune.lr_divisor`, for `finetune.steps` more updates. Train ends
at `train.steps` (as the published scripts do) or earlier when `finetune.patience`
validations pass without improvement (the paper's wording); either way step numbers continue
from train's, in the checkpoints and in MLflow.
"""

from __future__ import annotations

from pipeline.training.progress import training_result_lines
from stages.base import Stage, StageContext
from stages.training import (
    finish,
    preprocessed_data,
    preprocessed_timing_data,
    preprocessed_tokens,
    resolved_summary,
    start,
)


def plan(spec):
    """finetune.steps updates from train's newest intact checkpoint, its optimizer state
    kept, at train.optimizer.lr / finetune.lr_divisor throughout (checked after the first)."""
    from pipeline.training.optim import LrSchedule
    from pipeline.training.plan import Cadence, TrainingPlan

    ft, train = spec.finetune, spec.train
    return TrainingPlan(
        name="finetune",
        updates=ft.steps,
        lr=LrSchedule(train.optimizer.lr / ft.lr_divisor),
        cadence=Cadence.of(train),
        tokens=preprocessed_tokens(spec, ft.steps, "finetune.steps"),
        data=preprocessed_data(spec),
        timing_data=preprocessed_timing_data(spec),
        continues="train",
        check_lr=True,
    )


def run(ctx: StageContext) -> dict:
    started = start(ctx, plan(ctx.spec))
    trainer, ft, begin = started.trainer, ctx.spec.finetune, started.begin
    if started.resumed:  # an interrupted finetune resumes from its own checkpoint
        ctx.log(f"resuming the LR-drop phase at step {trainer.step}")
    lr = trainer.lr_at(begin + 1)
    ctx.log(
        f"from step {begin}: lr {ctx.spec.train.optimizer.lr:g} / {ft.lr_divisor:g} "
        f"= {lr:g} for {ft.steps} steps"
    )
    summary = finish(ctx, started)
    return summary | {"lr": lr, "from_step": begin} | resolved_summary(trainer)


STAGE = Stage(
    name="finetune",
    summary="The LR-drop phase: continue train's checkpoint at lr / lr_divisor.",
    inputs=("preprocess", "train"),
    section_key="finetune",
    # Every key changes the result (no runtime_only). The train.* and model.* settings it also
    # runs with reach its fingerprint through train's build id; train's RUNTIME_ONLY keys
    # (logging, validation, checkpoint cadence) are runtime-only here too.
    config=lambda spec: spec.finetune.model_dump(mode="json"),
    config_section="finetune",
    run=run,
    plan=plan,
    distributed=True,
    result_lines=training_result_lines,
)
