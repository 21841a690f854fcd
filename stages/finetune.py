"""finetune: the paper's LR-drop phase.

Continues from the train stage's final checkpoint with the optimizer state kept, the
learning rate divided by `finetune.lr_divisor`, for `finetune.steps` more updates. Train ends
at `train.steps` (as the published scripts do) or earlier when `finetune.patience`
validations pass without improvement (the paper's wording); either way step numbers continue
from train's, in the checkpoints and in MLflow.
"""

from __future__ import annotations

from pipeline.training.checkpoints import CHECKPOINTS
from pipeline.training.progress import training_result_lines
from stages.base import Stage, StageContext
from stages.train import log_head_tables, record_resolved, resolved_summary, tag_weights


def run(ctx: StageContext) -> dict:
    from pipeline.training.checkpoints import newest_intact, step_dirs, step_of
    from pipeline.training.micro_batch import read_record
    from pipeline.training.sources import PreprocessedData
    from pipeline.training.trainer import Trainer

    ft = ctx.spec.finetune
    ckpt_root = ctx.out_dir / CHECKPOINTS
    train_root = ctx.inputs["train"] / CHECKPOINTS
    # train's checkpoint continues at train's micro-batch and precision, never searched again
    recorded = (step_dirs(ckpt_root) and read_record(ctx.out_dir)) or read_record(
        ctx.inputs["train"]
    )
    trainer = Trainer(
        ctx.spec,
        PreprocessedData(ctx.inputs["preprocess"], ctx.spec.train.seq_len),
        ctx.tracker,
        ctx.log,
        recorded=recorded,
        stage="finetune",
    )
    record_resolved(ctx, trainer)
    if step_dirs(ckpt_root):  # an interrupted finetune resumes from its own
        ctx.log(f"resuming the LR-drop phase at step {trainer.load(ckpt_root)}")
        # where the first attempt began: train's newest intact checkpoint, as trainer.load
        # chose it (not `latest`, which may name a damaged one)
        newest = newest_intact(train_root, ctx.log)
        assert newest is not None  # train finished: it left an intact checkpoint
        begin = step_of(newest)
    else:
        begin = trainer.load(train_root)
    lr = trainer.lr_at(begin + 1)  # train.optimizer.lr / finetune.lr_divisor, constant
    ctx.log(
        f"from step {begin}: lr {ctx.spec.train.optimizer.lr:g} / {ft.lr_divisor:g} "
        f"= {lr:g} for {ft.steps} steps"
    )
    summary = trainer.fit(
        begin + ft.steps, ckpt_root, expect_lr=lr if trainer.step == begin else None
    )
    tag_weights(ctx, trainer, summary)
    log_head_tables(ctx, trainer, "finetune")
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
    distributed=True,
    result_lines=training_result_lines,
)
