"""The active-memory paper's length curriculum (docs/papers.md#active-memory-tasks), as the
trainer's data and one of its hooks: the lengths, the promotions and the history are the
curriculum's; the updates, the learning rate, the checkpoints and the stop on a signal are
the trainer's (pipeline.training.trainer).

An epoch is `steps_per_epoch` updates, each on a fresh batch of `train.batch_size`
generated cases at the current length; after its last update, `check_cases` fresh cases are
scored without dropout, and at `promote_accuracy` token accuracy (the paper: 100%) the
length grows by `length_step`. Each epoch's batches and dropout are drawn from streams
seeded by (seed, epoch), as the uninterrupted run draws them; a checkpoint inside an epoch
carries the batch stream's position (the dropout stream is the trainer's random state).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import torch

from pipeline.data.algorithmic import generate, length_step, vocab_size
from pipeline.errors import PipelineError
from pipeline.training.tasks import Task, TokenStreams


def stream_seed(seed: int, purpose: str, epoch: int) -> int:
    """A seed for one epoch's draws of one kind (train batches, the check, dropout):
    independent streams that a resumed run re-creates from the epoch number alone."""
    digest = hashlib.sha256(f"{seed}:{purpose}:{epoch}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def best_length(history: list[dict]) -> int:
    """The curriculum's score: the longest length solved, 0 if none was."""
    return max((h["length"] for h in history if h["solved"]), default=0)


def score(
    model,
    problem: str,
    length: int,
    cases: int,
    generator: torch.Generator,
    vocab: int | None,
    device,
    batch: int | None = None,
) -> tuple[int, int, int]:
    """(correct tokens, tokens, fully correct cases) of `cases` fresh cases at `length`,
    scored in eval mode (no dropout), `batch` cases at a time (default: all at once)."""
    was_training = model.training
    model.eval()
    correct = total = exact = 0
    with torch.no_grad():
        for start in range(0, cases, batch or cases):
            rows = min(batch or cases, cases - start)
            x, y = generate(problem, length, rows, generator, vocab)
            y = y.to(device)
            hit = model(x.to(device)).logits.argmax(-1) == y
            correct += int(hit.sum())
            total += y.numel()
            exact += int(hit.all(dim=1).sum())
    model.train(was_training)
    return correct, total, exact


class LengthCurriculum:
    """The trainer's data (TrainingData: generated cases at the current length) and its
    hook (TrainingHook: the check, the promotion and the history after each epoch)."""

    documents = None  # cases, not documents of a manifest

    def __init__(self, spec, name: str):
        self.name = name  # its key in a checkpoint's trainer state: the stage's
        task = spec.dataset.generator.algorithmic
        self.problem, self.task_vocab, self.cur = task.problem, task.vocab, task.curriculum
        self.data_seed, self.dropout_seed = spec.dataset.generator.seed, spec.train.seed
        self.batch_size = spec.train.batch_size
        self.step_by = length_step(task.problem, self.cur.length_step)
        self.vocab_size = vocab_size(task.problem, task.vocab)
        self.origin = f"dataset {spec.dataset.name}"
        # what a checkpoint carries (state_dict)
        self.epoch = 0  # epochs done
        self.length = self.cur.start_length  # the length being trained
        self.history: list[dict] = []
        self.stream: torch.Generator | None = None  # the epoch's batches, from its first update
        self.loss_sum: torch.Tensor | None = None  # the epoch's objective, on the device
        self.applied = 0  # the epoch's updates not skipped (train.nonfinite: skip)

    @property
    def updates(self) -> int:
        return self.cur.epochs * self.cur.steps_per_epoch

    # ---------------------------------------------------------------- as TrainingData

    @property
    def block_len(self) -> int:
        return self.length

    def train_batches(self, rows: int, rank: int, world_size: int, seed: int):
        if world_size != 1 or rows != self.batch_size:
            raise PipelineError(
                f"the curriculum trains in one process on whole batches of "
                f"{self.batch_size} cases (found {world_size} process(es), micro-batches of "
                f"{rows} rows)"
            )
        return self

    def starts_epoch(self, step: int) -> bool:
        return False  # the model carries no state from one batch to the next

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.stream is not None  # drawn from before_update's stream
        return generate(self.problem, self.length, self.batch_size, self.stream, self.task_vocab)

    def valid_split(self):
        raise PipelineError("the curriculum has no valid split: its check is after each epoch")

    def task(self, train) -> Task:
        # fed as streams that never restart; its check is the hook's, after each epoch
        return TokenStreams()

    # ---------------------------------------------------------------- as TrainingHook

    def before_update(self, trainer, update: int) -> None:
        if (update - 1) % self.cur.steps_per_epoch:
            return
        epoch = (update - 1) // self.cur.steps_per_epoch + 1  # it starts here
        torch.manual_seed(stream_seed(self.dropout_seed, "dropout", epoch))
        self.stream = torch.Generator().manual_seed(stream_seed(self.data_seed, "train", epoch))
        self.loss_sum, self.applied = torch.zeros((), device=trainer.device), 0

    def after_update(self, trainer, losses, log: Callable[[str], None]) -> None:
        assert self.loss_sum is not None
        if not trainer.guard.skipped_last:
            self.loss_sum = self.loss_sum.to(trainer.device)  # as saved, after a resume
            self.loss_sum += torch.stack([loss.objective for loss in losses]).mean()
            self.applied += 1
        if trainer.step % self.cur.steps_per_epoch:
            return
        epoch = trainer.step // self.cur.steps_per_epoch
        # before anything reads the epoch's result or a checkpoint saves it
        trainer.guard.read_and_check(trainer.model.parameters(), trainer.step)
        mean = self.loss_sum.item() / self.applied if self.applied else None
        check = torch.Generator().manual_seed(stream_seed(self.data_seed, "check", epoch))
        correct, total, _ = score(
            trainer.model,
            self.problem,
            self.length,
            self.cur.check_cases,
            check,
            self.task_vocab,
            trainer.device,
        )
        accuracy = correct / total
        solved = accuracy >= self.cur.promote_accuracy
        self.history.append(
            {
                "epoch": epoch,
                "length": self.length,
                "loss": mean,
                "accuracy": accuracy,
                "solved": solved,
            }
        )
        metrics = {"length": self.length, "accuracy": accuracy, "loss": mean}
        trainer.tracker.log_metrics({k: v for k, v in metrics.items() if v is not None}, step=epoch)
        log(
            f"epoch {epoch:>3}  length {self.length:>3}  "
            f"loss {'-' if mean is None else f'{mean:.4f}'}  accuracy "
            f"{accuracy:.4f}{'  solved' if solved else ''}"
        )
        if solved:
            self.length += self.step_by
        self.epoch = epoch

    def state_dict(self) -> dict:
        return {
            "epoch": self.epoch,
            "length": self.length,
            "history": self.history,
            "stream": None if self.stream is None else self.stream.get_state(),
            "loss_sum": None if self.loss_sum is None else self.loss_sum.cpu(),
            "applied": self.applied,
        }

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.length, self.history = state["epoch"], state["length"], state["history"]
        self.stream, self.loss_sum, self.applied = None, None, state["applied"]
        if state["stream"] is not None:
            self.stream = torch.Generator()
            self.stream.set_state(state["stream"])
        if state["loss_sum"] is not None:
            self.loss_sum = state["loss_sum"]  # on the host, until the next update adds to it

    def result(self, parameters: int) -> dict:
        """curriculum.json: `score`, the longest length solved (0 if none), the paper's;
        `next_length`, what the curriculum would train next, the authors' script's "Maximum
        Sequence Size"; `final_length`, the last epoch's; the model's `parameters`; the
        per-epoch history."""
        return {
            "problem": self.problem,
            "score": best_length(self.history),
            "next_length": self.length,
            "final_length": self.history[-1]["length"],
            "epochs": self.epoch,
            "parameters": parameters,
            "history": self.history,
        }
