"""The Triton kernels of the all-attention op (``attention.impl: triton``) against the reference.

On a machine without CUDA they run in Triton's interpreter (float32: the interpreter has no
bfloat16), which is what CI runs, at every tile size of TILES (``forced_tile``: on a GPU the
timed choice may run any of them, per kernel); on CUDA the same cases run compiled in bf16,
marked ``cuda`` (gpu/check.py), in the first tile of TILES only (each tile is a compilation
per case; the GPU check's ``nan`` part forces each tile in bf16).

Every case compares the output and every gradient (q, k, v, the position table u, the
persistent keys and values, the spans through log m) with the reference op in float64, the
expected values computed by the reference's own maths (pipeline/ops/attention.py) and, for
dropout, by an explicit keep mask from an independent computation of the hash
(tests/unit/ops/test_attention_fused.py's ``flex_mask``).

The kernels compute the reference's maths, its +1e-8 renormalisation guard included, so the
reference runs as it is. Tolerances: float32 against float64, atol 2e-5 relative to each
gradient's largest entry, what the kernel's float32 reassociation gives (measured: <= 8e-6);
bf16 3e-2 as for flex. Where scores are tens of nats apart, the float32 rounding of the
score itself (|s| * 2^-24 relative in e^s) sets the bound: 1.5e-6 per nat of the gap
(measured: 6.9e-7 per nat at every tile).

Every case runs the persistent vectors inside the kernels (``persistent_split(False)``); the
default, the persistent part split out of them, is tested in test_attention_triton_split.py.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch

import pipeline.ops.attention as attention_mod
import pipeline.ops.triton_attention as triton_attention
from pipeline.ops import get_attention_impl
from tests.fixtures.attention import (
    NAMES,
    assert_traced_triton_gives_the_eager_bits,
    flex_mask,
    inputs,
    op_grads,
    reference_fn,
)
from tests.fixtures.attention import check_against_reference as _check_against_reference
from tests.fixtures.attention import close as _close
from tests.fixtures.tiny_models import tiny_allattn

CUDA = torch.cuda.is_available()
ROOT = Path(__file__).resolve().parents[3]


INTERPRETER_TILE = triton_attention.INTERPRETER_TILE["T"]
INTERPRETER_TILES = sorted({t["T"] for t in triton_attention.TILES} | {INTERPRETER_TILE})
"""Every tile size a GPU may run (TILES) and the interpreter's default."""


def _devices(every_tile: bool = False):
    """(device, dtype, tolerance, tile) cases: the interpreter on a CUDA-less machine (with
    ``every_tile``, once per tile size of INTERPRETER_TILES; else its default tile), compiled
    kernels on CUDA (tile None: TILES[0], see ``one_tile``)."""
    on_cpu = pytest.mark.skipif(
        CUDA, reason="a CUDA machine runs the kernels compiled: the cuda cases"
    )
    sizes = INTERPRETER_TILES if every_tile else [None]
    # the interpreter's own tile in `make test`, the GPU's other tiles in the system tier
    other_tiles = [on_cpu, pytest.mark.system]
    cpu = [
        pytest.param(
            "cpu",
            torch.float32,
            2e-5,
            None if t is None else {"T": t},
            marks=on_cpu if t in (None, INTERPRETER_TILE) else other_tiles,
            id="interpreter-fp32" + ("" if t is None else f"-T{t}"),
        )
        for t in sizes
    ]
    cuda = pytest.param(
        "cuda",
        torch.bfloat16,
        3e-2,
        None,
        marks=[pytest.mark.cuda, pytest.mark.skipif(not CUDA, reason="needs CUDA")],
        id="cuda-bf16",
    )
    return [*cpu, cuda]


def _in_tile(tile):
    return contextlib.nullcontext() if tile is None else triton_attention.forced_tile(tile)


@pytest.fixture(autouse=True)
def one_tile(monkeypatch):
    """On CUDA, the first tile only: every tile tried is a compilation per case."""
    monkeypatch.setattr(triton_attention, "TILES", triton_attention.TILES[:1])
    monkeypatch.setattr(triton_attention, "_tiles", {})


@pytest.fixture(autouse=True)
def unsplit():
    """The persistent vectors inside the kernels, which this file tests (the mutation check
    included); the op splits them out by default, test_attention_triton_split.py's subject."""
    with triton_attention.persistent_split(False):
        yield


# shapes: odd M, L' and N (not multiples of the interpreter's tile of 16), L' < M, L' = 1,
# a head size that is not a power of 2, N = 0
SHAPES = {
    "odd": dict(b=2, h=3, m=21, span=37, d=8, n=6),
    "span<block": dict(b=1, h=3, m=19, span=5, d=8, n=3),
    "span=1": dict(b=1, h=3, m=7, span=1, d=8, n=2),
    "head24-N17": dict(b=1, h=3, m=16, span=40, d=24, n=17),
    "no-persistent": dict(b=2, h=3, m=18, span=33, d=8, n=0),
}


@pytest.mark.parametrize("device,dtype,tol,tile", _devices(every_tile=True))
@pytest.mark.parametrize("shape", list(SHAPES))
def test_triton_equals_reference_forward_and_every_gradient(shape, device, dtype, tol, tile):
    xs, spans = inputs(**SHAPES[shape])
    if SHAPES[shape]["n"] == 0:
        xs = [*xs[:4], None, None]
    _check_against_reference(xs, spans, device, dtype, tol, tile)


HOT_KEY = 46
"""The key index of ``_hot_key_inputs``' high-scoring key: distance 4 from query 10 (L' 40),
where a span of 0 and the ramp of 3 put the mask's edge (m = 0, the clamp still passing
the span's gradient); queries 7-9 see it inside their spans (m > 0), queries 11-19 beyond
(m = 0, clamped)."""


def _hot_key_inputs(gap: float, n: int = 3, spans=(3.0, 0.0, 1.5)):
    """Small random scores (|s| < 1) and one key, HOT_KEY, whose score is ``gap`` nats above
    them for every query that sees it: the cases where a formula in log m lets a masked key
    through (-69 nats is all log(0 + 1e-30) takes off) or sends e^gap to the span."""
    xs, _ = inputs(b=1, h=3, m=20, span=40, d=8, n=n)
    q, k, v, pos, pk, pv = xs
    q, k, pos, pk = q * 0.1, k * 0.1, pos * 0.1, pk * 0.1
    q[..., 0] = 1.0
    k[..., HOT_KEY, 0] = gap * 8**0.5  # q . k / sqrt(d_h) = gap for every query
    persistent = (pk, pv) if n else (None, None)
    return [q, k, v, pos, *persistent], torch.tensor(spans, dtype=torch.float64)


@pytest.mark.parametrize("device,dtype,tol,tile", _devices(every_tile=True))
@pytest.mark.parametrize("gap", [25, 50, 100, 150])
def test_a_masked_key_far_above_the_rest_weighs_nothing_and_the_span_gradient_is_the_reference_s(
    gap, device, dtype, tol, tile
):
    """A key whose score beats every other by 25-150 nats, masked (m = 0) for most queries
    and at the mask's edge for one: the output is the reference's (the key gets exactly no
    weight where m = 0, so a row's output is the rest's, scaled down by the +1e-8 guard) and
    so is every gradient, the span's included: bounded by 1 / 1e-8 per weight as the
    reference's is (it grew like e^gap through log m: 1.9e8 against the reference's 5.1e5 at
    25 nats, in the issue's case)."""
    xs, spans = _hot_key_inputs(gap)
    _check_against_reference(xs, spans, device, dtype, max(tol, 1.5e-6 * gap), tile)


@pytest.mark.parametrize("device,dtype,tol,tile", _devices(every_tile=True))
def test_spans_at_zero_as_at_initialisation_put_the_ramp_s_edge_inside_the_window(
    device, dtype, tol, tile
):
    """z = 0 for every head (where spans start): the mask is 1, 2/3, 1/3 and then exactly 0
    from distance 4 on, with a key of 10 nats above the rest at the edge for one query."""
    xs, spans = _hot_key_inputs(10, spans=(0.0, 0.0, 0.0))
    _check_against_reference(xs, spans, device, dtype, tol, tile)


@pytest.mark.parametrize("device,dtype,tol,tile", _devices(every_tile=True))
@pytest.mark.parametrize("n", [0, 3])
def test_a_window_masked_throughout_gives_the_reference_s_output(n, device, dtype, tol, tile):
    """Spans of -5 with a ramp of 3: m = 0 at every distance. Without persistent vectors the
    reference's output is exactly 0 (0 / (0 + 1e-8)) and so is the kernel's; with them, the
    persistent vectors' softmax share, renormalised over themselves. (The context values get
    no gradient in either case, nor, without persistent vectors, anything else.)"""
    xs, spans = _hot_key_inputs(10, n=n, spans=(-5.0, -5.0, -5.0))
    if n == 0:
        cast = [None if x is None else x.to(device, dtype) for x in xs]
        with _in_tile(tile):
            out, _ = op_grads(get_attention_impl("triton"), cast, spans.to(device))
        assert torch.equal(out, torch.zeros_like(out))
    _check_against_reference(xs, spans, device, dtype, tol, tile, exercised=False)


@pytest.mark.parametrize("device,dtype,tol,tile", _devices())
def test_triton_without_a_span_mask_is_the_plain_joint_softmax(device, dtype, tol, tile):
    """Fixed span (no mask, no renormalisation), the reference's +1e-8 guard untouched: it
    only acts with a mask."""
    xs, _ = inputs(b=2, h=2, m=20, span=35, d=8, n=5)
    q, k, v, pos, pk, pv = xs
    triton = get_attention_impl("triton")
    leaves = [x.to(device, dtype).requires_grad_() for x in xs]
    out = triton(*leaves[:4], persistent_k=leaves[4], persistent_v=leaves[5])
    out.double().sum().backward()
    ref_leaves = [x.clone().requires_grad_() for x in xs]
    want = attention_mod.attend_reference(
        *ref_leaves[:4], persistent_k=ref_leaves[4], persistent_v=ref_leaves[5]
    )
    want.sum().backward()
    _close(out, want, tol, "out")
    for name, a, b in zip(NAMES, leaves, ref_leaves, strict=False):
        _close(a.grad, b.grad, tol, name)


@pytest.mark.parametrize("device,dtype,tol,tile", _devices(every_tile=True))
def test_triton_dropout_is_flex_s_mask_forward_and_backward_and_the_same_run_to_run(
    device, dtype, tol, tile
):
    b, h, m, span, n, p, seed = 2, 3, 21, 37, 6, 0.3, 11
    xs, spans = inputs(b=b, h=h, m=m, span=span, d=8, n=n)
    kw = dict(
        dropout_p=p, training=True, dropout_seed=torch.tensor(seed, dtype=torch.int32).to(device)
    )
    triton = get_attention_impl("triton")
    cast = [x.to(device, dtype) for x in xs]
    with _in_tile(tile):
        out, grads = op_grads(triton, cast, spans.to(device), **kw)
        again, grads_again = op_grads(triton, cast, spans.to(device), **kw)
    assert torch.equal(out, again)  # same seed: the same mask, the same bits
    assert all(torch.equal(g, a) for g, a in zip(grads, grads_again, strict=True))
    keep = flex_mask(seed, b, h, m, span, n, p)
    want, want_grads = op_grads(reference_fn(keep, p), xs, spans, **kw)
    _close(out, want, tol, "out")
    for name, g, w in zip(NAMES, grads, want_grads, strict=True):
        _close(g, w, tol, name)
    other = dict(kw, dropout_seed=kw["dropout_seed"] + 1)
    assert (op_grads(triton, cast, spans.to(device), **other)[0] - out).abs().max() > 1e-2


@pytest.mark.parametrize("device,dtype,tol,tile", _devices())
def test_triton_dropout_keep_rate_and_unbiased_weights(device, dtype, tol, tile):
    """Values are one-hot rows, so each output row is the row's attention weights after
    dropout: every weight is either dropped (0) or its undropped value / (1 - p) (to float
    precision), kept at a rate of 1 - p (within 5 binomial standard deviations), and their
    mean over the draws is the undropped weights (E[dropout(a)] = a)."""
    b, h, m, span, n, d, p = 24, 4, 4, 8, 4, 16, 0.3
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(b, h, m, d, generator=g), torch.randn(b, h, span + m, d, generator=g)
    pos, pk = torch.randn(d, span, generator=g), torch.randn(h, n, d, generator=g)
    eye = torch.eye(d)  # key c's value is e_c; persistent vector n's is e_(L' + M + n)
    v, pv = eye[: span + m].expand(b, h, -1, -1), eye[span + m :].expand(h, -1, -1)
    args = [x.to(device, dtype) for x in (q, k, v, pos)]
    pers = dict(persistent_k=pk.to(device, dtype), persistent_v=pv.to(device, dtype))
    triton = get_attention_impl("triton")
    with torch.no_grad():
        full = triton(*args, **pers).double().cpu()
        draws = torch.stack(
            [
                triton(
                    *args,
                    **pers,
                    dropout_p=p,
                    training=True,
                    dropout_seed=torch.tensor(s, dtype=torch.int32, device=device),
                )
                .double()
                .cpu()
                for s in range(2)
            ]
        )
    weights = full.expand_as(draws)
    live = weights > 0  # the window's and persistent weights (the rest is outside the window)
    kept = draws[live] != 0
    n_live = live.sum().item()
    assert n_live > 9_000
    assert abs(kept.double().mean().item() - (1 - p)) < 5 * (p * (1 - p) / n_live) ** 0.5
    scaled = draws[live][kept] * (1 - p)
    torch.testing.assert_close(scaled, weights[live][kept], rtol=max(tol, 1e-5), atol=0)
    # E[dropout(a)] = a: the sum of the draws against the sum of the weights, within 5
    # standard deviations (each draw of a has variance a^2 p / (1 - p))
    ratio = draws[live].sum() / weights[live].sum()
    sd = (p / (1 - p) * weights[live].square().sum()).sqrt() / weights[live].sum()
    assert abs(ratio.item() - 1) < 5 * sd.item()


@pytest.mark.parametrize("device,dtype,tol,tile", _devices())
def test_triton_draws_its_dropout_seed_on_the_device_reproducibly(device, dtype, tol, tile):
    xs, spans = inputs(b=1, h=3, m=16, span=20, d=8, n=4)
    triton = get_attention_impl("triton")
    cast = [x.to(device, dtype) for x in xs]
    mask = attention_mod.adaptive_span_mask(spans.to(device), 3, 20)
    kw = dict(persistent_k=cast[4], persistent_v=cast[5], span_mask=mask)

    def run(**extra):
        with torch.no_grad():
            return triton(*cast[:4], **kw, dropout_p=0.3, training=True, **extra)

    torch.manual_seed(5)
    first = run()
    torch.manual_seed(5)
    assert torch.equal(run(), first)
    torch.manual_seed(6)
    assert (run() - first).abs().max() > 1e-2
    torch.manual_seed(5)
    seed = torch.randint(0, 2**31 - 1, (), dtype=torch.int32, device=device)  # what it drew
    assert torch.equal(run(dropout_seed=seed), first)
    with torch.no_grad():  # not training: no dropout whatever p says
        plain = triton(*cast[:4], **kw)
        assert torch.equal(triton(*cast[:4], **kw, dropout_p=0.3, training=False), plain)


@pytest.mark.parametrize("device,dtype,tol,tile", _devices())
def test_triton_in_the_model_equals_the_reference_loss_and_gradients(device, dtype, tol, tile):
    """A small all-attention LM, adaptive span and persistent vectors, two blocks of a stream
    (the second attends to the first's cache): the loss and every parameter's gradient."""

    def run(impl):
        model = tiny_allattn(max_span=64, span_init=0.3).to(device)
        if impl == "reference":
            model = model.double()
        else:
            model = model.to(dtype)
        model.set_attention_impl(impl)
        g = torch.Generator().manual_seed(0)
        x = torch.randint(11, (2, 2, 20), generator=g).to(device)
        state, loss = None, 0.0
        for block in range(2):
            out = model(x[block], x[block].roll(-1, 1), state)
            state, loss = out.state, loss + out.nll.double().mean()
        loss = loss + model.aux_loss().double()
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters()}

    loss, grads = run("triton")
    want_loss, want = run("reference")
    _close(loss, want_loss, tol, "loss")
    for name in want:
        _close(grads[name], want[name], tol, name)
    assert want["layers.0.attn.adaptive_span.frac"].abs().max() > 0


@pytest.mark.parametrize("device,dtype,tol,tile", _devices())
def test_triton_traces_into_one_graph_with_its_backward_and_gives_the_eager_bits(
    device, dtype, tol, tile
):
    """What train.compile and its CUDA graphs need: torch.compile traces the op (its checks,
    the mask's log, the custom forward and backward ops) with no graph break, and the
    traced forward and backward (AOT autograd, eager kernels) give the eager op's bits."""
    xs, spans = inputs(dtype=torch.float32, b=1, h=3, m=16, span=20, d=8, n=4)
    assert_traced_triton_gives_the_eager_bits(xs, spans, device, dtype)


@pytest.mark.parametrize("device,dtype,tol,tile", _devices())
@pytest.mark.parametrize("persistent,mask,dropout", [(True, True, True), (False, False, False)])
def test_triton_ops_fake_kernels_match_the_real_outputs(
    persistent, mask, dropout, device, dtype, tol, tile
):
    """torch.library.opcheck on the forward and the backward op: the fake kernels (what
    torch.compile plans with) give each output's shape, dtype and strides exactly. Inductor
    asserts the real strides against them, so a transposed or sliced gradient (u's and log
    m's) fails a compiled step on the GPU (aot_eager, above, does not check strides)."""
    xs, spans = inputs(dtype=torch.float32, b=1, h=3, m=19, span=21, d=8, n=3)
    q, k, v, pos, pk, pv = [x.to(device, dtype) for x in xs]
    if not persistent:
        pk = pv = None
    span_mask = attention_mod.adaptive_span_mask(spans, 3, 21).float().to(device) if mask else None
    seed = torch.tensor(5, dtype=torch.int32, device=device) if dropout else None
    p = 0.3 if dropout else 0.0
    out, lse = torch.ops.allattn.triton_attention(q, k, v, pos, pk, pv, span_mask, seed, p)
    grad = torch.randn_like(out)
    for op, args in [
        (torch.ops.allattn.triton_attention, (q, k, v, pos, pk, pv, span_mask, seed, p)),
        (
            torch.ops.allattn.triton_attention_backward,
            (grad, q, k, v, pos, pk, pv, span_mask, seed, out, lse, p),
        ),
    ]:
        report = torch.library.opcheck(op, args, test_utils="test_faketensor")
        assert report == {"test_faketensor": "SUCCESS"}, report


def test_triton_refuses_what_it_cannot_run_in_one_line():
    xs, spans = inputs(b=1, h=2, m=4, span=5, d=8, n=2)
    q, k, v, pos, pk, pv = xs
    triton = get_attention_impl("triton")
    with pytest.raises(ValueError, match="float32, float16 or bfloat16, not torch.float64"):
        triton(q, k, v, pos)
    with pytest.raises(ValueError, match="persistent_k and persistent_v go together"):
        triton(q.float(), k.float(), v.float(), pos.float(), persistent_k=pk.float())
    with pytest.raises(ValueError, match=r"pos \[d_h, L'\]"):
        triton(q.float(), k.float(), v.float(), pos[:, :3].float())
    with pytest.raises(ValueError, match=r"span_mask must be \[H, L'\] = \(2, 5\), got \(3, 5\)"):
        triton(*(x.float() for x in (q, k, v, pos)), span_mask=torch.ones(3, 5))
    if not CUDA:
        with pytest.raises(ValueError, match="interpreter, which has no bfloat16"):
            triton(*(x.bfloat16() for x in (q, k, v, pos)))


class _FakeCudaTensor:
    device = torch.device("cuda")
    dtype = torch.bfloat16
    shape = (1, 8, 512, 64)


def test_the_tile_is_the_fastest_that_fits_kept_per_kernel_and_chosen_untimed_in_a_capture(
    monkeypatch,
):
    """On CUDA the first call of a kernel (per device, dtype, head size, L' bucket and
    query-row bucket) launches every tile of TILES, skips those that run out of resources,
    times the rest and keeps the fastest; later calls in the same buckets launch the kept tile
    once, and a span or a batch in another bucket is timed anew; inside a CUDA graph capture
    nothing is timed and the first tile that fits is kept. Events and launches faked: no GPU
    needed."""
    from triton.runtime.errors import OutOfResources

    tiles = ({"T": 128}, {"T": 64}, {"T": 32}, {"T": 16})
    ms = {128: None, 64: 3.0, 32: 2.0, 16: 5.0}  # None: out of shared memory
    monkeypatch.setattr(triton_attention, "TILES", tiles)
    launched: list[int] = []
    clock = []

    class Event:
        def __init__(self, enable_timing=False):
            pass

        def record(self):
            clock.append(launched[-1])

        def synchronize(self):
            pass

        def elapsed_time(self, end):
            return ms[clock[-1]] * 3

    def launch(tile):
        if ms[tile["T"]] is None:
            raise OutOfResources(232448, 227 * 1024, "shared memory")
        launched.append(tile["T"])

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    q = _FakeCudaTensor()  # B 1, H 8, M 512: 4,096 rows
    assert triton_attention._launch("forward", q, launch, 300) == {"T": 32}
    assert launched == [64, 64, 64, 64, 32, 32, 32, 32, 16, 16, 16, 16, 32]  # kept: once more
    key = ("forward", "cuda", torch.bfloat16, 64, 512, 4096)  # L' 300 in the bucket of 512
    assert triton_attention.tiles_in_use() == {key: {"T": 32}}
    launched.clear()
    assert triton_attention._launch("forward", q, launch, 512) == {"T": 32}  # the same bucket
    assert launched == [32]
    # the spans grew past the bucket: timed again, and now another tile is the fastest
    launched.clear()
    ms.update({32: 9.0})
    assert triton_attention._launch("forward", q, launch, 513) == {"T": 64}
    assert launched == [64, 64, 64, 64, 32, 32, 32, 32, 16, 16, 16, 16, 64]
    assert triton_attention.tiles_in_use()[key] == {"T": 32}  # the first bucket keeps its own
    ms.update({32: 2.0})
    # a capture: no timing, the first tile that fits
    launched.clear()
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert triton_attention._launch("backward dq", q, launch, 300) == {"T": 64}
    assert launched == [64, 64]
    ms.update({64: None, 32: None, 16: None})
    with pytest.raises(RuntimeError, match="no tile of TILES fits"):
        triton_attention._launch("backward dk dv", q, launch, 300)


@pytest.mark.skipif(CUDA, reason="the interpreter's run of the hash; CUDA runs it in every op")
@pytest.mark.parametrize("T", [16, 32])
def test_the_kernels_keep_draws_two_weights_per_hash_as_the_numpy_definition(T, monkeypatch):
    """``_keep`` of the kernels on a window tile (key coordinates i0 + kT + t, even at the
    tile's first column) and on a tile of persistent vectors (-1 - n), against the numpy
    definition (``keep_np``): keys 2s and 2s + 1 read the low and high 16 bits of one hash,
    so a tile of T x T weights takes T x T / 2 hashes."""
    import numpy as np
    import triton
    import triton.language as tl

    from pipeline.ops import triton_kernels
    from pipeline.ops.dropout import keep_threshold
    from tests.fixtures.attention import keep_np

    # the interpreter resolves a kernel's names in its module's globals
    monkeypatch.setitem(globals(), "tl", tl)
    monkeypatch.setitem(globals(), "triton_kernels", triton_kernels)

    @triton.jit
    def tile(out_ptr, seed, b, h, i0, c0, threshold, T: tl.constexpr):
        r, t = tl.arange(0, T)[:, None], tl.arange(0, T)[None, :]
        c = c0 + t
        if c0 < 0:
            c = c0 - t
        keep = triton_kernels._keep(seed, b, h, i0 + r, c, threshold, T)
        tl.store(out_ptr + r * T + t, keep.to(tl.int32))

    p, seed, b, h, i0 = 0.4, 987, 1, 2, 3 * T
    for c0 in (i0 + 2 * T, -1 - T):  # window tile k = 2; persistent vectors T .. 2T - 1
        out = torch.empty(T, T, dtype=torch.int32)
        tile[(1,)](out, seed, b, h, i0, c0, keep_threshold(p), T)
        rows = np.arange(i0, i0 + T)[:, None]
        cols = c0 + np.arange(T)[None, :] if c0 >= 0 else c0 - np.arange(T)[None, :]
        want = keep_np(seed, b, h, rows, cols, p)
        assert np.array_equal(out.numpy().astype(bool), want), c0
