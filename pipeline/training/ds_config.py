"""The spec's `train` section rendered as DeepSpeed's JSON config."""

from __future__ import annotations

from pipeline.errors import PipelineError


def deepspeed_config(
    train, world_size: int, micro_batch_size: int | None = None, bf16: bool | None = None
) -> dict:
    """DeepSpeed's config for the spec's `train` section at `world_size` processes.

    `micro_batch_size` and `bf16` are what train.micro_batch_size and train.deepspeed.bf16
    resolved to for this run (pipeline.training.micro_batch.resolve: `auto` is settled on
    the device); unset, the spec's own values (the micro-batch from
    gradient_accumulation_steps)."""
    ds = train.deepspeed
    if micro_batch_size is None:
        if train.micro_batch_size not in (None, "auto"):
            micro_batch_size = train.micro_batch_size
        else:
            per_step = world_size * ds.gradient_accumulation_steps
            if train.batch_size % per_step:
                raise PipelineError(
                    f"train.batch_size {train.batch_size} is not divisible by "
                    f"world size {world_size} x gradient_accumulation_steps "
                    f"{ds.gradient_accumulation_steps}"
                )
            micro_batch_size = train.batch_size // per_step
    if train.batch_size % (world_size * micro_batch_size):
        raise PipelineError(
            f"train.batch_size {train.batch_size} is not divisible by world "
            f"size {world_size} x micro-batch {micro_batch_size}"
        )
    if bf16 is None:
        if ds.bf16 == "auto":
            raise PipelineError(
                "train.deepspeed.bf16 auto is resolved on the device "
                "(pipeline.training.micro_batch.resolve) before this"
            )
        bf16 = ds.bf16
    return {
        "train_batch_size": train.batch_size,
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": train.batch_size // (world_size * micro_batch_size),
        "zero_optimization": {"stage": ds.zero_stage},
        # bf16 has float32's range: no loss scale, nothing to overflow. DeepSpeed's ZeRO
        # optimizers still check every step's gradients for inf/NaN by default, two host
        # syncs and ~13 aten ops per parameter (bench/engine_overhead.py), to skip the step;
        # the float32 engine checks nothing, and neither does bf16 now
        "bf16": {"enabled": True, "check_grad_overflow": False} if bf16 else {"enabled": False},
        # dynamic loss scaling: fp16 gradients underflow without it
        "fp16": {"enabled": ds.fp16, "loss_scale": 0, "initial_scale_power": 16},
        "gradient_clipping": (
            train.optimizer.clip_norm if train.optimizer.clip == "global" else 0.0
        ),
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }
