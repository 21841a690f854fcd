"""The ∞-former (pipeline/models/infinity_former/model.py): its continuous memory against the
formulas (float64), and the model as a stream. Tiny sizes throughout."""

from __future__ import annotations

import math

import pytest
import torch
from torch.func import functional_call
from torch.utils.flop_counter import FlopCounterMode

from pipeline.models import MODELS, build_model
from pipeline.models.infinity_former.model import (
    ContinuousMemory,
    InfinityFormerConfig,
    InfinityFormerLM,
    basis_values,
    bin_masses,
    expected_basis,
    fit_positions,
    gaussian_basis,
    kl_variance,
    ridge_fit_matrix,
    sticky_positions,
)
from pipeline.spec import SpecError, load_spec
from tests.fixtures.tiny_models import float64_model

TINY = dict(
    d_model=8,
    n_layers=1,
    n_heads=2,
    ff_dim=16,
    dropout=0.0,
    mem_len=4,
    n_basis=16,
    n_samples=6,
    sticky_bins=8,
)


def tiny_model(**over) -> InfinityFormerLM:
    return float64_model("infinity_former", {**TINY, **over}, 13)


def smooth(t: torch.Tensor) -> torch.Tensor:
    """Two channels of a signal that is smooth and vanishes at both ends of [0, 1]."""
    return torch.stack([torch.sin(math.pi * t) ** 2, t * (1 - t) * (1 + 2 * t)], -1)


def test_closed_form_equals_numerical_integration():
    centres, widths = gaussian_basis(8, [0.01, 0.05])
    mu = torch.tensor([0.0, 0.3, 0.71, 1.0], dtype=torch.float64)
    sigma_sq = torch.tensor([1e-4, 0.002, 0.05, 0.3], dtype=torch.float64)
    t = torch.linspace(-3, 4, 200_001, dtype=torch.float64)
    psi = basis_values(t, centres, widths)  # [T, N]
    for m, s in zip(mu, sigma_sq, strict=False):
        density = torch.exp(-0.5 * (t - m) ** 2 / s) / torch.sqrt(2 * math.pi * s)
        numeric = torch.trapezoid(density.unsqueeze(-1) * psi, t, dim=0)
        closed = expected_basis(m, s, centres, widths)
        torch.testing.assert_close(closed, numeric, rtol=1e-6, atol=1e-9)


def test_basis_layout_is_the_codes():
    centres, widths = gaussian_basis(6, [0.01, 0.05])
    assert centres.tolist() == [0.0, 0.0, 0.5, 0.5, 1.0, 1.0]
    assert widths.tolist() == [0.01, 0.05] * 3


def test_ridge_fit_is_the_ridge_solution_and_reconstructs_a_smooth_signal():
    centres, widths = gaussian_basis(64, [0.01, 0.05])
    n_new = 101
    positions, pad = fit_positions(0, n_new, 0.75)
    assert pad == 50 and len(positions) == 2 * n_new - 1
    inner = positions[pad : pad + n_new]
    torch.testing.assert_close(inner, (torch.arange(n_new, dtype=torch.float64) + 0.5) / n_new)
    torch.testing.assert_close(
        positions.diff(), torch.full((len(positions) - 1,), 1 / n_new, dtype=torch.float64)
    )
    g = ridge_fit_matrix(positions, pad, centres, widths, 1.0)
    x = smooth(inner)  # [L, 2]
    coeff = g.T @ x  # [N, 2]
    # the ridge regression of the zero-padded signal, solved another way
    basis_t = basis_values(positions, centres, widths)
    padded = torch.cat([torch.zeros(pad, 2), x, torch.zeros(pad, 2)]).double()
    design = torch.cat([basis_t, torch.eye(64, dtype=torch.float64)])
    target = torch.cat([padded, torch.zeros(64, 2, dtype=torch.float64)])
    torch.testing.assert_close(coeff, torch.linalg.lstsq(design, target).solution)
    fitted = basis_values(inner, centres, widths) @ coeff
    assert (fitted - x).abs().max() < 0.02


def test_contraction_keeps_the_old_signal_at_the_contracted_positions():
    torch.manual_seed(0)
    cfg = InfinityFormerConfig(
        d_model=2, n_heads=1, n_basis=64, n_samples=60, gate=False, mem_len=40
    )
    memory = ContinuousMemory(cfg).double()
    t_old = (torch.arange(80, dtype=torch.float64) + 0.5) / 80
    old = memory.update(None, None, smooth(t_old).unsqueeze(0))  # [1, N, 2]
    new = memory.update(old, None, torch.zeros(1, 40, 2, dtype=torch.float64))
    u = torch.linspace(0.1, 0.9, 33, dtype=torch.float64)
    before = basis_values(u, memory.centres, memory.widths) @ old[0]
    after = basis_values(cfg.tau * u, memory.centres, memory.widths) @ new[0]
    assert (before - smooth(u)).abs().max() < 0.02
    assert (after - before).abs().max() < 0.03
    # the new vectors (zeros) fill (τ, 1]
    tail = torch.linspace(0.85, 0.95, 5, dtype=torch.float64)
    assert (basis_values(tail, memory.centres, memory.widths) @ new[0]).abs().max() < 0.03


def test_sticky_histogram_equals_a_direct_computation():
    torch.manual_seed(1)
    mu = torch.rand(2, 5, dtype=torch.float64)
    sigma_sq = torch.rand(2, 5, dtype=torch.float64) * 0.02 + 1e-4
    hist = bin_masses(mu, sigma_sq, 8)
    for b in range(2):
        direct = []
        for k in range(8):
            lo, hi = k / 8, (k + 1) / 8
            direct.append(
                sum(
                    0.5
                    * (
                        math.erf((hi - m) / math.sqrt(2 * s))
                        - math.erf((lo - m) / math.sqrt(2 * s))
                    )
                    for m, s in zip(mu[b].tolist(), sigma_sq[b].tolist(), strict=False)
                )
            )
        total = sum(direct)
        torch.testing.assert_close(
            hist[b], torch.tensor([v / total for v in direct], dtype=torch.float64)
        )


def test_sticky_positions_are_the_histograms_quantiles():
    hist = torch.tensor([[0.5, 0.0, 0.25, 0.25], [0.25] * 4], dtype=torch.float64)
    u = sticky_positions(hist, 8)
    q = (torch.arange(8, dtype=torch.float64) + 0.5) / 8
    for b in range(2):
        # the piecewise-linear CDF of the histogram at each position is its quantile level
        cdf = []
        for x in u[b].tolist():
            k = min(int(x * 4), 3)
            cdf.append(sum(hist[b, :k].tolist()) + hist[b, k].item() * (x * 4 - k))
        torch.testing.assert_close(torch.tensor(cdf, dtype=torch.float64), q)
    torch.testing.assert_close(u[1], q)  # a flat histogram samples evenly
    assert not ((u[0] > 0.25) & (u[0] < 0.5)).any()  # an empty bin gets no sample


def test_kl_term_equals_its_formula_and_is_the_aux_loss(monkeypatch):
    sigma_sq = torch.tensor([1e-6, 0.0025, 0.1, 2.0], dtype=torch.float64)
    mu = torch.full_like(sigma_sq, 0.4)
    expected = torch.distributions.kl_divergence(
        torch.distributions.Normal(mu, sigma_sq.sqrt()), torch.distributions.Normal(mu, 0.05)
    )
    torch.testing.assert_close(kl_variance(sigma_sq, 0.05), expected)

    model = tiny_model(n_layers=2, kl_weight=0.3)
    reads: list[torch.Tensor] = []
    for layer in model.layers:
        read = layer.ltm.read

        def recording(q, coeff, read=read):
            out = read(q, coeff)
            reads.append(out[2])
            return out

        monkeypatch.setattr(layer.ltm, "read", recording)
    tokens = torch.randint(0, 13, (2, 12))
    state = model.init_state(2)
    for block in tokens.split(4, 1):
        reads.clear()
        state = model(block, block, state).state
    assert len(reads) == 2
    direct = sum(0.5 * (s / 0.0025 - torch.log(s / 0.0025) - 1).mean() for s in reads)
    torch.testing.assert_close(model.aux_loss(), 0.3 * direct)
    assert model.metrics()["ltm_kl"] == pytest.approx(float(direct.detach()))


@pytest.mark.parametrize("sticky", [False, True])
def test_gradcheck_through_the_whole_ltm_read(sticky):
    """Old coefficients sampled (evenly or sticky), gate, refit, keys/values, μ and σ², the
    closed-form read and the output map: every input and parameter gets the gradient that
    finite differences give."""
    torch.manual_seed(2)
    cfg = InfinityFormerConfig(
        d_model=2, n_heads=2, n_basis=6, n_samples=3, mem_len=2, sticky=sticky, sticky_bins=4
    )
    memory = ContinuousMemory(cfg).double()
    names = [n for n, _ in memory.named_parameters()]
    params = tuple(p.detach().clone().requires_grad_() for p in memory.parameters())
    hist = torch.tensor([[0.1, 0.4, 0.2, 0.3]], dtype=torch.float64) if sticky else None
    old = torch.randn(1, 6, 2, dtype=torch.float64, requires_grad=True)
    new = torch.randn(1, 2, 2, dtype=torch.float64, requires_grad=True)
    q = torch.randn(1, 2, 2, 1, dtype=torch.float64, requires_grad=True)

    def step(old, new, q, *ps):
        return functional_call(memory, dict(zip(names, ps, strict=False)), (old, hist, new, q))

    assert torch.autograd.gradcheck(step, (old, new, q, *params))


def run_blocks(model, tokens, block, state=None):
    """Logits of the blocks of ``tokens`` streamed through ``model``, and the last state."""
    state = model.init_state(tokens.shape[0]) if state is None else state
    logits = []
    for chunk in tokens.split(block, 1):
        out = model(chunk, chunk, state)
        logits.append(out.logits)
        state = out.state
    return torch.cat(logits, 1), state


@pytest.mark.parametrize("ltm", [True, False])
def test_streaming_equals_one_pass_while_nothing_leaves_the_cache(ltm):
    model = tiny_model(ltm=ltm, n_layers=2, mem_len=8)
    tokens = torch.randint(0, 13, (2, 8))
    whole, _ = run_blocks(model, tokens, 8)
    streamed, state = run_blocks(model, tokens, 4)
    torch.testing.assert_close(streamed, whole)
    assert state[-1].tolist() == [8, 8]


def test_state_carries_and_a_reset_gives_the_first_block_again():
    model = tiny_model(sticky=True)
    tokens = torch.randint(0, 13, (2, 16))
    first, state = run_blocks(model, tokens, 4)
    flat = torch.full((2, 8), 1 / 8, dtype=torch.float64)
    assert state[1].abs().sum() > 0 and not torch.equal(state[2], flat)
    again, _ = run_blocks(model, tokens[:, :4], 4)  # from init_state
    torch.testing.assert_close(again, first[:, :4], rtol=0, atol=0)
    carried = model(tokens[:, :4], None, state).logits  # same block after a stream
    assert (carried - again).abs().max() > 1e-3


@pytest.mark.parametrize("ltm", [True, False])
def test_the_ltm_carries_what_the_cache_dropped(ltm):
    """One layer, cache of one block: block 4 can see block 1 only through the LTM; no block
    sees a later token."""
    model = tiny_model(ltm=ltm)
    tokens = torch.randint(0, 13, (1, 16))
    changed = tokens.clone()
    changed[0, 1] = (tokens[0, 1] + 1) % 13
    base, _ = run_blocks(model, tokens, 4)
    other, _ = run_blocks(model, changed, 4)
    torch.testing.assert_close(other[:, :1], base[:, :1], rtol=0, atol=0)
    assert (
        (other[:, 12:] - base[:, 12:]).abs().max() > 1e-6
        if ltm
        else torch.equal(other[:, 12:], base[:, 12:])
    )


def test_ltm_cost_does_not_grow_with_the_segments_stored():
    model = tiny_model(n_layers=2)
    tokens = torch.randint(0, 13, (2, 24))
    run_blocks(model, tokens, 4)  # the fit matrices are computed once, on first use
    state = model.init_state(2)
    flops, sizes = [], []
    for chunk in tokens.split(4, 1):
        counter = FlopCounterMode(display=False)
        with counter:
            state = model(chunk, chunk, state).state
        flops.append(counter.get_total_flops())
        sizes.append([tuple(t.shape) for t in state])
    # blocks 1 and 2 read only the STM (masked rows cost the same), block 3 starts the LTM
    # with block 1, from block 4 on it takes in samples of the old signal plus the block that
    # left the STM: the same work however much is stored
    assert len(set(flops[3:])) == 1 and flops[3] > flops[2] > flops[1] == flops[0]
    assert all(s == sizes[0] for s in sizes)
    assert state[-1].tolist() == [24, 24] and state[-2].tolist() == [16, 16]


def test_registry_config_errors_and_description():
    assert MODELS["infinity_former"] == (InfinityFormerConfig, InfinityFormerLM)
    with pytest.raises(ValueError, match=r"^tau must be in \(0, 1\), got 1.5$"):
        InfinityFormerConfig(tau=1.5)
    with pytest.raises(ValueError, match=r"^n_basis \(9\) must be a multiple of len\(basis"):
        InfinityFormerConfig(n_basis=9)
    with pytest.raises(ValueError, match=r"^mem_len must be an int, got '8'$"):
        InfinityFormerConfig(mem_len="8")
    with pytest.raises(ValueError, match=r"^basis_widths must be a non-empty list"):
        InfinityFormerConfig(basis_widths=[0.01, -1])
    model = tiny_model()
    with pytest.raises(ValueError, match=r"mem_len \(4\) >= the block length \(5\)"):
        model(torch.zeros(1, 5, dtype=torch.long))
    assert model.describe() == (
        "∞-former: Transformer-XL 1x8, 2 heads, mem_len 4; LTM 16 Gaussian RBFs "
        "(widths 0.01/0.05), tau 0.75, 6 samples, even"
    )
    assert (
        tiny_model(ltm=False).describe()
        == "Transformer-XL 1x8, 2 heads, mem_len 4; no long-term memory"
    )
    groups = model.parameter_groups()
    assert sum(groups.values()) == sum(p.numel() for p in model.parameters())
    assert groups["long_term_memory"] == sum(p.numel() for p in model.layers[0].ltm.parameters())
    assert "long_term_memory" not in tiny_model(ltm=False).parameter_groups()


SPEC = """\
name: inf
dataset: python_docs
model: {{kind: infinity_former, d_model: 16, n_heads: 2, mem_len: 8, {model}}}
train: {{steps: 2, batch_size: 2, seq_len: 8, optimizer: {{type: adam, lr: 1.0e-3, clip: global}}}}
stages: [download, preprocess, train]
"""


def test_a_spec_builds_it_and_refuses_keys_that_do_nothing(tmp_path):
    path = tmp_path / "inf.yaml"
    path.write_text(SPEC.format(model="n_basis: 8, n_samples: 4, sticky: true, sticky_bins: 4"))
    spec = load_spec(path)
    assert spec.model_params == InfinityFormerConfig(
        d_model=16, n_heads=2, mem_len=8, n_basis=8, n_samples=4, sticky=True, sticky_bins=4
    )
    path.write_text(SPEC.format(model="ltm: false, tau: 0.5"))
    with pytest.raises(SpecError) as err:
        load_spec(path)
    assert str(err.value).startswith(
        f"{path}:3: model.tau: does nothing here (model.ltm is false); remove it"
    )
    assert "\n" not in str(err.value)


def trace_memories(model, tokens, blocks):
    """Stream ``tokens`` [1, T] (distinct ids) through a one-layer ``model`` in blocks of the
    given lengths; per block: (the token ids of the STM rows the attention reads, those of
    the vectors the LTM takes in, whether it had old coefficients, whether it was read)."""
    layer = model.layers[0]
    table = model.embed.weight * math.sqrt(model.cfg.d_model)  # layer 0's input rows

    def ids(rows):  # [R, d] -> token ids; zero rows: none
        out = []
        for row in rows:
            if row.abs().max() == 0:
                continue
            dist = (table - row).abs().amax(-1)
            assert dist.min() < 1e-12, "a row that is no token's embedding"
            out.append(int(dist.argmin()))
        return out

    record = {}
    layer.qkv.register_forward_pre_hook(
        lambda mod, args: record.__setitem__("stm", ids(args[0][0, : -record["m"]]))
    )
    update, read = layer.ltm.update, layer.ltm.read

    def recording_update(coeff, hist, new):
        record["ltm"] = (ids(new[0]), coeff is not None)
        return update(coeff, hist, new)

    def recording_read(q, coeff):
        record["read"] = True
        return read(q, coeff)

    layer.ltm.update, layer.ltm.read = recording_update, recording_read
    trace, state, start = [], model.init_state(1), 0
    for m in blocks:
        record.clear()
        record["m"] = m
        state = model(tokens[:, start : start + m], None, state).state
        start += m
        intake, had_old = record.get("ltm", ([], False))
        trace.append((record["stm"], intake, had_old, record.get("read", False)))
    return trace


def span(a, b):
    return list(range(a, b))


@pytest.mark.parametrize(
    "mem_len, blocks, expected",
    [
        # STM rows read, LTM intake, intake refit with old samples, LTM read
        (
            4,
            [4] * 5,
            [
                ([], [], False, False),
                (span(0, 4), [], False, False),
                (span(4, 8), span(0, 4), False, True),  # block 1 left the STM in 2
                (span(8, 12), span(4, 8), True, True),
                (span(12, 16), span(8, 12), True, True),
            ],
        ),
        (
            6,
            [4] * 6,
            [
                ([], [], False, False),
                (span(0, 4), [], False, False),
                (span(2, 8), span(0, 2), False, True),
                (span(6, 12), span(2, 6), True, True),
                (span(10, 16), span(6, 10), True, True),
                (span(14, 20), span(10, 14), True, True),
            ],
        ),
        # a shorter block: the next one still takes in all that left the STM during it
        (
            4,
            [4, 4, 4, 2, 4, 4],
            [
                ([], [], False, False),
                (span(0, 4), [], False, False),
                (span(4, 8), span(0, 4), False, True),
                (span(8, 12), span(4, 8), True, True),
                (span(10, 14), span(8, 10), True, True),
                (span(14, 18), span(10, 14), True, True),
            ],
        ),
    ],
)
def test_a_state_enters_the_ltm_one_block_after_it_left_the_stm(mem_len, blocks, expected):
    """The authors' order (sorting/mem_transformer.py): the layer memory keeps mem_len +
    augment_len states, the attention reads the last mem_len, the LTM takes in the rest: no
    state is in the STM and the LTM at once."""
    model = build_model("infinity_former", {**TINY, "mem_len": mem_len}, 32).double().eval()
    tokens = torch.arange(sum(blocks)).unsqueeze(0)
    trace = trace_memories(model, tokens, blocks)
    assert trace == expected
    held = []
    for stm, intake, _, _ in trace:
        held += intake
        assert not set(held) & set(stm)  # the LTM never repeats the STM
    assert held == span(0, len(held))  # every state enters once, in order


@pytest.mark.parametrize("midpoints", [False, True])
def test_contraction_grid_positions(midpoints):
    """The authors' grid (default): the old signal sampled at k/M and placed at τk/M (k =
    1..M), the new vectors at τ + (1 − τ)j/L (j = 1..L); the option: the cells' midpoints."""
    n_old, n_new, tau = 4, 3, 0.75
    # the default called without the option: what the old code computed too
    option = {"contraction_midpoints": True} if midpoints else {}
    positions, pad = fit_positions(n_old, n_new, tau, *option.values())
    shift = 0.5 if midpoints else 0.0
    old_at = [(k - shift) / n_old for k in range(1, n_old + 1)]
    new_at = [tau + (1 - tau) * (j - shift) / n_new for j in range(1, n_new + 1)]
    inner = positions[pad : pad + n_old + n_new].tolist()
    assert inner == pytest.approx([tau * u for u in old_at] + new_at, abs=1e-15)
    assert pad == 3 and len(positions) == 2 * pad + n_old + n_new
    # the old signal is evaluated at old_at: give it one coefficient per basis function
    cfg = InfinityFormerConfig(d_model=1, n_heads=1, n_basis=6, n_samples=n_old, **option)
    memory = ContinuousMemory(cfg).double()
    coeff = torch.arange(1.0, 7.0, dtype=torch.float64).view(1, 6, 1)
    centres, widths = [0, 0, 0.5, 0.5, 1, 1], [0.01, 0.05] * 3
    expected = [
        sum(
            c * math.exp(-0.5 * ((u - mu) / s) ** 2) / (s * math.sqrt(2 * math.pi))
            for c, mu, s in zip(coeff.flatten().tolist(), centres, widths, strict=False)
        )
        for u in old_at
    ]
    got = memory.old_samples(coeff, None).flatten().tolist()
    assert got == pytest.approx(expected, rel=1e-12)


def record_dropout_sites(model, tokens, block):
    """Train-mode pass over ``tokens`` in blocks; per layer of the last block: (the residual
    that norm1 adds, the attention's + the LTM's outputs, the input of the position map)."""
    seen = {}
    for i, layer in enumerate(model.layers):
        layer.register_forward_pre_hook(lambda mod, args, i=i: seen.__setitem__(("x", i), args[0]))
        layer.norm1.register_forward_pre_hook(
            lambda mod, args, i=i: seen.__setitem__(("norm1", i), args[0])
        )
        layer.attn_out.register_forward_hook(
            lambda mod, args, out, i=i: seen.__setitem__(("attn", i), out)
        )
        layer.ltm.out.register_forward_hook(
            lambda mod, args, out, i=i: seen.__setitem__(("ltm", i), out)
        )
        layer.pos.register_forward_pre_hook(
            lambda mod, args, i=i: seen.__setitem__(("pos", i), args[0])
        )
    model.train()
    run_blocks(model, tokens, block)
    return [
        (seen["norm1", i] - seen["x", i], seen["attn", i] + seen["ltm", i], seen["pos", i])
        for i in range(len(model.layers))
    ]


@pytest.mark.parametrize("on_output", [False, True])
def test_dropout_acts_on_the_position_embeddings_not_the_attention_output(on_output):
    """The authors' relative attention adds its output (short-term + LTM) to the residual
    undropped and drops the position embeddings, one draw for all layers;
    attention_output_dropout also drops the output, as the original Transformer-XL."""
    p = 0.5
    option = {"attention_output_dropout": True} if on_output else {}
    model = tiny_model(n_layers=2, dropout=p, **option)
    tokens = torch.randint(0, 13, (2, 12))
    sites = record_dropout_sites(model, tokens, 4)  # the last block reads the LTM
    distances = torch.arange(8, dtype=torch.float64)  # STM 4 + block 4
    freq = 10000 ** (-torch.arange(0, 8, 2, dtype=torch.float64) / 8)
    sinusoid_table = torch.cat(
        [torch.sin(distances[:, None] * freq), torch.cos(distances[:, None] * freq)], -1
    )
    for residual, attention, pos_in in sites:
        if on_output:
            assert (residual == 0).any() and not torch.equal(residual, attention)
            kept = residual != 0
            torch.testing.assert_close(residual[kept], attention[kept] / (1 - p))
        else:
            torch.testing.assert_close(residual, attention, rtol=1e-12, atol=1e-12)
        kept = pos_in != 0
        assert 0 < kept.sum() < kept.numel() - 2  # sin(0) = 0 are 4 of the zeros
        torch.testing.assert_close(
            pos_in[kept], sinusoid_table[kept] / (1 - p), rtol=1e-6, atol=1e-6
        )
    assert torch.equal(sites[0][2], sites[1][2])  # one draw shared by the layers
