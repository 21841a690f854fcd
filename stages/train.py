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
from pipeline.training.checkpoints import CHECKPOINTS
from pipeline.training.progress import training_result_lines
from pipeline.training.settings import trains_with
from stages.base import Stage, StageContext


def patience(spec) -> int | None:
    return spec.finetune.patience if spec.finetune and "finetune" in spec.stages else None


def run(ctx: StageContext) -> dict:
    from pipeline.training.checkpoints import step_dirs
    from pipeline.training.micro_batch import read_record
    from pipeline.training.sources import PreprocessedData
    from pipeline.training.trainer import Trainer

    train = ctx.spec.train
    ckpt_root = ctx.out_dir / CHECKPOINTS
    resuming = bool(step_dirs(ckpt_root))
    trainer = Trainer(
        ctx.spec,
        PreprocessedData(ctx.inputs["preprocess"], train.seq_len),
        ctx.tracker,
        ctx.log,
        recorded=read_record(ctx.out_dir) if resuming else None,
    )
    record_resolved(ctx, trainer)
    if resuming:  # the newest intact one, or a refusal if none is
        ctx.log(f"resuming from step {trainer.load(ckpt_root)}")
    if trainer.rank == 0:
        atomic_write_json(ctx.out_dir / "deepspeed_config.json", trainer.ds_config)
        ctx.tracker.log_artifact(ctx.out_dir / "deepspeed_config.json")
        ctx.tracker.log_params(
            {
                "parameters": trainer.params,
                "vocab_size": trainer.vocab_size,
                "world_size": trainer.world_size,
            }
        )
    docs = trainer.documents
    batch = (
        f"{train.batch_size} documents of {docs['length']:,} tokens in segments of {train.seq_len}"
        if docs
        else f"{train.batch_size} x {train.seq_len} tokens"
    )
    ctx.log(
        f"{trainer.params:,} parameters, vocabulary {trainer.vocab_size}, "
        f"{train.steps} steps of {batch} "
        f"on {trainer.device} (world size {trainer.world_size}), "
        f"{trainer.model.describe()}"
    )
    summary = trainer.fit(train.steps, ckpt_root, patience=patience(ctx.spec))
    tag_weights(ctx, trainer, summary)
    log_head_tables(ctx, trainer, "train")
    return summary | resolved_summary(trainer)


def record_resolved(ctx: StageContext, trainer) -> None:
    """Write what the run trains with (trainer.resolved) into its output before the first
    step, and log it to the tracker as parameters; rank 0 only."""
    from pipeline.training.micro_batch import RECORD

    if trainer.rank != 0:
        return
    atomic_write_json(ctx.out_dir / RECORD, trainer.resolved)
    ctx.tracker.log_params(
        {f"resolved.{key}": value for key, value in resolved_summary(trainer).items()}
    )


def tag_weights(ctx: StageContext, trainer, summary: dict) -> None:
    """Tag the stage's MLflow run with the checkpoint it ended with, and the ids of its
    weights and of the checkpoint its validations marked best
    (pipeline.training.checkpoints.weights_id): what `compare` binds evaluate's scores to, by
    content. Rank 0 only."""
    from pathlib import Path

    from pipeline.training.checkpoints import BEST_WEIGHTS, WEIGHTS, read_pointer, weights_id

    if trainer.rank != 0:
        return
    final = Path(summary["checkpoint"])
    best = read_pointer(final.parent / "best")
    ids = {
        WEIGHTS: weights_id(final),
        BEST_WEIGHTS: weights_id(final.parent / best) if best else None,
    }
    ctx.tracker.set_tags(
        {"checkpoint": str(final)} | {key: value for key, value in ids.items() if value}
    )


def resolved_summary(trainer) -> dict:
    """For the stage's record (stage.json): the micro-batch and precision that ran."""
    r = trainer.resolved
    return {
        "micro_batch_size": r["micro_batch_size"],
        "gradient_accumulation_steps": trainer.accum,
        "precision": "bf16"
        if r["bf16"]
        else ("fp16" if trainer.ds_config["fp16"]["enabled"] else "float32"),
    }


def log_head_tables(ctx: StageContext, trainer, stage: str) -> None:
    """What the model reports per layer and head at the end of the stage (its learned spans:
    `spans.json`, `spans.png`) into out_dir, logged as artifacts; rank 0 only."""
    from pipeline.training.head_maps import save_head_tables

    if trainer.rank != 0:
        return
    for path in save_head_tables(
        trainer.model.head_tables(),
        ctx.out_dir,
        f"after step {trainer.step} ({ctx.spec.name}, {stage})",
    ):
        ctx.tracker.log_artifact(path)


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


# What does not change the trained weights. Everything else in `config` does, deliberately
# including train.device (cpu and cuda draw dropout from different generators) and
# train.deepspeed.activation_checkpointing (recomputation replays dropout: not proven exact).
RUNTIME_ONLY = {
    "train.launcher": "the global batch is fixed, so the process count does not change the "
    "numbers (a checkpoint still resumes only at the world size that wrote it)",
    "train.log_every": "logging reads the loss and changes no state",
    "train.eval_every": "validation runs in eval mode under no_grad with its own cache: no "
    "dropout, no RNG draw (with finetune.patience it is under validation.*)",
    "train.eval_batches": "as eval_every: it only sizes the validation estimate",
    "train.eval_batch_size": "as eval_batches",
    "train.eval_seq_len": "as eval_batches",
    "train.checkpoint_every": "saving reads the state; a resumed run is the uninterrupted run",
    "train.keep_checkpoints": "only which older checkpoints are deleted",
    "model.attention.impl": "every backend computes the reference op's maths (up to float "
    "rounding) or refuses the configuration; with attention dropout each "
    "draws its own masks from the same distribution, so the steps after "
    "the edit are the same training, not the same bits",
    "train.compile": "compiled layers compute the eager layers' maths (up to float rounding), "
    "their dropout drawn from torch's generator as in eager mode",
}


STAGE = Stage(
    name="train",
    summary="Train the model with DeepSpeed, checkpointing; resumes after an interruption.",
    inputs=("preprocess",),
    section_key="train",
    config=config,
    run=run,
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
