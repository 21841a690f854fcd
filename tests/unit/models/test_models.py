"""All-attention LM: config, layer math (eqs. 10-13), streaming cache, parameter counts,
gradients through the adaptive span, and a tiny overfitting sanity run."""

from __future__ import annotations

import ast
import dataclasses
import math
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from pipeline.models import (
    MODELS,
    AllAttnConfig,
    AllAttnLM,
    ModelOutput,
    SequenceModel,
    build_model,
    count_parameters,
)
from pipeline.models.allattn.layers import attn_span_len, cache_len
from tests.fixtures.tiny_models import tiny_allattn, tiny_allattn_config

DT = torch.float64
ROOT = Path(__file__).resolve().parents[3]


def tiny_model(vocab=11, seed=0, **kw) -> AllAttnLM:
    model = tiny_allattn(vocab, seed, **kw).to(DT)
    # LayerNorm affine params start at 1/0; perturb them so the test sees them at work
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model.eval()


def set_spans(model: AllAttnLM, spans_tokens: list[list[float]]) -> None:
    with torch.no_grad():
        for layer, z in zip(model.layers, spans_tokens, strict=False):
            layer.attn.adaptive_span.frac.copy_(torch.tensor(z, dtype=DT) / model.cfg.max_span)


def ramp(z: float, r: float, x: float) -> float:
    return min(1.0, max(0.0, (r + z - x) / r))


# ======================================================================================
# config and registry
# ======================================================================================


def test_config_defaults_are_the_papers_small_model():
    cfg = AllAttnConfig()
    assert (cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.n_persistent, cfg.ff_dim) == (
        512,
        18,
        8,
        1024,
        0,
    )
    assert (cfg.max_span, cfg.adaptive_span, cfg.span_ramp, cfg.span_init) == (8192, True, 32, 0.0)
    assert (cfg.span_loss_coef, cfg.attn_dropout, cfg.emb_dropout, cfg.out_dropout) == (
        1e-7,
        0.3,
        0.0,
        0.0,
    )
    # the paper's model (joint softmax) and the paper's word-level adaptive I/O settings
    assert (cfg.persistent_mode, cfg.ff_kind) == ("all_attn", "relu")
    assert (cfg.adaptive_io, cfg.adaptive_cutoffs, cfg.adaptive_div, cfg.adaptive_tied) == (
        False,
        [20000, 40000, 200000],
        4,
        True,
    )


@pytest.mark.parametrize(
    "field,value",
    [
        ("d_model", 0),
        ("d_model", 510),
        ("n_layers", 0),
        ("n_heads", 0),
        ("n_persistent", -1),
        ("ff_dim", -2),
        ("max_span", 0),
        ("span_ramp", 0),
        ("span_init", 1.5),
        ("span_init", -0.1),
        ("span_loss_coef", -1.0),
        ("attn_dropout", 1.0),
        ("emb_dropout", -0.1),
        ("out_dropout", 1.2),
        ("d_model", 512.0),
        ("adaptive_span", 1),
        ("n_layers", True),
    ],
)
def test_config_rejects_bad_values_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        AllAttnConfig(**{field: value})


def test_registry():
    assert MODELS["allattn"] == (AllAttnConfig, AllAttnLM)
    m = build_model("allattn", tiny_allattn_config(), 7)
    assert isinstance(m, AllAttnLM) and m.out.out_features == 7
    assert count_parameters(
        build_model("allattn", dataclasses.asdict(tiny_allattn_config()), 7)
    ) == count_parameters(m)
    with pytest.raises(ValueError, match="allattn"):
        build_model("transformer-xl", tiny_allattn_config(), 7)


def test_models_and_ops_import_only_plain_torch():
    banned = {"deepspeed", "mlflow", "yaml", "click", "pydantic"}
    files = list((ROOT / "pipeline" / "models").rglob("*.py")) + list(
        (ROOT / "pipeline" / "ops").glob("*.py")
    )
    assert files
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                assert name.split(".")[0] not in banned, f"{path.name} imports {name}"


# ======================================================================================
# spans and trimming
# ======================================================================================


def test_span_trimming_follows_the_code():
    big = 8192
    for z in [0.0, 1.0, 31.5, 32.0, 33.0, 100.0, 4000.2, 8100.0, 8192.0]:
        span_len = attn_span_len(z / big, big, 32)
        # L a multiple of 64: L' = ceil_to_64(ceil(z) + R), at most L
        want = min(big, 64 * math.ceil((math.ceil(z) + 32) / 64))
        assert span_len == want, z
        assert cache_len(span_len, big) == min(big, span_len + 64)
    # L not a multiple of 64: never shorter than the mask needs, never longer than L
    for big in (10, 100, 1000):
        for z in range(0, big + 1, 7):
            span_len = attn_span_len(z / big, big, 8)
            assert min(big, z + 8) <= span_len <= big


def test_span_lens_spans_loss_and_clamp():
    model = tiny_model(n_layers=3, n_heads=2, max_span=256, span_ramp=8)
    set_spans(model, [[0.0, 10.0], [60.0, 3.5], [200.0, 256.0]])
    assert model.span_lens() == [64, 128, 256]
    assert model.cache_lens() == [128, 192, 256]
    assert model.spans() == [[0.0, 10.0], [60.0, 3.5], [200.0, 256.0]]  # exact in binary
    want = model.cfg.span_loss_coef * ((0 + 10) / 2 + (60 + 3.5) / 2 + (200 + 256) / 2)
    assert model.aux_loss().item() == pytest.approx(want, rel=1e-12)
    with torch.no_grad():
        model.layers[0].attn.adaptive_span.frac.copy_(torch.tensor([-0.5, 1.5]))
    model.after_step()
    assert model.layers[0].attn.adaptive_span.frac.tolist() == [0.0, 1.0]
    fixed = tiny_model(adaptive_span=False, max_span=40)
    assert fixed.span_lens() == [40, 40] and fixed.cache_lens() == [40, 40]
    assert fixed.spans() == [[40.0, 40.0], [40.0, 40.0]]
    assert float(fixed.aux_loss()) == 0.0
    fixed.after_step()  # no-op
    assert not any("span" in n for n, _ in fixed.named_parameters())


# ======================================================================================
# the layer against equations 10-13
# ======================================================================================


def direct_attention(attn, pos_table, max_span, ctx, blk, span_len, spans, r):
    """Equations 10-13 for one layer's attention sublayer, explicit loops over t and c.

    ctx: [B, L', d] the L' hidden states before the block, blk: [B, M, d]. Block token i is
    at position t = L' + i and attends to c = t - L' .. t - 1 and the N persistent vectors.
    """
    X = torch.cat([ctx, blk], 1)
    bsz, m, d = blk.shape
    H, dh = attn.n_heads, attn.head_dim
    wq, wk, wv, wo = (p.weight for p in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj))
    n = attn.n_persistent
    pk = attn.persistent_k * math.sqrt(dh) if n else None  # k = sqrt(d_h) k'
    pv = attn.persistent_v * math.sqrt(n) if n else None  # v = sqrt(N) v'
    y = torch.zeros(bsz, m, H * dh, dtype=DT)
    for b in range(bsz):
        for h in range(H):
            rows = slice(h * dh, (h + 1) * dh)
            for i in range(m):
                t = span_len + i
                q = wq[rows] @ X[b, t]
                ctx_idx = range(t - span_len, t)
                s, mask, vals = [], [], []
                for c in ctx_idx:
                    k_c = wk[rows] @ X[b, c]  # (10)
                    u = pos_table[:, max_span - (t - c)]  # p(t, c) = u_{t-c}
                    s.append(q @ (k_c + u))  # (12)
                    mask.append(ramp(spans[h], r, (t - c) - 1) if spans is not None else 1.0)
                    vals.append(wv[rows] @ X[b, c])  # (11)
                for j in range(n):
                    s.append(q @ pk[h, j])  # (12), zero position term
                    mask.append(1.0)
                    vals.append(pv[h, j])
                s = torch.stack(s) / math.sqrt(dh)
                a = torch.softmax(s, 0)  # (13), jointly
                if spans is not None:
                    a = a * torch.tensor(mask, dtype=DT)
                    a = a / (a.sum() + 1e-8)
                y[b, i, rows] = (a[:, None] * torch.stack(vals)).sum(0)
    return y @ wo.T


@pytest.mark.parametrize("n_persistent", [5, 0])
def test_layer_attention_is_equations_10_to_13(n_persistent):
    model = tiny_model(n_persistent=n_persistent, max_span=192, span_ramp=8)
    # spans set by hand, mid-ramp: head 0 cut off by distance ~20, head 1 by ~70
    set_spans(model, [[12.25, 61.5], [3.0, 0.5]])
    span_lens = model.span_lens()
    assert span_lens == [128, 64]
    layer = model.layers[0]
    g = torch.Generator().manual_seed(1)
    cache = torch.randn(2, model.cache_lens()[0], 16, generator=g, dtype=DT)
    blk = torch.randn(2, 9, 16, generator=g, dtype=DT)
    got = layer.attn(blk, cache, model.pos_table)
    ctx = cache[:, -span_lens[0] :]
    want = direct_attention(
        layer.attn, model.pos_table, 192, ctx, blk, span_lens[0], [12.25, 61.5], 8
    )
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
    # the mask really is mid-ramp for some of the context
    mk = layer.attn.adaptive_span.mask(span_lens[0])
    assert ((mk > 0) & (mk < 1)).sum() >= 8 and (mk == 0).any()
    # a cache shorter than the span is padded with zero hidden states in front
    short = cache[:, -50:]
    got = layer.attn(blk, short, model.pos_table)
    ctx = torch.cat([torch.zeros(2, span_lens[0] - 50, 16, dtype=DT), short], 1)
    want = direct_attention(
        layer.attn, model.pos_table, 192, ctx, blk, span_lens[0], [12.25, 61.5], 8
    )
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
    if n_persistent == 0:
        assert layer.attn.persistent_k is None and layer.attn.persistent_v is None


def test_fixed_span_layer_attends_to_exactly_max_span_tokens():
    model = tiny_model(adaptive_span=False, max_span=20)
    layer = model.layers[1]
    g = torch.Generator().manual_seed(2)
    cache = torch.randn(1, 20, 16, generator=g, dtype=DT)
    blk = torch.randn(1, 6, 16, generator=g, dtype=DT)
    got = layer.attn(blk, cache, model.pos_table)
    want = direct_attention(layer.attn, model.pos_table, 20, cache, blk, 20, None, 1)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)


def test_post_norm_layer_structure():
    model = tiny_model(ff_dim=24)
    layer = model.layers[0]
    g = torch.Generator().manual_seed(3)
    cache = torch.randn(2, model.cache_lens()[0], 16, generator=g, dtype=DT)
    x = torch.randn(2, 5, 16, generator=g, dtype=DT)
    h = layer.norm1(x + layer.attn(x, cache, model.pos_table))
    want = layer.norm2(h + layer.ff.fc2(torch.relu(layer.ff.fc1(h))))
    torch.testing.assert_close(layer(x, cache, model.pos_table), want, rtol=0, atol=1e-12)
    no_ff = tiny_model().layers[0]
    assert no_ff.ff is None and no_ff.norm2 is None


# ======================================================================================
# streaming with the cache == one pass over the whole sequence
# ======================================================================================


def dense_lm(model: AllAttnLM, tokens: torch.Tensor) -> torch.Tensor:
    """The whole sequence in one pass with a span-limited causal mask over a dense
    T x (L' + T) score matrix (no cache, no skew). Every layer sees L' zero hidden states
    before the first token, as a stream starting from a zero cache does."""
    cfg = model.cfg
    H, dh, L, r = cfg.n_heads, cfg.head_dim, cfg.max_span, cfg.span_ramp
    x = model.embed(tokens)
    bsz, T, d = x.shape
    for layer, span_len, z in zip(model.layers, model.span_lens(), model.spans(), strict=False):
        a_ = layer.attn
        P = torch.cat([x.new_zeros(bsz, span_len, d), x], 1)
        heads = lambda y: y.view(bsz, -1, H, dh).transpose(1, 2)  # noqa: E731
        q, k, v = heads(a_.q_proj(x)), heads(a_.k_proj(P)), heads(a_.v_proj(P))
        dist = (span_len + torch.arange(T))[:, None] - torch.arange(span_len + T)[None, :]
        band = (dist >= 1) & (dist <= span_len)  # previous L' tokens, not itself
        u = model.pos_table[:, (L - dist).clamp(0, L - 1)]  # [dh, T, L'+T]
        s = torch.einsum("bhtd,bhcd->bhtc", q, k) + torch.einsum("bhtd,dtc->bhtc", q, u)
        s = s.masked_fill(~band, float("-inf"))
        n = cfg.n_persistent
        if n:
            s = torch.cat([s, q @ (a_.persistent_k * math.sqrt(dh)).transpose(1, 2)], -1)
        w = torch.softmax(s / math.sqrt(dh), -1)
        if cfg.adaptive_span:
            zz = torch.tensor(z, dtype=DT)[:, None, None]
            mk = ((r + zz - (dist - 1)) / r).clamp(0, 1) * band
            if n:
                mk = torch.cat([mk, torch.ones(H, T, n, dtype=DT)], -1)
            w = w * mk
            w = w / (w.sum(-1, keepdim=True) + 1e-8)
        y = w[..., : span_len + T] @ v
        if n:
            y = y + w[..., span_len + T :] @ (a_.persistent_v * math.sqrt(n))
        h = layer.norm1(x + a_.o_proj(y.transpose(1, 2).reshape(bsz, T, d)))
        if layer.ff is not None:
            h = layer.norm2(h + layer.ff(h))
        x = h
    return model.out(x)


@pytest.mark.parametrize(
    "kw,spans,block",
    [
        (dict(max_span=192), [[12.25, 61.5], [3.0, 0.5]], 24),  # L' = 128 / 64, block < L'
        (dict(max_span=128), [[0.0, 2.0], [40.0, 0.0]], 150),  # block > cache (128)
        (dict(max_span=30, adaptive_span=False, ff_dim=20), None, 17),  # fixed span
        (dict(max_span=128, n_persistent=0), [[5.0, 30.0], [0.0, 1.0]], 40),
    ],
)
def test_streaming_with_cache_matches_whole_sequence(kw, spans, block):
    model = tiny_model(**kw)
    if spans is not None:
        set_spans(model, spans)
    g = torch.Generator().manual_seed(4)
    tokens = torch.randint(0, 11, (2, 3 * block), generator=g)
    want = dense_lm(model, tokens)
    cache = None
    outs = []
    with torch.no_grad():
        for s in range(3):
            out = model(tokens[:, s * block : (s + 1) * block], state=cache)
            assert isinstance(out, ModelOutput) and out.nll is None
            assert [c.shape[1] for c in out.state] == model.cache_lens()
            cache = out.state
            outs.append(out.logits)
    got = torch.cat(outs, 1)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
    # the second segment alone (with the first one's cache) equals the whole-sequence pass
    first = model(tokens[:, :block])
    second = model(tokens[:, block : 2 * block], state=first.state)
    torch.testing.assert_close(second.logits, want[:, block : 2 * block], rtol=0, atol=1e-10)


def test_cache_shapes_zero_start_and_detach():
    model = tiny_model(max_span=192)
    set_spans(model, [[12.0, 61.0], [3.0, 0.5]])
    cache = model.init_state(3)
    assert [c.shape for c in cache] == [(3, 192, 16), (3, 128, 16)]
    assert all(c.dtype == DT and not c.any() for c in cache)
    tok = torch.randint(0, 11, (3, 10))
    tgt = torch.randint(0, 11, (3, 10))
    out = model(tok, tgt)
    torch.testing.assert_close(out.logits, model(tok, state=cache).logits, rtol=0, atol=0)
    assert out.logits.shape == (3, 10, 11)
    assert out.nll.shape == (3, 10)
    torch.testing.assert_close(
        out.nll,
        -torch.log_softmax(out.logits, -1).gather(-1, tgt[..., None])[..., 0],
        rtol=0,
        atol=1e-12,
    )
    model.train()
    out = model(tok, tgt)
    assert [c.shape for c in out.state] == [(3, 192, 16), (3, 128, 16)]
    assert all(not c.requires_grad for c in out.state)
    # the cache holds the layers' *input* hidden states: layer 0's is the embedding
    torch.testing.assert_close(out.state[0][:, -10:], model.embed(tok).detach(), rtol=0, atol=0)


# ======================================================================================
# parameter counts
# ======================================================================================


def _breakdown(model) -> dict[str, int]:
    groups: dict[str, int] = defaultdict(int)
    for name, p in model.named_parameters():
        key = name.split(".")
        key = ".".join(key[2:] if key[0] == "layers" else key)  # sum over layers
        groups[key] += p.numel()
    return dict(groups)


@pytest.mark.parametrize(
    "label,kw,published",
    [
        ("enwik8 small", dict(n_layers=18, n_persistent=1024), 38.5e6),
        ("enwik8 large", dict(n_layers=36, n_persistent=2048), 114.0e6),
    ],
)
def test_parameter_count_matches_the_authors(label, kw, published):
    with torch.device("meta"):
        model = AllAttnLM(AllAttnConfig(d_model=512, n_heads=8, max_span=8192, **kw), 205)
    n = count_parameters(model)
    print(f"\n{label}: {n:,} parameters (authors' code: {published / 1e6:.1f}M)")
    for key, cnt in sorted(_breakdown(model).items(), key=lambda kv: -kv[1]):
        print(f"  {key:32s} {cnt:>12,}")
    assert abs(n - published) / published < 0.01
    # and the make-up: 4 d^2 projections + 2 H N d_h persistent + LN + H spans per layer
    d, H, N, layers = 512, 8, kw["n_persistent"], kw["n_layers"]
    per_layer = 4 * d * d + 2 * H * N * (d // H) + 2 * d + H
    assert n == layers * per_layer + (d // H) * 8192 + 205 * d + (d * 205 + 205)


# ======================================================================================
# initialisation, gradients, training sanity
# ======================================================================================


def test_initialisation_follows_the_paper_and_code():
    torch.manual_seed(0)
    model = AllAttnLM(AllAttnConfig(n_layers=1), 205)
    attn = model.layers[0].attn
    dh, n = 64, 1024
    # effective persistent vectors have unit variance; raw k' ~ N(0, 1/d_h), v' ~ N(0, 1/N)
    assert attn.persistent_k.shape == attn.persistent_v.shape == (8, n, dh)
    assert (attn.persistent_k * math.sqrt(dh)).std().item() == pytest.approx(1.0, abs=0.01)
    assert (attn.persistent_v * math.sqrt(n)).std().item() == pytest.approx(1.0, abs=0.01)
    assert attn.persistent_v.std().item() == pytest.approx(1 / math.sqrt(n), rel=0.01)
    # one (d_h x L) position table N(0, 1), shared (no per-layer copies)
    assert model.pos_table.shape == (dh, 8192)
    assert model.pos_table.std().item() == pytest.approx(1.0, abs=0.01)
    assert [n_ for n_, _ in model.named_parameters() if "pos" in n_] == ["pos_table"]
    assert model.embed.weight.std().item() == pytest.approx(1.0, abs=0.02)
    for lin in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj):
        assert lin.bias is None
        assert lin.weight.abs().max().item() <= 1 / math.sqrt(512)
        assert lin.weight.abs().max().item() > 0.9 / math.sqrt(512)
    assert attn.adaptive_span.frac.tolist() == [0.0] * 8
    assert model.span_lens() == [64] and model.cache_lens() == [128]


def test_backward_reaches_spans_through_mask_and_loss():
    model = tiny_model(max_span=128, span_init=0.05).float().train()
    set_spans(model, [[6.0, 20.0], [0.0, 9.5]])
    tok = torch.randint(0, 11, (2, 20))
    out = model(tok, tok.roll(-1, 1))
    out.nll.mean().backward()
    for layer in model.layers:
        g = layer.attn.adaptive_span.frac.grad
        assert g is not None and torch.all(g != 0)  # through the soft mask
    for name, p in model.named_parameters():
        assert p.grad is not None, name
    model.zero_grad()
    loss = model.aux_loss()
    loss.backward()
    for layer in model.layers:  # d/dfrac of lambda * mean_h(frac * L) = lambda * L / H
        torch.testing.assert_close(
            layer.attn.adaptive_span.frac.grad, torch.full((2,), model.cfg.span_loss_coef * 128 / 2)
        )


def test_tiny_model_overfits_a_repeated_sequence():
    vocab = 12
    model = tiny_allattn(
        vocab, d_model=32, n_heads=4, n_persistent=16, max_span=64, span_init=0.25,
        span_loss_coef=1e-4,
    )  # fmt: skip
    pattern = torch.randint(0, vocab, (13,))
    data = pattern.repeat(20)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _step in range(40):
        starts = torch.randint(0, len(data) - 33, (4,))
        x = torch.stack([data[s : s + 32] for s in starts])
        y = torch.stack([data[s + 1 : s + 33] for s in starts])
        out = model(x, y)
        loss = out.nll.mean()
        (loss + model.aux_loss()).backward()
        opt.step()
        opt.zero_grad()
        model.after_step()
        losses.append(loss.item())
    print(f"\noverfit: loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    assert losses[0] > 0.8 * math.log(vocab)
    assert max(losses[-5:]) < 0.25 * losses[0]
    assert all(0.0 <= z <= 64.0 for row in model.spans() for z in row)


# ======================================================================================
# the ablations of section 5.3 against their definitions (float64, explicit loops)
# ======================================================================================


def _softmax(s: list) -> torch.Tensor:
    s = torch.stack(s) if isinstance(s[0], torch.Tensor) else torch.tensor(s, dtype=DT)
    return torch.softmax(s, 0)


def direct_variant(attn, pos_table, max_span, ctx, blk, span_len, spans, r, mode):
    """One layer's attention sublayer for persistent_mode ``mode``, from the definitions:

    attn_split:  y_t = sum_c softmax_ctx(s)_c v_c + sum_n softmax_pers(s)_n M_v[n] per head
    head_split:  heads < H/2: the context part only; heads >= H/2: the persistent part only
    single_head: the context part per head, concatenated, plus one d-dimensional persistent
                 attention of the full query W_q x_t: sum_n softmax_n(q . M_k[n] / sqrt d) M_v[n]
    The context part is softmax over the L' previous tokens (eq. 12 scores / sqrt d_h), times
    the span mask at distance - 1, renormalised over the context with +1e-8.
    Persistent vectors: k = sqrt(e) k', v = sqrt(N) v' (e = d_h, or d for single_head)."""
    X = torch.cat([ctx, blk], 1)
    bsz, m, d = blk.shape
    H, dh, n = attn.n_heads, attn.head_dim, attn.n_persistent
    hc = H // 2 if mode == "head_split" else H
    wq, wk, wv, wo = (p.weight for p in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj))
    e = d if mode == "single_head" else dh
    pk = attn.persistent_k * math.sqrt(e)
    pv = attn.persistent_v * math.sqrt(n)
    y = torch.zeros(bsz, m, d, dtype=DT)
    for b in range(bsz):
        for i in range(m):
            t = span_len + i
            q_full = wq @ X[b, t]
            for h in range(H):
                rows = slice(h * dh, (h + 1) * dh)
                q = q_full[rows]
                out = torch.zeros(dh, dtype=DT)
                if h < hc:  # context part
                    cs = range(t - span_len, t)
                    s = [
                        q @ (wk[rows] @ X[b, c] + pos_table[:, max_span - (t - c)]) / math.sqrt(dh)
                        for c in cs
                    ]
                    a = _softmax(s)
                    if spans is not None:
                        a = a * torch.tensor([ramp(spans[h], r, (t - c) - 1) for c in cs], dtype=DT)
                        a = a / (a.sum() + 1e-8)
                    for j, c in enumerate(cs):
                        out = out + a[j] * (wv[rows] @ X[b, c])
                if mode == "attn_split" or (mode == "head_split" and h >= hc):
                    g = h - hc if mode == "head_split" else h
                    a = _softmax([q @ pk[g, j] / math.sqrt(dh) for j in range(n)])
                    for j in range(n):
                        out = out + a[j] * pv[g, j]
                y[b, i, rows] = out
            if mode == "single_head":
                a = _softmax([q_full @ pk[0, j] / math.sqrt(d) for j in range(n)])
                for j in range(n):
                    y[b, i] = y[b, i] + a[j] * pv[0, j]
    return y @ wo.T


@pytest.mark.parametrize("mode", ["attn_split", "head_split", "single_head"])
def test_ablation_attention_equals_its_definition(mode):
    model = tiny_model(persistent_mode=mode, n_heads=4, n_persistent=6, max_span=64, span_ramp=8)
    spans = [10.5, 3.0, 20.25, 0.0] if mode != "head_split" else [10.5, 20.25]
    set_spans(model, [spans, [0.0] * len(spans)])
    layer = model.layers[0]
    span_len = model.span_lens()[0]
    assert span_len == 64
    mk = layer.attn.adaptive_span.mask(span_len)
    assert ((mk > 0) & (mk < 1)).any() and (mk == 0).any()  # mid-ramp and cut context
    g = torch.Generator().manual_seed(5)
    cache = torch.randn(2, model.cache_lens()[0], 16, generator=g, dtype=DT)
    blk = torch.randn(2, 5, 16, generator=g, dtype=DT)
    got = layer.attn(blk, cache, model.pos_table)
    want = direct_variant(
        layer.attn, model.pos_table, 64, cache[:, -span_len:], blk, span_len, spans, 8, mode
    )
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
    # and it is not the joint softmax: the same weights under all_attn give another output
    joint = tiny_model(n_heads=4, n_persistent=6, max_span=64, span_ramp=8).layers[0].attn
    if mode != "single_head" and mode != "head_split":
        joint.load_state_dict(layer.attn.state_dict())
        assert (joint(blk, cache, model.pos_table) - got).abs().max() > 1e-3


def test_ablation_shapes_spans_and_fixed_span():
    hs = tiny_model(persistent_mode="head_split", n_heads=4)
    attn = hs.layers[0].attn
    assert attn.n_ctx_heads == 2
    assert attn.persistent_k.shape == attn.persistent_v.shape == (2, 5, 4)  # only H/2 heads
    assert attn.adaptive_span.frac.shape == (2,) and len(hs.spans()[0]) == 2
    sh = tiny_model(persistent_mode="single_head", n_heads=4)
    assert sh.layers[0].attn.persistent_k.shape == (1, 5, 16)  # one set of dimension d
    # effective persistent vectors start with unit variance (k = sqrt(d) k', v = sqrt(N) v')
    torch.manual_seed(0)
    big = AllAttnLM(AllAttnConfig(n_layers=1, persistent_mode="single_head"), 27).layers[0].attn
    pk, pv = big.persistent_vectors()
    assert pk.std().item() == pytest.approx(1.0, abs=0.01) and pv.std().item() == pytest.approx(
        1.0, abs=0.01
    )
    # fixed span: every query sees exactly max_span tokens, no renormalisation
    fixed = tiny_model(persistent_mode="attn_split", n_heads=4, adaptive_span=False, max_span=12)
    assert fixed.spans() == [[12.0] * 4] * 2
    g = torch.Generator().manual_seed(6)
    cache, blk = (
        torch.randn(1, 12, 16, generator=g, dtype=DT),
        torch.randn(1, 4, 16, generator=g, dtype=DT),
    )
    got = fixed.layers[1].attn(blk, cache, fixed.pos_table)
    want = direct_variant(
        fixed.layers[1].attn, fixed.pos_table, 12, cache, blk, 12, None, 1, "attn_split"
    )
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
    hsf = tiny_model(persistent_mode="head_split", n_heads=4, adaptive_span=False)
    assert hsf.spans() == [[128.0] * 2] * 2


def test_ff_attn_and_softmax_ff_sublayers_equal_their_definitions():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(2, 5, 16, generator=g, dtype=DT)
    # FF-attn: W_o' sum_n softmax_n(W_q' x . k_n / sqrt(d)) v_n, k = sqrt(d) k', v = sqrt(N) v'
    model = tiny_model(n_persistent=0, ff_dim=7, ff_kind="ff_attn")
    ff = model.layers[0].ff
    assert model.layers[0].attn.persistent_k is None
    assert ff.persistent_k.shape == ff.persistent_v.shape == (1, 7, 16)
    assert ff.q_proj.bias is None and ff.o_proj.bias is None
    want = torch.zeros_like(x)
    for b in range(2):
        for t in range(5):
            q = ff.q_proj.weight @ x[b, t]
            a = _softmax(
                [q @ (ff.persistent_k[0, j] * 4.0) / 4.0 for j in range(7)]
            )  # sqrt(16) = 4
            want[b, t] = ff.o_proj.weight @ sum(
                a[j] * ff.persistent_v[0, j] * math.sqrt(7) for j in range(7)
            )
    torch.testing.assert_close(ff(x), want, rtol=0, atol=1e-12)
    # the layer is post-norm attention then FF-attn, each with its AddNorm
    layer = model.layers[0]
    cache = torch.randn(2, model.cache_lens()[0], 16, generator=g, dtype=DT)
    h = layer.norm1(x + layer.attn(x, cache, model.pos_table))
    torch.testing.assert_close(
        layer(x, cache, model.pos_table), layer.norm2(h + ff(h)), rtol=0, atol=1e-12
    )
    # eq. 9 literally: U softmax(V x), no biases
    sm = tiny_model(n_persistent=0, ff_dim=7, ff_kind="softmax").layers[0].ff
    assert sm.fc1.bias is None and sm.fc2.bias is None
    want = torch.softmax(x @ sm.fc1.weight.T, -1) @ sm.fc2.weight.T
    torch.testing.assert_close(sm(x), want, rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    "kw",
    [
        dict(persistent_mode="attn_split"),
        dict(persistent_mode="head_split", n_heads=4),
        dict(persistent_mode="single_head"),
        dict(n_persistent=0, ff_dim=12, ff_kind="ff_attn"),
        dict(adaptive_io=True, adaptive_cutoffs=[3, 6, 9], adaptive_div=2),
    ],
    ids=["attn_split", "head_split", "single_head", "ff_attn", "adaptive_io"],
)
def test_variants_stream_with_the_cache_like_one_pass(kw):
    model = tiny_model(vocab=13, max_span=64, **kw)
    spans = [[7.5, 30.0] + [0.0] * (len(model.spans()[0]) - 2), [2.0] * len(model.spans()[0])]
    set_spans(model, spans)
    g = torch.Generator().manual_seed(8)
    tokens = torch.randint(0, 13, (2, 60), generator=g)
    targets = torch.randint(0, 13, (2, 60), generator=g)
    with torch.no_grad():
        whole = model(tokens, targets)
        cache, nlls = None, []
        for s in range(3):
            out = model(tokens[:, 20 * s : 20 * (s + 1)], targets[:, 20 * s : 20 * (s + 1)], cache)
            cache = out.state
            nlls.append(out.nll)
    torch.testing.assert_close(torch.cat(nlls, 1), whole.nll, rtol=0, atol=1e-10)
    assert (whole.logits is None) == bool(kw.get("adaptive_io"))


@pytest.mark.parametrize(
    "field,value",
    [
        ("persistent_mode", "joint"),
        ("persistent_mode", 3),
        ("ff_kind", "gelu"),
        ("adaptive_cutoffs", [5, 3]),
        ("adaptive_cutoffs", []),
        ("adaptive_cutoffs", [0, 4]),
        ("adaptive_cutoffs", "20000"),
        ("adaptive_cutoffs", [2.5]),
        ("adaptive_div", 0),
        ("adaptive_io", "yes"),
        ("adaptive_tied", 1),
    ],
)
def test_new_fields_reject_bad_values_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        AllAttnConfig(**{field: value})


@pytest.mark.parametrize(
    "kw,needle",
    [
        (dict(persistent_mode="attn_split", n_persistent=0), "persistent_mode"),
        (dict(persistent_mode="head_split", n_heads=1, d_model=512), "n_heads"),
        (dict(ff_kind="ff_attn", ff_dim=0), "ff_kind"),
        (dict(adaptive_io=True, d_model=32, n_heads=2, adaptive_div=4), "adaptive_div"),
    ],
)
def test_bad_combinations_are_refused_naming_the_field(kw, needle):
    with pytest.raises(ValueError, match=needle):
        AllAttnConfig(**kw)


# ======================================================================================
# adaptive input and adaptive softmax (word level)
# ======================================================================================


def _adaptive_model(tied=True, seed=0):
    model = tiny_allattn(
        50,
        seed,
        d_model=64,
        n_heads=4,
        max_span=32,
        adaptive_io=True,
        adaptive_cutoffs=[5, 12, 30],
        adaptive_div=4,
        adaptive_tied=tied,
    )
    return model.to(DT).eval()


def test_adaptive_input_has_four_bands_at_the_right_dims_and_equals_its_definition():
    model = _adaptive_model()
    emb = model.embed
    assert emb.bounds == [0, 5, 12, 30, 50]
    assert [b.weight.shape for b in emb.bands] == [
        (5, 64),
        (7, 16),
        (18, 4),
        (20, 1),
    ]  # d, d/4, d/16, d/64
    assert [tuple(p.shape) for p in emb.projs] == [(64, 64), (64, 16), (64, 4), (64, 1)]
    tokens = torch.tensor([[0, 4, 5, 11, 12, 29, 30, 49], [49, 7, 3, 20, 31, 0, 6, 13]])
    got = emb(tokens)
    for b in range(2):
        for t in range(8):
            w = int(tokens[b, t])
            i = sum(w >= c for c in (5, 12, 30))
            lo = [0, 5, 12, 30][i]
            want = math.sqrt(64) * emb.projs[i] @ emb.bands[i].weight[w - lo]
            torch.testing.assert_close(got[b, t], want, rtol=0, atol=1e-12)


def direct_adaptive_nll(out, h, w):
    """-log P(w | h) of the four-band adaptive softmax, written out for one token:
    head = [P_0-projected shortlist logits ; cluster logits], band i >= 1 adds its tail."""
    bounds = out.bounds
    i = sum(w >= c for c in bounds[1:-1])
    p0 = h @ out.projs[0]
    head = torch.cat(
        [out.weights[0] @ p0 + out.biases[0], out.cluster.weight @ h + out.cluster.bias]
    )
    head_lp = head - torch.logsumexp(head, 0)
    if i == 0:
        return -head_lp[w]
    pi = h @ out.projs[i]
    tail = out.weights[i] @ pi + out.biases[i]
    return -(head_lp[bounds[1] + i - 1] + tail[w - bounds[i]] - torch.logsumexp(tail, 0))


@pytest.mark.parametrize("tied", [True, False])
def test_adaptive_softmax_nll_is_the_four_band_factorisation(tied):
    model = _adaptive_model(tied)
    out = model.out
    assert out.n_clusters == 3 and out.shortlist == 5
    g = torch.Generator().manual_seed(9)
    h = torch.randn(3, 7, 64, generator=g, dtype=DT)
    w = torch.randint(0, 50, (3, 7), generator=g)
    w[0, :4] = torch.tensor([0, 6, 20, 45])  # every band present
    nll = out.nll(h, w)
    assert nll.shape == (3, 7) and nll.dtype == DT
    for b in range(3):
        for t in range(7):
            torch.testing.assert_close(
                nll[b, t], direct_adaptive_nll(out, h[b, t], int(w[b, t])), rtol=0, atol=1e-12
            )
    lp = out.log_prob(h)
    assert lp.shape == (3, 7, 50)
    torch.testing.assert_close(
        torch.logsumexp(lp, -1), torch.zeros(3, 7, dtype=DT), rtol=0, atol=1e-12
    )
    torch.testing.assert_close(-lp.gather(-1, w[..., None])[..., 0], nll, rtol=0, atol=1e-12)


def test_adaptive_io_weights_are_really_tied():
    model = _adaptive_model(tied=True)
    for i in range(4):
        assert model.out.weights[i] is model.embed.bands[i].weight
        assert model.out.projs[i] is model.embed.projs[i]
    names = [n for n, _ in model.named_parameters()]
    assert not any(n.startswith("out.weight") or n.startswith("out.proj") for n in names)
    # counted once: bands + projections + output biases + cluster
    io = (
        sum(n * d for n, d in [(5, 64), (7, 16), (18, 4), (20, 1)])
        + 64 * (64 + 16 + 4 + 1)
        + 50
        + (3 * 64 + 3)
    )
    body = count_parameters(model) - io
    untied = _adaptive_model(tied=False)
    assert (
        count_parameters(untied) - body
        == io + sum(n * d for n, d in [(5, 64), (7, 16), (18, 4), (20, 1)]) + 64 * 85
    )
    # one tensor: the output loss alone gives the input embedding a gradient, and a change
    # to the embedding changes the output distribution
    h = torch.randn(4, 64, dtype=DT)
    w = torch.tensor([1, 8, 20, 40])
    model.out.nll(h, w).sum().backward()
    for band in model.embed.bands:
        assert band.weight.grad is not None and band.weight.grad.abs().sum() > 0
    before = model.out.nll(h, w).detach()
    with torch.no_grad():
        model.embed.bands[3].weight[40 - 30].add_(1.0)  # word 40's vector
    assert model.out.nll(h, w)[3] != before[3] and model.out.nll(h, w)[0] == before[0]


def test_adaptive_lm_returns_nll_without_logits():
    model = _adaptive_model()
    tokens = torch.randint(0, 50, (2, 9))
    targets = torch.randint(0, 50, (2, 9))
    seen = {}
    model.out.register_forward_hook(lambda mod, args, out: seen.update(h=args[0]))
    out = model(tokens, targets)
    assert out.logits is None and out.nll.shape == (2, 9)
    want = -model.out.log_prob(seen["h"]).gather(-1, targets[..., None])[..., 0]
    torch.testing.assert_close(out.nll, want, rtol=0, atol=1e-12)
    assert model(tokens).nll is None
    with pytest.raises(ValueError, match="adaptive_cutoffs"):
        AllAttnLM(
            tiny_allattn_config(d_model=64, adaptive_io=True, adaptive_cutoffs=[5, 12, 30]), 30
        )


def test_activation_checkpointing_gives_the_same_loss_and_gradients_with_dropout():
    def run(checkpointing: bool):
        model = tiny_model(attn_dropout=0.3, emb_dropout=0.1, ff_dim=12, span_init=0.2).train()
        model.activation_checkpointing = checkpointing
        g = torch.Generator().manual_seed(0)
        x, y = torch.randint(11, (2, 16), generator=g), torch.randint(11, (2, 16), generator=g)
        torch.manual_seed(5)
        loss = model(x, y).nll.mean() + model.aux_loss()
        loss.backward()
        return loss, {n: p.grad for n, p in model.named_parameters()}

    loss, grads = run(True)
    want_loss, want = run(False)
    assert torch.equal(loss, want_loss)
    assert want["layers.0.attn.adaptive_span.frac"].abs().max() > 0
    for name, g in want.items():
        torch.testing.assert_close(grads[name], g, rtol=0, atol=1e-12, msg=name)


def test_the_model_protocol_spans_bounds_metrics_and_groups():
    """What the trainer, evaluate and show see of the model (pipeline.models.protocol)."""
    model = tiny_model(n_layers=3, n_heads=2, max_span=256, span_ramp=8)
    assert isinstance(model, SequenceModel)
    set_spans(model, [[0.0, 10.0], [60.0, 3.5], [200.0, 256.0]])
    bounded = model.bounded_parameters()
    assert [(p, low, high) for p, low, high in bounded] == [
        (layer.attn.adaptive_span.frac, 0.0, 1.0) for layer in model.layers
    ]
    assert model.metrics() == {"span_mean": (10.0 + 63.5 + 456.0) / 6, "span_max": 256.0}
    state = model.init_state(2)
    out = model(torch.zeros(2, 4, dtype=torch.long), torch.zeros(2, 4, dtype=torch.long), state)
    assert [t.shape for t in out.state] == [(2, c, 16) for c in model.cache_lens()]
    groups = model.parameter_groups()
    assert sum(groups.values()) == count_parameters(model)
    assert groups["adaptive span"] == 6 and groups["position table"] == 8 * 256
    assert groups["persistent vectors"] == 3 * 2 * 2 * 5 * 8
    fixed = tiny_model(adaptive_span=False, max_span=40)
    assert fixed.bounded_parameters() == [] and float(fixed.aux_loss()) == 0.0
    assert fixed.metrics() == {"span_mean": 40.0, "span_max": 40.0}
    assert "adaptive span" not in fixed.parameter_groups()


def test_attention_impl_config_and_description():
    assert AllAttnConfig().attention.impl == "reference"
    with pytest.raises(ValueError, match="attention.impl"):
        AllAttnConfig(attention={"impl": "fast"})
    model = AllAttnLM(tiny_allattn_config(attention={"impl": "auto"}, attn_dropout=0.3), 11)
    assert model.describe() == (
        "attention impl auto on cpu float32 (attention dropout 0.3): "
        "reference for training, flex for evaluation"
    )
    model.set_attention_impl("sdpa")
    assert model.describe() == "attention impl sdpa"
