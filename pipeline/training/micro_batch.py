"""What `train.micro_batch_size` and `train.deepspeed.bf16` resolve to on the device at hand,
once per run, and the record that makes a resume (and finetune) use the same values.

`train.micro_batch_size: auto` is Composer's auto micro-batching (its
`device_train_microbatch_size: auto`) done once, at the start: try the per-rank batch,
then ever smaller divisors of it, each with one forward and backward, and keep the largest
that does not raise CUDA's out-of-memory error (caught inside the process; the cache is
emptied and the gradients dropped between tries). The global batch (train.batch_size) is
unchanged: the rest is gradient accumulation. Without a CUDA device there is no out-of-memory
signal to search on, so `auto` is the whole per-rank batch.

`train.deepspeed.bf16: auto` is bf16 on a CUDA device that supports it, else float32.

What was resolved is written to the stage's output directory (`RECORD`) before the first
step. A resume reads it back instead of resolving again: a run never changes its micro-batch
or its precision half way (its checkpoints' model states are cut per micro-batch, and
DeepSpeed's bf16 optimizer saves another layout than the fp32 one), whatever device it
resumes on. finetune continues train's checkpoint, so it reads train's record.
"""

from __future__ import annotations

import copy
import gc
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from pipeline.errors import PipelineError
from pipeline.fsutil import read_json
from pipeline.models.capabilities import bounded_parameters
from pipeline.training.tasks import Task, objective

RECORD = "resolved.json"
"""In the train (and finetune) stage's output: {"micro_batch_size", "bf16", "device"}."""


def divisors_largest_first(n: int) -> list[int]:
    """The sizes a micro-batch of a per-rank batch of `n` rows can have."""
    return [d for d in range(n, 0, -1) if n % d == 0]


def largest_that_fits(
    candidates: Iterable[int],
    try_step: Callable[[int], None],
    log: Callable[[str], None] = lambda line: None,
    reset: Callable[[], None] | None = None,
) -> int:
    """The first of `candidates` (largest first) at which `try_step(size)` (one forward and
    backward) does not raise torch.cuda.OutOfMemoryError. Between tries the gradients are
    dropped (`reset`) and CUDA's cache emptied; any other error propagates. None fitting is a
    PipelineError."""
    tried = []
    for size in candidates:
        try:
            try_step(size)
            return size
        except torch.cuda.OutOfMemoryError:
            tried.append(size)
            log(f"micro-batch {size}: out of memory, trying a smaller one")
        finally:
            if reset is not None:
                reset()
            gc.collect()  # the failed try's activations, held by the traceback's frames
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    raise PipelineError(
        f"no micro-batch fits on this device: out of memory at "
        f"{', '.join(map(str, tried)) or 'every size'} row(s); use a smaller "
        f"model or train.seq_len, or more processes"
    )


def can_search(device: torch.device) -> bool:
    """Whether running out of memory on `device` raises an error the search can catch."""
    return device.type == "cuda"


def resolve_bf16(setting: bool | str, device: torch.device) -> bool:
    """train.deepspeed.bf16 (true, false or auto) on `device`."""
    if setting != "auto":
        return bool(setting)
    return device.type == "cuda" and torch.cuda.is_bf16_supported()


def per_rank_batch(train, world_size: int) -> int:
    return train.batch_size // world_size


def fixed_micro_batch(train, world_size: int) -> int | None:
    """The micro-batch the spec sets outright (an int, or per-rank batch / gradient
    accumulation steps when train.micro_batch_size is unset); None for auto."""
    if train.micro_batch_size == "auto":
        return None
    rows = per_rank_batch(train, world_size)
    if train.micro_batch_size is None:
        return rows // train.deepspeed.gradient_accumulation_steps
    if rows % train.micro_batch_size:
        raise PipelineError(
            f"train.micro_batch_size {train.micro_batch_size} does not divide "
            f"the {rows} rows each of {world_size} process(es) trains on "
            f"(train.batch_size {train.batch_size})"
        )
    return train.micro_batch_size


def read_record(directory: Path | None) -> dict | None:
    """The record in a stage's output `directory`, or None where there is none."""
    if directory is None or not (directory / RECORD).exists():
        return None
    try:
        return read_json(directory / RECORD)
    except (OSError, ValueError) as e:
        raise PipelineError(
            f"{directory / RECORD}: unreadable ({e}); it holds the "
            f"micro-batch and precision the run started with"
        ) from None


def probe(
    model, vocab_size: int, seq_len: int, device: torch.device, bf16: bool, task: Task
) -> tuple[Callable[[int], None], Callable[[], None]]:
    """`try_step(size)`: one forward and backward of a copy of `model` on `device` in the
    training precision, on `size` random rows, its bounded parameters (the adaptive spans)
    at their upper bounds and the fullest state a micro-batch of the run's `task` starts
    from: the most memory a step of the run can take. The model itself, its weights and
    every random generator are left as they were. And the `reset` that drops the copy's
    gradients."""
    trial = copy.deepcopy(model).to(device)
    if bf16:
        trial = trial.to(torch.bfloat16)
    with torch.no_grad():
        for p, _, hi in bounded_parameters(trial):
            p.fill_(hi)
    trial.train()

    def try_step(size: int) -> None:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            out = task.trial_forward(trial, vocab_size, size, seq_len, device)
            _, loss = objective(out.nll, out.aux)
            loss.backward()
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # an asynchronous failure surfaces here

    def reset() -> None:
        trial.zero_grad(set_to_none=True)

    return try_step, reset


def resolve(
    spec,
    model,
    vocab_size: int,
    task: Task,
    device: torch.device,
    world_size: int,
    recorded: dict | None,
    log: Callable[[str], None],
) -> dict:
    """{"micro_batch_size", "bf16", "device"} for this run: `recorded` (a resume's, or
    train's for finetune) where there is one, else resolved here. Every rank gets rank 0's
    precision and the smallest micro-batch any rank fits."""
    from pipeline.cluster import distributed

    train = spec.train
    ds = train.deepspeed
    if recorded is not None:
        out = {
            "micro_batch_size": recorded["micro_batch_size"],
            "bf16": recorded["bf16"],
            "device": recorded.get("device", device.type),
        }
        fixed = fixed_micro_batch(train, world_size)
        rows = per_rank_batch(train, world_size)
        if fixed is None and rows % out["micro_batch_size"]:
            # a resume on another number of processes (train.launcher is runtime-only)
            raise PipelineError(
                f"train.micro_batch_size auto: this run started at "
                f"micro-batch {out['micro_batch_size']}, which does not divide "
                f"the {rows} rows per process at world size {world_size}; "
                f"resume on fewer processes, or start over"
            )
        if isinstance(train.micro_batch_size, int) and fixed != out["micro_batch_size"]:
            raise PipelineError(
                f"train.micro_batch_size: this run's checkpoints were written "
                f"at micro-batch {out['micro_batch_size']} and the spec now "
                f"gives {fixed}; set it back, or start over"
            )
        if fixed is not None:
            # unset, it is the per-rank batch over the accumulation steps: a resume on
            # another number of processes takes the new one (the states are resharded)
            out["micro_batch_size"] = fixed
        if ds.bf16 != "auto" and bool(ds.bf16) != out["bf16"]:
            raise PipelineError(
                f"train.deepspeed.bf16: this run's checkpoints were written "
                f"with bf16 {str(out['bf16']).lower()}; set it back, or "
                f"start over"
            )
        now = resolve_bf16(ds.bf16, device)
        if now != out["bf16"]:
            log(
                f"train.deepspeed.bf16 auto: keeping {'bf16' if out['bf16'] else 'float32'}, "
                f"which this run started with on {out['device']} ({device.type} would "
                f"pick {'bf16' if now else 'float32'})"
            )
        return out
    bf16 = distributed.broadcast_object(resolve_bf16(ds.bf16, device))
    size = fixed_micro_batch(train, world_size)
    if size is None:
        rows = per_rank_batch(train, world_size)
        if not can_search(device):
            size = rows
            log(
                f"train.micro_batch_size auto: {rows}, the whole per-rank batch (no "
                f"out-of-memory signal on {device.type} to search on)"
            )
        else:
            try_step, reset = probe(model, vocab_size, train.seq_len, device, bf16, task)
            size = largest_that_fits(divisors_largest_first(rows), try_step, log, reset)
            del try_step, reset
            gc.collect()
            torch.cuda.empty_cache()
            size = int(distributed.min_over_ranks(size))
            log(
                f"train.micro_batch_size auto: {size} of {rows} rows per process fit "
                f"({rows // size} accumulation step(s) per update)"
            )
    return {"micro_batch_size": size, "bf16": bf16, "device": device.type}
