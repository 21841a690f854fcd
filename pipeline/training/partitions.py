"""How a tensor the optimizer steps is cut into pieces of model parameters: a whole parameter,
or (under ZeRO and the bf16 wrapper) a rank's flat fp32 partition holding pieces of several.
The engine (pipeline.training.engine) builds these from DeepSpeed's wrapper; ClippedAdagrad
(pipeline.training.optim) clips each parameter's step over its pieces."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Run:
    """Consecutive elements of a stepped tensor that belong to one model parameter."""

    owner: int  # index into Layout.params; len(params) marks alignment padding
    start: int  # first element in the stepped (flattened) tensor
    length: int
    lp: torch.Tensor  # the same elements in the model's (or its partition's) copy


@dataclass
class Layout:
    """How one tensor the optimizer steps is cut into pieces of model parameters.

    Under ZeRO and the bf16 wrapper the optimizer steps one flat fp32 partition per rank:
    its runs may be pieces of parameters whose other pieces live on other ranks of `group`.
    """

    params: list[torch.Tensor]  # the model parameters flattened together, same on all ranks
    runs: list[Run]  # cover the stepped tensor, in order
    group: dist.ProcessGroup | None  # the group holding the other pieces; None: whole tensors


def whole(master: torch.Tensor, param: torch.Tensor) -> Layout:
    """`master` is the whole of `param` (itself, or DeepSpeed's fp32 copy of it)."""
    return Layout([param], [Run(0, 0, master.numel(), param.data.view(-1))], None)
