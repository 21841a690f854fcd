"""The spec's `train` section rendered as DeepSpeed's JSON config."""

from __future__ import annotations

from pipeline.errors import PipelineError


def deepspeed_config(train, world_size: int) -> dict:
    """DeepSpeed's config for the spec's `train` section at `world_size` processes."""
    ds = train.deepspeed
    per_step = world_size * ds.gradient_accumulation_steps
    if train.batch_size % per_step:
        raise PipelineError(f"train.batch_size {train.batch_size} is not divisible by "
                            f"world size {world_size} x gradient_accumulation_steps "
                            f"{ds.gradient_accumulation_steps}")
    return {
        "train_batch_size": train.batch_size,
        "train_micro_batch_size_per_gpu": train.batch_size // per_step,
        "gradient_accumulation_steps": ds.gradient_accumulation_steps,
        "zero_optimization": {"stage": ds.zero_stage},
        "bf16": {"enabled": ds.bf16},
        # dynamic loss scaling: fp16 gradients underflow without it
        "fp16": {"enabled": ds.fp16, "loss_scale": 0, "initial_scale_power": 16},
        "gradient_clipping": (train.optimizer.clip_norm
                              if train.optimizer.clip == "global" else 0.0),
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }
