"""The paper's optimizer: Adagrad whose step is clipped per parameter tensor."""

from __future__ import annotations

import copy
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from pipeline.diagnostics.host_syncs import HostSyncCounter
from pipeline.diagnostics.step_audit import OpCounter
from pipeline.errors import PipelineError
from pipeline.training.engine import _flat_layout, bind_to_engine
from pipeline.training.optim import ClippedAdagrad
from pipeline.training.partitions import whole as whole_layout

ROOT = Path(__file__).resolve().parents[3]


def reference_step(params, sums, grads, lr, clip, eps):
    """One float64 step of the update rule, element by element from its definition:
    the accumulator takes the unclipped g², and the step lr·g/(sqrt(sum) + eps) is scaled by
    clip/‖g‖ where the whole parameter's ‖g‖ exceeds clip. Returns how many were clipped."""
    clipped = 0
    for i, g in enumerate(grads):
        if g is None:
            continue
        g = g.double()
        sums[i] = sums[i] + g * g
        norm = math.sqrt(sum(x * x for x in g.reshape(-1).tolist()))
        factor = clip / (norm + 1e-10) if norm > clip else 1.0
        clipped += norm > clip
        params[i] = params[i] - lr * factor * g / (sums[i].sqrt() + eps)
    return clipped


# two groups with their own lr, clip and eps. eps = 1e-3 next to sqrt(sum) ~ 1e-3 makes its
# place in the formula visible (with the default 1e-10 it is not); the gradient scales give
# norms above the clip for some tensors and below it for others
GROUPS = [
    {
        "lr": 0.2,
        "clip_norm": 0.03,
        "eps": 1e-10,
        "shapes": [(4, 3), (7,), (2, 2, 2), (1,)],
        "scales": [1.0, 1e-3, 0.3, 2e-2],
    },
    {
        "lr": 0.05,
        "clip_norm": 0.5,
        "eps": 1e-3,
        "shapes": [(5, 5), (3,), (6, 1)],
        "scales": [0.4, 1e-3, 2e-3],
    },
]


# both ways of updating: torch's fused kernel (the CPU's default) and the multi-tensor ops
# (every other device's), each on the CPU here
BOTH = pytest.mark.parametrize("fused", [True, False], ids=["fused", "foreach"])


@BOTH
def test_clipped_adagrad_equals_its_update_rule_in_float64(fused):
    torch.manual_seed(0)
    groups = [[torch.nn.Parameter(torch.randn(s)) for s in g["shapes"]] for g in GROUPS]
    opt = ClippedAdagrad(
        [
            {"params": ps, **{k: g[k] for k in ("lr", "clip_norm", "eps")}}
            for ps, g in zip(groups, GROUPS, strict=False)
        ],
        lr=1.0,
        fused=fused,
    )
    ref = [[p.detach().double().clone() for p in ps] for ps in groups]
    acc = [[torch.zeros_like(r) for r in rs] for rs in ref]
    clipped = total = 0
    for step in range(6):
        for gi, (ps, g) in enumerate(zip(groups, GROUPS, strict=False)):
            grads = [torch.randn(s) * c for s, c in zip(g["shapes"], g["scales"], strict=False)]
            if step == 2:
                grads[1] = None  # a tensor without a gradient is left alone
            for p, grad in zip(ps, grads, strict=False):
                p.grad = None if grad is None else grad.clone()
            clipped += reference_step(ref[gi], acc[gi], grads, g["lr"], g["clip_norm"], g["eps"])
            total += sum(grad is not None for grad in grads)
        opt.step()
    assert 0 < clipped < total
    for ps, rs, accs in zip(groups, ref, acc, strict=False):
        for p, r, a in zip(ps, rs, accs, strict=False):
            torch.testing.assert_close(p.detach().double(), r, rtol=1e-5, atol=1e-7)
            torch.testing.assert_close(opt.state[p]["sum"].double(), a, rtol=1e-5, atol=0)


def flat_setup(fused: bool, seed: int = 0):
    """Stepped tensors cut like DeepSpeed's partitions, in one group with a whole tensor: two
    flat masters holding whole parameters between padding, and an ordinary parameter.
    Returns the optimizer, its stepped tensors, and where each parameter and padding lies."""
    torch.manual_seed(seed)
    shapes = [(3, 4), (7,), (2, 5), (6,)]
    model = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    # (stepped tensor, param index, offset, length); the rest of each flat is padding
    pieces_a, pieces_b = [(0, 2, 12), (1, 17, 7)], [(0, 0, 10), (1, 13, 6)]
    flat_a, flat_b = torch.randn(25), torch.randn(20)  # the model's low-precision copies
    master_a, master_b = (torch.nn.Parameter(f.clone()) for f in (flat_a, flat_b))
    whole = torch.nn.Parameter(torch.randn(4, 4))
    layouts = {
        master_a: _flat_layout(master_a, flat_a, model[:2], pieces_a, None),
        whole: whole_layout(whole, whole),
        master_b: _flat_layout(master_b, flat_b, model[2:], pieces_b, None),
    }
    opt = ClippedAdagrad([master_a, whole, master_b], lr=0.1, clip_norm=0.5, eps=1e-10, fused=fused)
    opt.bind_layouts(layouts)
    # where each parameter's elements are: (stepped tensor, slice)
    where = [(master_a, slice(o, o + n)) for _, o, n in pieces_a]
    where += [(whole, slice(0, 16))]
    where += [(master_b, slice(o, o + n)) for _, o, n in pieces_b]
    padding = {
        master_a: [slice(0, 2), slice(14, 17), slice(24, 25)],
        master_b: [slice(10, 13), slice(19, 20)],
    }
    return opt, [master_a, whole, master_b], where, padding


@BOTH
def test_flat_partitions_step_each_parameter_by_its_own_norm_and_padding_never_moves(fused):
    opt, stepped, where, padding = flat_setup(fused)
    ref = [t.detach().reshape(-1)[s].double().clone() for t, s in where]
    acc = [torch.zeros_like(r) for r in ref]
    pad_before = {t: [t.detach().reshape(-1)[s].clone() for s in sl] for t, sl in padding.items()}
    scales = [1.0, 1e-3, 0.05, 2.0, 1e-2]
    clipped = 0
    for _ in range(4):
        for t in stepped:
            t.grad = torch.randn_like(t)  # padding gets gradients too: it must not move
        for (t, s), c in zip(where, scales, strict=False):
            t.grad.view(-1)[s] *= c
        grads = [t.grad.reshape(-1)[s].clone() for t, s in where]
        clipped += reference_step(ref, acc, grads, lr=0.1, clip=0.5, eps=1e-10)
        opt.step()
    assert 0 < clipped < 4 * len(where)
    for (t, s), r in zip(where, ref, strict=False):
        torch.testing.assert_close(t.detach().reshape(-1)[s].double(), r, rtol=1e-5, atol=1e-7)
    for t, sl in padding.items():
        for s, before in zip(sl, pad_before[t], strict=False):
            assert torch.equal(t.detach().reshape(-1)[s], before)


@BOTH
def test_a_finite_gradient_whose_square_overflows_float32_is_clipped_by_its_true_norm(fused):
    """Issue 43 item 1: four finite gradients of 1e20 (float32) had a float32 norm of inf,
    so the parameter's step was clipped to nothing, and their squares made the accumulator
    inf for good. Their norm is 2e20: the fifth element, whose gradient is 1, moves by
    lr·clip/2e20 each step; the accumulator stays finite (at float32's largest value where
    g² = 1e40 passes it), and so do the weights."""
    lr, clip, eps = 0.1, 0.03, 1e-10
    w = torch.nn.Parameter(torch.zeros(5))
    opt = ClippedAdagrad([w], lr=lr, clip_norm=clip, eps=eps, fused=fused)
    float32_max = 3.4028234663852886e38  # (2 - 2**-23) * 2**127
    norm = math.sqrt(4 * 1e20 * 1e20 + 1.0)  # 2e20
    expected_w5 = 0.0
    for step in (1, 2):
        w.grad = torch.tensor([1e20, 1e20, 1e20, 1e20, 1.0])
        opt.step()
        expected_w5 -= lr * (clip / (norm + 1e-10)) * 1.0 / (math.sqrt(step * 1.0) + eps)
        acc = opt.state[w]["sum"]
        assert torch.isfinite(acc).all() and torch.isfinite(w).all()
        assert acc.tolist() == [float32_max] * 4 + [float(step)]
        assert w[:4].tolist() == [0.0] * 4  # g / inf at the step where g² overflowed
        assert w[4].item() == pytest.approx(expected_w5, rel=1e-6, abs=0)
    assert expected_w5 == pytest.approx(-1.5e-23 * (1 + 1 / math.sqrt(2)), rel=1e-9, abs=0)


@BOTH
def test_a_step_never_waits_for_the_device(fused):
    """No op of a step reads a device value on the host (the loop before read one per tensor)."""
    opt, stepped, _, _ = flat_setup(fused)
    for step in range(3):  # the first step builds the plan and the state: also none
        for t in stepped:
            t.grad = torch.randn_like(t)
        with HostSyncCounter() as counted:
            opt.step()
        assert counted.syncs == [], f"step {step}: {counted.syncs}"


def ops_per_step(fused: bool, tensors_per_group: int, groups: int = 2) -> int:
    torch.manual_seed(0)
    shapes = [(3, 5), (17,), (2, 3, 4), (8, 8)]
    params = [
        [torch.nn.Parameter(torch.randn(shapes[i % len(shapes)])) for i in range(tensors_per_group)]
        for _ in range(groups)
    ]
    opt = ClippedAdagrad(
        [{"params": ps, "clip_norm": 0.1 * (g + 1)} for g, ps in enumerate(params)],
        lr=0.1,
        fused=fused,
    )
    counts = []
    for _ in range(2):
        for p in (p for ps in params for p in ps):
            p.grad = torch.randn_like(p)
        with OpCounter() as counted:
            opt.step()
        counts.append(counted.total)
    return counts[-1]


@BOTH
def test_the_ops_per_step_do_not_grow_with_the_number_of_tensors(fused):
    """A step dispatches a fixed number of (multi-tensor) ops per param group: the same for 5
    and 60 tensors a group, and few. The loop before ran about 26 per tensor."""
    few, many = ops_per_step(fused, 5), ops_per_step(fused, 60)
    assert few == many, (few, many)
    assert many <= 2 * 30, many


def test_the_state_loaded_from_a_checkpoint_is_the_one_stepped():
    """Plans are cached per list of tensors; the accumulators they use are not: after
    load_state_dict the next steps continue the saved run exactly."""

    def run(steps, opt, params, seed):
        gen = torch.Generator().manual_seed(seed)
        for _ in range(steps):
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen)
            opt.step()

    torch.manual_seed(0)
    a = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(5))]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    opt_a, opt_b = ClippedAdagrad(a, lr=0.1), ClippedAdagrad(b, lr=0.1)
    run(3, opt_a, a, 1)
    run(3, opt_b, b, 1)  # b's plan is built and cached here
    saved = copy.deepcopy(opt_a.state_dict())  # not the live accumulators
    run(2, opt_b, b, 2)  # b drifts, then gets a's state and weights back
    opt_b.load_state_dict(saved)
    with torch.no_grad():
        for p, q in zip(a, b, strict=False):
            q.copy_(p)
    run(2, opt_a, a, 3)
    run(2, opt_b, b, 3)
    for p, q in zip(a, b, strict=False):
        assert torch.equal(p, q)


def test_eps_must_be_positive():
    """eps = 0 divides 0 by 0 where the accumulator is still 0, and lets padding move."""
    with pytest.raises(ValueError, match="eps"):
        ClippedAdagrad([torch.nn.Parameter(torch.ones(3))], lr=0.1, eps=0.0)


def test_a_flattened_parameter_it_was_not_told_about_is_refused():
    opt = ClippedAdagrad([torch.nn.Parameter(torch.ones(3))], lr=0.1)
    flat = torch.nn.Parameter(torch.ones(8))  # what a DeepSpeed wrapper substitutes
    flat.grad = torch.ones(8)
    opt.param_groups[0]["params"] = [flat]
    with pytest.raises(PipelineError, match="bind_to_engine"):
        opt.step()


def test_an_unknown_deepspeed_wrapper_is_refused():
    opt = ClippedAdagrad([torch.nn.Parameter(torch.ones(3))], lr=0.1)
    engine = SimpleNamespace(basic_optimizer=opt, optimizer=SimpleNamespace(optimizer=opt))
    with pytest.raises(PipelineError, match="unknown DeepSpeed optimizer wrapper"):
        bind_to_engine(engine)
