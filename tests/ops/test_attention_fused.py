"""The fused attention backends against the reference op, forward and backward, the seeded
dropout mask they share, and the flex path's bounded compilations.

Tolerances: float64 backends equal the reference to 1e-12 with the reference's +1e-8
renormalisation guard set to 0 (the fused paths leave it out, see pipeline/ops/fused.py),
and to rtol 1e-6 / atol 1e-7 with it; the sdpa model's loss and gradients to 1e-7 / rtol
1e-6; flex runs in float32 (forward only on CPU): atol 2e-6 on the logits.
"""

from __future__ import annotations

import pytest
import torch

import pipeline.ops.attention as attention_mod
from pipeline.models import AllAttnConfig, AllAttnLM
from pipeline.ops import (
    adaptive_span_mask,
    attend_reference,
    compile_count,
    get_attention_impl,
    seeded_keep_mask,
)
from pipeline.ops.dropout import key_coords
from pipeline.ops.fused import flex_bucket, pick_attention_impl

DT = torch.float64
CUDA = torch.cuda.is_available()
NO_CUDA = "needs CUDA (FlexAttention backward and its compiled dropout are CUDA-only in torch 2.13)"


def _inputs(dtype=DT, device="cpu", b=2, h=3, m=5, span=7, d=4, n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(b, h, m, d), (b, h, span + m, d), (b, h, span + m, d), (d, span), (h, n, d), (h, n, d)]
    xs = [torch.randn(*s, generator=g, dtype=DT).to(device, dtype) for s in shapes]
    # spans mid-ramp: some context kept, some on the ramp, some cut (mask exactly 0)
    spans = torch.tensor([1.5, 0.0, 3.25], dtype=DT).to(device, dtype)
    return xs, spans


def _run(fn, xs, spans, ramp=3, **kw):
    q, k, v, pos, pk, pv = xs
    mask = adaptive_span_mask(spans, ramp, pos.shape[1])
    return fn(q, k, v, pos, persistent_k=pk, persistent_v=pv, span_mask=mask, **kw)


def _grads(fn, xs, spans, **kw):
    leaves = [x if x is None else x.detach().clone().requires_grad_() for x in (*xs, spans)]
    out = _run(fn, leaves[:-1], leaves[-1], **kw)
    g = torch.Generator(device=out.device).manual_seed(1)
    (out * torch.randn(out.shape, generator=g, dtype=out.dtype, device=out.device)).sum().backward()
    return out.detach(), [None if x is None else x.grad for x in leaves]


def test_seeded_dropout_mask_is_a_function_of_the_seed():
    keys = key_coords(300, 200)
    s1, s2 = torch.tensor(7, dtype=torch.int32), torch.tensor(8, dtype=torch.int32)
    a = seeded_keep_mask(s1, (4, 3, 50), keys, 0.3)
    assert a.shape == (4, 3, 50, 500) and a.dtype == torch.bool
    assert torch.equal(a, seeded_keep_mask(s1, (4, 3, 50), keys, 0.3))
    assert (a != seeded_keep_mask(s2, (4, 3, 50), keys, 0.3)).float().mean() > 0.3
    assert abs(a.float().mean().item() - 0.7) < 0.005
    # no structure along any axis: rows, heads and batch elements drop different keys
    for dim in range(3):
        first, second = a.select(dim, 0), a.select(dim, 1)
        assert 0.35 < (first != second).float().mean() < 0.49  # 2 p (1 - p) = 0.42
    # the reference with a seed drops exactly these weights and rescales by 1 / (1 - p)
    xs, spans = _inputs()
    seed = torch.tensor(3, dtype=torch.int32)
    got = _run(attend_reference, xs, spans, dropout_p=0.3, training=True, dropout_seed=seed)
    q, k, v, pos, pk, pv = xs
    a_ctx, a_pers = attention_mod.attention_weights(
        q, k, pos, persistent_k=pk, span_mask=adaptive_span_mask(spans, 3, pos.shape[1]))
    keep = seeded_keep_mask(seed, (2, 3, 5), key_coords(7, 6), 0.3)
    a = torch.cat([a_ctx, a_pers], -1) * keep / 0.7
    want = attention_mod.skew(a[..., :7]) @ v + a[..., 7:] @ pv
    torch.testing.assert_close(got, want, rtol=0, atol=1e-14)


@pytest.mark.parametrize("persistent", [True, False])
def test_sdpa_equals_reference_forward_and_backward(persistent, monkeypatch):
    xs, spans = _inputs()
    if not persistent:  # Transformer + adaptive span: no persistent vectors
        xs = [*xs[:4], None, None]
    sdpa = get_attention_impl("sdpa")
    out, grads = _grads(sdpa, xs, spans)
    assert all(torch.isfinite(g).all() for g in grads if g is not None)  # log 0 is NaN-safe
    want, want_grads = _grads(attend_reference, xs, spans)
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-7)
    monkeypatch.setattr(attention_mod, "RENORM_EPS", 0.0)
    want, want_grads = _grads(attend_reference, xs, spans)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
    names = ["q", "k", "v", "pos", "persistent_k", "persistent_v", "spans"]
    for name, g, w in zip(names, grads, want_grads):
        if w is None:
            assert g is None, name
            continue
        assert w.abs().max() > 0, name
        torch.testing.assert_close(g, w, rtol=0, atol=1e-12, msg=name)


def test_sdpa_refuses_dropout():
    xs, spans = _inputs()
    with pytest.raises(ValueError, match="dropout"):
        _run(get_attention_impl("sdpa"), xs, spans, dropout_p=0.1, training=True)


def test_flex_buckets_bound_the_compiled_shapes():
    lens = range(64, 8192 + 1, 64)
    buckets = {flex_bucket(n) for n in lens}
    assert len(buckets) <= 15
    assert all(n <= flex_bucket(n) < 1.5 * n for n in lens)
    assert flex_bucket(1) == 64


def test_auto_picks_by_device_dtype_and_dropout():
    f32, bf16 = torch.float32, torch.bfloat16
    assert pick_attention_impl("cuda", bf16, dropout=True, grad=True) == "flex"
    assert pick_attention_impl("cpu", f32, dropout=True, grad=True) == "reference"
    assert pick_attention_impl("cpu", f32, dropout=False, grad=True) == "sdpa"
    assert pick_attention_impl("cpu", f32, dropout=False, grad=False) == "flex"
    assert pick_attention_impl("cpu", DT, dropout=False, grad=True) == "reference"


def _tiny_lm(**kw) -> AllAttnLM:
    cfg = dict(d_model=16, n_layers=2, n_heads=2, n_persistent=5, max_span=128, span_ramp=8,
               span_init=0.2, attn_dropout=0.0)
    cfg.update(kw)
    torch.manual_seed(0)
    return AllAttnLM(AllAttnConfig(**cfg), 11)


def test_flex_model_forward_equals_reference_and_training_compiles_a_bounded_number_of_times():
    """50 training steps (spans learned, changing every step) with an eval forward through
    flex after each: flex equals the reference and compiles at most once (one bucket)."""
    model = _tiny_lm()
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
        model = _tiny_lm(attn_dropout=0.0).to(DT)
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
    for name in ("pos_table", "layers.0.attn.adaptive_span.frac", "layers.1.attn.persistent_k",
                 "layers.1.attn.persistent_v", "layers.0.attn.q_proj.weight"):
        assert want[name].abs().max() > 0, name
        torch.testing.assert_close(grads[name], want[name], rtol=1e-6, atol=1e-8, msg=name)


def test_flex_dropout_construction_equals_reference_with_the_same_seed_on_cpu():
    # Forward only (FlexAttention has no CPU backward), uncompiled: the score_mod that drops
    # entries and the exp(lse_kept - lse_all) / (1 - p) rescaling, against the reference's
    # seeded mask. float32 is what flex computes in; tolerance for its reassociation.
    xs, spans = _inputs(dtype=torch.float32, m=16, span=40, d=8, n=6)
    kw = dict(dropout_p=0.3, training=True, dropout_seed=torch.tensor(11, dtype=torch.int32))
    with torch.no_grad():
        out = _run(get_attention_impl("flex"), xs, spans, **kw)
        want = _run(attend_reference, [x.double() for x in xs], spans.double(), **kw)
        other_seed = _run(attend_reference, [x.double() for x in xs], spans.double(),
                          **(kw | {"dropout_seed": torch.tensor(12, dtype=torch.int32)}))
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-6)
    assert (other_seed - want).abs().max() > 1e-2   # the mask really depends on the seed


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason=NO_CUDA)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)])
def test_flex_on_cuda_equals_reference_with_dropout_forward_and_backward(dtype, tol):
    xs, spans = _inputs(dtype=dtype, device="cuda", b=2, h=3, m=128, span=192, d=16, n=64)
    seed = torch.tensor(11, dtype=torch.int32)
    kw = dict(dropout_p=0.3, training=True, dropout_seed=seed)
    out, grads = _grads(get_attention_impl("flex"), xs, spans, **kw)
    want, want_grads = _grads(attend_reference, [x.double() for x in xs], spans.double(), **kw)
    torch.testing.assert_close(out.double(), want, rtol=tol, atol=tol)
    for g, w in zip(grads, want_grads):
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g.double(), w, rtol=tol, atol=tol * max(1.0, w.abs().max().item()))
