"""The ``triton`` op with its persistent part split out of the kernels (issue 43, item 4):
the window through the kernels without the persistent tiles, the persistent part a dense
attention over the batch-folded queries (``pipeline.ops.persistent_part``), the two merged by
log-sum-exp, and each part's backward given the joint output and log-sum-exp.

As in test_attention_triton.py: on a machine without CUDA the kernels run in Triton's
interpreter in float32 against the reference in float64, the output and every gradient (q,
k, v, u, the persistent keys and values, the spans through m) within 2e-5 of each one's scale,
1.5e-6 per nat where scores are tens of nats apart; on CUDA (``-m cuda``, the GPU check) the
same cases through torch's flash and memory-efficient ops. The persistent part's joint-output
backward is also checked on its own, in float64, against autograd through the merge.
"""

from __future__ import annotations

import math

import pytest
import torch

import pipeline.ops.triton_attention as triton_attention
from pipeline.ops import adaptive_span_mask, get_attention_impl, persistent_part
from pipeline.ops.triton_attention import persistent_split
from tests.fixtures.attention import (
    NAMES,
    assert_traced_triton_gives_the_eager_bits,
    check_against_reference,
    close,
    flex_mask,
    inputs,
    op_grads,
    reference_fn,
)

CUDA = torch.cuda.is_available()
on_cpu = pytest.mark.skipif(CUDA, reason="a CUDA machine runs the kernels compiled: the cuda cases")
cuda = [pytest.mark.cuda, pytest.mark.skipif(not CUDA, reason="needs CUDA")]

CPU_CASES = [
    pytest.param("cpu", torch.float32, 2e-5, b, marks=on_cpu, id=f"interpreter-fp32-{b}")
    for b in ("cpu_flash", "math")
]
"""The interpreter with each CPU backend of the persistent part; most cases run the first
only (the maths of the two are checked against each other in float64 below)."""
CUDA_CASES = [
    pytest.param("cuda", torch.bfloat16, 3e-2, "flash", marks=cuda, id="cuda-bf16-flash"),
    pytest.param("cuda", torch.bfloat16, 3e-2, "efficient", marks=cuda, id="cuda-bf16-efficient"),
    pytest.param("cuda", torch.float32, 1e-4, "efficient", marks=cuda, id="cuda-fp32-efficient"),
]
ONE_CPU_CASE = CPU_CASES[:1]


@pytest.fixture(autouse=True)
def one_tile(monkeypatch):
    """On CUDA, the first tile only (as in test_attention_triton.py)."""
    monkeypatch.setattr(triton_attention, "TILES", triton_attention.TILES[:1])
    monkeypatch.setattr(triton_attention, "_tiles", {})


def _split_check(xs, spans, device, dtype, tol, backend, **kw):
    with persistent_split(True, backend):
        check_against_reference(xs, spans, device, dtype, tol, **kw)


@pytest.mark.parametrize("device,dtype,tol,backend", CPU_CASES + CUDA_CASES)
def test_the_split_equals_the_reference_forward_and_every_gradient(device, dtype, tol, backend):
    """Odd M, L' and N, two batch elements folded into one query length."""
    xs, spans = inputs(b=2, h=3, m=19, span=21, d=8, n=6)
    _split_check(xs, spans, device, dtype, tol, backend)


@pytest.mark.parametrize("device,dtype,tol,backend", ONE_CPU_CASE + CUDA_CASES[:1])
def test_the_split_folds_any_batch_and_any_rows(device, dtype, tol, backend):
    """Three batch elements of 7 queries (L' < M, N > M): the fold's rows r = b M + i back
    in their places, for the output, dq and the persistent vectors' batch sum."""
    xs, spans = inputs(b=3, h=3, m=7, span=5, d=8, n=17)
    _split_check(xs, spans, device, dtype, tol, backend)


def _gap_inputs(gap: float, spans=(1.5, 0.0, 3.25)):
    """Small random scores, every window key ``gap`` nats above them for batch element 0's
    queries and ``gap`` below for element 1's: in the fold, rows whose window outweighs the
    persistent part by e^gap next to rows where it is the other way round (so a part's
    weights from its own log-sum-exp, not the joint one, are wrong by ~1 somewhere)."""
    xs, _ = inputs(b=2, h=3, m=9, span=12, d=8, n=4)
    q, k, v, pos, pk, pv = xs
    q, k, pos, pk = q * 0.1, k * 0.1, pos * 0.1, pk * 0.1
    q[0, ..., 0], q[1, ..., 0] = 1.0, -1.0
    k[..., 0] = gap * 8**0.5  # q . k / sqrt(d_h) = +-gap
    return [q, k, v, pos, pk, pv], torch.tensor(spans, dtype=torch.float64)


@pytest.mark.parametrize("device,dtype,tol,backend", ONE_CPU_CASE + CUDA_CASES[:1])
@pytest.mark.parametrize("gap", [25, 100])
def test_the_merge_keeps_both_parts_when_they_are_tens_of_nats_apart(
    gap, device, dtype, tol, backend
):
    """Window and persistent parts 25 and 100 nats apart either way: no overflow in the
    merge, the smaller part's e^-gap share neither blown up nor the larger part lost."""
    xs, spans = _gap_inputs(gap)
    _split_check(xs, spans, device, dtype, max(tol, 1.5e-6 * gap), backend)


@pytest.mark.parametrize("device,dtype,tol,backend", ONE_CPU_CASE + CUDA_CASES[:1])
def test_a_window_masked_throughout_leaves_the_persistent_part_and_the_guard(
    device, dtype, tol, backend
):
    """Spans of -5 with a ramp of 3: m = 0 at every distance, so the window's part is its
    guard alone, D_w = 1e-8 sum(e) over its 12 keys. 18 nats above the persistent part (batch
    element 0) that weighs about as much as the persistent part (1e-8 * 12 e^18 = 7.9 against
    4), so the merge's shares are both far from 0 and 1; 18 nats below it (element 1), nothing.
    The output is the persistent vectors' share renormalised by the reference's guard. (The
    context values get no gradient.)"""
    xs, spans = _gap_inputs(18, spans=(-5.0, -5.0, -5.0))
    _split_check(xs, spans, device, dtype, max(tol, 1.5e-6 * 18), backend, exercised=False)


@pytest.mark.parametrize("device,dtype,tol,backend", ONE_CPU_CASE + CUDA_CASES[:1])
def test_without_persistent_vectors_there_is_nothing_to_split(device, dtype, tol, backend):
    xs, spans = inputs(b=2, h=3, m=18, span=9, d=8, n=0)
    _split_check([*xs[:4], None, None], spans, device, dtype, tol, backend)


@pytest.mark.parametrize(
    "device,dtype,tol",
    [pytest.param("cpu", torch.float32, 2e-5, marks=on_cpu, id="interpreter-fp32")],
)
def test_the_split_s_dropout_on_the_cpu_is_the_kernels_mask(device, dtype, tol):
    """With dropout the CPU's persistent part (``math``) draws flex's hash at key coordinate
    -1 - n, the window kernel's bits: against the reference with that mask, computed
    independently of the code. (On CUDA the SDPA ops draw their own: the statistics tests of
    test_attention_triton.py cover them.)"""
    b, h, m, span, n, p, seed = 2, 3, 9, 13, 6, 0.3, 11
    xs, spans = inputs(b=b, h=h, m=m, span=span, d=8, n=n)
    kw = dict(dropout_p=p, training=True, dropout_seed=torch.tensor(seed, dtype=torch.int32))
    with persistent_split(True):  # dropout: the math backend
        out, grads = op_grads(get_attention_impl("triton"), [x.to(dtype) for x in xs], spans, **kw)
    keep = flex_mask(seed, b, h, m, span, n, p)
    want, want_grads = op_grads(reference_fn(keep, p), xs, spans, **kw)
    close(out, want, tol, "out")
    for name, g, w in zip(NAMES, grads, want_grads, strict=True):
        close(g, w, tol, name)


@pytest.mark.parametrize(
    "device,backend",
    [
        pytest.param("cpu", "math", marks=on_cpu, id="interpreter-math"),
        pytest.param("cuda", "flash", marks=cuda, id="cuda-flash"),
    ],
)
def test_the_split_ops_fake_kernels_match_the_real_outputs(device, backend):
    """torch.library.opcheck on the split's forward and backward op (with the mask and
    dropout): the fake kernels give each output's shape, dtype and strides, the persistent
    part's dropout state included."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    xs, spans = inputs(dtype=torch.float32, b=2, h=3, m=5, span=6, d=8, n=3)
    q, k, v, pos, pk, pv = [x.to(device, dtype) for x in xs]
    span_mask = adaptive_span_mask(spans, 3, 6).float().to(device)
    seed = torch.tensor(5, dtype=torch.int32, device=device)
    args = (q, k, v, pos, pk, pv, span_mask, seed, 0.3, backend)
    out, lse, rng_a, rng_b = torch.ops.allattn.triton_attention_split(*args)
    grad = torch.randn_like(out)
    back = (grad, q, k, v, pos, pk, pv, span_mask, seed, out, lse, rng_a, rng_b, 0.3, backend)
    for op, op_args in [
        (torch.ops.allattn.triton_attention_split, args),
        (torch.ops.allattn.triton_attention_split_backward, back),
    ]:
        report = torch.library.opcheck(op, op_args, test_utils="test_faketensor")
        assert report == {"test_faketensor": "SUCCESS"}, report


# ------------------------------------------------------------------------------------------
# the persistent part alone: its backward from the joint output and log-sum-exp, float64
# ------------------------------------------------------------------------------------------


def _dense(q, k, v):
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    lse = torch.logsumexp(s, -1)
    return torch.exp(s - lse[..., None]) @ v, lse


@pytest.mark.parametrize("backend", ["math", "cpu_flash"])
def test_the_persistent_part_s_backward_from_the_joint_output_is_the_joint_op_s_gradient(
    backend,
):
    """Another part (keys ka, va) merged with the persistent part by log-sum-exp: autograd
    through the merge (float64) against ``persistent_backward`` given only the merged output
    and log-sum-exp, to 1e-12; and the part's output and log-sum-exp against plain maths.
    With its own log-sum-exp or output in place of the joint ones it is far off."""
    g = torch.Generator().manual_seed(0)
    h, rows, n, d, m = 2, 10, 5, 8, 5

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).requires_grad_()

    q, pk, pv = rand(h, rows, d), rand(h, n, d, scale=2.0), rand(h, n, d)
    ka, va = rand(h, 7, d), rand(h, 7, d)
    out_a, lse_a = _dense(q, ka, va)
    out_p, lse_p = _dense(q, pk, pv)
    lse = torch.logaddexp(lse_a, lse_p)
    out = out_a * torch.exp(lse_a - lse)[..., None] + out_p * torch.exp(lse_p - lse)[..., None]
    w = torch.randn(out.shape, generator=g, dtype=torch.float64)
    want = torch.autograd.grad((out * w).sum(), (q, pk, pv))

    got_out, got_lse, rng_a, rng_b = persistent_part.persistent_forward(
        q.detach(), pk.detach(), pv.detach(), None, 0.0, backend, m
    )
    close(got_out, out_p.detach(), 1e-12, "out")
    close(got_lse, lse_p.detach(), 1e-6, "lse")  # float32, as the kernels' lse

    args = (w, q.detach(), pk.detach(), pv.detach(), None)

    def backward(o, lse_used):
        return persistent_part.persistent_backward(
            *args, o.detach(), lse_used.detach(), rng_a, rng_b, 0.0, backend, m
        )

    dq_p, dpk, dpv = backward(out, lse)
    close(dpk, want[1], 1e-12, "persistent_k")
    close(dpv, want[2], 1e-12, "persistent_v")
    # dq: the persistent part's share, i.e. the joint dq less the other part's, which is the
    # same formula over the other keys (P = exp(s_a - lse), delta the joint one)
    s_a = q.detach() @ ka.detach().transpose(-1, -2) / math.sqrt(d)
    p_a = torch.exp(s_a - lse.detach()[..., None])
    delta = (w * out.detach()).sum(-1, keepdim=True)
    dq_a = (p_a * (w @ va.detach().transpose(-1, -2) - delta)) @ ka.detach() / math.sqrt(d)
    close(dq_p + dq_a, want[0], 1e-12, "q")
    # the parts' own output / log-sum-exp in place of the joint ones: wrong
    for o, lse_used in [(out_p, lse), (out, lse_p)]:
        _, dpk_bad, _ = backward(o, lse_used)
        assert (dpk_bad - want[1]).abs().max() > 1e-3


def test_the_persistent_part_s_backend_is_flash_or_memory_efficient_on_cuda_where_they_apply():
    choose = persistent_part.choose_backend
    assert choose("cuda", torch.bfloat16, 64, True) == "flash"
    assert choose("cuda", torch.float16, 128, False) == "flash"
    assert choose("cuda", torch.float32, 64, True) == "efficient"
    assert choose("cuda", torch.bfloat16, 512, True) == "efficient"
    assert choose("cuda", torch.bfloat16, 12, True) == "math"
    assert choose("cpu", torch.float32, 8, False) == "cpu_flash"
    assert choose("cpu", torch.float32, 8, True) == "math"  # torch's CPU op has no dropout
    with pytest.raises(ValueError, match="no dropout"):
        persistent_part.persistent_forward(
            torch.zeros(1, 4, 8), torch.zeros(1, 2, 8), torch.zeros(1, 2, 8), None, 0.3,
            "cpu_flash", 2,
        )  # fmt: skip


@pytest.mark.parametrize(
    "device,dtype", [pytest.param("cpu", torch.float32, marks=on_cpu, id="interpreter-fp32")]
)
def test_the_split_is_off_by_default_and_can_be_switched_on(device, dtype, monkeypatch):
    """``SPLIT_PERSISTENT`` (and ``persistent_split`` over it) decides which op runs; off
    until a GPU has run the split's CUDA path."""
    xs, spans = inputs(dtype=torch.float32, b=1, h=3, m=5, span=4, d=8, n=3)
    called = []
    for name in ("_split_forward_op", "_forward_op"):
        real = getattr(triton_attention, name)
        monkeypatch.setattr(
            triton_attention, name, lambda *a, _real=real, _n=name: called.append(_n) or _real(*a)
        )
    triton = get_attention_impl("triton")
    q, k, v, pos, pk, pv = xs
    assert not triton_attention.SPLIT_PERSISTENT
    with torch.no_grad():
        triton(q, k, v, pos, persistent_k=pk, persistent_v=pv)
        with persistent_split(True):
            triton(q, k, v, pos, persistent_k=pk, persistent_v=pv)
        monkeypatch.setattr(triton_attention, "SPLIT_PERSISTENT", True)
        triton(q, k, v, pos, persistent_k=pk, persistent_v=pv)
        with persistent_split(False):
            triton(q, k, v, pos, persistent_k=pk, persistent_v=pv)
    assert called == ["_forward_op", "_split_forward_op", "_split_forward_op", "_forward_op"]


@pytest.mark.parametrize(
    "device,dtype,backend",
    [
        pytest.param("cpu", torch.float32, "math", marks=on_cpu, id="interpreter-fp32-math"),
        pytest.param("cuda", torch.bfloat16, "flash", marks=cuda, id="cuda-bf16-flash"),
    ],
)
def test_the_split_traces_into_one_graph_with_its_backward_and_gives_the_eager_bits(
    device, dtype, backend
):
    """torch.compile traces the split (its forward and backward ops, the persistent part's
    dropout state among their outputs) with no graph break, and the traced forward and
    backward give the eager op's bits (torch's generator seeded alike for the CUDA ops'
    dropout)."""
    xs, spans = inputs(dtype=torch.float32, b=2, h=3, m=5, span=6, d=8, n=3)
    assert_traced_triton_gives_the_eager_bits(
        xs, spans, device, dtype, around=lambda: persistent_split(True, backend)
    )
