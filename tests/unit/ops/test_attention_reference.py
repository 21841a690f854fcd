"""The reference all-attention op against equations 10-13 computed directly (float64)."""

from __future__ import annotations

import math

import pytest
import torch

from pipeline.ops.attention import (
    ATTENTION_IMPLS,
    RENORM_EPS,
    adaptive_span_mask,
    attend_reference,
    attention_weights,
    get_attention_impl,
    skew,
    unskew,
)

DT = torch.float64


def _inputs(b=2, h=3, m=5, span=7, d=4, n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, m, d, generator=g, dtype=DT)
    k = torch.randn(b, h, span + m, d, generator=g, dtype=DT)
    v = torch.randn(b, h, span + m, d, generator=g, dtype=DT)
    pos = torch.randn(d, span, generator=g, dtype=DT)
    pk = torch.randn(h, n, d, generator=g, dtype=DT) if n else None
    pv = torch.randn(h, n, d, generator=g, dtype=DT) if n else None
    return q, k, v, pos, pk, pv


def _ramp(z: float, ramp: float, x: float) -> float:
    """m_z(x) = clamp((R + z - x) / R, 0, 1), the adaptive-span soft mask."""
    return min(1.0, max(0.0, (ramp + z - x) / ramp))


def direct(q, k, v, pos, pk, pv, spans=None, ramp=None):
    """Equations 10-13 with explicit loops over the query t and the context element c.

    Block query i sits at key index t = L' + i; its context C_t is the L' previous key
    indices c = t - L' .. t - 1 (distance t - c in 1..L'); pos[:, L' - (t - c)] is u_{t-c}.
    spans: per-head z in tokens (None = no mask); the mask is evaluated at t - c - 1 and is
    1 for the persistent vectors. Returns [B, H, M, d] and the weights [B, H, M, L' + N].
    """
    b_sz, h_sz, m, d = q.shape
    span_len = k.shape[2] - m
    n = 0 if pk is None else pk.shape[1]
    out = torch.zeros(b_sz, h_sz, m, d, dtype=DT)
    weights = torch.zeros(b_sz, h_sz, m, span_len + n, dtype=DT)
    for b in range(b_sz):
        for h in range(h_sz):
            for i in range(m):
                t = span_len + i
                qt = q[b, h, i]
                # (10)-(12): scores against the context keys (+ relative position) ...
                ctx = list(range(t - span_len, t))
                scores = [float(qt @ (k[b, h, c] + pos[:, span_len - (t - c)])) for c in ctx]
                # ... and against the persistent keys (zero position term)
                scores += [float(qt @ pk[h, j]) for j in range(n)]
                s = torch.tensor(scores, dtype=DT) / math.sqrt(d)
                a = torch.exp(s - s.max())
                a = a / a.sum()  # (13) joint softmax
                if spans is not None:
                    mk = [_ramp(float(spans[h]), ramp, (t - c) - 1) for c in ctx] + [1.0] * n
                    a = a * torch.tensor(mk, dtype=DT)
                    a = a / (a.sum() + 1e-8)
                y = torch.zeros(d, dtype=DT)
                for jj, c in enumerate(ctx):
                    y += a[jj] * v[b, h, c]
                for j in range(n):
                    y += a[span_len + j] * pv[h, j]
                out[b, h, i] = y
                weights[b, h, i] = a
    return out, weights


# --------------------------------------------------------------------------------------


def test_unskew_picks_the_keys_before_each_query():
    x = torch.randn(2, 3, 4, 7 + 4, dtype=DT)
    u = unskew(x)
    assert u.shape == (2, 3, 4, 7)
    for i in range(4):
        for j in range(7):
            assert torch.equal(u[..., i, j], x[..., i, i + j])


def test_skew_places_rows_back_and_pads():
    a = torch.randn(2, 4, 7, dtype=DT)
    s = skew(a, pad_value=-1.0)
    assert s.shape == (2, 4, 11)
    for i in range(4):
        for c in range(11):
            expected = a[:, i, c - i] if 0 <= c - i < 7 else torch.full((2,), -1.0, dtype=DT)
            assert torch.equal(s[:, i, c], expected)
    assert torch.equal(unskew(skew(a)), a)


def test_span_mask_shape_of_the_ramp():
    z = torch.tensor([3.0, 0.0, 2.5], dtype=DT)
    ramp, span_len = 4, 12
    mk = adaptive_span_mask(z, ramp, span_len)
    assert mk.shape == (3, span_len)
    for h in range(3):
        for j in range(span_len):
            dist = span_len - j
            x = dist - 1
            if x <= z[h]:
                assert mk[h, j] == 1.0
            elif x >= z[h] + ramp:
                assert mk[h, j] == 0.0
            else:  # linear from 1 at x = z down to 0 at x = z + R
                assert mk[h, j] == pytest.approx(1.0 - (x - float(z[h])) / ramp, abs=1e-15)
    # the previous token is always fully attended, mid-ramp example: z=3, R=4, distance 6
    assert torch.all(mk[:, -1] == 1.0)
    assert mk[0, span_len - 6] == pytest.approx(0.5)


@pytest.mark.parametrize("m,span_len", [(5, 7), (9, 3), (4, 1)])
def test_equations_10_to_13_with_span_mask_and_persistent(m, span_len):
    q, k, v, pos, pk, pv = _inputs(m=m, span=span_len)
    # spans mid-ramp: some context fully kept, some partly, some cut (for span_len=7)
    spans = torch.tensor([1.5, 0.0, 3.25], dtype=DT)
    ramp = 3
    mask = adaptive_span_mask(spans, ramp, span_len)
    if span_len == 7:
        assert ((mask > 0) & (mask < 1)).any() and (mask == 0).any()
    got = attend_reference(q, k, v, pos, persistent_k=pk, persistent_v=pv, span_mask=mask)
    want, w = direct(q, k, v, pos, pk, pv, spans=spans, ramp=ramp)
    assert got.shape == (2, 3, m, 4)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
    a_ctx, a_pers = attention_weights(q, k, pos, persistent_k=pk, span_mask=mask)
    torch.testing.assert_close(torch.cat([a_ctx, a_pers], -1), w, rtol=0, atol=1e-12)


def test_no_persistent_vectors_is_plain_banded_attention():
    q, k, v, pos, _, _ = _inputs(n=0)
    got = attend_reference(q, k, v, pos)
    want, _ = direct(q, k, v, pos, None, None)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
    # and as a dense (M x (L'+M)) masked softmax, the textbook way
    m, span_len, d = q.shape[2], pos.shape[1], q.shape[3]
    t = span_len + torch.arange(m)[:, None]
    c = torch.arange(span_len + m)[None, :]
    dist = t - c
    band = (dist >= 1) & (dist <= span_len)
    u = pos[:, (span_len - dist).clamp(0, span_len - 1)]  # [d, M, L'+M]
    s = torch.einsum("bhmd,bhcd->bhmc", q, k) + torch.einsum("bhmd,dmc->bhmc", q, u)
    a = torch.softmax((s / math.sqrt(d)).masked_fill(~band, float("-inf")), -1)
    torch.testing.assert_close(got, a @ v, rtol=0, atol=1e-12)


def test_persistent_weights_are_not_masked():
    q, k, v, pos, pk, pv = _inputs()
    span_len = pos.shape[1]
    a_ctx0, a_pers0 = attention_weights(q, k, pos, persistent_k=pk)  # no mask: softmax
    torch.testing.assert_close(
        a_ctx0.sum(-1) + a_pers0.sum(-1), torch.ones(2, 3, 5, dtype=DT), rtol=0, atol=1e-12
    )
    mask = adaptive_span_mask(torch.tensor([0.5, 2.0, 0.0], dtype=DT), 2, span_len)
    a_ctx, a_pers = attention_weights(q, k, pos, persistent_k=pk, span_mask=mask)
    # persistent weights keep their softmax value up to the joint renormalisation
    denom = (a_ctx0 * mask[:, None, :]).sum(-1) + a_pers0.sum(-1) + RENORM_EPS
    torch.testing.assert_close(a_pers, a_pers0 / denom[..., None], rtol=0, atol=1e-14)
    torch.testing.assert_close(
        a_ctx, a_ctx0 * mask[:, None, :] / denom[..., None], rtol=0, atol=1e-14
    )
    # a mask that cuts all context leaves the persistent vectors carrying all the weight
    a_ctx, a_pers = attention_weights(
        q, k, pos, persistent_k=pk, span_mask=torch.zeros(3, span_len, dtype=DT)
    )
    assert torch.all(a_ctx == 0)
    pers_mass = a_pers0.sum(-1, keepdim=True)
    torch.testing.assert_close(a_pers, a_pers0 / (pers_mass + RENORM_EPS), rtol=0, atol=1e-14)
    torch.testing.assert_close(a_pers.sum(-1), torch.ones(2, 3, 5, dtype=DT), rtol=0, atol=1e-5)


def test_dropout_is_on_the_renormalised_weights_and_unbiased():
    q, k, v, pos, pk, pv = _inputs(b=1, m=3)
    mask = adaptive_span_mask(torch.tensor([1.0, 2.0, 0.0], dtype=DT), 2, pos.shape[1])
    rep = 4000
    qb, kb, vb = (x.expand(rep, *x.shape[1:]) for x in (q, k, v))
    kw = dict(persistent_k=pk, persistent_v=pv, span_mask=mask)
    ev = attend_reference(q, k, v, pos, **kw)
    torch.manual_seed(0)
    tr = attend_reference(qb, kb, vb, pos, dropout_p=0.3, training=True, **kw)
    assert not torch.allclose(tr[0], ev[0])
    # eval mode drops nothing: compared at the same batch shape, since a 4000-row batch may take
    # another matmul kernel (AVX-512) whose float64 rounding differs in the last bit
    assert torch.equal(attend_reference(q, k, v, pos, dropout_p=0.3, training=False, **kw), ev)
    # E[dropout(a) / keep] = a, so the batch mean approaches the eval output
    torch.testing.assert_close(tr.mean(0), ev[0], rtol=0, atol=0.1)


def test_gradients_reach_every_input_including_the_span():
    q, k, v, pos, pk, pv = _inputs(b=1, h=2, m=3, span=4, d=3, n=2)
    spans = torch.tensor([0.7, 1.3], dtype=DT, requires_grad=True)
    inputs = [x.requires_grad_() for x in (q, k, v, pos, pk, pv)]

    def f(q, k, v, pos, pk, pv, spans):
        return attend_reference(
            q,
            k,
            v,
            pos,
            persistent_k=pk,
            persistent_v=pv,
            span_mask=adaptive_span_mask(spans, 2, 4),
        )

    assert torch.autograd.gradcheck(f, (*inputs, spans))


def test_registry_and_shape_errors():
    assert get_attention_impl("reference") is attend_reference
    assert "reference" in ATTENTION_IMPLS
    with pytest.raises(ValueError, match="reference"):
        get_attention_impl("nope")
    q, k, v, pos, pk, pv = _inputs()
    with pytest.raises(ValueError, match="pos"):
        attend_reference(q, k, v, pos[:, 1:])
    with pytest.raises(ValueError, match="persistent"):
        attend_reference(q, k, v, pos, persistent_k=pk)
