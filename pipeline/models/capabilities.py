"""The optional parts of the model protocol: hooks that only some families need, in small
groups, each with defaults that do nothing.

`SequenceModel` (pipeline.models.protocol) inherits every group, so the trainer, the stages
and `show` call any hook on any model without asking first; a family that has the
capability overrides the group's hooks. Which built-in family implements which group:

- `BoundedParameters`: all-attention (its span fractions, in [0, 1]).
- `PlannedShapes`: all-attention with adaptive span (its L', planned ahead).
- `TrainingBackends`: all-attention (attention backends, compiled layers).
- `TrainingMetrics`: all-attention (spans, plan overflows), ∞-former (its memory's KL and
  variance).
- `HeadReports`: all-attention (learned spans, the persistent vectors' share of attention).
- `MemoryCounts`: every built-in family (what a training step keeps for backward, counted
  from the shapes, for the memory plan of `show --estimate`).

`AttentionSpans` is opt in: `SequenceModel` does not inherit it. A family that has attention
spans lists it among its bases (all-attention does), and a caller asks
``isinstance(model, AttentionSpans)`` before it calls its hooks: a model without spans has no
answer to give, not a default one.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NamedTuple

import torch
import torch.nn as nn
from torch import Tensor


class BoundedParameters:
    """Parameters that must stay within a range, clamped after every optimizer step."""

    def bounded_parameters(self) -> list[tuple[nn.Parameter, float, float]]:
        """(parameter, low, high): parameters that must stay within [low, high] after every
        optimizer step. The trainer clamps their fp32 master copies (under bf16 / fp16 the
        module's copy is a rounded view) and the model reads them in float32."""
        return []

    def after_step(self) -> None:
        """Called after every optimizer step: clamps ``bounded_parameters`` in place."""
        with torch.no_grad():
            for p, low, high in self.bounded_parameters():
                p.clamp_(low, high)


class PlannedShapes:
    """Tensor shapes that depend on learned values (the all-attention model's span lengths),
    planned ahead so that a training step never waits for the device: planned from values
    asked for after an earlier update (``request_plan``: a non-blocking copy to the host),
    not from the current ones (``planned_update``). What a plan needs to resume exactly is
    ``plan_state``, saved with the checkpoint. A family implements all four hooks or none."""

    @contextmanager
    def planned_update(self) -> Iterator[None]:
        """The trainer runs each update's forwards and backwards inside this. A model may fix
        host-side shapes for them here from values requested after earlier updates
        (``request_plan``), without reading the device; forwards outside it (evaluation,
        sampling) compute them from the current values. Default: nothing to plan."""
        yield

    def request_plan(self) -> None:
        """Called after every optimizer step (after ``after_step``): start, without waiting,
        the copy to the host of what a later ``planned_update`` plans from."""

    def plan_state(self) -> dict | None:
        """What the plan in force and the requested values are, for a checkpoint (None: no
        plan); read at a checkpoint, where waiting for the device is fine."""
        return None

    def load_plan_state(self, state: dict | None) -> None:
        """Restore ``plan_state()``'s dict; None (a checkpoint from before plans, or a model
        without one): plan from the current values at the next update."""


class TrainingBackends:
    """More than one way to compute the same model (attention backends, compiled code)."""

    def compile_for_training(self, backend: str = "inductor", graphs: bool = False) -> bool:
        """torch.compile what the training updates run (train.compile); with ``graphs``, in
        CUDA graphs (torch.compile's reduce-overhead mode). False when the family has no
        compiled path (the default: it trains eagerly)."""
        return False

    def cannot_train_on(self, device: torch.device) -> str | None:
        """Why this model cannot train on `device` (a backend that runs forward only there:
        ``pipeline.ops.backend_cannot_train_on`` says which), said before the first step;
        None when it can."""
        return None


class TrainingMetrics:
    """Numbers about the model itself, logged with the loss while it trains."""

    def metrics(self) -> dict[str, float]:
        """Numbers about the model itself worth tracking while it trains (learned spans,
        memory usage); logged with the loss at every report."""
        return {}

    def metric_tensors(self) -> dict[str, Tensor]:
        """``metrics()`` as 0-dim tensors, for the trainer to read together with the loss in
        one transfer from the device. Default: ``metrics()`` itself (which may read the
        device on its own)."""
        return {k: torch.tensor(float(v), dtype=torch.float64) for k, v in self.metrics().items()}

    def metric_warnings(self, values: dict[str, float]) -> list[str]:
        """Lines to warn with in the training log, given the values just read of
        ``metric_tensors()``; [] when all is well."""
        return []

    def train_hardware_flops_per_token(self, block_len: int) -> float:
        """Training FLOPs per token that the hardware executes, for the hardware FLOPs
        utilisation (HFU) reported beside the MFU: ``train_flops_per_token()`` plus what the
        computation does twice. Default: with ``activation_checkpointing``, the forward again
        (a third more: 2 of the 6 per weight element). A family adds what it recomputes of
        its own; ``block_len``: the tokens of one training block (``train.seq_len``)."""
        flops = self.train_flops_per_token()  # type: ignore[attr-defined]  # SequenceModel's
        return flops * 4 / 3 if getattr(self, "activation_checkpointing", False) else flops


class HeadReports:
    """Numbers per layer x head, reported at the end of training and by evaluate."""

    def head_tables(self) -> dict[str, list[list[float]]]:
        """Numbers per layer x head the model reports about itself, by name (the learned
        spans, for a heat map at the end of training); {} for a model with none."""
        return {}

    @contextmanager
    def measure_persistent_share(self) -> Iterator[dict[str, list[list[float]]] | None]:
        """While inside, forward passes measure how much attention weight goes to the
        persistent vectors; on exit the yielded dict holds ``"persistent_share"``: per layer
        x head, the mean over the query rows seen of the weight summed over the persistent
        vectors. Yields None for a model with nothing to measure (the default), so that the
        caller can skip the pass."""
        yield None


class ActivationMemory(NamedTuple):
    """Bytes one training micro-batch takes beyond the weights, gradients and optimizer."""

    saved: int
    """What autograd keeps for backward at the end of the micro-batch's forward."""
    working: int
    """The most the backward holds at once beyond ``saved`` (its largest gradients)."""
    state: int
    """The state carried to the next block (``init_state``'s tensors), for these rows."""


class MemoryCounts:
    """What a training step of the model keeps in memory, counted from its shapes, so that
    the memory plan (pipeline/training/memory_plan.py) never runs or inspects the model."""

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
        softmax's bands cost depends on it). None: not counted (the default)."""
        return None

    def hold_shapes_at(self, fraction: float | None) -> str:
        """Size the shapes that depend on learned values (the all-attention spans) as if
        every such value were at ``fraction`` of its range (None: at its initial value), for
        the FLOP and memory counts of the estimate, whatever the device holds; returns what
        that sets, in words ("L' 8192"), or "" for a model without such shapes."""
        return ""


class AttentionSpans(ABC):
    """Attention spans, learned in training (adaptive span) or fixed: what `show --estimate`
    costs a run at and names, asked through these hooks alone (never the model's planner).
    Opt in (see the module doc): a family implements every hook (abstract: a family that
    declares it without one cannot be built)."""

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
