"""Optimizers and the learning-rate schedule, as the all-attention authors' code runs them."""

from __future__ import annotations

import torch


class ClippedAdagrad(torch.optim.Optimizer):
    """Adagrad whose *step* is clipped per parameter tensor, not its gradient.

    For each tensor: the accumulator adds the unclipped g², and the update
    lr · g / (sqrt(sum) + eps) is scaled by clip / ‖g‖ when ‖g‖ > clip. Clipping g first and
    then running torch's Adagrad would also shrink the accumulator: a different optimizer.
    Valid where each parameter is a whole tensor on this rank (ZeRO stage 0).
    """

    def __init__(self, params, lr: float, clip_norm: float = 0.03, eps: float = 1e-10):
        if lr <= 0 or clip_norm <= 0:
            raise ValueError(f"ClippedAdagrad: lr and clip_norm must be > 0 "
                             f"(got {lr}, {clip_norm})")
        super().__init__(params, {"lr": lr, "clip_norm": clip_norm, "eps": eps})

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                state = self.state[p]
                if not state:
                    state["sum"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                lr = group["lr"]
                norm = g.norm(2).item()
                if norm > group["clip_norm"]:
                    lr = lr * group["clip_norm"] / (norm + 1e-10)
                state["sum"].addcmul_(g, g)
                std = state["sum"].sqrt().add_(group["eps"])
                p.addcdiv_(g, std, value=-lr)
        return loss


def build_optimizer(params, cfg) -> torch.optim.Optimizer:
    """`cfg` is the spec's train.optimizer section."""
    params = [p for p in params if p.requires_grad]
    if cfg.type == "adagrad":
        if cfg.clip == "per_param":
            return ClippedAdagrad(params, lr=cfg.lr, clip_norm=cfg.clip_norm)
        return torch.optim.Adagrad(params, lr=cfg.lr, eps=1e-10,
                                   weight_decay=cfg.weight_decay)
    return torch.optim.Adam(params, lr=cfg.lr, betas=tuple(cfg.betas),
                            weight_decay=cfg.weight_decay)


def warmup_lr(base_lr: float, warmup_steps: int, update: int) -> float:
    """The lr of optimizer update number `update` (1-based): linear warmup, then constant."""
    if warmup_steps <= 0:
        return base_lr
    return base_lr * min(1.0, update / warmup_steps)
