"""A training run's checkpoints, written and restored through its DeepSpeed engine.

A checkpoint `step-N` (the directory's conventions: pipeline.training.checkpoint_dirs) holds
DeepSpeed's files and one `trainer-rank<r>.pt` per rank with what the training loop needs to
continue exactly: the step, the model's state for each of the rank's micro-batches, the validation
record, the rank's random state, the model's plan (shapes planned ahead) and the state of the
loop's hooks (the curriculum's lengths and history).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pipeline.cluster import distributed
from pipeline.errors import PipelineError, did_not_fit, write_cause
from pipeline.fsutil import atomic_write_text, refuse_link
from pipeline.models.protocol import State
from pipeline.training import reshard
from pipeline.training.checkpoint_dirs import (
    CHECKSUMS,
    checkpoint_bytes,
    disk_full,
    file_too_large,
    has_room,
    newest_intact,
    not_a_trainer_checkpoint,
    out_of_space,
    read_checkpoint_file,
    read_pointer,
    rng_state,
    set_rng_state,
    step_dirs,
    step_of,
    too_large,
    write_checksums,
)
from pipeline.training.engine import before_save_checkpoint, quiet_failed_save


@dataclass
class LoopState:
    """The training loop's part of a checkpoint, for one rank."""

    step: int
    states: list[State]
    """The model's state for each of this rank's micro-batches."""
    best_valid: float | None
    evals_since_best: int
    plan: dict | None = None
    """The model's plan_state() (pipeline.models.protocol): the shapes planned ahead, so that a
    resumed run plans as the uninterrupted one; None from a checkpoint written before plans
    (the model then plans from its current values at the first update)."""
    hooks: dict = field(default_factory=dict)
    """Each training hook's state_dict() by its name (pipeline.training.trainer.TrainingHook)."""


def trainer_file(ckpt: Path, rank: int) -> Path:
    return ckpt / f"trainer-rank{rank}.pt"


def read_trainer_file(path: Path) -> dict:
    """A `trainer-rank<r>.pt` as written by `CheckpointIO`. One written before models had a
    state of their own holds the same tensors (the all-attention model's cache) under
    "caches": they are returned under "states", so such a checkpoint still resumes."""
    saved = read_checkpoint_file(path)
    if "caches" in saved:
        saved["states"] = saved.pop("caches")
    return saved


def cannot_write(path: Path, failure: BaseException) -> PipelineError | None:
    """The one-line error for checkpoint `path` that could not be written because its
    directory refuses writes (turned read-only, no permission), with the real cause: torch's
    writer reports that only as "Parent directory ... does not exist". None when the directory
    takes writes and the failure was an OSError of another kind or no OSError at all (a
    bug, whose traceback is the message)."""
    import tempfile

    if write_cause(failure):  # full, or too large: not a directory's refusal
        assert isinstance(failure, OSError)
        return did_not_fit(failure, path)
    root = path.parent
    try:
        tempfile.TemporaryFile(dir=root).close()
        why = None
    except OSError as e:
        why = e.strerror or str(e)
    if why is None:
        if not isinstance(failure, OSError):
            return None
        why = failure.strerror or str(failure)
    return PipelineError(
        f"checkpoint {path}: cannot write it: {why} (in {root}); the "
        f"checkpoints already there are as they were: make {root} writable "
        f"and run again to resume from the newest one"
    )


class CheckpointIO:
    """Saves and loads the checkpoints of one training process (every rank holds one and
    calls it together with the others)."""

    def __init__(
        self, engine, rank: int, world_size: int, parameters: int, log: Callable[[str], None]
    ):
        self.engine, self.rank, self.world_size, self.log = engine, rank, world_size, log
        self.parameters = parameters
        # checkpoint directories this run wrote or verified: saving at their step writes none
        self.trusted: set[Path] = set()

    def save(self, root: Path, keep: int, loop: LoopState, best: bool = False) -> Path:
        """Write checkpoint `step-N` under `root` atomically (once per step), its checksums
        last, and point `latest` at it; `best=True` also points `best` at it. The newest
        `keep` checkpoints and the best one survive. A disk without room for it: a one-line
        PipelineError, and the checkpoints already there are left as they were."""
        tag = f"step-{loop.step:08d}"
        if root / tag not in self.trusted:
            self._write(root, tag, loop)
            self.trusted.add(root / tag)
        if self.rank == 0:
            try:
                atomic_write_text(root / "latest", tag + "\n")
                if best:
                    atomic_write_text(root / "best", tag + "\n")
            except OSError as e:
                raise cannot_write(root / "latest", e) or e from None
            best_tag = read_pointer(root / "best")
            # Newer ones are damaged leftovers of the run this one resumed: the run rewrites
            # them as it reaches their steps, and they never take an intact one's place.
            older = [p for p in step_dirs(root) if step_of(p.name) < loop.step]
            for path in [p for p in older[keep - 1 :] if p.name != best_tag] + list(
                root.glob("tmp-step-*")
            ):
                shutil.rmtree(path, ignore_errors=True)
        distributed.barrier()
        return root / tag

    def _write(self, root: Path, tag: str, loop: LoopState) -> None:
        """Every rank writes its files into `tmp-<tag>`; then rank 0 records their checksums
        and renames it to `tag` (replacing a damaged one left from before a resume)."""
        path, tmp = root / tag, root / f"tmp-{tag}"
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise cannot_write(path, e) or e from None
        previous = [p for p in step_dirs(root) if (p / CHECKSUMS).exists()]
        # the previous checkpoint's size, or fp32 weights plus Adam's two moments
        needed = checkpoint_bytes(previous[0]) if previous else 12 * self.parameters
        if not distributed.broadcast_object(has_room(root, needed) if self.rank == 0 else None):
            raise disk_full(path, needed)
        # DeepSpeed and torch.save write into `tmp` by name: never into a directory a link
        # planted there names
        refuse_link(tmp, "checkpoint directory", directory=True)
        failure = None
        try:
            before_save_checkpoint(self.engine)
            with quiet_failed_save():
                self.engine.save_checkpoint(str(root), tag=tmp.name, save_latest=False)
            torch.save(
                {
                    "step": loop.step,
                    "rng": rng_state(),
                    "states": [[t.cpu() for t in state] for state in loop.states],
                    "valid": {"best": loop.best_valid, "since_best": loop.evals_since_best},
                    "plan": loop.plan,
                    "hooks": loop.hooks,
                },
                trainer_file(tmp, self.rank),
            )
        except (OSError, RuntimeError) as e:
            failure = e
        self._settle(failure, tmp, needed)  # every rank's files are written past this
        failure = None
        if self.rank == 0:
            try:
                write_checksums(tmp)
                if path.is_dir():
                    shutil.rmtree(path)
                os.rename(tmp, path)
            except OSError as e:
                failure = e
        self._settle(failure, tmp, needed)

    def _settle(self, failure: BaseException | None, tmp: Path, needed: int) -> None:
        """Raise on every rank if writing failed on any. The half-written `tmp` goes first:
        on a full disk that frees the room MLflow's store needs to record the failure."""
        full = failure is not None and out_of_space(failure, tmp.parent, needed)
        large = failure is not None and not full and too_large(failure, tmp)
        if not distributed.any_rank(failure is not None):
            return
        full = distributed.any_rank(full)
        large = distributed.any_rank(large)
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        if full:
            raise disk_full(tmp.parent / tmp.name.removeprefix("tmp-"), needed) from None
        if large:
            raise file_too_large(tmp.parent / tmp.name.removeprefix("tmp-")) from None
        if failure is not None:
            refused = cannot_write(tmp.parent / tmp.name.removeprefix("tmp-"), failure)
            if refused is None:
                raise failure
            raise refused from None
        raise PipelineError(f"writing checkpoint {tmp} failed on another rank")

    def load(self, root: Path, accum: int, device: torch.device) -> LoopState:
        """Restore the newest intact checkpoint under `root` (chosen on rank 0, so every rank
        loads the same one) into the engine and this process's random state; returns the
        loop's part, its states on `device`, cut for `accum` micro-batches per rank."""
        choice = None
        if self.rank == 0:
            try:
                tag = newest_intact(root, self.log)
                choice = (tag, None) if tag else (None, f"no checkpoint under {root}")
            except PipelineError as e:
                choice = (None, str(e))
        tag, refusal = distributed.broadcast_object(choice)
        if refusal:
            raise PipelineError(refusal)
        ckpt = root / tag
        writers = len(list(ckpt.glob("trainer-rank*.pt")))
        if writers == 0:
            raise PipelineError(not_a_trainer_checkpoint(ckpt))
        reshard.load_engine(self.engine, root, tag, writers)
        if writers != self.world_size:
            self.log(reshard.message(writers, self.world_size))
            saved = reshard.trainer_state(
                [read_trainer_file(trainer_file(ckpt, r)) for r in range(writers)],
                self.rank,
                self.world_size,
                accum,
                ckpt,
            )
        else:
            saved = read_trainer_file(trainer_file(ckpt, self.rank))
        if saved["rng"] is not None:
            set_rng_state(saved["rng"])
        self.trusted.add(ckpt)
        return LoopState(
            step=saved["step"],
            states=[[t.to(device) for t in state] for state in saved["states"]],
            best_valid=saved["valid"]["best"],
            evals_since_best=saved["valid"]["since_best"],
            plan=saved.get("plan"),
            hooks=saved.get("hooks", {}),
        )
