"""What the trainer, the evaluate stage, checkpoints and `show` know of a model.

Every registered model family subclasses `SequenceModel` (a plain `nn.Module`) and nothing
outside `pipeline/models` looks further into it: no parameter is found by name, no state is
taken apart. Adding a family is a config dataclass, a module, and a `ModelFamily` pairing them
named by an entry point in the group `allattn_pipe.models` (pipeline/plugins.py; the built-ins
are in pipeline/models/builtin.py, declared in pyproject.toml; docs/extending.md).

A model maps a block of tokens [B, M] (with the state the previous block left) to a per-token
loss [B, M] and the next state:

    with model.planned_update():             # training: shapes fixed ahead (see below)
        out = model(tokens, targets, state)  # ModelOutput(logits, nll, state)
        loss = out.nll.mean() + model.aux_loss()
        ... backward, optimizer step ...
    model.after_step()
    model.request_plan()

The state is what a model carries from one block of a stream to the next (the
Transformer-XL cache, the ∞-former's long-term memory); a model without one returns [].
It is a list of tensors, each with the batch as its first dimension and detached from the
graph, so that the trainer can checkpoint it, and cut and join it by batch rows when a run
resumes on another number of processes, without knowing what it holds.

A training step never waits for the device: a model whose tensor shapes depend on learned
values (the all-attention model's span lengths) plans them from values it asked for after an
earlier update (``request_plan``: a non-blocking copy to the host), not from the current
ones (``planned_update``). What a plan needs to resume exactly is ``plan_state``, saved with
the checkpoint. Families without such shapes keep the defaults, which do nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import NamedTuple

import torch
import torch.nn as nn
from torch import Tensor

State = list[Tensor]
"""Tensors carried from block to block, each [B, ...] (batch first), detached."""


class ModelOutput(NamedTuple):
    logits: Tensor | None
    """[B, M, V] unnormalised scores; None where the model never forms them (an adaptive
    softmax: use ``nll``)."""
    nll: Tensor | None
    """[B, M] per-token negative log-likelihood in nats; None without targets."""
    state: State
    """The state for the next block (see the module doc)."""


class SequenceModel(nn.Module):
    """Base class of every model family. Subclasses implement
    ``forward(tokens, targets=None, state=None) -> ModelOutput`` (tokens, targets: [B, M]
    int64; state: the previous block's ``ModelOutput.state``, None for ``init_state``'s) and,
    if they carry a state, ``init_state``; the rest has defaults for a model with nothing more
    to say."""

    activation_checkpointing: bool = False
    """Set by the trainer from ``train.deepspeed.activation_checkpointing``: recompute each
    layer's activations in backward instead of storing them (a model may ignore it)."""

    def init_state(self, batch_size: int, device=None) -> State:
        """The state before a stream's first block (zeros, or [] for a stateless model)."""
        return []

    def aux_loss(self) -> Tensor:
        """A scalar the trainer adds to the mean token loss in training (the adaptive-span
        L1 penalty, the ∞-former's KL term); zero by default."""
        return next(self.parameters()).new_zeros(())

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

    def compile_for_training(self, backend: str = "inductor", graphs: bool = False) -> bool:
        """torch.compile what the training updates run (train.compile); with ``graphs``, in
        CUDA graphs (torch.compile's reduce-overhead mode). False when the family has no
        compiled path (the default: it trains eagerly)."""
        return False

    def train_flops_per_token(self) -> float:
        """Training FLOPs per token (forward + backward), for the model FLOPs utilisation the
        trainer reports: a host-side estimate that never reads the device. Default: 6 per
        parameter element (2 in the forward multiply-add, 4 in the backward's two) outside
        the ``nn.Embedding`` modules, whose lookups are not matmuls. Sequence-length terms
        (attention over the context) are the family's to add in an override."""
        embedded = {
            id(p) for m in self.modules() if isinstance(m, nn.Embedding) for p in m.parameters()
        }
        return 6.0 * count_elements(p for p in self.parameters() if id(p) not in embedded)

    def describe(self) -> str:
        """One line for the training log: how this model computes (backends and the like)."""
        return type(self).__name__

    def cannot_train_on(self, device: torch.device) -> str | None:
        """Why this model cannot train on `device` (a backend that runs forward only there),
        said before the first step; None when it can."""
        return None

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

    def parameter_groups(self) -> dict[str, int]:
        """Parameter elements by role, for `show` (default: by top-level submodule)."""
        groups: dict[str, int] = {}
        for name, p in self.named_parameters():
            role = name.split(".", 1)[0]
            groups[role] = groups.get(role, 0) + p.numel()
        return groups


def count_elements(parameters: Iterable[nn.Parameter]) -> int:
    """Elements of the parameters, whole: under ZeRO stage 3 a parameter's own tensor is
    this process's partition (often empty) and DeepSpeed keeps the full count in
    ``ds_numel``."""
    return sum(getattr(p, "ds_numel", None) or p.numel() for p in parameters)


class ModelFamily(NamedTuple):
    """What an `allattn_pipe.models` entry point names: a config dataclass, whose fields are
    the spec's `model.*` keys (an optional ``inert_keys()`` lists those that do nothing under
    the others, as (key, why) pairs), and the model class, built as ``model(config,
    vocab_size)``."""

    config: type
    model: type[SequenceModel]
