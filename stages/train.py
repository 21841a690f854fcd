"""train: the model on the train split through a DeepSpeed engine.

Outputs: `checkpoints/` (DeepSpeed checkpoints `step-N`, `latest`, and `best` by validation),
`deepspeed_config.json`, and `resolved.json`: the micro-batch and precision the run trains
with (train.micro_batch_size and train.deepspeed.bf16 `auto` settled on the device at the
start; a resume and the finetune stage read them back, pipeline.training.micro_batch). An
interrupted run resumes from the newest intact checkpoint in
its partial directory when re-run with the same settings (`RUNTIME_ONLY` ones may differ).
With `finetune.patience`, training stops early once validation has stalled, and the finetune
stage takes over from there.
"""

from __future__ import annotations

from pipeline.fsutil import atomic_write_json
from pipeline.training.progress import training_result_lines
from pipeline.training.settings import trains_with
from stages.base import Stage, StageContext
from stages.training import (
    TRAINER_RUNTIME_ONLY,
    finish,
    log_params,
    preprocessed_data,
    preprocessed_timing_data,
    preprocessed_tokens,
    resolved_summary,
    start,
)


def patience(spec) -> int | None:
    return spec.finetune.patience if spec.finetune and "finetune" in spec.stages else None


def plan(spec):
    """train.optimizer's schedule over train.steps updates on the preprocessed data, at
    train.*'s cadences; with finetune.patience, an early stop the finetune stage takes over
    from."""
    from pipeline.training.optim import LrSchedule
    from pipeline.training.plan import Cadence, TrainingPlan

    train = spec.train
    return TrainingPlan(
        name="train",
        updates=train.steps,
        lr=LrSchedule.of(train.optimizer, train.steps),
        cadence=Cadence.of(train),
        tokens=preprocessed_tokens(spec, train.steps, "train.steps"),
        data=preprocessed_data(spec),
        timing_data=preprocessed_timing_data(spec),
        patience=patience(spec),
    )


def run(ctx: StageContext) -> dict:
    started = start(ctx, plan(ctx.spec))
    trainer, train = started.trainer, ctx.spec.train
    if started.resumed:
        ctx.log(f"resuming from step {trainer.step}")
    if trainer.rank == 0:
        atomic_write_json(ctx.out_dir / "deepspeed_config.json", trainer.ds_config)
        ctx.tracker.log_artifact(ctx.out_dir / "deepspeed_config.json")
    log_params(ctx, trainer, {"world_size": trainer.world_size})
    docs = trainer.data.documents
    batch = (
        f"{train.batch_size} documents of {docs['length']:,} tokens in segments of {train.seq_len}"
        if docs
        else f"{train.batch_size} x {train.seq_len} tokens"
    )
    ctx.log(
        f"{trainer.params:,} parameters, vocabulary {trainer.vocab_size}, "
        f"{train.steps} steps of {batch} on {trainer.device} (world size "
        f"{trainer.world_size}), {trainer.model.describe()}"
    )
    return finish(ctx, started) | resolved_summary(trainer)


# train's validation settings: runtime-only, unless finetune.patience stops training on them
VALIDATION = ("eval_every", "eval_batches", "eval_batch_size", "eval_seq_len")


def config(spec) -> dict:
    """What the trainer trains with (pipeline.training.settings.trains_with: every train.*
    key, less RUNTIME_ONLY's), and what decides when it stops."""
    out = trains_with(spec) | {"finetune": {"patience": patience(spec)}}
    if patience(spec) is not None:
        # the validations decide when train stops: here their settings change the result
        out["validation"] = {key: getattr(spec.train, key) for key in VALIDATION}
    return out


RUNTIME_ONLY = TRAINER_RUNTIME_ONLY


STAGE = Stage(
    name="train",
    summary="Train the model with DeepSpeed, checkpointing; resumes after an interruption.",
    inputs=("preprocess",),
    section_key="train",
    config=config,
    run=run,
    plan=plan,
    distributed=True,
    runtime_only=RUNTIME_ONLY,
    # nonfinite stop: a run it lets finish is the run before the key existed
    added_keys={
        "train.optimizer.schedule": "linear_warmup",
        "train.micro_batch_size": None,
        "train.nonfinite": "stop",
        "train.nonfinite_limit": 100,
    },
    result_lines=training_result_lines,
)
