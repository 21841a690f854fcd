"""What the trainer, the evaluate stage, checkpoints and `show` know of a model.

Every registered model family subclasses `SequenceModel` (a plain `nn.Module`) and nothing
of the pipeline outside `pipeline/models` (the trainer, the stages, the commands, the
workspace; tests/unit/models/test_protocol.py reads them for it) looks further into it: no
parameter is found by name, no state is taken apart, no attribute of a family is read; what
a caller needs of a model it asks through a hook. (The GPU checks and benches of one
family, gpu/ and bench/, read that family's own methods.) Adding a family
is a config dataclass, a module, and a `ModelFamily` pairing them named by an entry point in
the group `allattn_pipe.models` (pipeline/plugins.py; the built-ins are in
pipeline/models/builtin.py, declared in pyproject.toml; docs/extending.md).

A model maps a block of tokens [B, M] (with the state the previous block left) to a per-token
loss [B, M] and the next state:

    out = model(tokens, targets, state)      # ModelOutput(logits, nll, state)
    loss = out.nll.mean() + model.aux_loss()
    ... backward, optimizer step ...

(a model that is `PlannedShapes` runs that inside ``model.planned_update()`` and is asked
``request_plan()`` after the step; one that is `BoundedParameters` is clamped by
``after_step()``.)

The state is what a model carries from one block of a stream to the next (the
Transformer-XL cache, the ∞-former's long-term memory); a model without one returns [].
It is a list of tensors, each with the batch as its first dimension and detached from the
graph, so that the trainer can checkpoint it, and cut and join it by batch rows when a run
resumes on another number of processes, without knowing what it holds.

The protocol is a small core, which every family provides (``forward``; ``init_state`` for
a model with a state; the rest has defaults that fit most models), and optional
capabilities in small groups (pipeline.models.capabilities: bounded parameters, shapes
planned ahead, training backends, training metrics, per-head reports, memory counts,
attention spans). A capability is opt in: a family that has one lists it among its bases
and implements its hooks; a caller asks ``isinstance(model, Group)`` before it calls them
and does without where the model is not one. `SequenceModel` inherits none.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

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
    """Base class of every model family: the core of the protocol. Subclasses implement
    ``forward(tokens, targets=None, state=None) -> ModelOutput`` (tokens, targets: [B, M]
    int64; state: the previous block's ``ModelOutput.state``, None for ``init_state``'s) and,
    if they carry a state, ``init_state``; the rest has defaults for a model with nothing more
    to say. A family declares its optional capabilities as further bases
    (pipeline.models.capabilities)."""

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

    def train_hardware_flops_per_token(self, block_len: int) -> float:
        """Training FLOPs per token that the hardware executes, for the hardware FLOPs
        utilisation (HFU) reported beside the MFU: ``train_flops_per_token()`` plus what the
        computation does twice. Default: with ``activation_checkpointing``, the forward again
        (a third more: 2 of the 6 per weight element). A family adds what it recomputes of
        its own; ``block_len``: the tokens of one training block (``train.seq_len``)."""
        flops = self.train_flops_per_token()
        return flops * 4 / 3 if self.activation_checkpointing else flops

    def describe(self) -> str:
        """One line for the training log: how this model computes (backends and the like)."""
        return type(self).__name__

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
