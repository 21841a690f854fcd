"""The one module that reaches into DeepSpeed's engine (tests/test_architecture.py holds the
rule; pipeline/cluster/distributed.py also imports deepspeed, for the process group and its
comm op, before any engine exists).

Everything that builds the engine or reads its internals is here: the tensors its optimizer
wrapper really steps and which parameter each element of them belongs to (for
ClippedAdagrad's per-parameter clipping and for the bounded parameters' clamp), the fixes
its checkpoints need, the ZeRO 1/2 partitions of a resharded resume, its checkpoint files'
types and its logger. The rest of the training code holds an engine and calls only its
public methods (forward, backward, step, save_checkpoint, load_checkpoint, module) and the
functions here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pipeline.errors import PipelineError
from pipeline.training.optim import ClippedAdagrad
from pipeline.training.partitions import Layout, Run, whole


def initialize(model: torch.nn.Module, optimizer: torch.optim.Optimizer, config: dict):
    """DeepSpeed's engine around `model` (already on its device) and the client `optimizer`,
    configured by `config` (pipeline.training.ds_config.deepspeed_config)."""
    import deepspeed

    with _without(UNTESTED_OPTIMIZER):
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


UNTESTED_OPTIMIZER = "**** You are using ZeRO with an untested optimizer"
"""DeepSpeed's warning for an optimizer outside its ZeRO list (ClippedAdagrad, the paper's),
printed by every engine built (train's and finetune's: twice a run). The config allows it
on purpose (ds_config's zero_allow_untested_optimizer), and these optimizers under ZeRO are
checked against an unsharded float64 update (tests/system/training/test_optim_two_processes):
the warning is left out."""


@contextlib.contextmanager
def _without(prefix: str):
    """DeepSpeed's log records that start with `prefix` left out while inside."""
    from deepspeed.utils import logger

    def keep(record) -> bool:
        return not str(record.msg).startswith(prefix)

    logger.addFilter(keep)
    try:
        yield
    finally:
        logger.removeFilter(keep)


def param_groups(engine) -> list[dict]:
    """The param groups whose "lr" the engine's next step uses."""
    return engine.optimizer.param_groups


def skip_single_process_allreduce(engine, world_size: int) -> bool:
    """At world size 1 without ZeRO, stop the engine averaging the gradients over the one
    process after each backward: it flattens every gradient into one buffer, all-reduces it
    over a group of one, divides it by 1 and copies it back (about 5 aten ops per parameter
    and two passes over the gradients; bench/engine_overhead.py), and no DeepSpeed config key
    turns that off. ZeRO stages keep it: their reduction is what fills their partitions.
    Returns whether it was turned off."""
    if world_size != 1 or engine.zero_optimization_stage() != 0:
        return False
    engine.enable_backward_allreduce = False
    return True


# ------------------------------------------------------------ the tensors the optimizer steps


def _flat_layout(master, flat, params, pieces, group) -> Layout:
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
            runs.append(Run(len(params), pos, start - pos, flat_1d[pos:start]))
        runs.append(Run(owner, start, length, flat_1d[start : start + length]))
        pos = start + length
    if pos < flat.numel() or not runs:
        runs.append(Run(len(params), pos, flat.numel() - pos, flat_1d[pos:]))
    return Layout(list(params), runs, group)


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


def master_layouts(engine) -> dict[torch.Tensor, Layout]:
    """For every tensor the basic optimizer steps: which model parameter each element is."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    wrapper = engine.optimizer
    if wrapper is engine.basic_optimizer:  # ZeRO 0, fp32: steps the parameters
        return {p: whole(p, p) for g in wrapper.param_groups for p in g["params"]}
    if getattr(wrapper, "cpu_offload", False) or getattr(wrapper, "offload_optimizer", False):
        raise PipelineError(
            "per-parameter optimizer layouts are not supported with ZeRO offload; turn offload off"
        )
    layouts: dict[torch.Tensor, Layout] = {}
    if type(wrapper) is FP16_UnfusedOptimizer:  # ZeRO 0, bf16: one fp32 copy per tensor
        for masters, params in zip(wrapper.fp32_groups, wrapper.fp16_groups, strict=False):
            layouts |= {m: whole(m, p) for m, p in zip(masters, params, strict=False)}
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


def stepped_optimizer(engine) -> torch.optim.Optimizer:
    """The torch optimizer DeepSpeed really steps: for torch's Adagrad, ZeRO builds a new one
    over its fp32 partitions instead of the client's."""
    return getattr(engine.optimizer, "optimizer", engine.optimizer)


def bind_to_engine(engine) -> None:
    """Call right after `deepspeed.initialize`: tells a ClippedAdagrad how DeepSpeed cut the
    parameters into the tensors it steps. A no-op for other optimizers."""
    opt = engine.basic_optimizer
    if isinstance(opt, ClippedAdagrad):
        if stepped_optimizer(engine) is not opt:
            raise PipelineError(
                f"{type(engine.optimizer).__name__} replaced ClippedAdagrad "
                "by an optimizer of its own: per-tensor clipping would be lost"
            )
        opt.bind_layouts(master_layouts(engine))


class MasterClamp:
    """Clamps each model parameter of `bounded` (parameter, low, high: a model's
    `bounded_parameters()`) to [low, high] in every copy this rank holds: the fp32 master the
    optimizer steps, from which DeepSpeed overwrites the model's copy at the next step, and
    the model's copy itself. Build it once after `initialize` (and `bind_to_engine`); call
    `clamp()` after every optimizer step."""

    def __init__(self, engine, bounded: Iterable[tuple[torch.Tensor, float, float]]):
        bounds = {id(p): (low, high) for p, low, high in bounded}
        self.views: list[tuple[torch.Tensor, tuple[float, float]]] = []
        for master, layout in master_layouts(engine).items():
            flat_master = master.data.view(-1)
            for run in layout.runs:
                if run.owner < len(layout.params) and id(layout.params[run.owner]) in bounds:
                    low_high = bounds[id(layout.params[run.owner])]
                    self.views += [
                        (flat_master[run.start : run.start + run.length], low_high),
                        (run.lp, low_high),
                    ]
        # ZeRO 0-2 keep every parameter whole on every rank (ZeRO 3: empty outside forward)
        self.views += [
            (p.data, bounds[id(p)])
            for p in engine.module.parameters()
            if id(p) in bounds and p.numel()
        ]

    @torch.no_grad()
    def clamp(self) -> None:
        for view, (low, high) in self.views:
            view.clamp_(low, high)


class Float32Masters:
    """Makes each of `params` (model parameters) a float32 tensor holding its fp32 master's
    values: for a model's `bounded_parameters()`, which it reads in float32 (the span
    fractions: pipeline.models.allattn.layers.AdaptiveSpan). DeepSpeed casts every parameter to the
    training precision and ZeRO 1/2 point the parameters back at that rounded copy after
    every step, so call `copy_to_params()` before every forward and after clamping.

    The parameters always point at the same float32 buffer, allocated here and refilled in
    place by each copy: a CUDA graph records a parameter's address when it is captured, so
    the address must not change for the life of the engine.

    Build it once after `initialize` (and before anything re-points parameters): it writes
    `initial` (their float32 values from before DeepSpeed's cast) into the masters. Under
    ZeRO 1/2 a master is cut across ranks, so each copy sums the pieces over the group (one
    all_reduce of the few span values). Does nothing when no parameter is in bf16 or fp16
    (fp32 training). Not for ZeRO 3 (the spec refuses it for adaptive-span models)."""

    def __init__(self, engine, params: Iterable[torch.Tensor], initial: Iterable[torch.Tensor]):
        self.params = list(params)
        self.pieces: list[tuple[torch.Tensor, int]] = []  # (a master's run, its offset)
        self.active = any(p.dtype in (torch.bfloat16, torch.float16) for p in self.params)
        if not self.active:
            return
        index = {id(p): i for i, p in enumerate(self.params)}
        self.starts = [0]
        for p in self.params:
            self.starts.append(self.starts[-1] + p.numel())
        values = torch.cat([v.detach().reshape(-1).float() for v in initial])
        groups = set()
        for master, layout in master_layouts(engine).items():
            if any(id(p) in index for p in layout.params):  # the same on every rank
                groups.add(layout.group)
            flat_master = master.data.view(-1)
            for run in layout.runs:  # this rank's pieces (none, under ZeRO 1/2, on some ranks)
                if run.owner == len(layout.params) or id(layout.params[run.owner]) not in index:
                    continue
                param = layout.params[run.owner]
                at = (
                    self.starts[index[id(param)]]
                    + (run.lp.data_ptr() - param.data.data_ptr()) // param.element_size()
                )
                view = flat_master[run.start : run.start + run.length]
                view.copy_(values[at : at + run.length])
                self.pieces.append((view, at))
        if len(groups) != 1:
            raise PipelineError(
                "the bounded parameters are spread over several DeepSpeed process "
                "groups: cannot gather their fp32 masters"
            )
        (self.group,) = groups
        self.buffer = torch.zeros(
            self.starts[-1], dtype=torch.float32, device=self.params[0].device
        )
        self.views = [
            self.buffer[a:b].view(p.shape)
            for p, a, b in zip(self.params, self.starts, self.starts[1:], strict=False)
        ]
        self.copy_to_params()

    @torch.no_grad()
    def copy_to_params(self) -> None:
        if not self.active:
            return
        self.buffer.zero_()  # the ranks' pieces are summed: the others' places hold 0
        for view, at in self.pieces:
            self.buffer[at : at + view.numel()].copy_(view)
        if self.group is not None:
            dist.all_reduce(self.buffer, group=self.group)
        for p, view in zip(self.params, self.views, strict=True):
            p.data = view


def before_save_checkpoint(engine) -> None:
    """Call right before `engine.save_checkpoint`. torch's Adagrad creates its state for the
    model parameters when it is built; DeepSpeed's bf16 wrappers then swap in fp32 copies,
    and that stale state makes torch's `state_dict` fail (KeyError). Drop it."""
    opt = stepped_optimizer(engine)
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
        for group in stepped_optimizer(engine).param_groups:
            group["params"] = []


# ------------------------------------------------------------ checkpoints


@contextlib.contextmanager
def quiet_failed_save():
    """Without DeepSpeed's log line for a checkpoint directory it could not make: the write
    fails next, and the caller reports it, with its cause, in the one line of the error."""
    with _without("Failed saving model checkpoint"):
        yield


def optimizer_file_types() -> list:
    """The types DeepSpeed's ZeRO optimizer files (`*optim_states.pt`) hold besides tensors
    and plain containers."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, ZeroStageEnum, fragment_address]


def zero3_fp32_weights(root: Path, tag: str) -> dict:
    """The fp32 weights of ZeRO 3 checkpoint `tag` under `root`, assembled from its shards.
    DeepSpeed unpickles them without restriction: read each safely first."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return get_fp32_state_dict_from_zero_checkpoint(str(root), tag=tag)


def optimizer_partitioned(engine, ckpt: Path) -> bool:
    """True if the checkpoint's optimizer state is split over its writers' files (ZeRO 1/2),
    False if it is whole in the model-states file (ZeRO 0); refuses what cannot be resharded."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    if not engine.zero_optimization():
        return False
    wrapper = engine.optimizer
    if engine.zero_optimization_stage() >= 3:
        # each parameter is sharded separately and the module weights exist only as shards
        raise PipelineError(
            f"checkpoint {ckpt}: resuming a ZeRO 3 checkpoint on another "
            f"number of processes is not supported; resume with the "
            f"train.launcher it was written with"
        )
    if type(wrapper) is not DeepSpeedZeroOptimizer or wrapper.cpu_offload:
        raise PipelineError(
            f"checkpoint {ckpt}: resuming on another number of processes "
            f"supports ZeRO 1/2 without offload (DeepSpeed's "
            f"{type(wrapper).__name__} here); resume with the train.launcher "
            f"it was written with"
        )
    if wrapper.round_robin_gradients:
        raise PipelineError(
            "zero_optimization.round_robin_gradients orders the flat buffer by "
            "world size: the checkpoint cannot be resharded"
        )
    return True


def zero_partition_files(engine, ckpt: Path, writers: int) -> list[Path]:
    """The `writers` ranks' ZeRO 1/2 optimizer files in checkpoint directory `ckpt`, in rank
    order; refuses a checkpoint that lacks one."""
    prefix = "bf16_" if engine.bfloat16_enabled() else ""  # DeepSpeed's naming
    files = [ckpt / f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(writers)]
    missing = [f.name for f in files if not f.exists()]
    if missing:
        raise PipelineError(
            f"checkpoint {ckpt} lacks {', '.join(missing)}: it was not written "
            f"by {writers} ZeRO 1/2 processes and cannot be resharded"
        )
    return files


def load_zero_partitions(engine, saved: list[dict], ckpt: Path) -> None:
    """Fill this rank's ZeRO 1/2 fp32 masters and optimizer state from `saved`, the writer
    ranks' `zero_pp_rank_*` files (zero_partition_files) of checkpoint directory `ckpt` as
    read (memory-mapped: a rank reads only the slices its own partition needs). Call after
    the engine has loaded the checkpoint's module weights (`load_optimizer_states=False`)."""
    from deepspeed.checkpoint.constants import (
        BASE_OPTIMIZER_STATE,
        GROUP_PADDINGS,
        OPTIMIZER_STATE_DICT,
        PARAM_ALIGNMENT_PADDINGS,
        SINGLE_PARTITION_OF_FP32_GROUPS,
    )

    wrapper = engine.optimizer
    writers = len(saved)
    old = [sd[OPTIMIZER_STATE_DICT] for sd in saved]
    if old[0].get(PARAM_ALIGNMENT_PADDINGS) != wrapper.round_robin_bit16_padding:
        raise PipelineError(
            f"checkpoint {ckpt} lays out the parameters with other alignment "
            f"padding than this run: it cannot be resharded"
        )
    wrapper._load_global_state(old[0])  # loss scale, overflow flag, clipping: rank-independent
    base = old[0][BASE_OPTIMIZER_STATE]
    state: dict[Any, Any] = {}
    for i, master in enumerate(wrapper.single_partition_of_fp32_groups):
        rank = torch.distributed.get_rank(group=wrapper.real_dp_process_group[i])
        start = rank * master.numel()  # the flat buffer is cut into equal slices
        masters = [sd[SINGLE_PARTITION_OF_FP32_GROUPS][i] for sd in old]
        held = sum(m.numel() for m in masters)
        expected = sum(p.numel() for p in wrapper.bit16_groups[i]) + sum(
            wrapper.round_robin_bit16_padding[i]
        )
        if held != expected:
            raise PipelineError(
                f"checkpoint {ckpt}: param group {i} holds {held} elements over "
                f"{writers} ranks, this model {expected}: not the same model"
            )
        with torch.no_grad():
            master.copy_(_slice(masters, start, master.numel()))
        # optimizer state tensors cover a rank's slice with its padding; others (`step`) are
        # the same on every rank
        padded = masters[0].numel() + old[0][GROUP_PADDINGS][i]
        state[i] = {}
        for key, value in base["state"].get(i, {}).items():
            if torch.is_tensor(value) and value.shape == (padded,):
                pieces = [
                    sd[BASE_OPTIMIZER_STATE]["state"][i][key][: m.numel()]
                    for sd, m in zip(old, masters, strict=False)
                ]
                value = _slice(pieces, start, master.numel())
            state[i][key] = value.clone() if torch.is_tensor(value) else value  # off the mmap
    wrapper.optimizer.load_state_dict({"state": state, "param_groups": base["param_groups"]})
    wrapper._link_all_hp_params()  # DeepSpeed's per-parameter views into the new state


def _slice(pieces: list[torch.Tensor], start: int, length: int) -> torch.Tensor:
    """Elements start .. start+length-1 of the concatenated `pieces`, zero past their end
    (the end padding of the flat buffer). Only the overlapping parts of pieces are read."""
    out = torch.zeros(length, dtype=pieces[0].dtype)
    offset = 0
    for piece in pieces:
        piece = piece.reshape(-1)
        lo, hi = max(start, offset), min(start + length, offset + piece.numel())
        if lo < hi:
            out[lo - start : hi - start] = piece[lo - offset : hi - offset]
        offset += piece.numel()
    return out
