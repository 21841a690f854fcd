"""The ∞-former's short-term attention (Transformer-XL's relative-position attention over the
short-term memory and the block) against its formula, computed here in float64 with explicit
loops over Python floats, never with the module's helpers.

For the query at stream position t (row i of a block that starts at s, t = s + i) and the key
at stream position p, per head (Dai et al. 2019, eq. for A^rel; the authors' sorting code,
RelPartialLearnableMultiHeadAttn):

    score(t, p) = ((q_t + u) · k_p + (q_t + v) · W_R R(t − p)) / sqrt(d_head)

with q, k, v the layer's qkv map of its inputs, u / v its content / position biases, W_R its
position map, R(δ) = [sin δω_k]_k ++ [cos δω_k]_k, ω_k = 10000^(−2k/d) (k < d/2). A query reads
the keys p ≤ t (causal) back to s − mem_len, as far as the stream has them: at a document's
start the cache rows hold no states and must be masked, whatever they contain. The output is
W_O applied to the heads' Σ_p softmax_p(score) v_p, concatenated.

The reference keeps its own history of each layer's inputs (read from the layer as it runs),
so it checks the cache and the count of its valid rows too, not only the arithmetic of one
call. Cases: memory empty (first block), partial (fewer states than mem_len), full, a block
longer than the memory, and the LTM's cache (2·mem_len rows of which the attention reads the
last mem_len). Weights, biases included (zero at init), are random so that no term vanishes;
d_model 6 with 2 heads so that sqrt(d_head), d_head and sqrt(d_model) all differ.

Tolerance: the module computes the sinusoids in float32 (as Transformer-XL does) before
casting them to the model's dtype, so the float64 model agrees with the exact formula to about
1e-7 relative, not to float64's precision; any single-line change of the formula moves the
output by orders of magnitude more (quality/mutations.py checks that).
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.fixtures.tiny_models import float64_model

VOCAB = 11
CFG = dict(
    d_model=6,
    n_heads=2,
    n_layers=2,
    ff_dim=8,
    dropout=0.0,
    attn_dropout=0.0,
    n_basis=4,
    basis_widths=[0.1, 0.3],
    n_samples=3,
)


# --- the formula, written out -----------------------------------------------------------------


def matvec(matrix, vector):
    return [sum(a * b for a, b in zip(row, vector, strict=False)) for row in matrix]


def relative_embedding(distance, d_model):
    """Transformer-XL's sinusoid R(δ): sines then cosines of δ·10000^(−2k/d), k < d/2."""
    freqs = [10000 ** (-2 * k / d_model) for k in range(d_model // 2)]
    return [math.sin(distance * w) for w in freqs] + [math.cos(distance * w) for w in freqs]


def short_term_attention(history, start, block_len, mem_len, p, n_heads):
    """The attention's output (before the LTM is added) for the block at stream positions
    start..start+block_len−1 of one batch row. history: the layer's input rows [d] at stream
    positions 0..start+block_len−1; p: the layer's parameters as nested lists."""
    d = len(history[0])
    dh = d // n_heads
    w = p["qkv.weight"]
    w_q, w_k, w_v = w[:d], w[d : 2 * d], w[2 * d :]
    first_key = max(0, start - mem_len)  # what the STM still holds of the stream
    outputs = []
    for t in range(start, start + block_len):
        q = matvec(w_q, history[t])
        keys = range(first_key, t + 1)  # causal: nothing after t
        k = {pos: matvec(w_k, history[pos]) for pos in keys}
        v = {pos: matvec(w_v, history[pos]) for pos in keys}
        rel = {pos: matvec(p["pos.weight"], relative_embedding(t - pos, d)) for pos in keys}
        heads = []
        for h in range(n_heads):
            cols = range(h * dh, (h + 1) * dh)
            u_h, v_h = p["content_bias"][h], p["position_bias"][h]
            scores = []
            for pos in keys:
                content = sum((q[c] + u_h[c - h * dh]) * k[pos][c] for c in cols)
                position = sum((q[c] + v_h[c - h * dh]) * rel[pos][c] for c in cols)
                scores.append((content + position) / math.sqrt(dh))
            top = max(scores)
            weights = [math.exp(s - top) for s in scores]
            total = sum(weights)
            heads += [
                sum(wt / total * v[pos][c] for wt, pos in zip(weights, keys, strict=False))
                for c in cols
            ]
        outputs.append(matvec(p["attn_out.weight"], heads))
    return outputs


# --- the module, observed -----------------------------------------------------------------------


def random_model(**over):
    """A float64 model with every parameter random (the attention's biases start at zero)."""
    model = float64_model("infinity_former", {**CFG, **over}, VOCAB)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn_like(param) * 0.4)
    return model


def run_blocks(model, tokens, block_len, state=None):
    """Run the blocks of ``tokens`` through the model as a stream: per block, per layer,
    (the layer's inputs [B, M, d], the short-term attention's output [B, M, d])."""
    record = []
    hooks = []
    for layer in model.layers:
        hooks.append(
            layer.register_forward_pre_hook(
                lambda mod, args: record.append([args[0].detach().clone()])
            )
        )
        # attn_out is the attention's output projection: its output is the attention's
        # output before the LTM's read is added to it
        hooks.append(
            layer.attn_out.register_forward_hook(
                lambda mod, args, out: record[-1].append(out.detach().clone())
            )
        )
    if state is None:
        state = model.init_state(tokens.shape[0])
    blocks = []
    try:
        with torch.no_grad():
            for block in tokens.split(block_len, 1):
                state = model(block, None, state).state
                blocks.append(record[:])
                record.clear()
    finally:
        for hook in hooks:
            hook.remove()
    return blocks, state


def layer_params(layer):
    return {name: param.detach().tolist() for name, param in layer.named_parameters()}


def expected_outputs(model, blocks, mem_len, start=0, history=None):
    """The reference outputs of every block and layer, from the layers' inputs as observed,
    the stream starting at ``start`` with ``history`` (per layer, per batch row: the input
    rows of the positions before ``start`` the stream has; None: a fresh stream)."""
    n_layers, bsz = len(model.layers), blocks[0][0][0].shape[0]
    history = history or [[[] for _ in range(bsz)] for _ in range(n_layers)]
    params = [layer_params(layer) for layer in model.layers]
    expected = []
    for block in blocks:
        per_layer = []
        for i, (x, _) in enumerate(block):
            block_len = x.shape[1]
            rows = []
            for b in range(bsz):
                history[i][b] += x[b].tolist()
                rows.append(
                    short_term_attention(
                        history[i][b], start, block_len, mem_len, params[i], model.cfg.n_heads
                    )
                )
            per_layer.append(torch.tensor(rows, dtype=torch.float64))
        expected.append(per_layer)
        start += block[0][0].shape[1]
    return expected


def assert_outputs_match(blocks, expected):
    for k, (block, reference) in enumerate(zip(blocks, expected, strict=True)):
        for i, ((_, got), want) in enumerate(zip(block, reference, strict=True)):
            torch.testing.assert_close(
                got,
                want,
                rtol=1e-6,
                atol=1e-7,
                msg=lambda m, k=k, i=i: f"block {k}, layer {i}: {m}",
            )


# --- the tests ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "ltm, mem_len, block_len, n_blocks, memory_sizes",
    [
        # the memory empty, partial (2 of 3 rows), full, full
        (False, 3, 2, 4, [0, 2, 3, 3]),
        # the same through the LTM's cache (2·mem_len rows, the attention reads the last mem_len);
        # the LTM is read from the third block on, which must not touch the attention's output
        (True, 3, 2, 4, [0, 2, 3, 3]),
        # a block longer than the memory: the first queries read less of the block than the last
        (False, 2, 3, 3, [0, 2, 2]),
    ],
)
def test_short_term_attention_against_its_formula(ltm, mem_len, block_len, n_blocks, memory_sizes):
    """Every layer's attention output, block after block, equals the formula of the module
    doc: content and position terms with their biases, the 1/sqrt(d_head) scale, the causal
    mask and the mask of the cache rows that hold no state yet."""
    model = random_model(ltm=ltm, mem_len=mem_len)
    tokens = torch.randint(
        0, VOCAB, (2, n_blocks * block_len), generator=torch.Generator().manual_seed(1)
    )
    blocks, _ = run_blocks(model, tokens, block_len)
    # the cases the parameters claim: how many earlier states each block's memory holds
    assert [min(k * block_len, mem_len) for k in range(n_blocks)] == memory_sizes
    assert_outputs_match(blocks, expected_outputs(model, blocks, mem_len))


def test_rows_without_states_are_masked_whatever_they_hold():
    """At a document's start (and while the stream is shorter than mem_len) the cache rows
    before the first valid one must not be read: filling them with large garbage changes
    nothing, the output being the formula's over the states the stream has. A mask that is
    off by one row, or missing, reads the garbage."""
    mem_len, block_len = 3, 2
    model = random_model(mem_len=mem_len, ltm=False)
    tokens = torch.randint(0, VOCAB, (2, 3 * block_len), generator=torch.Generator().manual_seed(2))
    clean, _ = run_blocks(model, tokens, block_len)
    garbage = torch.Generator().manual_seed(3)

    def soiled(state, n_valid):
        """``state`` with the cache rows before the last n_valid ones overwritten."""
        state = [s.clone() for s in state]
        for cache in state[:-1]:
            cache[:, : cache.shape[1] - n_valid] = 20 * torch.randn(
                cache[:, : cache.shape[1] - n_valid].shape, dtype=cache.dtype, generator=garbage
            )
        return state

    # a fresh stream whose cache holds garbage: the first block reads only itself
    fresh = soiled(model.init_state(2), 0)
    first, state = run_blocks(model, tokens[:, :block_len], block_len, fresh)
    # one block in: 2 states of 3 rows, the first row garbage
    rest, _ = run_blocks(model, tokens[:, block_len:], block_len, soiled(state, block_len))
    for got, want in zip(first + rest, clean, strict=False):
        for (_, got_out), (_, want_out) in zip(got, want, strict=False):
            torch.testing.assert_close(got_out, want_out, rtol=1e-12, atol=1e-12)
    assert_outputs_match(first + rest, expected_outputs(model, first + rest, mem_len))
