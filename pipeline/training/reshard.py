"""Resuming a checkpoint on a different number of processes than the one that wrote it.

The global batch is fixed and the data position follows from the step, so only two parts of a
checkpoint depend on the world size that wrote it:

- ZeRO 1/2 optimizer partitions. Each param group is one flat buffer (its parameters back to
  back, the same at any world size) padded at the end and cut into one equal slice per rank;
  rank r saved its slice of the fp32 master and of every optimizer state tensor, the last
  rank's end padding removed from the master. Concatenated in rank order they are the whole
  buffer again, and each new rank cuts its own slice out of it. (ZeRO 0 keeps the whole
  optimizer in the model-states file that every world size reads.)
- The model's states (pipeline.models.protocol: tensors with the batch first, the
  Transformer-XL cache for instance). Rank r owns rows r*B .. r*B+B-1 of the global batch
  (B = micro-batch x accumulation steps) and its micro-batch i rows i*mb .. (i+1)*mb-1 of
  those; concatenated in that order they are the global batch's state, cut again for the
  new layout.

Random streams are per process and have no counterpart at another world size: new rank r
continues old rank r's stream where there was one, so dropout differs from the run that
would have continued on the old world size.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from pipeline.errors import PipelineError
from pipeline.training.checkpoints import read_checkpoint_file


def message(writers: int, world_size: int) -> str:
    """The one line logged when a checkpoint is resharded."""
    return (
        f"resuming a {writers}-process checkpoint on {_processes(world_size)}: optimizer "
        f"partitions and caches redistributed; random streams are per process, so dropout "
        f"differs from a run that stayed on {_processes(writers)}"
    )


def _processes(n: int) -> str:
    return f"{n} process{'es' if n > 1 else ''}"


def load_engine(engine, root: Path, tag: str, writers: int) -> None:
    """`engine.load_checkpoint` of checkpoint `tag` under `root`, written by `writers`
    processes; where that is not this engine's world size, this rank's ZeRO 1/2 optimizer
    partitions are cut out of the writers' ones."""
    from pipeline.training.optim import before_load_checkpoint

    ckpt = root / tag
    partitioned = writers != torch.distributed.get_world_size() and optimizer_partitioned(
        engine, ckpt
    )
    before_load_checkpoint(engine)
    # DeepSpeed refuses ZeRO optimizer files of another world size: load the module weights
    # (every world size reads the same file), then the partitions here
    path, _ = engine.load_checkpoint(
        str(root), tag=tag, load_optimizer_states=not partitioned, load_lr_scheduler_states=False
    )
    if path is None:
        raise PipelineError(f"DeepSpeed could not load checkpoint {ckpt}")
    if partitioned:
        load_zero_partitions(engine, ckpt, writers)


def optimizer_partitioned(engine, ckpt: Path) -> bool:
    """True if the checkpoint's optimizer state is split over its writers' files (ZeRO 1/2),
    False if it is whole in the model-states file (ZeRO 0); refuses what cannot be resharded."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    if not engine.zero_optimization():
        return False
    wrapper = engine.optimizer
    if engine.zero_optimization_stage() >= 3:
        # each parameter is sharded separately and the module weights exist only as shards
        raise PipelineError(
            f"checkpoint {ckpt}: resuming a ZeRO 3 checkpoint on another "
            f"number of processes is not supported; resume with the "
            f"train.launcher it was written with"
        )
    if type(wrapper) is not DeepSpeedZeroOptimizer or wrapper.cpu_offload:
        raise PipelineError(
            f"checkpoint {ckpt}: resuming on another number of processes "
            f"supports ZeRO 1/2 without offload (DeepSpeed's "
            f"{type(wrapper).__name__} here); resume with the train.launcher "
            f"it was written with"
        )
    if wrapper.round_robin_gradients:
        raise PipelineError(
            "zero_optimization.round_robin_gradients orders the flat buffer by "
            "world size: the checkpoint cannot be resharded"
        )
    return True


def load_zero_partitions(engine, ckpt: Path, writers: int) -> None:
    """Fill this rank's ZeRO 1/2 fp32 masters and optimizer state from the `writers` ranks'
    `zero_pp_rank_*` files of checkpoint directory `ckpt`. Call after the engine has loaded
    the checkpoint's module weights (`load_optimizer_states=False`)."""
    from deepspeed.checkpoint.constants import (
        BASE_OPTIMIZER_STATE,
        GROUP_PADDINGS,
        OPTIMIZER_STATE_DICT,
        PARAM_ALIGNMENT_PADDINGS,
        SINGLE_PARTITION_OF_FP32_GROUPS,
    )

    wrapper = engine.optimizer
    prefix = "bf16_" if engine.bfloat16_enabled() else ""  # DeepSpeed's naming
    files = [ckpt / f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(writers)]
    missing = [f.name for f in files if not f.exists()]
    if missing:
        raise PipelineError(
            f"checkpoint {ckpt} lacks {', '.join(missing)}: it was not written "
            f"by {writers} ZeRO 1/2 processes and cannot be resharded"
        )
    # memory-mapped: a rank reads only the slices its own partition needs
    old = [read_checkpoint_file(f, mmap=True)[OPTIMIZER_STATE_DICT] for f in files]
    if old[0].get(PARAM_ALIGNMENT_PADDINGS) != wrapper.round_robin_bit16_padding:
        raise PipelineError(
            f"checkpoint {ckpt} lays out the parameters with other alignment "
            f"padding than this run: it cannot be resharded"
        )
    wrapper._load_global_state(old[0])  # loss scale, overflow flag, clipping: rank-independent
    base = old[0][BASE_OPTIMIZER_STATE]
    state: dict[Any, Any] = {}
    for i, master in enumerate(wrapper.single_partition_of_fp32_groups):
        rank = torch.distributed.get_rank(group=wrapper.real_dp_process_group[i])
        start = rank * master.numel()  # the flat buffer is cut into equal slices
        masters = [sd[SINGLE_PARTITION_OF_FP32_GROUPS][i] for sd in old]
        held = sum(m.numel() for m in masters)
        expected = sum(p.numel() for p in wrapper.bit16_groups[i]) + sum(
            wrapper.round_robin_bit16_padding[i]
        )
        if held != expected:
            raise PipelineError(
                f"checkpoint {ckpt}: param group {i} holds {held} elements over "
                f"{writers} ranks, this model {expected}: not the same model"
            )
        with torch.no_grad():
            master.copy_(_slice(masters, start, master.numel()))
        # optimizer state tensors cover a rank's slice with its padding; others (`step`) are
        # the same on every rank
        padded = masters[0].numel() + old[0][GROUP_PADDINGS][i]
        state[i] = {}
        for key, value in base["state"].get(i, {}).items():
            if torch.is_tensor(value) and value.shape == (padded,):
                pieces = [
                    sd[BASE_OPTIMIZER_STATE]["state"][i][key][: m.numel()]
                    for sd, m in zip(old, masters, strict=False)
                ]
                value = _slice(pieces, start, master.numel())
            state[i][key] = value.clone() if torch.is_tensor(value) else value  # off the mmap
    wrapper.optimizer.load_state_dict({"state": state, "param_groups": base["param_groups"]})
    wrapper._link_all_hp_params()  # DeepSpeed's per-parameter views into the new state


def _slice(pieces: list[torch.Tensor], start: int, length: int) -> torch.Tensor:
    """Elements start .. start+length-1 of the concatenated `pieces`, zero past their end
    (the end padding of the flat buffer). Only the overlapping parts of pieces are read."""
    out = torch.zeros(length, dtype=pieces[0].dtype)
    offset = 0
    for piece in pieces:
        piece = piece.reshape(-1)
        lo, hi = max(start, offset), min(start + length, offset + piece.numel())
        if lo < hi:
            out[lo - start : hi - start] = piece[lo - offset : hi - offset]
        offset += piece.numel()
    return out


def trainer_state(old: list[dict], rank: int, world_size: int, accum: int, ckpt: Path) -> dict:
    """This rank's trainer state at `world_size` processes of `accum` micro-batches, from the
    old ranks' ones (`old[r]`: rank r's `trainer-rank<r>.pt`, read by
    pipeline.training.checkpoint_io.read_trainer_file) of checkpoint `ckpt`: the same step and
    validation record and span plan, the model states cut for the new rows, and old rank
    `rank`'s random state (None for a rank that did not exist)."""
    # per state tensor: the global batch's rows in order
    rows = [
        torch.cat([state[i] for saved in old for state in saved["states"]])
        for i in range(len(old[0]["states"][0]))
    ]
    batch = rows[0].shape[0] if rows else 0
    if batch % (world_size * accum):
        raise PipelineError(
            f"checkpoint {ckpt}: its {batch} saved batch rows do not split "
            f"over {world_size} processes x {accum} micro-batches"
        )
    micro = batch // (world_size * accum)
    first = rank * accum * micro
    states = [[t[first + i * micro : first + (i + 1) * micro] for t in rows] for i in range(accum)]
    return {
        "step": old[0]["step"],
        "valid": old[0]["valid"],
        "states": states,
        "rng": old[rank]["rng"] if rank < len(old) else None,
        # the span plan follows the model's parameters, the same on every rank
        "plan": old[0].get("plan"),
    }
