"""The ∞-former's continuous memory under bf16 / fp16: the basis, μ, σ², the read weights and
the old samples stay float32 (pipeline/models/infinity_former/model.py, ContinuousMemory).

bf16 keeps 8 bits of mantissa: at N = 1024 the 512 centres linspace(0, 1, 512) round to 385
distinct values, and read weights computed from them move by about 12%."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from pipeline.models.infinity_former.model import ContinuousMemory, InfinityFormerConfig

CFG = InfinityFormerConfig(d_model=8, n_heads=2, n_basis=1024, n_samples=64)
LOW = [torch.bfloat16, torch.float16]


def exact_basis():
    """Centres and widths of CFG's basis in float64, written out."""
    n_centres = CFG.n_basis // 2
    centres = [k / (n_centres - 1) for k in range(n_centres) for _ in range(2)]
    widths = [0.01, 0.05] * n_centres
    return (torch.tensor(centres, dtype=torch.float64), torch.tensor(widths, dtype=torch.float64))


def gaussian(x, mean, var):
    return torch.exp(-0.5 * (x - mean) ** 2 / var) / torch.sqrt(2 * math.pi * var)


@pytest.mark.parametrize("dtype", LOW)
def test_a_low_precision_memory_keeps_its_basis_in_float32(dtype):
    torch.manual_seed(0)
    f32 = ContinuousMemory(CFG)
    low = copy.deepcopy(f32).to(dtype)
    assert low.key.weight.dtype == dtype  # the rest of it is cast
    assert low.centres.dtype == low.widths.dtype == torch.float32
    assert torch.equal(low.centres, f32.centres) and torch.equal(low.widths, f32.widths)
    assert len(set(low.centres.tolist())) == CFG.n_basis // 2
    centres, widths = exact_basis()
    torch.testing.assert_close(low.centres.double(), centres, rtol=0, atol=1e-7)


@pytest.mark.parametrize("dtype", LOW)
def test_low_precision_read_weights_equal_float32s(dtype):
    f32 = ContinuousMemory(CFG)
    low = copy.deepcopy(f32).to(dtype)
    mu = torch.rand(200, generator=torch.Generator().manual_seed(1))
    sigma_sq = torch.logspace(-6, -1, 200)
    r32, r_low = f32.read_weights(mu, sigma_sq), low.read_weights(mu, sigma_sq)
    assert r_low.dtype == torch.float32
    rel = (r_low - r32).abs().amax(-1) / r32.abs().amax(-1)
    assert rel.max() < 1e-3
    # and both are the closed form of the exact basis
    centres, widths = exact_basis()
    direct = gaussian(mu.double()[:, None], centres, sigma_sq.double()[:, None] + widths**2)
    assert ((r_low.double() - direct).abs().amax(-1) / direct.abs().amax(-1)).max() < 1e-5


@pytest.mark.parametrize("dtype", LOW)
def test_a_low_precision_read_and_old_samples_use_the_exact_basis(dtype):
    """The read of a bf16 / fp16 module against float64 arithmetic on the same (rounded)
    inputs and the μ, σ² it returns: only the output's own rounding apart."""
    torch.manual_seed(2)
    low = ContinuousMemory(CFG).to(dtype)
    coeff = (torch.randn(1, CFG.n_basis, CFG.d_model) * 0.3).to(dtype)
    q = torch.randn(1, 2, 5, 4).to(dtype)
    out, mu, sigma_sq = low.read(q, coeff)
    assert out.dtype == dtype and mu.dtype == sigma_sq.dtype == torch.float32
    centres, widths = exact_basis()
    r = gaussian(mu.double()[..., None], centres, sigma_sq.double()[..., None] + widths**2)
    values = (coeff.double() @ low.value.weight.double().T).view(1, -1, 2, 4).transpose(1, 2)
    z = (r @ values).transpose(1, 2).reshape(1, 5, 8)
    expected = z @ low.out.weight.double().T
    assert ((out.double() - expected).abs().max() / expected.abs().max()) < 2e-2
    # the old signal at the authors' grid k/M
    u = torch.arange(1, CFG.n_samples + 1, dtype=torch.float64) / CFG.n_samples
    psi = gaussian(u[:, None], centres, widths**2)
    samples = low.old_samples(coeff, None)
    expected = psi @ coeff[0].double()
    assert ((samples[0].double() - expected).abs().max() / expected.abs().max()) < 1e-2
