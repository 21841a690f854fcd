"""train: the model on the train split through a DeepSpeed engine.

Outputs: `checkpoints/` (DeepSpeed checkpoints `step-N`, `latest`, and `best` by validation)
and `deepspeed_config.json`. An interrupted run, re-run with the same config, resumes from the
newest intact checkpoint in its partial directory. With `finetune.patience`, training stops
early once validation has stalled, and the finetune stage takes over from there.
"""

from __future__ import annotations

from pipeline.fsutil import atomic_write_json
from stages import Stage, StageContext


def patience(spec) -> int | None:
    return spec.finetune.patience if spec.finetune and "finetune" in spec.stages else None


def run(ctx: StageContext) -> dict:
    from pipeline.optim import warmup_lr
    from pipeline.checkpoints import step_dirs
    from pipeline.trainer import Trainer

    train = ctx.spec.train
    trainer = Trainer(ctx.spec, ctx.inputs["preprocess"], ctx.tracker, ctx.log)
    ckpt_root = ctx.out_dir / "checkpoints"
    if step_dirs(ckpt_root):          # the newest intact one, or a refusal if none is
        ctx.log(f"resuming from step {trainer.load(ckpt_root)}")
    if trainer.rank == 0:
        atomic_write_json(ctx.out_dir / "deepspeed_config.json", trainer.ds_config)
        ctx.tracker.log_artifact(ctx.out_dir / "deepspeed_config.json")
        ctx.tracker.log_params({"parameters": trainer.params, "vocab_size": trainer.vocab_size,
                                "world_size": trainer.world_size})
    ctx.log(f"{trainer.params:,} parameters, vocabulary {trainer.vocab_size}, "
            f"{train.steps} steps of {train.batch_size} x {train.seq_len} tokens "
            f"on {trainer.device} (world size {trainer.world_size}), "
            f"{trainer.model.attention_impl_description()}")
    opt = train.optimizer
    summary = trainer.fit(train.steps, lambda k: warmup_lr(opt.lr, opt.warmup_steps, k),
                          ckpt_root, patience=patience(ctx.spec))
    ctx.tracker.set_tags({"checkpoint": summary["checkpoint"]})
    return summary


def config(spec) -> dict:
    # The launcher is left out: the numbers do not depend on how many processes compute them
    # (the global batch is fixed), so a finished stage stays valid under another launcher.
    return {"model": spec.resolved()["model"],
            "train": spec.train.model_dump(mode="json", exclude={"launcher"}),
            "patience": patience(spec)}


STAGE = Stage(
    name="train",
    summary="Train the model with DeepSpeed, checkpointing; resumes after an interruption.",
    inputs=("preprocess",),
    section_key="train",
    config=config,
    run=run,
    distributed=True,
)
