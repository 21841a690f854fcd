"""The optional parts of the model protocol: hooks that only some families need, in small
groups. Each group is opt in: a family that has the capability lists the group among its
bases and implements its abstract hooks (a family that declares one without them cannot be
built); a model that does not declare it is not an instance of it, and a caller asks
``isinstance(model, Group)`` before it calls the group's hooks, doing without where the
answer is no. `SequenceModel` (pipeline.models.protocol) inherits none of them. Which
built-in family declares which group:

- `BoundedParameters`: all-attention (its span fractions, in [0, 1]).
- `PlannedShapes`: all-attention (its L', planned ahead under adaptive span).
- `TrainingBackends`: all-attention (attention backends, compiled layers).
- `TrainingMetrics`: all-attention (spans, plan overflows), ∞-former (its memory's KL and
  variance).
- `HeadReports`: all-attention (learned spans, the persistent vectors' share of attention).
- `MemoryCounts`: every built-in family (what a training step keeps for backward, counted
  from the shapes, for the memory plan of `show --estimate`).
- `AttentionSpans`: all-attention (what the estimate costs a run's spans at).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import AbstractContextManager
from typing import NamedTuple

import torch
import torch.nn as nn
from torch import Tensor


class BoundedParameters(ABC):
    """Parameters that must stay within a range, clamped after every optimizer step."""

    @abstractmethod
    def bounded_parameters(self) -> list[tuple[nn.Parameter, float, float]]:
        """(parameter, low, high): parameters that must stay within [low, high] after every
        optimizer step. The trainer clamps their fp32 master copies (under bf16 / fp16 the
        module's copy is a rounded view) and the model reads them in float32."""

    def after_step(self) -> None:
        """Called after every optimizer step: clamps ``bounded_parameters`` in place."""
        with torch.no_grad():
            for p, low, high in self.bounded_parameters():
                p.clamp_(low, high)


def bounded_parameters(model) -> list[tuple[nn.Parameter, float, float]]:
    """A model's ``bounded_parameters()``, or [] for a model that keeps none in bounds."""
    return model.bounded_parameters() if isinstance(model, BoundedParameters) else []


class PlannedShapes(ABC):
    """Tensor shapes that depend on learned values (the all-attention model's span lengths),
    planned ahead so that a training step never waits for the device: planned from values
    asked for after an earlier update (``request_plan``: a non-blocking copy to the host),
    not from the current ones (``planned_update``). What a plan needs to resume exactly is
    ``plan_state``, saved with the checkpoint: the four hooks go together."""

    @abstractmethod
    def planned_update(self) -> AbstractContextManager[None]:
        """The trainer runs each update's forwards and backwards inside this. The model fixes
        host-side shapes for them here from values requested after earlier updates
        (``request_plan``), without reading the device; forwards outside it (evaluation,
        sampling) compute them from the current values."""

    @abstractmethod
    def request_plan(self) -> None:
        """Called after every optimizer step (after ``after_step``): start, without waiting,
        the copy to the host of what a later ``planned_update`` plans from."""

    @abstractmethod
    def plan_state(self) -> dict | None:
        """What the plan in force and the requested values are, for a checkpoint (None: no
        plan yet); read at a checkpoint, where waiting for the device is fine."""

    @abstractmethod
    def load_plan_state(self, state: dict | None) -> None:
        """Restore ``plan_state()``'s dict; None (a checkpoint from before plans, or of a
        model without them): plan from the current values at the next update."""


class TrainingBackends(ABC):
    """More than one way to compute the same model (attention backends, compiled code). A
    model without the capability trains eagerly on any device."""

    @abstractmethod
    def compile_for_training(self, backend: str = "inductor", graphs: bool = False) -> bool:
        """torch.compile what the training updates run (train.compile); with ``graphs``, in
        CUDA graphs (torch.compile's reduce-overhead mode). False when it has no compiled
        path in this configuration (it trains eagerly)."""

    @abstractmethod
    def cannot_train_on(self, device: torch.device) -> str | None:
        """Why this model cannot train on `device` (a backend that runs forward only there:
        ``pipeline.ops.backend_cannot_train_on`` says which), said before the first step;
        None when it can."""


class TrainingMetrics(ABC):
    """Numbers about the model itself, logged with the loss while it trains."""

    @abstractmethod
    def metrics(self) -> dict[str, float]:
        """Numbers about the model itself worth tracking while it trains (learned spans,
        memory usage); logged with the loss at every report."""

    def metric_tensors(self) -> dict[str, Tensor]:
        """``metrics()`` as 0-dim tensors, for the trainer to read together with the loss in
        one transfer from the device. Default: ``metrics()`` itself (which may read the
        device on its own)."""
        return {k: torch.tensor(float(v), dtype=torch.float64) for k, v in self.metrics().items()}

    def metric_warnings(self, values: dict[str, float]) -> list[str]:
        """Lines to warn with in the training log, given the values just read of
        ``metric_tensors()``; [] when all is well."""
        return []


class HeadReports(ABC):
    """Numbers per layer x head, reported at the end of training and by evaluate."""

    @abstractmethod
    def head_tables(self) -> dict[str, list[list[float]]]:
        """Numbers per layer x head the model reports about itself, by name (the learned
        spans, for a heat map at the end of training)."""

    @abstractmethod
    def measure_persistent_share(
        self,
    ) -> AbstractContextManager[dict[str, list[list[float]]] | None]:
        """While inside, forward passes measure how much attention weight goes to the
        persistent vectors; on exit the yielded dict holds ``"persistent_share"``: per layer
        x head, the mean over the query rows seen of the weight summed over the persistent
        vectors. Yields None when there is nothing to measure (no persistent vectors), so
        that the caller can skip the pass."""


class ActivationMemory(NamedTuple):
    """Bytes one training micro-batch takes beyond the weights, gradients and optimizer."""

    saved: int
    """What autograd keeps for backward at the end of the micro-batch's forward."""
    working: int
    """The most the backward holds at once beyond ``saved`` (its largest gradients)."""
    state: int
    """The state carried to the next block (``init_state``'s tensors), for these rows."""


class MemoryCounts(ABC):
    """What a training step of the model keeps in memory, counted from its shapes, so that
    the memory plan (pipeline/training/memory_plan.py) never runs or inspects the model."""

    @abstractmethod
    def activation_memory(
        self,
        rows: int,
        block_len: int,
        dtype: torch.dtype,
        device_type: str,
        uniform_tokens: bool = False,
    ) -> ActivationMemory | None:
        """The memory of one training forward and backward of ``rows`` x ``block_len``
        tokens (a document-trained model: ``rows`` documents read in segments of
        ``block_len``) in ``dtype`` on ``device_type`` ("cpu", "cuda"), at the shapes in
        force (``hold_shapes_at``). ``uniform_tokens``: the tokens are drawn uniformly (the
        estimate's timing) rather than text, whose words follow Zipf's law (what an adaptive
        softmax's bands cost depends on it). None: not counted in this configuration."""

    def hold_shapes_at(self, fraction: float | None) -> str:
        """Size the shapes that depend on learned values (the all-attention spans) as if
        every such value were at ``fraction`` of its range (None: at its initial value), for
        the FLOP and memory counts of the estimate, whatever the device holds; returns what
        that sets, in words ("L' 8192"), or "" for a model without such shapes (the
        default)."""
        return ""


class AttentionSpans(ABC):
    """Attention spans, learned in training (adaptive span) or fixed: what `show --estimate`
    costs a run at and names, asked through these hooks alone (never the model's planner).
    A family that declares it implements every hook."""

    @abstractmethod
    def spans_grow(self) -> bool:
        """Whether training learns the spans (they start at span_init and grow): the estimate
        then costs the run at the full span and at a short one, else at the full span."""

    @abstractmethod
    def train_flops_per_token_at(self, fraction: float) -> tuple[float, str]:
        """``train_flops_per_token()`` with every span at ``fraction`` of the longest, its L'
        planned as training plans it, and that span in words ("L' 8192"); the shapes in force
        are left as they were."""

    @abstractmethod
    def describe_spans(self) -> str:
        """The spans in force, in words ("L' up to 128"), for a line saying what was timed."""
