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

import torch

from pipeline.errors import PipelineError
from pipeline.training.checkpoint_dirs import read_checkpoint_file


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
    from pipeline.training.engine import (
        before_load_checkpoint,
        load_zero_partitions,
        optimizer_partitioned,
        zero_partition_files,
    )

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
        files = zero_partition_files(engine, ckpt, writers)
        # memory-mapped: a rank reads only the slices its own partition needs
        load_zero_partitions(engine, [read_checkpoint_file(f, mmap=True) for f in files], ckpt)


def trainer_state(old: list[dict], rank: int, world_size: int, accum: int, ckpt: Path) -> dict:
    """This rank's trainer state at `world_size` processes of `accum` micro-batches, from the
    old ranks' ones (`old[r]`: rank r's `trainer-rank<r>.pt`, read by
    pipeline.training.engine_checkpoints.read_trainer_file) of checkpoint `ckpt`: the same step and
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
