"""Optimizers and the learning-rate schedule, as the all-attention authors' code runs them."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist

from pipeline.errors import PipelineError


@dataclass(frozen=True)
class _Run:
    """Consecutive elements of a stepped tensor that belong to one model parameter."""

    owner: int  # index into _Layout.params; len(params) marks alignment padding
    start: int  # first element in the stepped (flattened) tensor
    length: int
    lp: torch.Tensor  # the same elements in the model's (or its partition's) copy


@dataclass
class _Layout:
    """How one tensor the optimizer steps is cut into pieces of model parameters.

    Under ZeRO and the bf16 wrapper the optimizer steps one flat fp32 partition per rank:
    its runs may be pieces of parameters whose other pieces live on other ranks of `group`.
    """

    params: list[torch.Tensor]  # the model parameters flattened together, same on all ranks
    runs: list[_Run]  # cover the stepped tensor, in order
    group: object | None  # process group holding the other pieces; None: whole tensors


def _whole(master: torch.Tensor, param: torch.Tensor) -> _Layout:
    """`master` is the whole of `param` (itself, or DeepSpeed's fp32 copy of it)."""
    return _Layout([param], [_Run(0, 0, master.numel(), param.data.view(-1))], None)


class _Plan:
    """The index tensors one param group's step needs, built once for a given list of stepped
    tensors so that the step itself runs a fixed number of multi-tensor ops and never asks
    the device for a value.

    Every run of every tensor gets a slot: its parameter's, where the squares of the
    parameter's pieces add up (then over the ranks of the layout's process group). All
    padding shares one last slot, which starts at +inf: an infinite norm is clipped to a zero
    step, so padding never moves.
    """

    def __init__(self, tensors: list[torch.Tensor], layouts: list[_Layout], fused: bool | None):
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
        self.dtype = (
            torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32
        )
        self.owners = torch.tensor(
            [slots if o is None else o for o in owners], dtype=torch.long, device=device
        )
        self.base = torch.zeros(slots + 1, dtype=self.dtype, device=device)
        self.base[slots] = math.inf

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
    flat partitions instead of the parameters (ZeRO 1-3, bf16), `bind_to_engine` tells it
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
        self._layouts = {p: _whole(p, p) for g in self.param_groups for p in g["params"]}
        self._plans: dict[tuple, _Plan] = {}

    def bind_layouts(self, layouts: dict[torch.Tensor, _Layout]) -> None:
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
            plan = self._plans[key] = _Plan(tensors, cast("list[_Layout]", layouts), self.fused)
            return plan
        # DeepSpeed's unfused bf16 wrapper steps once with zero gradients while it is being
        # built, before it can be bound: a zero gradient changes nothing, whatever the layout.
        # This check syncs, but only until bind_to_engine; such a plan is not cached.
        if any(
            layout is None and t.grad is not None and t.grad.any()
            for t, layout in zip(tensors, layouts, strict=False)
        ):
            raise PipelineError(
                "ClippedAdagrad is asked to step a tensor it was not built with "
                "(DeepSpeed flattened the parameters): call "
                "pipeline.training.optim.bind_to_engine(engine) after deepspeed.initialize"
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
        run_norms = torch.stack(torch._foreach_norm(plan.runs(grads), dtype=plan.dtype))
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
            return
        torch._foreach_addcmul_(sums, grads, grads)  # the unclipped g²
        std = torch._foreach_sqrt(sums)
        torch._foreach_add_(std, group["eps"])
        torch._foreach_mul_(plan.runs(std), run_stretch)
        torch._foreach_addcdiv_(plan.tensors, grads, std, value=-group["lr"])


# ------------------------------------------------------------ DeepSpeed's partitions


def _flat_layout(master, flat, params, pieces, group) -> _Layout:
    """Layout of `master`, the fp32 copy of `flat` (a rank's low-precision partition).

    `pieces`: (param index, element offset in `flat`, length) for every piece of a parameter
    that `flat` holds. Offsets come from where DeepSpeed put the tensors in memory, so
    DeepSpeed's alignment rules need not be re-derived here; gaps are padding."""
    if master.numel() != flat.numel():
        raise PipelineError(
            f"DeepSpeed's fp32 partition ({master.numel()} elements) does not "
            f"match its model partition ({flat.numel()}): unknown layout"
        )
    runs, pos = [], 0
    flat_1d = flat.view(-1)
    for owner, start, length in sorted(pieces, key=lambda piece: piece[1]):
        if start < pos or start + length > flat.numel():
            raise PipelineError(
                "DeepSpeed's partition layout has overlapping or out-of-range "
                "parameters: refusing to guess per-parameter norms"
            )
        if start > pos:
            runs.append(_Run(len(params), pos, start - pos, flat_1d[pos:start]))
        runs.append(_Run(owner, start, length, flat_1d[start : start + length]))
        pos = start + length
    if pos < flat.numel() or not runs:
        runs.append(_Run(len(params), pos, flat.numel() - pos, flat_1d[pos:]))
    return _Layout(list(params), runs, group)


def _offset(view: torch.Tensor, flat: torch.Tensor) -> int:
    """Element offset of `view` inside `flat`, checked to really be a view into it."""
    if (
        view.untyped_storage().data_ptr() != flat.untyped_storage().data_ptr()
        or not view.is_contiguous()
        or view.dtype != flat.dtype
    ):
        raise PipelineError(
            "a parameter is not a view into DeepSpeed's flat buffer: the "
            "partition layout cannot be established"
        )
    return (view.data_ptr() - flat.data_ptr()) // flat.element_size()


def _clip_pieces(params, flat, part_start, part_len):
    """Pieces of `params` (views into `flat`) inside [part_start, part_start + part_len),
    as offsets relative to the partition."""
    pieces = []
    for j, p in enumerate(params):
        lo = _offset(p.data, flat)
        a, b = max(lo, part_start), min(lo + p.numel(), part_start + part_len)
        if a < b:
            pieces.append((j, a - part_start, b - a))
    return pieces


def _master_layouts(engine) -> dict[torch.Tensor, _Layout]:
    """For every tensor the basic optimizer steps: which model parameter each element is."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    wrapper = engine.optimizer
    if wrapper is engine.basic_optimizer:  # ZeRO 0, fp32: steps the parameters
        return {p: _whole(p, p) for g in wrapper.param_groups for p in g["params"]}
    if getattr(wrapper, "cpu_offload", False) or getattr(wrapper, "offload_optimizer", False):
        raise PipelineError(
            "per-parameter optimizer layouts are not supported with ZeRO offload; turn offload off"
        )
    layouts: dict[torch.Tensor, _Layout] = {}
    if type(wrapper) is FP16_UnfusedOptimizer:  # ZeRO 0, bf16: one fp32 copy per tensor
        for masters, params in zip(wrapper.fp32_groups, wrapper.fp16_groups, strict=False):
            layouts |= {m: _whole(m, p) for m, p in zip(masters, params, strict=False)}
    elif type(wrapper) in (DeepSpeedZeroOptimizer, BF16_Optimizer):
        # ZeRO 1 and 2, and bf16 with fp32 gradient accumulation: one flat buffer per group,
        # cut into equal partitions, the same layout under two sets of attribute names
        if type(wrapper) is DeepSpeedZeroOptimizer:
            names = (
                "bit16_groups",
                "bit16_groups_flat",
                "parallel_partitioned_bit16_groups",
                "single_partition_of_fp32_groups",
            )
        else:
            names = (
                "bf16_groups",
                "bf16_groups_flat",
                "bf16_partitioned_groups",
                "fp32_groups_flat_partition",
            )
        groups, flats, partitions, masters = (getattr(wrapper, n) for n in names)
        for i, params in enumerate(groups):
            rank = dist.get_rank(group=wrapper.real_dp_process_group[i])
            part = partitions[i][rank]
            start = _offset(part, flats[i])
            layouts[masters[i]] = _flat_layout(
                masters[i],
                part,
                params,
                _clip_pieces(params, flats[i], start, part.numel()),
                wrapper.real_dp_process_group[i],
            )
    elif type(wrapper) is DeepSpeedZeroOptimizer_Stage3:
        # each parameter is cut into equal ds_tensor slices, rank r holding elements from
        # r * slice; a sub-group's slices sit side by side in one flat buffer
        for sg, params in enumerate(wrapper.fp16_groups):
            flat = wrapper.fp16_partitioned_groups_flat[sg]
            if flat is None:
                raise PipelineError("ZeRO 3 parameters offloaded to NVMe: no flat partition")
            group = wrapper.sub_group_process_groups[sg]
            rank = dist.get_rank(group=group)
            pieces = []
            for j, p in enumerate(params):
                size = p.ds_tensor.numel()
                length = min(size, p.ds_numel - rank * size)  # the last slices are padded
                if length > 0:
                    pieces.append((j, _offset(p.ds_tensor, flat), length))
            master = wrapper.fp32_partitioned_groups_flat[sg]
            layouts[master] = _flat_layout(master, flat, params, pieces, group)
    else:
        raise PipelineError(
            f"unknown DeepSpeed optimizer wrapper {type(wrapper).__name__}: "
            "cannot tell which parameter each optimizer element belongs to"
        )
    return layouts


def _stepped_optimizer(engine) -> torch.optim.Optimizer:
    """The torch optimizer DeepSpeed really steps: for torch's Adagrad, ZeRO builds a new one
    over its fp32 partitions instead of the client's."""
    return getattr(engine.optimizer, "optimizer", engine.optimizer)


def bind_to_engine(engine) -> None:
    """Call right after `deepspeed.initialize`: tells a ClippedAdagrad how DeepSpeed cut the
    parameters into the tensors it steps. A no-op for other optimizers."""
    opt = engine.basic_optimizer
    if isinstance(opt, ClippedAdagrad):
        if _stepped_optimizer(engine) is not opt:
            raise PipelineError(
                f"{type(engine.optimizer).__name__} replaced ClippedAdagrad "
                "by an optimizer of its own: per-tensor clipping would be lost"
            )
        opt.bind_layouts(_master_layouts(engine))


def master_clamp(
    engine, bounded: Iterable[tuple[torch.Tensor, float, float]]
) -> Callable[[], None]:
    """A function that clamps each model parameter of `bounded` (parameter, low, high: a
    model's `bounded_parameters()`) to [low, high] in every copy this rank holds: the fp32
    master the optimizer steps, from which DeepSpeed overwrites the model's copy at the next
    step, and the model's copy itself. Build it once after `deepspeed.initialize` (and
    `bind_to_engine`); call it after every optimizer step."""
    bounds = {id(p): (low, high) for p, low, high in bounded}
    views = []
    for master, layout in _master_layouts(engine).items():
        flat_master = master.data.view(-1)
        for run in layout.runs:
            if run.owner < len(layout.params) and id(layout.params[run.owner]) in bounds:
                low_high = bounds[id(layout.params[run.owner])]
                views += [
                    (flat_master[run.start : run.start + run.length], low_high),
                    (run.lp, low_high),
                ]
    # ZeRO 0-2 keep every parameter whole on every rank (ZeRO 3: empty outside forward)
    views += [
        (p.data, bounds[id(p)]) for p in engine.module.parameters() if id(p) in bounds and p.numel()
    ]

    @torch.no_grad()
    def clamp() -> None:
        for view, (low, high) in views:
            view.clamp_(low, high)

    return clamp


def float32_from_master(
    engine, params: Iterable[torch.Tensor], initial: Iterable[torch.Tensor]
) -> Callable[[], None]:
    """A function that makes each of `params` (model parameters) a float32 tensor holding its
    fp32 master's values: for a model's `bounded_parameters()`, which it reads in float32
    (the span fractions: pipeline.models.layers.AdaptiveSpan). DeepSpeed casts every
    parameter to the training precision and ZeRO 1/2 point the parameters back at that
    rounded copy after every step, so call it before every forward and after clamping.

    Build it once after `deepspeed.initialize` (and before anything re-points parameters):
    it writes `initial` (their float32 values from before DeepSpeed's cast) into the
    masters. Under ZeRO 1/2 a master is cut across ranks, so each call sums the pieces over
    the group (one all_reduce of the few span values). A no-op when no parameter is in bf16
    or fp16 (fp32 training). Not for ZeRO 3 (the spec refuses it for adaptive-span models)."""
    params = list(params)
    if not any(p.dtype in (torch.bfloat16, torch.float16) for p in params):
        return lambda: None
    index = {id(p): i for i, p in enumerate(params)}
    starts = [0]
    for p in params:
        starts.append(starts[-1] + p.numel())
    values = torch.cat([v.detach().reshape(-1).float() for v in initial])
    pieces, groups = [], set()
    for master, layout in _master_layouts(engine).items():
        if any(id(p) in index for p in layout.params):  # the same on every rank
            groups.add(layout.group)
        flat_master = master.data.view(-1)
        for run in layout.runs:  # this rank's pieces (none, under ZeRO 1/2, on some ranks)
            if run.owner == len(layout.params) or id(layout.params[run.owner]) not in index:
                continue
            param = layout.params[run.owner]
            at = (
                starts[index[id(param)]]
                + (run.lp.data_ptr() - param.data.data_ptr()) // param.element_size()
            )
            view = flat_master[run.start : run.start + run.length]
            view.copy_(values[at : at + run.length])
            pieces.append((view, at))
    if len(groups) != 1:
        raise PipelineError(
            "the bounded parameters are spread over several DeepSpeed process "
            "groups: cannot gather their fp32 masters"
        )
    (group,) = groups

    @torch.no_grad()
    def to_float32() -> None:
        buf = torch.zeros(starts[-1], dtype=torch.float32, device=params[0].device)
        for view, at in pieces:
            buf[at : at + view.numel()] = view
        if group is not None:
            dist.all_reduce(buf, group=group)
        for p, a, b in zip(params, starts, starts[1:], strict=False):
            p.data = buf[a:b].view(p.shape)

    to_float32()
    return to_float32


def before_save_checkpoint(engine) -> None:
    """Call right before `engine.save_checkpoint`. torch's Adagrad creates its state for the
    model parameters when it is built; DeepSpeed's bf16 wrappers then swap in fp32 copies,
    and that stale state makes torch's `state_dict` fail (KeyError). Drop it."""
    opt = _stepped_optimizer(engine)
    stepped = {id(p) for g in opt.param_groups for p in g["params"]}
    for p in [p for p in engine.module.parameters() if p in opt.state and id(p) not in stepped]:
        del opt.state[p]


def before_load_checkpoint(engine) -> None:
    """Call right before `engine.load_checkpoint`. ZeRO 3 steps each sub-group with its
    param group holding just that flat partition and leaves it empty afterwards, so saved
    groups are empty; a fresh torch Adagrad still lists the model parameters, and loading
    fails on the size mismatch. Empty them as ZeRO 3 would."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    if type(engine.optimizer) is DeepSpeedZeroOptimizer_Stage3:
        for group in _stepped_optimizer(engine).param_groups:
            group["params"] = []


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
