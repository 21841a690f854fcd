"""The fused attention backends against the reference op, forward and backward, flex's hashed
dropout mask against an independent computation of the hash, and the flex path's bounded
compilations.

Tolerances: float64 backends equal the reference to 1e-12 with the reference's +1e-8
renormalisation guard set to 0 (the fused paths leave it out, see pipeline/ops/fused.py),
and to rtol 1e-6 / atol 1e-7 with it; the sdpa model's loss and gradients to 1e-7 / rtol
1e-6; flex runs in float32 (forward only on CPU): atol 2e-6 on the logits.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import pipeline.ops.attention as attention_mod
import pipeline.ops.fused as fused_mod
from pipeline.ops import (
    adaptive_span_mask,
    attend_reference,
    compile_count,
    flex_keep,
    get_attention_impl,
)
from pipeline.ops.dropout import KEEP_BITS, keep_threshold
from pipeline.ops.fused import flex_bucket, pick_attention_impl
from tests.fixtures.attention import (
    DT,
    flex_mask,
    inputs,
    keep_np,
    op_grads,
    reference_fn,
    reference_with_mask,
    run_op,
)
from tests.fixtures.tiny_models import tiny_allattn

CUDA = torch.cuda.is_available()
NO_CUDA = "needs CUDA (FlexAttention backward and its compiled dropout are CUDA-only in torch 2.13)"


# --------------------------------------------------------------------------------------
# flex's dropout mask, computed independently of pipeline.ops.dropout
# --------------------------------------------------------------------------------------


def _eager_flex(monkeypatch):
    """flex through torch's eager flex_attention with its math backward, which torch runs on
    the CPU too once its device check is lifted (the CUDA kernel's maths, without a GPU)."""
    import torch.nn.attention.flex_attention as fa

    monkeypatch.setattr(fa, "_validate_device", lambda *a: None)

    def fn(*args, **kw):
        return fused_mod._attend_flex(*args, flex=fa.flex_attention, **kw)

    return fn


def test_flex_keep_is_the_hash_computed_independently_with_int32_or_int64_counters():
    g = np.random.default_rng(0)
    counters = [g.integers(-(2**31), 2**31, 4000) for _ in range(5)]
    seed, b, h, q, c = counters
    want = keep_np(seed, b, h, q, c, 0.3)
    for dt in (torch.int32, torch.int64):  # the compiled kernel's / eager flex's indices
        t = [torch.from_numpy(x).to(dt) for x in counters]
        got = flex_keep(t[0].to(torch.int32), *t[1:], threshold=round(0.3 * 2**16))
        assert np.array_equal(got.numpy(), want), dt


@pytest.mark.parametrize("p", [0.1, 0.4, 0.9])
def test_the_keep_fraction_over_a_million_draws_is_1_minus_p_within_4_sigma(p):
    """A million weights (250 queries x 4000 consecutive key coordinates, so 500,000 hashes of
    two draws each, negative coordinates included), their keep bits computed by numpy
    (``keep_np``), the op's hash equal to them; the keep fraction within 4 binomial standard
    deviations of 1 - p, and the two halves of a hash (keys 2s and 2s + 1) uncorrelated."""
    q, c = np.meshgrid(np.arange(250), np.arange(-2000, 2000), indexing="ij")
    keep = keep_np(12345, 1, 2, q, c, p)
    got = flex_keep(
        torch.tensor(12345, dtype=torch.int32), torch.tensor(1), torch.tensor(2),
        torch.from_numpy(q), torch.from_numpy(c), keep_threshold(p),
    )  # fmt: skip
    assert np.array_equal(got.numpy(), keep)
    n = keep.size
    assert n == 1_000_000
    assert abs(keep.mean() - (1 - p)) < 4 * (p * (1 - p) / n) ** 0.5
    even, odd = keep[:, 0::2].ravel().astype(float), keep[:, 1::2].ravel().astype(float)
    assert abs(np.corrcoef(even, odd)[0, 1]) < 4 / even.size**0.5


def test_the_keep_threshold_s_16_bits_quantise_p_by_less_than_1e_4_relative():
    """Two draws of 16 bits per 32-bit hash: p is kept as a multiple of 2**-16, at most 2**-17
    off; at p = 0.4, 26214 / 65536 = 0.3999939 (1.5e-5 relative; 8 bits would give 102 / 256,
    0.39% off)."""
    assert KEEP_BITS == 16
    assert keep_threshold(0.4) == 26214
    assert abs(keep_threshold(0.4) / 2**16 - 0.4) / 0.4 < 1e-4
    for p in np.linspace(0.0, 0.99, 199):
        assert abs(keep_threshold(p) / 2**16 - p) <= 2**-17


def test_flex_mask_statistics():
    """Keep rate within a binomial bound, and no structure along any axis."""
    p, shape = 0.3, (4, 3, 50, 500)
    a = flex_mask(7, *shape[:3], 300, 200, p)
    assert a.shape == shape
    n = a.numel()
    assert abs(a.float().mean().item() - (1 - p)) < 5 * (p * (1 - p) / n) ** 0.5
    assert 0.35 < (a != flex_mask(8, *shape[:3], 300, 200, p)).float().mean() < 0.49
    for dim in range(4):  # rows, heads, batch elements and keys drop independently
        first, second = a.select(dim, 0), a.select(dim, 1)
        assert 0.38 < (first != second).float().mean() < 0.46  # 2 p (1 - p) = 0.42


def test_reference_dropout_is_reproducible_from_the_seed_and_acts_on_the_renormalised_weights():
    xs, spans = inputs()
    q, k, v, pos, pk, pv = xs
    mask = adaptive_span_mask(spans, 3, pos.shape[1])
    kw = dict(persistent_k=pk, persistent_v=pv, span_mask=mask, dropout_p=0.3, training=True)
    torch.manual_seed(3)
    got = attend_reference(q, k, v, pos, **kw)
    torch.manual_seed(3)
    assert torch.equal(attend_reference(q, k, v, pos, **kw), got)
    torch.manual_seed(4)
    assert (attend_reference(q, k, v, pos, **kw) - got).abs().max() > 1e-2
    # the same draws again, as masks: one per part (context, persistent), in that order
    # (on the CPU: a weight is dropped when a float32 uniform draw from torch's generator is
    # below p)
    torch.manual_seed(3)
    keep_ctx = torch.rand(2, 3, 5, 7) >= 0.3
    keep_pers = torch.rand(2, 3, 5, 6) >= 0.3
    want = reference_with_mask(
        torch.cat([keep_ctx, keep_pers], -1),
        0.3,
        q,
        k,
        v,
        pos,
        persistent_k=pk,
        persistent_v=pv,
        span_mask=mask,
    )
    torch.testing.assert_close(got, want, rtol=0, atol=1e-13)
    with pytest.raises(ValueError, match="dropout_seed"):
        attend_reference(q, k, v, pos, dropout_seed=torch.tensor(1, dtype=torch.int32), **kw)


def test_attention_dropout_statistics():
    """Keep rate within a binomial bound; E[dropout(a)] = a (kept weights scaled by 1/(1-p))."""
    from pipeline.ops import attention_dropout

    p, n = 0.4, 200_000
    torch.manual_seed(0)
    a = torch.rand(n, dtype=DT)

    def dropout(a):
        dropped, owed = attention_dropout(a, p)
        return dropped * owed

    d = dropout(a)
    kept = d != 0
    assert abs(kept.double().mean().item() - (1 - p)) < 5 * (p * (1 - p) / n) ** 0.5
    torch.testing.assert_close(d[kept], a[kept] / (1 - p), rtol=1e-15, atol=0)
    draws = torch.stack([dropout(torch.full((n,), 0.25, dtype=DT)) for _ in range(4)])
    sd = 0.25 * (p / (1 - p)) ** 0.5 / (draws.numel()) ** 0.5
    assert abs(draws.mean().item() - 0.25) < 5 * sd


@pytest.mark.parametrize("persistent", [True, False])
def test_sdpa_equals_reference_forward_and_backward(persistent, monkeypatch):
    xs, spans = inputs()
    if not persistent:  # Transformer + adaptive span: no persistent vectors
        xs = [*xs[:4], None, None]
    sdpa = get_attention_impl("sdpa")
    out, grads = op_grads(sdpa, xs, spans)
    assert all(torch.isfinite(g).all() for g in grads if g is not None)  # log 0 is NaN-safe
    want, want_grads = op_grads(attend_reference, xs, spans)
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-7)
    monkeypatch.setattr(attention_mod, "RENORM_EPS", 0.0)
    want, want_grads = op_grads(attend_reference, xs, spans)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
    names = ["q", "k", "v", "pos", "persistent_k", "persistent_v", "spans"]
    for name, g, w in zip(names, grads, want_grads, strict=False):
        if w is None:
            assert g is None, name
            continue
        assert w.abs().max() > 0, name
        torch.testing.assert_close(g, w, rtol=0, atol=1e-12, msg=name)


def test_sdpa_refuses_dropout():
    xs, spans = inputs()
    with pytest.raises(ValueError, match="dropout"):
        run_op(get_attention_impl("sdpa"), xs, spans, dropout_p=0.1, training=True)


def test_flex_buckets_bound_the_compiled_shapes():
    lens = range(64, 8192 + 1, 64)
    buckets = {flex_bucket(n) for n in lens}
    assert len(buckets) <= 15
    assert all(n <= flex_bucket(n) < 1.5 * n for n in lens)
    assert flex_bucket(1) == 64


def test_auto_picks_by_device_dtype_and_dropout():
    f32, bf16 = torch.float32, torch.bfloat16
    # CUDA, from the measured step times (docs/benchmarks.md): the reference in every dtype
    # (flex in bf16 was 8x / 5x slower per enwik8_large step at span 1/16 / 1 on an H200)
    for dropout in (True, False):
        for grad in (True, False):
            for dtype in (bf16, torch.float16, f32):
                assert pick_attention_impl("cuda", dtype, dropout, grad) == "reference"
    assert pick_attention_impl("cpu", f32, dropout=True, grad=True) == "reference"
    assert pick_attention_impl("cpu", f32, dropout=False, grad=True) == "sdpa"
    assert pick_attention_impl("cpu", f32, dropout=False, grad=False) == "flex"
    assert pick_attention_impl("cpu", DT, dropout=False, grad=True) == "reference"


def test_flex_model_forward_equals_reference_and_training_compiles_a_bounded_number_of_times():
    """50 training steps (spans learned, changing every step) with an eval forward through
    flex after each: flex equals the reference and compiles at most once (one bucket)."""
    model = tiny_allattn(span_init=0.2)
    model.set_attention_impl("auto")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(11, (2, 16), generator=g), torch.randint(11, (2, 16), generator=g)
    before = compile_count()
    spans_seen = []
    for _ in range(50):
        model.train()
        # a reward for longer spans makes them grow, within L' = 64 (z + R <= 64)
        grow = sum(layer.attn.adaptive_span.frac.sum() for layer in model.layers)
        loss = model(x, y).nll.mean() - 0.02 * grow
        opt.zero_grad()
        loss.backward()
        opt.step()
        model.after_step()
        spans_seen.append(model.spans()[0][0])
        model.eval()
        with torch.no_grad():
            flex_out = model(x).logits  # auto: flex for a forward without grad on CPU
            model.set_attention_impl("reference")
            ref_out = model(x).logits
            model.set_attention_impl("auto")
        torch.testing.assert_close(flex_out, ref_out, rtol=0, atol=2e-6)
    assert len(set(spans_seen)) == 50  # the spans changed every step
    assert set(model.span_lens()) == {64}
    assert compile_count() - before <= 1
    print(f"flex compilations over 50 steps: {compile_count() - before}")


def test_model_backends_equal_reference_loss_and_gradients():
    """sdpa inside the model (float64, fixed seed, dropout off as sdpa has no dropout):
    loss and every gradient, including the spans, position table and persistent vectors."""

    def run(impl):
        model = tiny_allattn(span_init=0.2, attn_dropout=0.0).to(DT)
        model.set_attention_impl(impl)
        model.train()
        g = torch.Generator().manual_seed(0)
        x, y = torch.randint(11, (2, 16), generator=g), torch.randint(11, (2, 16), generator=g)
        loss = model(x, y).nll.mean() + model.aux_loss()
        loss.backward()
        return loss, dict((n, p.grad) for n, p in model.named_parameters())

    loss, grads = run("sdpa")
    want_loss, want = run("reference")
    torch.testing.assert_close(loss, want_loss, rtol=0, atol=1e-7)
    for name in (
        "pos_table",
        "layers.0.attn.adaptive_span.frac",
        "layers.1.attn.persistent_k",
        "layers.1.attn.persistent_v",
        "layers.0.attn.q_proj.weight",
    ):
        assert want[name].abs().max() > 0, name
        torch.testing.assert_close(grads[name], want[name], rtol=1e-6, atol=1e-8, msg=name)


def test_flex_dropout_equals_the_reference_with_flex_s_mask_on_cpu():
    # Forward only (FlexAttention has no CPU backward), uncompiled: the score_mod that drops
    # entries and the exp(lse_kept - lse_all) / (1 - p) rescaling, against the reference's
    # maths in float64 with the mask computed independently. float32 is what flex computes
    # in; tolerance for its reassociation.
    b, h, m, span, n, p = 2, 3, 16, 40, 6, 0.3
    xs, spans = inputs(dtype=torch.float32, m=m, span=span, d=8, n=n)
    seed = torch.tensor(11, dtype=torch.int32)
    with torch.no_grad():
        out = run_op(
            get_attention_impl("flex"), xs, spans, dropout_p=p, training=True, dropout_seed=seed
        )
        again = run_op(
            get_attention_impl("flex"), xs, spans, dropout_p=p, training=True, dropout_seed=seed
        )
        other = run_op(
            get_attention_impl("flex"), xs, spans, dropout_p=p, training=True, dropout_seed=seed + 1
        )
        keep = flex_mask(11, b, h, m, span, n, p)
        want = run_op(
            reference_fn(keep, p),
            [x.double() for x in xs],
            spans.double(),
            dropout_p=p,
            training=True,
            dropout_seed=None,
        )
    assert torch.equal(out, again)  # same seed, same mask
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-6)
    assert (other - out).abs().max() > 1e-2  # the mask really depends on the seed


def test_flex_dropout_draws_its_seed_on_the_device_reproducibly():
    xs, spans = inputs(dtype=torch.float32, m=16, span=40, d=8, n=6)
    kw = dict(dropout_p=0.3, training=True)
    flex = get_attention_impl("flex")
    with torch.no_grad():
        torch.manual_seed(5)
        first = run_op(flex, xs, spans, **kw)
        torch.manual_seed(5)
        assert torch.equal(run_op(flex, xs, spans, **kw), first)
        torch.manual_seed(6)
        assert (run_op(flex, xs, spans, **kw) - first).abs().max() > 1e-2
        torch.manual_seed(5)
        seed = torch.randint(0, 2**31 - 1, (), dtype=torch.int32)  # what flex drew
        torch.testing.assert_close(
            run_op(flex, xs, spans, dropout_seed=seed, **kw), first, rtol=0, atol=0
        )


def test_flex_dropout_rows_with_every_weight_dropped_give_zero():
    b, h, m, span, n, p = 2, 3, 16, 40, 6, 0.97
    xs, spans = inputs(dtype=torch.float32, m=m, span=span, d=8, n=n)
    keep = flex_mask(3, b, h, m, span, n, p)
    empty = ~keep.any(-1)
    assert empty.any() and not empty.all()
    with torch.no_grad():
        out = run_op(
            get_attention_impl("flex"),
            xs,
            spans,
            dropout_p=p,
            training=True,
            dropout_seed=torch.tensor(3, dtype=torch.int32),
        )
        want = run_op(
            reference_fn(keep, p),
            [x.double() for x in xs],
            spans.double(),
            dropout_p=p,
            training=True,
            dropout_seed=None,
        )
    assert torch.isfinite(out).all() and (out[empty] == 0).all()
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)


CUDA_CASE = dict(b=2, h=3, m=128, span=192, d=16, n=64)
"""The shapes of the CUDA test below."""


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)])
def test_flex_dropout_forward_and_backward_on_cpu_through_torch_s_math_backward(
    dtype, tol, monkeypatch
):
    """The CUDA test's case without a GPU: flex's construction through eager FlexAttention,
    whose backward is torch's math implementation of the kernel's. It found the two faults
    behind the CUDA failures: the test drew its output weights w in the run's dtype, so the
    float64 reference got other w (every gradient off by more than its size); and in bf16
    log m was a bf16 table, which put the spans' gradient 15-30% off (3e-2 needed)."""
    xs, spans = inputs(dtype=dtype, **CUDA_CASE)
    p, seed = 0.3, 11
    kw = dict(dropout_p=p, training=True, dropout_seed=torch.tensor(seed, dtype=torch.int32))
    out, grads = op_grads(_eager_flex(monkeypatch), xs, spans, **kw)
    keep = flex_mask(seed, 2, 3, 128, 192, 64, p)
    want, want_grads = op_grads(
        reference_fn(keep, p), [x.double() for x in xs], spans.double(), **kw
    )
    torch.testing.assert_close(out.double(), want, rtol=tol, atol=tol)
    for name, g, w in zip(
        ["q", "k", "v", "pos", "pk", "pv", "spans"], grads, want_grads, strict=False
    ):
        assert torch.isfinite(g).all(), name
        torch.testing.assert_close(
            g.double(), w, rtol=tol, atol=tol * max(1.0, w.abs().max().item()), msg=name
        )


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason=NO_CUDA)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)])
def test_flex_on_cuda_equals_reference_with_dropout_forward_and_backward(dtype, tol):
    xs, spans = inputs(dtype=dtype, device="cuda", **CUDA_CASE)
    p, seed = 0.3, 11
    kw = dict(
        dropout_p=p,
        training=True,
        dropout_seed=torch.tensor(seed, dtype=torch.int32, device="cuda"),
    )
    out, grads = op_grads(get_attention_impl("flex"), xs, spans, **kw)
    keep = flex_mask(seed, 2, 3, 128, 192, 64, p)
    want, want_grads = op_grads(
        reference_fn(keep, p), [x.double() for x in xs], spans.double(), **kw
    )
    torch.testing.assert_close(out.double(), want, rtol=tol, atol=tol)
    for g, w in zip(grads, want_grads, strict=False):
        assert torch.isfinite(g).all()
        torch.testing.assert_close(
            g.double(), w, rtol=tol, atol=tol * max(1.0, w.abs().max().item())
        )


def test_flex_falls_back_to_smaller_tiles_when_the_kernel_runs_out_of_shared_memory(monkeypatch):
    """An H200 in bf16 at d_h 64: torch's default tile asked for more shared memory than the
    chip has and the compile failed ("out of resource"). The op retries with the next tile
    of FLEX_TILES, keeps the one that compiled for later calls, and passes any other error
    through untouched."""
    import torch.nn.attention.flex_attention as fa

    monkeypatch.setattr(fa, "_validate_device", lambda *a: None)
    monkeypatch.setattr(fused_mod, "_flex_tile", {})
    fits = fused_mod.FLEX_TILES[2]
    tried = []

    def small_chip_flex(*args, kernel_options=None, **kw):
        tried.append(kernel_options or {})
        if (kernel_options or {}) != fits:
            raise RuntimeError(
                "No valid triton configs. OutOfMemoryError: out of resource: "
                "Required: 247808 Hardware limit: 232448"
            )
        return fa.flex_attention(*args, **kw)

    xs, spans = inputs(dtype=torch.float32, b=1, h=2, m=16, span=24, d=8, n=4)
    kw = dict(dropout_p=0.3, training=True, dropout_seed=torch.tensor(5, dtype=torch.int32))
    with torch.no_grad():
        got = run_op(
            lambda *a, **k: fused_mod._attend_flex(*a, flex=small_chip_flex, **k), xs, spans, **kw
        )
        assert tried == [fused_mod.FLEX_TILES[0], fused_mod.FLEX_TILES[1], fits, fits]
        assert fused_mod.flex_tiles_in_use() == {("cpu", torch.float32, 8): fits}
        want = run_op(
            lambda *a, **k: fused_mod._attend_flex(*a, flex=fa.flex_attention, **k), xs, spans, **kw
        )
        assert torch.equal(got, want)
        tried.clear()  # the tile that fitted is where the next call starts
        plain = dict(dropout_p=0.0, training=False, dropout_seed=None)
        run_op(
            lambda *a, **k: fused_mod._attend_flex(*a, flex=small_chip_flex, **k),
            xs,
            spans,
            **plain,
        )
        assert tried == [fits]

        def broken_flex(*args, **kw):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

        monkeypatch.setattr(fused_mod, "_flex_tile", {})
        with pytest.raises(RuntimeError, match="illegal memory access"):
            run_op(
                lambda *a, **k: fused_mod._attend_flex(*a, flex=broken_flex, **k),
                xs,
                spans,
                **plain,
            )

        def no_tile_fits(*args, **kw):
            raise RuntimeError("out of resource: shared memory")

        with pytest.raises(RuntimeError, match="out of resource"):
            run_op(
                lambda *a, **k: fused_mod._attend_flex(*a, flex=no_tile_fits, **k),
                xs,
                spans,
                **plain,
            )


PAPER_HEAD = dict(b=1, h=3, m=512, span=512, d=64, n=128)  # h: inputs has 3 heads' spans
"""enwik8_large's head size and block (d_h 64, M 512): the shape whose default flex tile did
not fit an H200's shared memory in bf16."""


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason=NO_CUDA)
@pytest.mark.parametrize("dropout_p", [0.0, 0.3])
def test_flex_on_cuda_compiles_and_trains_at_the_paper_s_head_size_in_bf16(dropout_p):
    xs, spans = inputs(dtype=torch.bfloat16, device="cuda", **PAPER_HEAD)
    seed = torch.tensor(3, dtype=torch.int32, device="cuda")
    kw = dict(dropout_p=dropout_p, training=True, dropout_seed=seed)
    out, grads = op_grads(get_attention_impl("flex"), xs, spans, **kw)
    keep = flex_mask(3, 1, 3, 512, 512, 128, dropout_p)
    want, want_grads = op_grads(
        reference_fn(keep, dropout_p), [x.double() for x in xs], spans.double(), **kw
    )
    tol = 3e-2
    torch.testing.assert_close(out.double(), want, rtol=tol, atol=tol)
    for g, w in zip(grads, want_grads, strict=False):
        assert torch.isfinite(g).all()
        torch.testing.assert_close(
            g.double(), w, rtol=tol, atol=tol * max(1.0, w.abs().max().item())
        )
