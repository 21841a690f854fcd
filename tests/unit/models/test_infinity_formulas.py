"""The ∞-former's continuous memory against its definitions, computed here without the module's
helpers: explicit loops over Python floats (float64), quadrature and finite differences.

Each piece (basis and design matrix, ridge fit, closed-form read, gradients, the whole LTM
step over two blocks, KL, sticky positions, the query the LTM reads with) is written out from
the paper (docs/papers.md#infinity-former) and the authors' code, so that changing any single
line of a formula in pipeline/models/infinity_former/model.py fails a test here
(quality/mutations.py checks that).

Sizes are tiny and the basis wide (widths 0.1 / 0.3 over 4 centres) so that every basis
function overlaps every position and no term vanishes in rounding; λ = 0.5 and τ = 0.6 so
that λ² or 1 − τ would not give the same numbers.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from pipeline.models import build_model
from pipeline.models.infinity_former.model import (
    ContinuousMemory,
    InfinityFormerConfig,
    basis_values,
    bin_masses,
    expected_basis,
    fit_positions,
    gaussian_basis,
    kl_variance,
    ridge_fit_matrix,
    sticky_positions,
)

WIDTHS = [0.1, 0.3]
CFG = dict(
    d_model=4,
    n_heads=2,
    n_basis=8,
    basis_widths=WIDTHS,
    ridge_penalty=0.5,
    n_samples=5,
    tau=0.6,
    sticky_bins=4,
    mem_len=3,
)
SQRT_2PI = math.sqrt(2 * math.pi)


# --- the definitions, written out ----------------------------------------------------------


def basis(n_basis=8, widths=WIDTHS):
    """(centre, width) of each basis function: n_basis / len(widths) centres evenly on [0, 1]
    (both ends included), each with every width, centre by centre (the authors' meshgrid)."""
    n_centres = n_basis // len(widths)
    return [(k / (n_centres - 1), w) for k in range(n_centres) for w in widths]


def psi(t, fns):
    """The normalised Gaussian densities N(t; c, w²) of the basis at position t."""
    return [math.exp(-(((t - c) / w) ** 2) / 2) / (w * SQRT_2PI) for c, w in fns]


def positions(n_old, n_new, tau, midpoints=False):
    """(left padding, the vectors' positions, right padding) of one fit."""
    total = n_old + n_new
    shift = 0.5 if midpoints else 0.0
    if n_old:
        inner = [tau * (k - shift) / n_old for k in range(1, n_old + 1)] + [
            tau + (1 - tau) * (j - shift) / n_new for j in range(1, n_new + 1)
        ]
    else:
        inner = [(i + 0.5) / n_new for i in range(n_new)]
    pad = total // 2
    return (
        [-(pad - k - 0.5) / total for k in range(pad)],
        inner,
        [1 + (k + 0.5) / total for k in range(pad)],
    )


def ridge_fit(xs, n_old, tau, ridge, fns, midpoints=False):
    """B [N, d] = argmin ‖Fᵀ B − X‖² + λ‖B‖² over the positions of one fit, X zero at the
    padding: B = (F Fᵀ + λ I)⁻¹ F X."""
    left, inner, right = positions(n_old, len(xs) - n_old, tau, midpoints)
    where = left + inner + right
    rows = [[0.0] * len(xs[0])] * len(left) + xs + [[0.0] * len(xs[0])] * len(right)
    f = torch.tensor([psi(t, fns) for t in where], dtype=torch.float64).T  # [N, P]
    gram = f @ f.T + ridge * torch.eye(len(fns), dtype=torch.float64)
    return torch.linalg.solve(gram, f @ torch.tensor(rows, dtype=torch.float64))


def gate(xs, weight, bias):
    """X̃ = sigmoid(conv1d_k3(X)) ⊙ X, the convolution zero-padded at both ends."""
    length, d = len(xs), len(xs[0])
    out = []
    for i in range(length):
        row = []
        for o in range(d):
            a = bias[o] + sum(
                weight[o][c][k] * xs[i + k - 1][c]
                for c in range(d)
                for k in range(3)
                if 0 <= i + k - 1 < length
            )
            row.append(xs[i][o] / (1 + math.exp(-a)))
        out.append(row)
    return out


def signal_at(coeff, u, fns):
    """X(u) = Bᵀ ψ(u)."""
    weights = psi(u, fns)
    return [sum(w * coeff[j][e] for j, w in enumerate(weights)) for e in range(len(coeff[0]))]


def gaussian_read(mu, var, fns):
    """E_{t ~ N(μ, σ²)}[ψ_j(t)]: the convolution of two Gaussians, N(μ; c_j, w_j² + σ²)."""
    return [
        math.exp(-((mu - c) ** 2) / (2 * (w * w + var))) / math.sqrt(2 * math.pi * (w * w + var))
        for c, w in fns
    ]


def read(q, coeff, p, fns, n_heads):
    """The LTM read of queries q [H][M][d_head] from coefficients B [N][d] with the module's
    weights p (plain lists): -> (output [M][d], μ [H][M], σ² [H][M])."""
    d = len(coeff[0])
    dh = d // n_heads
    keys = [
        [sum(coeff[j][c] * p["key.weight"][o][c] for c in range(d)) for o in range(d)]
        for j in range(len(coeff))
    ]
    values = [
        [sum(coeff[j][c] * p["value.weight"][o][c] for c in range(d)) for o in range(d)]
        for j in range(len(coeff))
    ]
    m = len(q[0])
    z = [[0.0] * d for _ in range(m)]
    mus, sigmas = [], []
    for h in range(n_heads):
        cols = range(h * dh, (h + 1) * dh)
        mus.append([]), sigmas.append([])
        for i in range(m):
            s = [
                sum(q[h][i][a] * keys[j][c] for a, c in enumerate(cols)) / math.sqrt(dh)
                for j in range(len(coeff))
            ]
            mu = 1 / (1 + math.exp(-sum(w * x for w, x in zip(p["mu.weight"][0], s, strict=False))))
            var = max(
                math.log1p(
                    math.exp(sum(w * x for w, x in zip(p["sigma.weight"][0], s, strict=False)))
                ),
                1e-6,
            )
            mus[h].append(mu), sigmas[h].append(var)
            r = gaussian_read(mu, var, fns)
            for c in cols:
                z[i][c] = sum(r[j] * values[j][c] for j in range(len(coeff)))
    out = [
        [sum(p["out.weight"][o][c] * z[i][c] for c in range(d)) for o in range(d)] for i in range(m)
    ]
    return out, mus, sigmas


def histogram(mus, sigmas, n_bins):
    """The mass each N(μ, σ²) puts on each of n_bins equal bins of [0, 1], summed, normalised."""
    mass = [0.0] * n_bins
    for mu, var in zip(mus, sigmas, strict=False):
        for k in range(n_bins):
            lo, hi = k / n_bins, (k + 1) / n_bins
            mass[k] += 0.5 * (
                math.erf((hi - mu) / math.sqrt(2 * var)) - math.erf((lo - mu) / math.sqrt(2 * var))
            )
    total = sum(mass)
    return [v / total for v in mass]


def quantile(hist, level):
    """The position on [0, 1] where the CDF of the histogram's piecewise-uniform density
    reaches ``level``, by bisection."""

    def cdf(x):
        k = min(int(x * len(hist)), len(hist) - 1)
        return sum(hist[:k]) + hist[k] * (x * len(hist) - k)

    lo, hi = 0.0, 1.0
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cdf(mid) < level else (lo, mid)
    return (lo + hi) / 2


def params(memory):
    return {name: p.detach().tolist() for name, p in memory.named_parameters()}


def memory_with_weights(sticky=False, midpoints=False, seed=0):
    torch.manual_seed(seed)
    cfg = InfinityFormerConfig(**CFG, sticky=sticky, contraction_midpoints=midpoints)
    memory = ContinuousMemory(cfg).double()
    with torch.no_grad():
        for p in memory.parameters():
            p.copy_(torch.randn_like(p) * 0.7)
    return memory


# --- the pieces -----------------------------------------------------------------------------


def test_basis_and_design_matrix():
    centres, widths = gaussian_basis(8, WIDTHS)
    assert centres.tolist() == pytest.approx([c for c, _ in basis()], abs=1e-15)
    assert widths.tolist() == [w for _, w in basis()]
    t = [-0.3, 0.0, 0.2, 0.5, 0.77, 1.0, 1.4]
    torch.testing.assert_close(
        basis_values(torch.tensor(t, dtype=torch.float64), centres, widths),
        torch.tensor([psi(x, basis()) for x in t], dtype=torch.float64),
        rtol=1e-12,
        atol=0,
    )
    # the module's signal: the old samples of B = I are the design matrix rows ψ(k/M)
    memory = ContinuousMemory(InfinityFormerConfig(**dict(CFG, n_samples=3))).double()
    coeff = torch.eye(8, dtype=torch.float64).unsqueeze(0)
    torch.testing.assert_close(
        memory.old_samples(coeff, None)[0],
        torch.tensor([psi(k / 3, basis()) for k in (1, 2, 3)], dtype=torch.float64),
        rtol=1e-12,
        atol=0,
    )


@pytest.mark.parametrize("n_old, midpoints", [(0, False), (5, False), (5, True)])
def test_ridge_fit_matrix_is_the_ridge_solution(n_old, midpoints):
    n_new = 3
    where, pad = fit_positions(n_old, n_new, 0.6, midpoints)
    left, inner, right = positions(n_old, n_new, 0.6, midpoints)
    assert where.tolist() == pytest.approx(left + inner + right, abs=1e-15)
    g = ridge_fit_matrix(where, pad, *gaussian_basis(8, WIDTHS), 0.5)  # [L, N]
    xs = torch.randn(
        n_old + n_new, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(3)
    ).tolist()
    torch.testing.assert_close(
        g.T @ torch.tensor(xs, dtype=torch.float64),
        ridge_fit(xs, n_old, 0.6, 0.5, basis(), midpoints),
        rtol=1e-10,
        atol=1e-12,
    )


def test_closed_form_read_weights_against_quadrature():
    fns = basis()
    centres, widths = gaussian_basis(8, WIDTHS)
    t = torch.linspace(-4, 5, 400_001, dtype=torch.float64)
    for mu, var in [(0.0, 1e-3), (0.31, 0.02), (0.8, 0.4)]:
        density = torch.exp(-((t - mu) ** 2) / (2 * var)) / math.sqrt(2 * math.pi * var)
        quad = [
            float(
                torch.trapezoid(density * torch.exp(-(((t - c) / w) ** 2) / 2) / (w * SQRT_2PI), t)
            )
            for c, w in fns
        ]
        closed = expected_basis(
            torch.tensor(mu, dtype=torch.float64),
            torch.tensor(var, dtype=torch.float64),
            centres,
            widths,
        )
        assert closed.tolist() == pytest.approx(quad, rel=1e-7, abs=1e-10)
        assert gaussian_read(mu, var, fns) == pytest.approx(quad, rel=1e-7, abs=1e-10)


def test_kl_against_the_gaussians_kl_and_quadrature():
    sigma_0 = 0.05
    sigma_sq = [1e-6, 0.0025, 0.01, 0.3]
    t = torch.linspace(-6, 6, 600_001, dtype=torch.float64)
    for var, kl in zip(
        sigma_sq,
        kl_variance(torch.tensor(sigma_sq, dtype=torch.float64), sigma_0).tolist(),
        strict=False,
    ):
        closed = math.log(sigma_0 / math.sqrt(var)) + var / (2 * sigma_0**2) - 0.5
        assert kl == pytest.approx(closed, rel=1e-12)
        if var >= 1e-4:  # numerically: ∫ p log(p / p0), p = N(0.4, σ²), p0 = N(0.4, σ0²)
            logp = -((t - 0.4) ** 2) / (2 * var) - 0.5 * math.log(2 * math.pi * var)
            logp0 = -((t - 0.4) ** 2) / (2 * sigma_0**2) - 0.5 * math.log(2 * math.pi * sigma_0**2)
            assert kl == pytest.approx(
                float(torch.trapezoid(logp.exp() * (logp - logp0), t)), rel=1e-6
            )


def test_sticky_positions_are_quantiles_at_the_cells_midpoints():
    hist = [0.1, 0.45, 0.0, 0.45]
    got = sticky_positions(torch.tensor([hist], dtype=torch.float64), 5)[0].tolist()
    assert got == pytest.approx([quantile(hist, (k + 0.5) / 5) for k in range(5)], abs=1e-12)


def test_sticky_histogram_from_its_definition():
    gen = torch.Generator().manual_seed(4)
    mu = torch.rand(2, 6, dtype=torch.float64, generator=gen)
    sigma_sq = torch.rand(2, 6, dtype=torch.float64, generator=gen) * 0.05 + 1e-3
    got = bin_masses(mu, sigma_sq, 4)
    for b in range(2):
        assert got[b].tolist() == pytest.approx(
            histogram(mu[b].tolist(), sigma_sq[b].tolist(), 4), rel=1e-12
        )


# --- the whole LTM step ---------------------------------------------------------------------


def reference_steps(memory, blocks, queries, sticky):
    """Two blocks by hand: gate, fit (with the old signal sampled and contracted the second
    time, where the sticky histogram of the first read says when ``sticky``), read."""
    p, fns, n = params(memory), basis(), CFG["n_samples"]
    outs, coeff, hist = [], None, None
    for new, q in zip(blocks, queries, strict=False):
        xs = gate(new, p["gate.weight"], p["gate.bias"])
        if coeff is None:
            coeff = ridge_fit(xs, 0, CFG["tau"], CFG["ridge_penalty"], fns).tolist()
        else:
            at = (
                [quantile(hist, (k + 0.5) / n) for k in range(n)]
                if sticky
                else [k / n for k in range(1, n + 1)]
            )
            old = [signal_at(coeff, u, fns) for u in at]
            coeff = ridge_fit(old + xs, n, CFG["tau"], CFG["ridge_penalty"], fns).tolist()
        out, mus, sigmas = read(q, coeff, p, fns, CFG["n_heads"])
        outs.append((out, coeff, mus, sigmas))
        hist = histogram(sum(mus, []), sum(sigmas, []), CFG["sticky_bins"])
    return outs


@pytest.mark.parametrize("sticky", [False, True])
def test_two_ltm_steps_against_the_definitions(sticky):
    memory = memory_with_weights(sticky)
    gen = torch.Generator().manual_seed(5)
    blocks = [torch.randn(1, 3, 4, dtype=torch.float64, generator=gen) for _ in range(2)]
    queries = [torch.randn(1, 2, 3, 2, dtype=torch.float64, generator=gen) for _ in range(2)]
    # some queries' σ² falls below the clamp: softplus of a very negative logit
    with torch.no_grad():
        memory.sigma.weight *= 300
    expected = reference_steps(
        memory, [b[0].tolist() for b in blocks], [q[0].tolist() for q in queries], sticky
    )
    coeff, hist = None, None
    clamped = False
    for (new, q), (out_ref, coeff_ref, mu_ref, sigma_ref) in zip(
        zip(blocks, queries, strict=False), expected, strict=False
    ):
        out, coeff, mu, sigma_sq = memory(coeff, hist, new, q)
        torch.testing.assert_close(
            coeff[0], torch.tensor(coeff_ref, dtype=torch.float64), rtol=1e-9, atol=1e-12
        )
        torch.testing.assert_close(
            mu[0], torch.tensor(mu_ref, dtype=torch.float64), rtol=1e-9, atol=1e-12
        )
        torch.testing.assert_close(
            sigma_sq[0], torch.tensor(sigma_ref, dtype=torch.float64), rtol=1e-9, atol=1e-15
        )
        torch.testing.assert_close(
            out[0], torch.tensor(out_ref, dtype=torch.float64), rtol=1e-9, atol=1e-12
        )
        clamped |= bool((sigma_sq == 1e-6).any())
        if sticky:
            hist = bin_masses(mu.reshape(1, -1), sigma_sq.reshape(1, -1), CFG["sticky_bins"])
        coeff = coeff.detach()
    assert clamped, "no σ² reached the clamp: the case is not tested"


def test_gradients_against_finite_differences_of_the_definitions():
    """d(output · w)/d(new vectors, queries, old coefficients, weights) by autograd against
    central differences of the hand-written step."""
    memory = memory_with_weights(seed=1)
    gen = torch.Generator().manual_seed(6)
    new = torch.randn(1, 3, 4, dtype=torch.float64, generator=gen, requires_grad=True)
    q = torch.randn(1, 2, 3, 2, dtype=torch.float64, generator=gen, requires_grad=True)
    old = torch.randn(1, 8, 4, dtype=torch.float64, generator=gen, requires_grad=True)
    w = torch.randn(1, 3, 4, dtype=torch.float64, generator=gen)
    out, *_ = memory(old, None, new, q)
    (out * w).sum().backward()
    fns, n = basis(), CFG["n_samples"]

    def reference(new_, q_, old_, p):
        xs = gate(new_, p["gate.weight"], p["gate.bias"])
        samples = [signal_at(old_, k / n, fns) for k in range(1, n + 1)]
        coeff = ridge_fit(samples + xs, n, CFG["tau"], CFG["ridge_penalty"], fns).tolist()
        ref, _, _ = read(q_, coeff, p, fns, CFG["n_heads"])
        return sum(
            a * b
            for row, wrow in zip(ref, w[0].tolist(), strict=False)
            for a, b in zip(row, wrow, strict=False)
        )

    base = [new[0].tolist(), q[0].tolist(), old[0].tolist(), params(memory)]
    eps = 1e-6

    def numeric(path):
        def shifted(delta):
            args = copy.deepcopy(base)
            cell = args
            for i in path[:-1]:
                cell = cell[i]
            cell[path[-1]] += delta
            return reference(*args)

        return (shifted(eps) - shifted(-eps)) / (2 * eps)

    checks = [([0], new.grad[0]), ([1], q.grad[0]), ([2], old.grad[0])]
    checks += [([3, name], p.grad) for name, p in memory.named_parameters()]
    pick = torch.Generator().manual_seed(7)
    for path, grad in checks:
        for k in torch.randperm(grad.numel(), generator=pick)[:3].tolist():
            index = [int(i) for i in torch.unravel_index(torch.tensor(k), grad.shape)]
            assert float(grad.reshape(-1)[k]) == pytest.approx(
                numeric(path + index), rel=1e-5, abs=1e-8
            ), path + index


# --- in the model ---------------------------------------------------------------------------


def test_the_ltm_reads_with_the_short_term_attentions_query():
    """The query of the LTM read is the short-term attention's own: the first third of the
    layer's qkv map of the block's inputs, split into heads (no position or content bias)."""
    torch.manual_seed(0)
    model = (
        build_model("infinity_former", dict(CFG, n_layers=1, ff_dim=8, dropout=0.0), 11)
        .double()
        .eval()
    )
    layer, seen = model.layers[0], {}
    layer.register_forward_pre_hook(lambda mod, args: seen.__setitem__("x", args[0]))
    read = layer.ltm.read

    def recording(q, coeff):
        seen["q"] = q
        return read(q, coeff)

    layer.ltm.read = recording
    state = model.init_state(2)
    for block in torch.randint(0, 11, (2, 9)).split(3, 1):
        state = model(block, None, state).state
    x, w_q = seen["x"].detach(), layer.qkv.weight.detach()[:4]
    for b in range(2):
        for h in range(2):
            for i in range(3):
                for a in range(2):
                    expected = sum(float(w_q[2 * h + a, c]) * float(x[b, i, c]) for c in range(4))
                    assert float(seen["q"][b, h, i, a].detach()) == pytest.approx(
                        expected, rel=1e-12
                    )
