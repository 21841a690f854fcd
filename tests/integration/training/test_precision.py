"""Issue 26, item 2: on a GPU the paper configs train in bf16 (train.deepspeed.bf16: auto). The CPU
counterpart of tests/system/cluster/test_cuda.py::test_bf16_training_step_on_cuda_follows_float32,
through the DeepSpeed engine as the trainer builds it (pipeline.training.ds_config, ZeRO 0, bf16's
fp32 masters, the paper's clipped Adagrad bound to the engine): a few updates of a tiny
all-attention model in bf16 follow the float32 ones."""

from __future__ import annotations

import contextlib
from functools import partial
from types import SimpleNamespace as NS

import pytest
import torch


def tiny_engine(bf16: bool, zero_stage: int = 0, ds_extra: dict | None = None):
    """The engine around a tiny adaptive-span model, as the trainer builds it, and the span
    fractions' float32 values from before DeepSpeed's cast."""
    import deepspeed

    from pipeline.cluster import distributed
    from pipeline.models import build_model
    from pipeline.training.ds_config import deepspeed_config
    from pipeline.training.engine import bind_to_engine
    from pipeline.training.optim import build_optimizer

    distributed.init_process_group()
    torch.manual_seed(0)
    model = build_model(
        "allattn",
        {
            "d_model": 32,
            "n_layers": 2,
            "n_heads": 2,
            "n_persistent": 8,
            "max_span": 32,
            "span_init": 0.5,
            "attn_dropout": 0.0,
        },
        vocab_size=23,
    )
    opt_cfg = NS(type="adagrad", lr=0.07, clip="per_param", clip_norm=0.03)
    train = NS(
        batch_size=4,
        micro_batch_size=None,
        optimizer=opt_cfg,
        deepspeed=NS(zero_stage=zero_stage, bf16=bf16, fp16=False, gradient_accumulation_steps=1),
    )
    bounded_init = [p.detach().clone() for p, _, _ in model.bounded_parameters()]
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        optimizer=build_optimizer(model.parameters(), opt_cfg),
        config=deepspeed_config(train, 1) | (ds_extra or {}),
    )
    bind_to_engine(engine)
    return engine, bounded_init


def losses(
    bf16: bool,
    steps: int = 4,
    skip_allreduce: bool = False,
    engine_out: list | None = None,
    around=None,
    zero_stage: int = 0,
    ds_extra: dict | None = None,
) -> list[float]:
    from pipeline.training.engine import skip_single_process_allreduce

    engine, _ = tiny_engine(bf16, zero_stage, ds_extra)
    if skip_allreduce:
        assert skip_single_process_allreduce(engine, 1)
    if engine_out is not None:
        engine_out.append(engine)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 23, (4, 17), generator=gen)
    out = []
    state = engine.module.init_state(4)
    with around or contextlib.nullcontext():
        for _ in range(steps):
            res = engine(tokens[:, :-1], tokens[:, 1:], state)
            nll = res.nll.float().mean()
            engine.backward(nll + engine.module.aux_loss())
            engine.step()
            state = res.state
            out.append(nll.item())
    return out


def test_bf16_training_on_the_cpu_follows_float32():
    f32, bf16 = losses(False), losses(True)
    assert f32[-1] < f32[0]  # it learns, so following it means something
    assert bf16 == pytest.approx(f32, rel=1e-2)  # measured: within 1.2e-3


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_one_process_without_the_engines_allreduce_steps_the_same_weights(bf16):
    """Issue 26, item 2: at world size 1 without ZeRO the trainer turns the engine's
    gradient allreduce off (engine.skip_single_process_allreduce); it was an average over
    one process, so the updates are bit for bit the same, and no allreduce runs."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names: list[int] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if "allreduce" in func.__name__:  # (its tensors, ...): their sizes
                self.names.append(sum(t.numel() for t in args[0]))
            return func(*args, **(kwargs or {}))

    default, skipped = [], []
    assert losses(bf16, 3, engine_out=default) == losses(bf16, 3, True, engine_out=skipped)
    for a, b in zip(default[0].module.parameters(), skipped[0].module.parameters(), strict=False):
        assert torch.equal(a, b)
    # bf16's overflow check still all-reduces its one-element flag (DeepSpeed does that
    # when the engine's allreduce is off); no gradient is
    losses(bf16, 1, True, around=(ops := Ops()))
    assert ops.names == ([1] if bf16 else [])
    losses(bf16, 1, False, around=(ops := Ops()))
    assert max(ops.names) > 10_000  # what it saves: every gradient


def test_bf16_under_zero_checks_no_gradient_for_overflow():
    """bf16 cannot overflow where float32 does not: ds_config turns off DeepSpeed's check of
    every step's gradients for inf/NaN (two host syncs a step under ZeRO 1 and 2), which
    the float32 engine never does; the updates are the same."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Syncs(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += func.__name__.startswith("_local_scalar_dense")
            return func(*args, **(kwargs or {}))

    checked = {"bf16": {"enabled": True, "check_grad_overflow": True}}
    ours, default = Syncs(), Syncs()
    a = losses(True, 2, zero_stage=2, around=ours)
    b = losses(True, 2, zero_stage=2, around=default, ds_extra=checked)
    assert a == b
    assert default.count - ours.count == 2 * 2  # two a step, over two steps


def fp32_master(engine, param: torch.Tensor) -> torch.Tensor:
    """DeepSpeed's fp32 master of `param`, read through DeepSpeed's own records."""
    from deepspeed.utils import safe_get_full_fp32_param

    master = safe_get_full_fp32_param(param)  # ZeRO 1 and 2
    if master is not None:
        return master
    wrapper = engine.optimizer  # ZeRO 0: one fp32 copy per tensor, group by group
    for params, masters in zip(wrapper.fp16_groups, wrapper.fp32_groups, strict=True):
        for p, m in zip(params, masters, strict=True):
            if p is param:
                return m.detach().clone()
    raise AssertionError("no fp32 master found")


@pytest.mark.parametrize("zero_stage", [0, 2])
def test_the_span_fractions_stay_at_one_address_holding_their_fp32_masters(zero_stage):
    """Issue 43 item 1: inside a CUDA graph a parameter is read at the address recorded at
    capture, so the float32 span fractions must live at one address for the life of the
    engine: every forward and every update sees the address they had after initialisation
    (the first tensor is kept alive, so a new buffer could not reuse its memory), holding
    the fp32 masters' values."""
    from pipeline.training.nonfinite import NonfiniteGuard
    from pipeline.training.tasks import TokenStreams
    from pipeline.training.trainer import EngineUpdates

    engine, bounded_init = tiny_engine(True, zero_stage)
    model = engine.module
    fracs = [p for p, _, _ in model.bounded_parameters()]
    updates = EngineUpdates(engine, NonfiniteGuard("stop", 0, "train", "cpu"), bounded_init)
    first = [p.data for p in fracs]
    addresses = [t.data_ptr() for t in first]
    assert all(p.dtype == torch.float32 for p in fracs)
    seen: list[list[int]] = []
    model.register_forward_pre_hook(lambda m, a: seen.append([p.data_ptr() for p in fracs]))
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 23, (4, 17), generator=gen)
    state = model.init_state(4)
    moved = []
    for _ in range(4):
        rows = (tokens[:, :-1], tokens[:, 1:])
        forward = partial(TokenStreams().forward, engine, rows, state)
        out = updates.run(partial(updates.micro_batch, forward))
        state = out.state
        assert [p.data_ptr() for p in fracs] == addresses
        for p in fracs:
            assert p.dtype == torch.float32
            assert torch.equal(p.detach(), fp32_master(engine, p))
        moved.append(torch.cat([p.detach().clone() for p in fracs]))
    assert seen == [addresses] * 4
    assert not torch.equal(moved[0], moved[-1])  # the spans were trained, not left alone
