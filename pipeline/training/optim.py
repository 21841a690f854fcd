"""Optimizers and the learning-rate schedule, as the all-attention authors' code runs them."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist

from pipeline.errors import PipelineError
from pipeline.training.partitions import Layout, whole


class _Plan:
    """The index tensors one param group's step needs, built once for a given list of stepped
    tensors so that the step itself runs a fixed number of multi-tensor ops and never asks
    the device for a value.

    Every run of every tensor gets a slot: its parameter's, where the squares of the
    parameter's pieces add up (then over the ranks of the layout's process group). All
    padding shares one last slot, which starts at +inf: an infinite norm is clipped to a zero
    step, so padding never moves. The slots are float64: a float32 gradient's squares pass
    float32's range from a norm of 1.8e19 (four finite 1e20s), and it is still clipped.
    """

    def __init__(self, tensors: list[torch.Tensor], layouts: list[Layout], fused: bool | None):
        devices = {t.device for t in tensors}
        if len(devices) > 1:
            raise PipelineError(
                f"ClippedAdagrad: one param group spans devices {devices}; "
                "give each device its own group"
            )
        (device,) = devices
        if fused and device.type != "cpu":
            raise PipelineError(
                f"ClippedAdagrad(fused=True): torch's fused Adagrad kernel "
                f"runs on the CPU only, these tensors are on {device}"
            )
        # torch's fused CPU Adagrad came with 2.4; fall back to foreach where it is missing
        self.fused = (
            device.type == "cpu" and hasattr(torch, "_fused_adagrad_") if fused is None else fused
        )
        self.tensors = tensors
        self.splits: list[
            list[int] | None
        ] = []  # per tensor: its runs' lengths, or None where it is one run
        owners: list[int | None] = []  # a run's slot, None for padding
        slots = 0
        self.reduce: list[list[Any]] = []  # [process group, first slot, end slot]
        for layout in layouts:
            n = len(layout.params)
            self.splits.append(None if len(layout.runs) == 1 else [r.length for r in layout.runs])
            owners += [slots + r.owner if r.owner < n else None for r in layout.runs]
            if layout.group is not None:
                # one all_reduce for neighbouring layouts of the same group
                if (
                    self.reduce
                    and self.reduce[-1][0] is layout.group
                    and self.reduce[-1][2] == slots
                ):
                    self.reduce[-1][2] = slots + n
                else:
                    self.reduce.append([layout.group, slots, slots + n])
            slots += n
        self.owners = torch.tensor(
            [slots if o is None else o for o in owners], dtype=torch.long, device=device
        )
        self.base = torch.zeros(slots + 1, dtype=torch.float64, device=device)
        self.base[slots] = math.inf
        self.sum_max = [torch.finfo(t.dtype).max for t in tensors]  # per accumulator

    def runs(self, per_tensor: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Views of the runs of tensors shaped like the stepped ones (their gradients...)."""
        out = []
        for x, split in zip(per_tensor, self.splits, strict=False):
            if split is None:
                out.append(x)
            else:
                out.extend(x.reshape(-1).split(split))
        return out


class ClippedAdagrad(torch.optim.Optimizer):
    """Adagrad whose *step* is clipped per parameter tensor, not its gradient.

    For each model parameter: the accumulator adds the unclipped g², and the update
    lr · g / (sqrt(sum) + eps) is scaled by clip / ‖g‖ when ‖g‖ > clip. Clipping g first and
    then running torch's Adagrad would also shrink the accumulator: a different optimizer.

    ‖g‖ is the norm of the whole parameter's gradient. Where DeepSpeed hands this optimizer
    flat partitions instead of the parameters (ZeRO 1-3, bf16), pipeline.training.engine's
    `bind_to_engine` tells it
    which parameter each element belongs to; the partial sums of squares are then summed
    over the data-parallel ranks before the step.

    Each param group steps with about twenty `torch._foreach_*` and small index ops whatever
    its number of tensors, and no host sync: the clip factors stay on the device. (On CUDA
    the per-run scaling, a list of 0-d factors, takes foreach's per-tensor path: one small
    kernel per run.) On the CPU, where one op over all tensors after another loses the
    cache, the update is instead torch's fused Adagrad kernel, one pass per tensor; `fused`
    forces either way (True: CPU only).
    """

    def __init__(
        self,
        params,
        lr: float,
        clip_norm: float = 0.03,
        eps: float = 1e-10,
        fused: bool | None = None,
    ):
        if lr <= 0 or clip_norm <= 0 or eps <= 0:
            raise ValueError(
                f"ClippedAdagrad: lr, clip_norm and eps must be > 0 (got {lr}, {clip_norm}, {eps})"
            )
        super().__init__(params, {"lr": lr, "clip_norm": clip_norm, "eps": eps})
        self.fused = fused
        # built on whole parameters; a wrapper that flattens them must call bind_layouts
        self._layouts = {p: whole(p, p) for g in self.param_groups for p in g["params"]}
        self._plans: dict[tuple, _Plan] = {}

    def bind_layouts(self, layouts: dict[torch.Tensor, Layout]) -> None:
        self._layouts = layouts
        self._plans = {}

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            tensors = [p for p in group["params"] if p.grad is not None]
            plan = self._plan(tensors) if tensors else None
            if plan is not None:
                self._update(plan, group)
        return loss

    def _plan(self, tensors: list[torch.Tensor]) -> _Plan | None:
        # the plan holds the tensors, so their ids cannot be reused while it is cached; a
        # model moved to another device keeps its Parameter objects
        key = (tensors[0].device, *map(id, tensors))
        if key in self._plans:
            return self._plans[key]
        layouts = [self._layouts.get(t) for t in tensors]
        if all(layout is not None for layout in layouts):
            plan = self._plans[key] = _Plan(tensors, cast("list[Layout]", layouts), self.fused)
            return plan
        # DeepSpeed's unfused bf16 wrapper steps once with zero gradients while it is being
        # built, before it can be bound: a zero gradient changes nothing, whatever the layout.
        # This check syncs, but only until engine.bind_to_engine; such a plan is not cached.
        if any(
            layout is None and t.grad is not None and t.grad.any()
            for t, layout in zip(tensors, layouts, strict=False)
        ):
            raise PipelineError(
                "ClippedAdagrad is asked to step a tensor it was not built with "
                "(DeepSpeed flattened the parameters): call "
                "pipeline.training.engine.bind_to_engine(engine) after initialize"
            )
        bound = [
            (t, layout) for t, layout in zip(tensors, layouts, strict=False) if layout is not None
        ]
        return (
            _Plan([t for t, _ in bound], [layout for _, layout in bound], self.fused)
            if bound
            else None
        )

    def _update(self, plan: _Plan, group: dict) -> None:
        # a plan holds only tensors with a gradient (step() leaves the others out)
        grads = cast("list[torch.Tensor]", [t.grad for t in plan.tensors])
        for t in plan.tensors:
            if not self.state[t]:
                self.state[t]["sum"] = torch.zeros_like(t, memory_format=torch.preserve_format)
        sums = [self.state[t]["sum"] for t in plan.tensors]

        # ‖g‖² per parameter: per-run norms, added into their parameter's slot, then summed
        # over the ranks that hold the parameter's other pieces
        run_norms = torch.stack(torch._foreach_norm(plan.runs(grads), dtype=torch.float64))
        sq = plan.base.index_add(0, plan.owners, run_norms.square())
        for process_group, a, b in plan.reduce:
            dist.all_reduce(sq[a:b], group=process_group)
        norm = sq.sqrt_()
        clip = group["clip_norm"]
        # 1 / the clip factor (+inf for padding): multiplying the denominator by it, rather
        # than g by the factor, scales the step without another gradient-sized temporary
        stretch = torch.where(norm > clip, (norm + 1e-10) / clip, 1.0)
        run_stretch = list(stretch.index_select(0, plan.owners).unbind())

        if plan.fused:
            # the kernel steps each tensor with lr / (1 + (step - 1)·lr_decay), `step` a 0-d
            # tensor of its own: with lr_decay = 1 and step = stretch that is lr · factor
            # (read as a float32: exact enough for fp32 and lower). The accumulator takes the
            # unclipped g², as here.
            torch._fused_adagrad_(
                plan.runs(plan.tensors),
                plan.runs(grads),
                plan.runs(sums),
                run_stretch,
                lr=group["lr"],
                lr_decay=1.0,
                weight_decay=0.0,
                eps=group["eps"],
                maximize=False,
            )
        else:
            torch._foreach_addcmul_(sums, grads, grads)  # the unclipped g²
            std = torch._foreach_sqrt(sums)
            torch._foreach_add_(std, group["eps"])
            torch._foreach_mul_(plan.runs(std), run_stretch)
            torch._foreach_addcdiv_(plan.tensors, grads, std, value=-group["lr"])
        # a finite g whose g² overflows (|g| > 1.8e19 in float32) leaves inf in the
        # accumulator, and its element unmoved (g / inf): saturated at the largest finite
        # value instead, the state stays finite, and the element's later steps near 0
        torch._foreach_clamp_max_(sums, plan.sum_max)


def build_optimizer(params, cfg) -> torch.optim.Optimizer:
    """`cfg` is the spec's train.optimizer section."""
    params = [p for p in params if p.requires_grad]
    if cfg.type == "adagrad":
        if cfg.clip == "per_param":
            return ClippedAdagrad(params, lr=cfg.lr, clip_norm=cfg.clip_norm)
        return torch.optim.Adagrad(params, lr=cfg.lr, eps=1e-10, weight_decay=cfg.weight_decay)
    return torch.optim.Adam(
        params, lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay
    )


@dataclass(frozen=True)
class LrSchedule:
    """The learning rate of every update of one stage (its plan's, pipeline.training.plan):
    train.optimizer's schedule over the stage's updates, or one constant rate (the LR-drop
    phase). The trainer sets it on the optimizer before each update; nothing else in the
    pipeline writes the optimizer's lr."""

    lr: float
    warmup_steps: int = 0
    schedule: str = "constant"  # or a train.optimizer.schedule
    total_steps: int | None = None  # the updates cosine decays over

    @classmethod
    def of(cls, optimizer, total_steps: int) -> LrSchedule:
        """train.optimizer's schedule (`optimizer`: that section) over `total_steps` updates."""
        return cls(optimizer.lr, optimizer.warmup_steps, optimizer.schedule, total_steps)

    def __call__(self, update: int) -> float:
        """The lr of update number `update` (1-based)."""
        if self.schedule == "constant":
            return self.lr
        return scheduled_lr(self.lr, self.warmup_steps, update, self.schedule, self.total_steps)


def scheduled_lr(
    base_lr: float,
    warmup_steps: int,
    update: int,
    schedule: str = "linear_warmup",
    total_steps: int | None = None,
) -> float:
    """The lr of optimizer update number `update` (1-based) under train.optimizer.schedule;
    cosine decays over `total_steps` updates."""
    if schedule == "transformer":
        return base_lr * min(update**-0.5, update * warmup_steps**-1.5)
    if schedule == "cosine" and update > warmup_steps:
        if total_steps is None:  # was a TypeError on the division below
            raise ValueError("scheduled_lr: the cosine schedule needs total_steps")
        # the ∞-former authors' CosineAnnealingLR to 0 over all updates, warm-up included
        # (theirs is recomputed every 240 updates; this one every update)
        return base_lr * 0.5 * (1 + math.cos(math.pi * (update - 1) / total_steps))
    if warmup_steps <= 0:
        return base_lr
    return base_lr * min(1.0, update / warmup_steps)
