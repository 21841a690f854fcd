"""The ∞-former (Martins, Marinho, Martins, 2022): a Transformer-XL whose attention also reads
a continuous long-term memory (LTM). docs/papers.md#infinity-former has the facts; where the
paper is silent this follows the authors' sorting code (deep-spin/infinite-former, sorting/).

Per layer and block of M tokens (batch first throughout):
- the short-term memory (STM) is the Transformer-XL cache the attention reads: the layer's
  input hidden states of the last ``mem_len`` tokens. With the LTM the cache keeps ``mem_len``
  more rows: the states that left the STM in the previous block wait there, and the LTM
  takes them in at the start of this block, before the block reads it (the authors' layer
  memory of mem_len + augment_len states, of which the attention reads the last mem_len and
  the LTM takes in the rest). So a state enters the LTM only once the STM no longer reads it,
  one block after it left, and the LTM is first read in the block after the first states
  left the STM (the third block when mem_len is the block length). They are all past
  tokens, so the read stays causal, and the gate gets a gradient through them;
- the LTM is N coefficient vectors B [N, d] of a signal X(t) = Bᵀψ(t) on [0, 1], ψ = N
  normalised Gaussian densities (centres linspace(0, 1, N/2), each with every width of
  ``basis_widths``). Taking in vectors X [L, d]: gate X̃ = sigmoid(conv1d_k3(X)) ⊙ X, then the
  ridge fit B = Gᵀ X̃, G = Fᵀ(FFᵀ + λI)⁻¹ precomputed in float64 over positions on about
  [−0.5, 1.5] of which the vectors occupy the middle (the zero-padded boundary of the code);
- unbounded memory: once the LTM holds something, M = ``n_samples`` samples of the old signal
  are contracted into [0, τ] and the L new vectors placed in (τ, 1], and B is refit from both;
  the old B is detached (the memory history carries no gradient). The paper says only
  "linearly spaced"; as the authors' code, the old signal is sampled at k/M and the samples
  placed at τk/M (k = 1..M), the new vectors at τ + (1 − τ)j/L (j = 1..L): the right ends of
  equal cells. ``contraction_midpoints`` takes the cells' midpoints instead ((k − 1/2)/M,
  τ + (1 − τ)(j − 1/2)/L);
- sticky memories: the old signal is sampled where the previous block's Gaussians put their
  mass (a histogram over ``sticky_bins`` bins, bin mass via erf) instead of evenly. The
  authors draw the positions at random; here they are the histogram's quantiles at
  (k + 1/2)/n_samples, so a stream and its resumed copy sample the same places. The samples
  still land evenly on [0, τ], so regions read often take more of the new memory;
- the read: keys K = B W_K and values V = B W_V split by heads; the query is the short-term
  attention's own query q; s = K q / sqrt(d_head), μ = sigmoid(w_μ·s), σ² = softplus(w_σ·s)
  (one pair of Linear(N, 1) per layer, shared by heads; σ² ≥ 1e-6); z = Vᵀ r with the closed
  form r_j = N(μ; μ_j, σ_j² + σ²) (the density of N(μ, σ²) integrated against ψ_j over the
  line); z's heads go through the LTM's own output map and are added to the short-term
  attention's output (after its output projection); the sum joins the residual without
  dropout, as in the authors' code (``attention_output_dropout``: with it); μ, σ², r and the
  basis are float32 under bf16 / fp16 (``ContinuousMemory``);
- loss + kl_weight · Σ_layers mean KL(N(μ, σ²) ‖ N(μ, σ0²)) (the variance only).

``ltm: false`` is the Transformer-XL baseline with the same short-term memory.

The state (``init_state``): per layer the cache [B, mem_len, d] ([B, 2·mem_len, d] with the
LTM: the states waiting to enter the LTM, then the STM); with the LTM also its coefficients
[B, N, d], and with sticky memories the bin masses [B, sticky_bins] (float32 under bf16 /
fp16); then, with the LTM, the number of stream positions the LTM has taken in [B] (int64;
it takes in the next ones up to the STM's first); last, the number of tokens seen so far in
the stream [B] (int64), which tells which cache rows hold states (the rest are masked). A
stream is reset (a new document) by starting again from ``init_state``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from pipeline.models.capabilities import ActivationMemory, MemoryCounts, TrainingMetrics
from pipeline.models.checks import check_at_least, check_scalar_types
from pipeline.models.protocol import ModelOutput, SequenceModel, State

MIN_SIGMA_SQ = 1e-6
"""Lower bound of a query's variance σ² (the authors' code)."""


@dataclass
class InfinityFormerConfig:
    """Architecture of an ∞-former LM (the `model:` section with ``kind: infinity_former``).
    Defaults: the paper's sorting model (3 layers, 6 heads, STM 1,024 + 1,024 RBFs)."""

    d_model: int = 300
    """Model width d (the authors' sorting script: 300 = 6 heads of 50)."""
    n_layers: int = 3
    """Transformer-XL layers."""
    n_heads: int = 6
    """Attention heads; d_model must be a multiple (head size d / n_heads)."""
    ff_dim: int = 300
    """Inner size of each layer's feed-forward sublayer (the authors' sorting script: 300)."""
    dropout: float = 0.1
    """Dropout on the token embeddings, the relative position embeddings (one draw per block,
    shared by the layers), the feed-forward's hidden units and output, and the last hidden
    states before the output layer: the authors' places (their relative attention drops only
    the position embeddings). See ``attention_output_dropout``."""
    attn_dropout: float = 0.0
    """Dropout on the short-term attention's probabilities."""
    attention_output_dropout: bool = False
    """Also drop (``dropout``) the sum of the short-term attention's and the LTM's outputs
    before its residual, as the original Transformer-XL does; false = the authors' ∞-former
    code, which applies none there."""
    mem_len: int = 1024
    """Short-term memory: hidden states of earlier blocks each layer's attention reads
    (Transformer-XL cache). With the LTM it must be at least the block length
    (train.seq_len): the states leaving the STM in a block wait in the cache (mem_len more
    rows) until the next block's LTM takes them in."""
    ltm: bool = True
    """Read a continuous long-term memory; false = the Transformer-XL baseline."""
    n_basis: int = 1024
    """N Gaussian basis functions (paper: 1,024; the authors' script: 512); a multiple of the
    number of ``basis_widths``."""
    basis_widths: list[float] = field(default_factory=lambda: [0.01, 0.05])
    """Standard deviations of the basis densities; every centre gets each width."""
    ridge_penalty: float = 1.0
    """λ of the ridge fit of the coefficients (the authors' code: 1)."""
    n_samples: int = 512
    """M samples of the old signal taken into each refit (the authors' code: 512)."""
    tau: float = 0.75
    """The old signal is contracted into [0, τ], the new vectors fill (τ, 1]."""
    contraction_midpoints: bool = False
    """Where a refit samples the old signal and places its vectors: false = the right ends of
    equal cells, as the authors' code (samples of the old signal at k/M placed at τk/M, k =
    1..M; new vectors at τ + (1 − τ)j/L, j = 1..L); true = the cells' midpoints ((k − 1/2)/M
    and τ + (1 − τ)(j − 1/2)/L). The paper says only "linearly spaced"."""
    gate: bool = True
    """Smooth what enters the LTM with X̃ = sigmoid(conv1d_k3(X)) ⊙ X."""
    sticky: bool = False
    """Sticky memories: sample the old signal where the previous block attended."""
    sticky_bins: int = 128
    """Histogram bins on [0, 1] for sticky memories."""
    sigma_0: float = 0.05
    """σ0 of the KL penalty's reference N(μ, σ0²)."""
    kl_weight: float = 1e-6
    """λ_KL: weight of Σ_layers mean KL in the loss (0 = none)."""

    def __post_init__(self) -> None:
        check_scalar_types(self)
        check_at_least(
            self,
            (
                "d_model",
                "n_layers",
                "n_heads",
                "ff_dim",
                "mem_len",
                "n_basis",
                "n_samples",
                "sticky_bins",
            ),
            1,
        )
        if self.d_model % self.n_heads:
            raise ValueError(
                f"d_model ({self.d_model}) must be a multiple of n_heads ({self.n_heads})"
            )
        for name in ("dropout", "attn_dropout"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        widths = self.basis_widths
        if (
            not isinstance(widths, list)
            or not widths
            or not all(
                isinstance(w, (int, float))
                and not isinstance(w, bool)
                and math.isfinite(w)
                and w > 0
                for w in widths
            )
        ):
            raise ValueError(
                f"basis_widths must be a non-empty list of numbers > 0, got {widths!r}"
            )
        if self.n_basis % len(widths) or self.n_basis // len(widths) < 2:
            raise ValueError(
                f"n_basis ({self.n_basis}) must be a multiple of len(basis_widths) "
                f"({len(widths)}) with at least 2 centres"
            )
        if self.ridge_penalty <= 0:
            raise ValueError(f"ridge_penalty must be > 0, got {self.ridge_penalty}")
        if not 0 < self.tau < 1:
            raise ValueError(f"tau must be in (0, 1), got {self.tau}")
        if self.sigma_0 <= 0:
            raise ValueError(f"sigma_0 must be > 0, got {self.sigma_0}")
        if self.kl_weight < 0:
            raise ValueError(f"kl_weight must be >= 0, got {self.kl_weight}")

    def inert_keys(self) -> list[tuple[str, str]]:
        """Fields that do nothing under the other fields' values, each with why (the spec
        refuses them where the user wrote them)."""
        inert = []
        if self.dropout == 0:
            inert.append(("attention_output_dropout", "model.dropout is 0"))
        if not self.ltm:
            return inert + [
                (k, "model.ltm is false")
                for k in (
                    "n_basis",
                    "basis_widths",
                    "ridge_penalty",
                    "n_samples",
                    "tau",
                    "contraction_midpoints",
                    "gate",
                    "sticky",
                    "sticky_bins",
                    "sigma_0",
                    "kl_weight",
                )
            ]
        if not self.sticky:
            inert.append(("sticky_bins", "model.sticky is false"))
        return inert


# --- the continuous memory's mathematics (float64 where precomputed) -------------------------


def gaussian_basis(n_basis: int, widths: list[float]) -> tuple[Tensor, Tensor]:
    """Centres and widths [N] (float64): n_basis / len(widths) centres evenly on [0, 1], each
    with every width, in the code's order (centre-major)."""
    centres = torch.linspace(0, 1, n_basis // len(widths), dtype=torch.float64)
    sig = torch.tensor(widths, dtype=torch.float64)
    return centres.repeat_interleave(len(widths)), sig.repeat(len(centres))


def basis_values(t: Tensor, centres: Tensor, widths: Tensor) -> Tensor:
    """ψ(t): [..., N] Gaussian densities N(t; μ_j, σ_j²) at positions t [...]."""
    z = (t.unsqueeze(-1) - centres) / widths
    return torch.exp(-0.5 * z * z) / (widths * math.sqrt(2 * math.pi))


def contraction_grid(n: int, midpoints: bool) -> Tensor:
    """n points of (0, 1] (float64), one per equal cell: its right end k/n (k = 1..n, the
    authors' code) or its midpoint (k − 1/2)/n."""
    k = torch.arange(1, n + 1, dtype=torch.float64)
    return (k - 0.5) / n if midpoints else k / n


def fit_positions(
    n_old: int, n_new: int, tau: float, midpoints: bool = False
) -> tuple[Tensor, int]:
    """Where the vectors of one fit sit on [0, 1] (float64), with the zero-padding around
    them, and the padding count on the left (as many on the right).

    Without old samples (n_old 0) the n_new vectors sit at (i + 1/2)/n_new; with them, the
    samples at τ·grid(n_old) and the new vectors at τ + (1 − τ)·grid(n_new)
    (``contraction_grid``). Either way ⌊L/2⌋ padding positions continue each side at spacing
    1/L (L = n_old + n_new), so the fit sees the signal fall to zero outside [0, 1] as the
    authors' code does."""
    total = n_old + n_new
    pad = total // 2
    if n_old:
        inner = torch.cat(
            [
                tau * contraction_grid(n_old, midpoints),
                tau + (1 - tau) * contraction_grid(n_new, midpoints),
            ]
        )
    else:
        inner = (torch.arange(n_new, dtype=torch.float64) + 0.5) / n_new
    offsets = (torch.arange(pad, dtype=torch.float64) + 0.5) / total
    return torch.cat([-offsets.flip(0), inner, 1 + offsets]), pad


def ridge_fit_matrix(
    positions: Tensor, pad: int, centres: Tensor, widths: Tensor, ridge: float
) -> Tensor:
    """G [L, N] (float64) with B = Gᵀ X: the rows of Fᵀ(FFᵀ + λI)⁻¹ of the L inner positions
    (F = ψ at every position, padding included: zero vectors there)."""
    basis_t = basis_values(positions, centres, widths)  # Fᵀ [P, N]
    gram = basis_t.T @ basis_t + ridge * torch.eye(len(centres), dtype=torch.float64)
    g = torch.linalg.solve(gram, basis_t.T).T  # Fᵀ (FFᵀ + λI)⁻¹
    return g[pad : len(positions) - pad]


def expected_basis(mu: Tensor, sigma_sq: Tensor, centres: Tensor, widths: Tensor) -> Tensor:
    """r [..., N] = E_{t ~ N(μ, σ²)}[ψ(t)] = N(μ; μ_j, σ_j² + σ²) for μ, σ² [...]."""
    var = sigma_sq.unsqueeze(-1) + widths * widths
    diff = mu.unsqueeze(-1) - centres
    return torch.exp(-0.5 * diff * diff / var) / torch.sqrt(2 * math.pi * var)


def bin_masses(mu: Tensor, sigma_sq: Tensor, n_bins: int) -> Tensor:
    """The sticky histogram [B, n_bins]: the probability each N(μ, σ²) of a row (μ, σ² [B, Q],
    all heads and queries of a block) puts on each of n_bins equal bins of [0, 1], summed over
    the row's Gaussians and normalised to sum 1."""
    edges = torch.linspace(0, 1, n_bins + 1, dtype=mu.dtype, device=mu.device)
    z = (edges - mu.unsqueeze(-1)) / torch.sqrt(2 * sigma_sq).unsqueeze(-1)
    cdf = 0.5 * (1 + torch.erf(z))  # [B, Q, n_bins + 1]
    mass = (cdf[..., 1:] - cdf[..., :-1]).sum(1)
    return mass / mass.sum(-1, keepdim=True)


def sticky_positions(hist: Tensor, n_samples: int) -> Tensor:
    """[B, n_samples] positions on [0, 1]: the quantiles (k + 1/2)/n_samples of the density
    that is uniform within each bin with the bin's mass (hist [B, D], rows summing to 1)."""
    n_bins = hist.shape[-1]
    cum = hist.cumsum(-1)
    start = cum - hist
    q = (torch.arange(n_samples, dtype=hist.dtype, device=hist.device) + 0.5) / n_samples
    q = q.expand(hist.shape[0], n_samples).contiguous()
    b = torch.searchsorted(cum.contiguous(), q, right=True).clamp(max=n_bins - 1)
    frac = (q - start.gather(1, b)) / hist.gather(1, b)
    return (b + frac.clamp(0, 1)) / n_bins


def kl_variance(sigma_sq: Tensor, sigma_0: float) -> Tensor:
    """KL(N(μ, σ²) ‖ N(μ, σ0²)) elementwise: (σ²/σ0² − log(σ²/σ0²) − 1) / 2."""
    ratio = sigma_sq / (sigma_0 * sigma_0)
    return 0.5 * (ratio - torch.log(ratio) - 1)


class ContinuousMemory(nn.Module):
    """One layer's LTM: takes in vectors (``update``) and answers queries (``read``); its
    ``forward`` is one block's step, both.

    Under bf16 / fp16 (``model.to(dtype)``, ``.bfloat16()``, ``.half()``) the basis centres and
    widths stay float32, and so do what the closed-form read and the old samples are computed
    from (μ, σ², the read weights r, ψ at the sample positions, the sticky histogram): bf16
    keeps 8 bits of mantissa, so at N = 1024 its 512 centres would collapse to 385 distinct
    values, and μ would move in steps of up to 1/256, a good part of the 0.01 width. The
    matrix products with the model's vectors run in the model's dtype."""

    centres: Tensor  # buffers (register_buffer), rebuilt from the config by _apply
    widths: Tensor

    def __init__(self, cfg: InfinityFormerConfig) -> None:
        super().__init__()
        self.cfg = cfg
        d = cfg.d_model
        self.gate = nn.Conv1d(d, d, 3, padding=1) if cfg.gate else None
        self.key = nn.Linear(d, d, bias=False)
        self.value = nn.Linear(d, d, bias=False)
        self.mu = nn.Linear(cfg.n_basis, 1, bias=False)
        self.sigma = nn.Linear(cfg.n_basis, 1, bias=False)
        self.out = nn.Linear(d, d, bias=False)
        centres, widths = gaussian_basis(cfg.n_basis, cfg.basis_widths)
        # float32 as the parameters (``_apply``: float64 after .double(), float32 under bf16)
        self.register_buffer("centres", centres.float(), persistent=False)
        self.register_buffer("widths", widths.float(), persistent=False)
        self._fits: dict[tuple, Tensor] = {}

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        # from the config, not the cast values: bf16 would round them, and float64 would keep
        # float32's rounding
        centres, widths = gaussian_basis(self.cfg.n_basis, self.cfg.basis_widths)
        exact = _exact(self.centres.dtype)
        self.centres = centres.to(self.centres.device, exact)
        self.widths = widths.to(self.widths.device, exact)
        return self

    def _fit_matrix(self, n_old: int, n_new: int, like: Tensor) -> Tensor:
        key = (n_old, n_new, like.dtype, like.device)
        if key not in self._fits:
            # from the config, not the buffers: casting the module (bf16) rounds those
            positions, pad = fit_positions(
                n_old, n_new, self.cfg.tau, self.cfg.contraction_midpoints
            )
            basis = gaussian_basis(self.cfg.n_basis, self.cfg.basis_widths)
            g = ridge_fit_matrix(positions, pad, *basis, self.cfg.ridge_penalty)
            self._fits[key] = g.to(device=like.device, dtype=like.dtype)
        return self._fits[key]

    def old_samples(self, coeff: Tensor, hist: Tensor | None) -> Tensor:
        """[B, n_samples, d]: the signal of ``coeff`` [B, N, d] at the sample positions
        (evenly spaced, ``contraction_grid``, or the sticky histogram's quantiles)."""
        n = self.cfg.n_samples
        if hist is None:
            u = contraction_grid(n, self.cfg.contraction_midpoints).to(self.centres)
        else:
            u = sticky_positions(hist.to(self.centres.dtype), n)
        samples = basis_values(u, self.centres, self.widths) @ coeff.to(self.centres.dtype)
        return samples.to(coeff.dtype)

    def update(self, coeff: Tensor | None, hist: Tensor | None, new: Tensor) -> Tensor:
        """The coefficients [B, N, d] after taking in ``new`` [B, L, d]; ``coeff`` is the old
        LTM (None: empty), detached by the caller."""
        if self.gate is not None:
            new = torch.sigmoid(self.gate(new.transpose(1, 2))).transpose(1, 2) * new
        if coeff is not None:
            new = torch.cat([self.old_samples(coeff, hist), new], 1)
            g = self._fit_matrix(self.cfg.n_samples, new.shape[1] - self.cfg.n_samples, new)
        else:
            g = self._fit_matrix(0, new.shape[1], new)
        return torch.einsum("ln,bld->bnd", g, new)

    def forward(
        self, coeff: Tensor | None, hist: Tensor | None, new: Tensor, q: Tensor
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """``update`` then ``read``: (output [B, M, d], the new coefficients, μ, σ²)."""
        coeff = self.update(coeff, hist, new)
        out, mu, sigma_sq = self.read(q, coeff)
        return out, coeff, mu, sigma_sq

    def read(self, q: Tensor, coeff: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q [B, H, M, d_head] (the short-term attention's queries), coeff [B, N, d] ->
        (output [B, M, d], μ [B, H, M], σ² [B, H, M])."""
        bsz, n_heads, m, d_head = q.shape
        n = coeff.shape[1]
        keys = self.key(coeff).view(bsz, n, n_heads, d_head).transpose(1, 2)
        values = self.value(coeff).view(bsz, n, n_heads, d_head).transpose(1, 2)
        scores = q @ keys.transpose(-1, -2) / math.sqrt(d_head)  # [B, H, M, N]
        # μ and σ² in the basis's precision (float32 under bf16 / fp16; see the class doc)
        scores = scores.to(self.centres.dtype)
        mu_logit = F.linear(scores, self.mu.weight.to(scores.dtype)).squeeze(-1)
        sigma_logit = F.linear(scores, self.sigma.weight.to(scores.dtype)).squeeze(-1)
        mu = torch.sigmoid(mu_logit)
        sigma_sq = F.softplus(sigma_logit).clamp(min=MIN_SIGMA_SQ)
        r = self.read_weights(mu, sigma_sq).to(values.dtype)
        z = (r @ values).transpose(1, 2).reshape(bsz, m, n_heads * d_head)
        return self.out(z), mu, sigma_sq

    def read_weights(self, mu: Tensor, sigma_sq: Tensor) -> Tensor:
        """r [..., N] = E_{t ~ N(μ, σ²)}[ψ(t)] for μ, σ² [...], in the basis's precision."""
        return expected_basis(
            mu.to(self.centres.dtype), sigma_sq.to(self.centres.dtype), self.centres, self.widths
        )


def _exact(dtype: torch.dtype) -> torch.dtype:
    """The dtype the basis and the read are computed in under a model of ``dtype``."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _same_in_every_row(counter: Tensor, what: str) -> int:
    """The value of a state's per-row counter [B], which the rows of a batch share."""
    value = int(counter[0])
    if bool((counter != value).any()):
        raise ValueError(f"state: the rows of a batch must have the same count ({what})")
    return value


# --- the Transformer-XL host --------------------------------------------------------------


def sinusoid(distances: Tensor, d_model: int) -> Tensor:
    """Transformer-XL's relative position embeddings [K, d] of the distances [K]."""
    inv_freq = 1 / (
        10000
        ** (torch.arange(0, d_model, 2, dtype=torch.float32, device=distances.device) / d_model)
    )
    angles = distances.float().unsqueeze(-1) * inv_freq
    return torch.cat([angles.sin(), angles.cos()], -1)


class XLLayer(nn.Module):
    """Relative-position attention over [cache; block] (Transformer-XL, post-norm), then a
    feed-forward sublayer; with the LTM, its read is added to the attention's output."""

    def __init__(self, cfg: InfinityFormerConfig) -> None:
        super().__init__()
        d, h = cfg.d_model, cfg.n_heads
        self.n_heads, self.d_head = h, d // h
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.pos = nn.Linear(d, d, bias=False)
        self.content_bias = nn.Parameter(torch.zeros(h, d // h))
        self.position_bias = nn.Parameter(torch.zeros(h, d // h))
        self.attn_out = nn.Linear(d, d, bias=False)
        self.norm1 = nn.LayerNorm(d)
        self.ff = nn.Sequential(
            nn.Linear(d, cfg.ff_dim), nn.ReLU(), nn.Dropout(cfg.dropout), nn.Linear(cfg.ff_dim, d)
        )
        self.norm2 = nn.LayerNorm(d)
        self.drop = nn.Dropout(cfg.dropout)
        self.attn_out_drop = (
            nn.Dropout(cfg.dropout) if cfg.attention_output_dropout else nn.Identity()
        )
        self.attn_drop = nn.Dropout(cfg.attn_dropout)
        self.ltm = ContinuousMemory(cfg) if cfg.ltm else None

    def forward(
        self,
        x: Tensor,
        cache: Tensor,
        n_valid: int,
        pos_emb: Tensor,
        ltm_in: tuple[Tensor | None, Tensor | None, Tensor] | None,
    ) -> tuple[Tensor, tuple[Tensor, Tensor, Tensor] | None]:
        """x [B, M, d], cache [B, C, d] (the STM) whose last n_valid rows hold states;
        pos_emb [C + M, d]: the embeddings of distances 0..C+M−1; ltm_in: what the LTM steps
        with (old coefficients or None, sticky histogram or None, vectors to take in), None
        when it has nothing to read -> (output, (coefficients, μ, σ²) or None)."""
        bsz, m, d = x.shape
        c = cache.shape[1]
        h, dh = self.n_heads, self.d_head
        q, k, v = self.qkv(torch.cat([cache, x], 1)).chunk(3, -1)
        q = q[:, c:].view(bsz, m, h, dh).transpose(1, 2)  # [B, H, M, dh]
        k = k.view(bsz, c + m, h, dh).transpose(1, 2)
        v = v.view(bsz, c + m, h, dh).transpose(1, 2)
        # distance of key j from query i is (c + i) − j; scores by distance, then gathered
        keys_at = torch.arange(c + m, device=x.device)
        dist = (c + torch.arange(m, device=x.device)).unsqueeze(1) - keys_at
        rel = self.pos(pos_emb.to(x.dtype))
        rel = rel.view(c + m, h, dh).transpose(0, 1)  # [H, K, dh]
        content = (q + self.content_bias.unsqueeze(1)) @ k.transpose(-1, -2)
        by_dist = (q + self.position_bias.unsqueeze(1)) @ rel.transpose(-1, -2)
        position = by_dist.gather(-1, dist.clamp(min=0).expand(bsz, h, m, c + m))
        scores = (content + position) / math.sqrt(dh)
        masked = (dist < 0) | (keys_at < c - n_valid)
        scores = scores.masked_fill(masked, float("-inf"))
        attn = self.attn_drop(torch.softmax(scores, -1))
        out = self.attn_out((attn @ v).transpose(1, 2).reshape(bsz, m, d))
        read = None
        if ltm_in is not None:
            assert self.ltm is not None  # ltm_in is given only to a layer with one
            ltm_out, *read = self.ltm(*ltm_in, q)
            out = out + ltm_out
        x = self.norm1(x + self.attn_out_drop(out))
        x = self.norm2(x + self.drop(self.ff(x)))
        return x, read


class InfinityFormerLM(SequenceModel, TrainingMetrics, MemoryCounts):
    """The ∞-former language model (``ltm: false``: Transformer-XL); see the module doc."""

    def __init__(self, cfg: InfinityFormerConfig, vocab_size: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(vocab_size, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleList(XLLayer(cfg) for _ in range(cfg.n_layers))
        self.head = nn.Linear(cfg.d_model, vocab_size)
        self._kl: Tensor | None = None
        self._sigma_sq: Tensor | None = None

    def _per_layer(self) -> int:
        return 1 + (self.cfg.ltm) + (self.cfg.ltm and self.cfg.sticky)

    def _cache_len(self) -> int:
        """Cache rows per layer: the STM, and with the LTM the states waiting to enter it."""
        return 2 * self.cfg.mem_len if self.cfg.ltm else self.cfg.mem_len

    def init_state(self, batch_size: int, device=None) -> State:
        cfg = self.cfg
        like = dict(device=device, dtype=self.head.weight.dtype)
        state: State = []
        for _ in range(cfg.n_layers):
            state.append(torch.zeros(batch_size, self._cache_len(), cfg.d_model, **like))
            if cfg.ltm:
                state.append(torch.zeros(batch_size, cfg.n_basis, cfg.d_model, **like))
                if cfg.sticky:  # bin masses: float32 at least, as μ and σ² are
                    state.append(
                        torch.full(
                            (batch_size, cfg.sticky_bins),
                            1 / cfg.sticky_bins,
                            device=device,
                            dtype=_exact(like["dtype"]),
                        )
                    )
        counters = 2 if cfg.ltm else 1  # positions the LTM has taken in; tokens seen
        state.extend(
            torch.zeros(batch_size, dtype=torch.int64, device=device) for _ in range(counters)
        )
        return state

    def forward(
        self, tokens: Tensor, targets: Tensor | None = None, state: State | None = None
    ) -> ModelOutput:
        cfg = self.cfg
        bsz, m = tokens.shape
        if state is None:
            state = self.init_state(bsz, tokens.device)
        per = self._per_layer()
        counters = 2 if cfg.ltm else 1
        if len(state) != per * cfg.n_layers + counters:
            raise ValueError(
                f"state has {len(state)} tensors; this model carries "
                f"{per * cfg.n_layers + counters}"
            )
        seen_rows = state[-1]
        seen = _same_in_every_row(seen_rows, "seen")
        if cfg.ltm and m > cfg.mem_len:
            raise ValueError(
                f"the ∞-former needs model.mem_len ({cfg.mem_len}) >= the block "
                f"length ({m}): the states leaving the short-term memory in a "
                f"block wait in the cache's extra mem_len rows for the LTM"
            )
        c = self._cache_len()
        n_valid = min(seen, cfg.mem_len)  # the STM: the cache's last n_valid rows
        if cfg.ltm:
            # the LTM takes in positions [taken, seen − mem_len): those that left the STM
            # since the last block, still in the cache (position p is row p − seen + c)
            taken = _same_in_every_row(state[-2], "taken in by the LTM")
            left_stm = max(seen - cfg.mem_len, 0)
            takes_in, holds = left_stm > taken, taken > 0
            intake_rows = slice(taken - seen + c, c - cfg.mem_len)
        x = self.drop(self.embed(tokens) * math.sqrt(cfg.d_model))
        # one draw of dropout on the position embeddings for every layer, as the authors'
        pos_emb = self.drop(
            sinusoid(torch.arange(cfg.mem_len + m, device=tokens.device), cfg.d_model)
        )
        new_state: State = []
        kls: list[Tensor] = []
        sig_means: list[Tensor] = []
        for i, layer in enumerate(self.layers):
            cache = state[i * per]
            ltm_in = None
            if cfg.ltm and takes_in:
                old = state[i * per + 1].detach() if holds else None
                hist = state[i * per + 2] if cfg.sticky else None
                ltm_in = (old, hist, cache[:, intake_rows])
            out, read = layer(x, cache[:, c - cfg.mem_len :], n_valid, pos_emb, ltm_in)
            new_state.append(torch.cat([cache, x], 1)[:, -c:].detach())
            if cfg.ltm:
                if read is None:
                    new_state.extend(state[i * per + 1 : (i + 1) * per])
                else:
                    coeff, mu, sigma_sq = read
                    new_state.append(coeff.detach())
                    if cfg.sticky:
                        new_state.append(
                            bin_masses(
                                mu.detach().reshape(bsz, -1),
                                sigma_sq.detach().reshape(bsz, -1),
                                cfg.sticky_bins,
                            )
                        )
                    kls.append(kl_variance(sigma_sq, cfg.sigma_0).mean())
                    sig_means.append(sigma_sq.detach().mean())
            x = out
        if cfg.ltm:
            new_state.append(torch.full_like(seen_rows, max(left_stm, taken)))
        new_state.append(seen_rows + m)
        # kept as tensors: metrics() reads them only when the trainer reports
        self._kl = torch.stack(kls).sum() if kls else None
        self._sigma_sq = torch.stack(sig_means).mean() if kls else None
        logits = self.head(self.drop(x))
        nll = None
        if targets is not None:
            nll = F.cross_entropy(logits.float().transpose(1, 2), targets, reduction="none")
        return ModelOutput(logits=logits, nll=nll, state=new_state)

    def activation_memory(
        self,
        rows: int,
        block_len: int,
        dtype: torch.dtype,
        device_type: str,
        uniform_tokens: bool = False,
    ) -> ActivationMemory:
        """A block with a graph, the LTM reading (the most a block keeps). Per layer: the
        projections' inputs ([cache; block] and the output's), the heads the products copy
        (queries with each bias, keys, values, the relative positions over the batch), the
        softmax over the mem_len + M keys and its dropout; with the LTM the gated intake and
        the refit's input, the coefficients, and seven float32 [B, H, M, N] tensors of the
        closed-form read (the scores, its variance, difference, square and exponential) with
        the read weights; the LayerNorms and the feed-forward. Then the output's float32
        log-softmax, and the state: the cache, with the LTM its coefficients."""
        c, e = self.cfg, torch.empty((), dtype=dtype).element_size()
        tokens, d, h = rows * block_len, c.d_model, c.n_heads
        keys = c.mem_len + block_len
        mask = 1 if device_type == "cuda" else e  # torch's dropout mask (bool on a GPU)
        scores = rows * h * block_len * keys
        # [cache; block], the keys, values and positions copied; the output's input, the
        # queries with each bias; the scores by distance (the gather's input) and the softmax
        layer = e * (rows * keys * d * 4 + tokens * d * 3 + 2 * scores) + 8 * block_len * keys
        if c.attn_dropout > 0:
            layer += (e + mask) * scores
        working = 6 * e * scores  # the softmax, scores, by-distance and gather gradients
        if c.ltm:
            read = rows * h * block_len * c.n_basis
            intake = rows * (c.n_samples + block_len) * d
            layer += e * (3 * tokens * d + intake + rows * c.n_basis * d * 3)
            layer += (7 * 4 + e) * read
            working = max(working, 3 * 4 * read)
        layer += e * tokens * d * 3 + 16 * tokens + e * tokens * c.ff_dim  # norms, ff input
        if c.dropout > 0:
            layer += (e + mask) * tokens * c.ff_dim + mask * tokens * d
        vocab = self.head.out_features
        saved = c.n_layers * layer + (4 + e) * tokens * vocab + e * tokens * d  # + the logits
        if c.dropout > 0:
            saved += 2 * mask * tokens * d
        per_layer = rows * d * e * (self._cache_len() + (c.n_basis if c.ltm else 0))
        return ActivationMemory(
            saved, max(working, (4 + e) * tokens * vocab), c.n_layers * per_layer
        )

    def aux_loss(self) -> Tensor:
        """kl_weight · Σ_layers mean KL of the last forward's LTM reads (0 without reads)."""
        if self._kl is None:
            return self.head.weight.new_zeros(())
        return self.cfg.kl_weight * self._kl

    def describe(self) -> str:
        cfg = self.cfg
        host = (
            f"Transformer-XL {cfg.n_layers}x{cfg.d_model}, {cfg.n_heads} heads, "
            f"mem_len {cfg.mem_len}"
        )
        if not cfg.ltm:
            return f"{host}; no long-term memory"
        widths = "/".join(f"{w:g}" for w in cfg.basis_widths)
        sampling = f"sticky ({cfg.sticky_bins} bins)" if cfg.sticky else "even"
        if cfg.contraction_midpoints:
            sampling += ", cell midpoints"
        return (
            f"∞-former: {host}; LTM {cfg.n_basis} Gaussian RBFs (widths {widths}), "
            f"tau {cfg.tau:g}, {cfg.n_samples} samples, {sampling}"
        )

    def metrics(self) -> dict[str, float]:
        """The last forward's Σ_layers mean KL and mean σ² of the LTM reads (none before the
        LTM holds anything)."""
        if self._kl is None or self._sigma_sq is None:  # set together
            return {}
        return {"ltm_kl": float(self._kl.detach()), "ltm_sigma_sq": float(self._sigma_sq)}

    def parameter_groups(self) -> dict[str, int]:
        groups = {
            "embedding": self.embed.weight.numel(),
            "attention": 0,
            "feed_forward": 0,
            "long_term_memory": 0,
            "norms": 0,
            "output": sum(p.numel() for p in self.head.parameters()),
        }
        for layer in self.layers:
            for name, p in layer.named_parameters():
                role = name.split(".", 1)[0]
                if role == "ltm":
                    groups["long_term_memory"] += p.numel()
                elif role == "ff":
                    groups["feed_forward"] += p.numel()
                elif role.startswith("norm"):
                    groups["norms"] += p.numel()
                else:
                    groups["attention"] += p.numel()
        if not self.cfg.ltm:
            del groups["long_term_memory"]
        return groups
