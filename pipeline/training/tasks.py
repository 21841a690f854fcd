"""What the `Trainer` does with one kind of data: a `Task` per kind, chosen by the data
(pipeline.training.training_data.TrainingData.task), so that the loop asks nothing about it.

A task says the model's state before a row's first token, when the carried states stop being
the rows' left context, an update's micro-batches and the forward of one (its per-token nll,
the model's auxiliary loss, the state after it), and how validation scores the valid split:
its metrics, the one of them that decides the best, the summary's key for it and its log
line. What is minimised is `objective`, the one place the loss is composed; the update body
around a forward (backward, the non-finite guard, the engine's step) is the trainer's
EngineUpdates.micro_batch, one for every task.

- `TokenStreams`: rows that continue their streams from update to update, the model's state
  carried between them; validated in bits per token over the valid split's streams. The
  curriculum's generated cases are fed as streams too (their data never restarts, their
  check is the curriculum's hook and they have no valid split).
- `Documents`: whole documents (the manifest's `documents`, pipeline.data.documents), each
  read from the model's initial state in segments of train.seq_len and scored on the targets
  after its separator (pipeline.training.document_passes.run_documents). Nothing carries
  across updates, so the states are empty; validation reports the loss per scored target,
  token accuracy and exact match.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import torch
from torch import Tensor

from pipeline.errors import PipelineError
from pipeline.models.protocol import State
from pipeline.training.document_passes import run_documents, score_documents
from pipeline.training.evaluation import LN2, evaluate_nll

ToDevice = Callable[[Tensor], Tensor]


class Forward(NamedTuple):
    nll: Tensor  # the nll (nats) of each scored target, with a graph
    aux: Tensor  # the model's auxiliary loss of this forward (pipeline.models.protocol)
    state: State  # the model's state after it


def objective(nll: Tensor, aux: Tensor) -> tuple[Tensor, Tensor]:
    """(the mean token nll in float32, what training minimises: it plus the model's
    auxiliary loss), from the nll of each scored target: the one place the loss is made."""
    mean = nll.float().mean()
    return mean, mean + aux


class Task(Protocol):
    metric: str  # validation's metric that decides the best (lower is better)
    best_key: str  # the fit summary's key for the best value of `metric`
    reports_bits: bool  # the loss is over a text's tokens: reports add bits per token

    def initial_state(self, model, rows: int, device: torch.device) -> State:
        """The state of `rows` rows before their first token."""

    def restarts(self, batches, step: int) -> bool:
        """Whether update `step`'s rows no longer continue the carried states."""

    def micro_batches(self, batches, step: int, rows: int, to_device: ToDevice) -> list[Any]:
        """Update `step`'s micro-batches of `rows` rows each, on the device."""

    def forward(self, model, inputs: Any, state: State) -> Forward:
        """One micro-batch through `model` (a DeepSpeed engine or the model), from `state`."""

    def trial_forward(
        self, model, vocab_size: int, rows: int, seq_len: int, device: torch.device
    ) -> Forward:
        """`rows` random rows through `model` from the fullest state a micro-batch starts
        from: what the micro-batch search tries (pipeline.training.micro_batch.probe)."""

    def validate(self, model, split: Any, train, device: torch.device) -> dict[str, float]:
        """The valid split's metrics with train's validation settings."""

    def valid_line(self, metrics: dict, bits: str, scope: str) -> str:
        """The log line of a validation (`bits`: what bits per token are called)."""


def max_batches(train) -> int | None:
    return None if train.eval_batches == "all" else train.eval_batches


class TokenStreams:
    """Rows that continue their streams across updates (the module doc)."""

    metric = "bpc"
    best_key = "best_valid_bpc_estimate"
    reports_bits = True

    def initial_state(self, model, rows: int, device: torch.device) -> State:
        return model.init_state(rows, device=device)

    def restarts(self, batches, step: int) -> bool:
        # the streams restart at a new offset: the carried states are no longer the rows'
        # left context (the authors' trainer starts from the initial ones at the wrap too)
        return step > 0 and batches.starts_epoch(step)

    def micro_batches(self, batches, step: int, rows: int, to_device: ToDevice) -> list[Any]:
        x, y = batches.batch(step)
        x, y = to_device(x), to_device(y)
        return [(x[i : i + rows], y[i : i + rows]) for i in range(0, len(x), rows)]

    def forward(self, model, inputs: Any, state: State) -> Forward:
        out = model(*inputs, state)
        return Forward(out.nll, model.aux_loss(), out.state)

    def trial_forward(
        self, model, vocab_size: int, rows: int, seq_len: int, device: torch.device
    ) -> Forward:
        x = torch.randint(vocab_size, (rows, seq_len), device=device)
        with torch.no_grad():  # the state a block leaves: the carried one at its fullest
            state = model(x, x, model.init_state(rows, device=device)).state
        return self.forward(model, (x, x), state)

    def validate(self, model, split: Any, train, device: torch.device) -> dict[str, float]:
        total, count = evaluate_nll(
            model,
            split,
            train.eval_batch_size,
            train.eval_seq_len or train.seq_len,
            device,
            max_batches=max_batches(train),
        )
        if count == 0:
            raise PipelineError(
                f"the valid split has {len(split)} token(s): "
                f"nothing to validate on; make dataset.split.valid larger"
            )
        return {"bpc": total / count / LN2, "tokens": count}

    def valid_line(self, metrics: dict, bits: str, scope: str) -> str:
        return f"valid {bits} {metrics['bpc']:.3f} ({scope}, {metrics['tokens']:,} tokens)"


class Documents:
    """Whole documents of `layout` (the manifest's `documents`: length, input_length), read
    in segments of `seq_len` (the module doc)."""

    metric = "loss"
    best_key = "best_valid_loss"
    reports_bits = False  # the loss is over the sorted targets, not bits of a text

    def __init__(self, layout: dict, seq_len: int):
        self.length, self.input_length = layout["length"], layout["input_length"]
        self.seq_len = seq_len

    def initial_state(self, model, rows: int, device: torch.device) -> State:
        # each document starts from init_state in run_documents: [] as a stateless model's,
        # which checkpoints and resharding already handle
        return []

    def restarts(self, batches, step: int) -> bool:
        return False  # nothing carries

    def micro_batches(self, batches, step: int, rows: int, to_device: ToDevice) -> list[Any]:
        docs = to_device(batches.batch(step))
        return [docs[i : i + rows] for i in range(0, len(docs), rows)]

    def forward(self, model, inputs: Any, state: State) -> Forward:
        out = run_documents(model, inputs, self.seq_len, self.input_length, train=True)
        return Forward(out.nll, out.aux, [])

    def trial_forward(
        self, model, vocab_size: int, rows: int, seq_len: int, device: torch.device
    ) -> Forward:
        docs = torch.randint(vocab_size, (rows, self.length), device=device)
        return self.forward(model, docs, [])

    def validate(self, model, split: Any, train, device: torch.device) -> dict[str, float]:
        scores = score_documents(
            model,
            split,
            train.eval_batch_size,
            train.eval_seq_len or train.seq_len,
            self.input_length,
            device,
            max_batches(train),
        )
        return scores.metrics()

    def valid_line(self, metrics: dict, bits: str, scope: str) -> str:
        return (
            f"valid loss {metrics['loss']:.4f}  token accuracy "
            f"{metrics['token_accuracy']:.3f}  exact match "
            f"{metrics['exact_match']:.3f} ({scope}, {metrics['documents']:,} documents)"
        )
