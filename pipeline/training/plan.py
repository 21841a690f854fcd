"""How a training stage trains: its `TrainingPlan`, read off the spec alone.

A stage that trains declares `Stage.plan(spec)`. One body runs any plan
(stages/training.py), `show --estimate` counts its tokens and times its update by it
(pipeline/commands/estimate.py, update_timing.py), and the `Trainer` takes from it the
learning rate of every update, the hooks around the updates and the cadences of its reports,
validations and checkpoints. Nothing under pipeline/training asks which stage it runs: a
stage plugin that trains is run, resumed, estimated and timed as the built-in ones are.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from pipeline.training.optim import LrSchedule

if TYPE_CHECKING:
    from pipeline.training.training_data import TrainingData


class TrainingHook(Protocol):
    """What a stage adds to the loop without a loop of its own (the curriculum's lengths and
    promotions): called around every update, its state carried by every checkpoint.
    `trainer` is the pipeline.training.trainer.Trainer running it (not imported here: the
    trainer imports its plan)."""

    name: str  # its key in a checkpoint's trainer state

    def before_update(self, trainer: Any, update: int) -> None:
        """Before update number `update` (1-based) draws its batch."""

    def after_update(self, trainer: Any, losses: list, log: Callable[[str], None]):
        """After the update (trainer.step is its number; `losses`, its micro-batches'
        MicroBatchLoss),
        before the loop reports, validates or checkpoints it; `log` prints above the
        progress bar."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


@dataclass(frozen=True)
class Cadence:
    """How often the loop reports the loss, validates and checkpoints, in updates (0: never;
    the last update is checkpointed regardless), and how many checkpoints it keeps."""

    log_every: int
    eval_every: int
    checkpoint_every: int
    keep_checkpoints: int

    @classmethod
    def of(cls, train) -> Cadence:
        """The spec's train.* settings."""
        return cls(
            train.log_every, train.eval_every, train.checkpoint_every, train.keep_checkpoints
        )


@dataclass(frozen=True)
class Tokens:
    """What a stage feeds the model, for the estimate: `tokens` over `updates` updates, and
    `how` that was counted, in the spec's keys."""

    updates: int
    tokens: int
    how: str
    at_least: bool = False  # the rows grow as the stage runs (the curriculum's lengths)


def no_hooks(data: TrainingData) -> Sequence[TrainingHook]:
    return ()


@dataclass(frozen=True)
class TrainingPlan:
    """Everything a training stage decides about its training."""

    name: str  # the stage's: the loop's lines and errors name it
    updates: int  # how many updates the stage runs, from where it starts
    lr: LrSchedule  # the lr of update k, k the step number (continued across stages)
    cadence: Cadence
    tokens: Tokens
    # the data, from the output directories of the stage's inputs (by stage name)
    data: Callable[[Mapping[str, Path]], TrainingData]
    # data of the stage's shape for a vocabulary (its size, where it is from) before any
    # stage has run: what the estimate times an update on
    timing_data: Callable[[int, str], TrainingData]
    hooks: Callable[[TrainingData], Sequence[TrainingHook]] = no_hooks
    # the input stage whose newest intact checkpoint the stage continues (the LR drop:
    # train's), at that stage's micro-batch and precision; None: from the initial weights
    continues: str | None = None
    patience: int | None = None  # stop once validation has not improved in that many
    # after the stage's first update, fail unless the optimizer ran at lr(that update): the
    # LR-drop check that a continued optimizer state did not keep the old rate
    check_lr: bool = False
