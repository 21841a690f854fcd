"""Adaptive input (Baevski & Auli 2019) and adaptive softmax (Grave et al. 2017), tied, as the
all-attention authors' code builds them for WikiText-103 (``adaptive_io.py`` of the
adaptive-span codebase: ``AdaptiveEmbedding`` + ``ProjectedAdaptiveLogSoftmax``).

Bands. The vocabulary must be ordered by decreasing frequency (id 0 the most frequent word).
``cutoffs`` [c_1, ..., c_K] split it into K + 1 bands [0, c_1), [c_1, c_2), ..., [c_K, V);
band i has vectors of dimension d // div**i. The paper's "3 clusters of size 20k, 40k, 200k,
dimensions d, d/4, d/16" is, in the authors' code, cutoffs [20000, 40000, 200000] with
div 4: FOUR bands 0-20k at d, 20k-40k at d/4, 40k-200k at d/16 and 200k-V at d/64 (for
d = 512: 512, 128, 32, 8). The 132.5M parameter count of the WikiText-103 model only comes
out with the four bands.

Parameters (per band i, size n_i = band width, dimension d_i):
- ``AdaptiveInput.bands[i]``: [n_i, d_i] embedding, N(0, 1) (nn.Embedding's default);
- ``AdaptiveInput.proj{i}``: [d, d_i] projection to the model width (nn.Linear(d_i, d)'s
  weight and default init); *every* band has one, band 0's included (d x d);
- ``AdaptiveLogSoftmax.bias{i}``: [n_i] output bias (nn.Linear(d_i, n_i)'s default init);
- ``AdaptiveLogSoftmax.cluster``: nn.Linear(d, K) with bias, the head's K cluster logits;
- tied (the paper, ``adapt_io_tied``): the output weights ARE the band embeddings and the
  output projections ARE the input projections (the same Parameter objects, counted once);
  untied: the softmax has its own [n_i, d_i] weights and [d, d_i] projections.

Input: x = sqrt(d) * bands[i][w - lo_i] @ projs[i]^T for the band i that holds w (the code
scales the adaptive input by sqrt(d)).

Output (the adaptive softmax's factorisation). With p_i = h @ projs[i] ([d_i]):
    head logits  = [p_0 @ W_0^T + b_0  ;  cluster(h)]          (c_1 + K entries)
    log P(w)     = log_softmax(head)[w]                               w in band 0
    log P(w)     = log_softmax(head)[c_1 + i - 1]
                   + log_softmax(p_i @ W_i^T + b_i)[w - lo_i]         w in band i >= 1
The code reads the cluster logits from the end of the head (band i at column -i); here band
i's cluster logit is ``cluster`` row i - 1. The two differ by a permutation of identically
initialised rows, so they are the same model.
"""

from __future__ import annotations

import math
from itertools import pairwise

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

__all__ = ["AdaptiveInput", "AdaptiveLogSoftmax", "band_bounds", "band_dims"]


def band_bounds(vocab_size: int, cutoffs: list[int]) -> list[int]:
    """[0, c_1, ..., c_K, V]: band i holds ids bounds[i] .. bounds[i + 1] - 1."""
    if not cutoffs or list(cutoffs) != sorted(set(cutoffs)) or cutoffs[0] <= 0:
        raise ValueError(f"adaptive_cutoffs must be increasing positive ints, got {cutoffs}")
    if cutoffs[-1] >= vocab_size:
        raise ValueError(
            f"adaptive_cutoffs {list(cutoffs)} need a vocabulary larger than the last cutoff; "
            f"vocab_size is {vocab_size}"
        )
    return [0, *cutoffs, vocab_size]


def band_dims(d_model: int, n_bands: int, div: int) -> list[int]:
    """d // div**i for each band i."""
    return [d_model // div**i for i in range(n_bands)]


def _linear_weight(out_features: int, in_features: int) -> nn.Parameter:
    """A weight with nn.Linear's default init (uniform +-1/sqrt(in_features))."""
    w = torch.empty(out_features, in_features)
    nn.init.kaiming_uniform_(w, a=math.sqrt(5))
    return nn.Parameter(w)


def _linear_bias(out_features: int, in_features: int) -> nn.Parameter:
    """A bias with nn.Linear's default init (uniform +-1/sqrt(in_features))."""
    bound = 1 / math.sqrt(in_features)
    return nn.Parameter(torch.empty(out_features).uniform_(-bound, bound))


class AdaptiveInput(nn.Module):
    """Token ids -> [*, d] with per-band embedding sizes and projections (see module doc)."""

    def __init__(self, vocab_size: int, d_model: int, cutoffs: list[int], div: int) -> None:
        super().__init__()
        self.vocab_size, self.d_model = vocab_size, d_model
        self.bounds = band_bounds(vocab_size, list(cutoffs))
        self.dims = band_dims(d_model, len(self.bounds) - 1, div)
        if min(self.dims) < 1:
            raise ValueError(f"adaptive_div {div}: d_model {d_model} leaves a band of size 0")
        self.bands = nn.ModuleList(
            nn.Embedding(hi - lo, di)
            for lo, hi, di in zip(self.bounds[:-1], self.bounds[1:], self.dims, strict=False)
        )
        for i, di in enumerate(self.dims):  # direct attributes: used in this module's forward
            setattr(self, f"proj{i}", _linear_weight(d_model, di))
        self.scale = math.sqrt(d_model)

    @property
    def projs(self) -> list[nn.Parameter]:
        """[d, d_i] projection of each band."""
        return [getattr(self, f"proj{i}") for i in range(len(self.dims))]

    def forward(self, tokens: Tensor) -> Tensor:
        flat = tokens.reshape(-1)
        projs = self.projs
        out = projs[0].new_zeros(flat.shape[0], self.d_model)
        for i, (lo, hi) in enumerate(zip(self.bounds[:-1], self.bounds[1:], strict=False)):
            rows = ((flat >= lo) & (flat < hi)).nonzero().squeeze(1)
            if rows.numel() == 0:
                continue
            emb = F.linear(self.bands[i](flat[rows] - lo), projs[i])  # [n, d]
            out = out.index_copy(0, rows, emb.to(out.dtype))
        return (out * self.scale).view(*tokens.shape, self.d_model)

    def extra_repr(self) -> str:
        return f"bounds={self.bounds}, dims={self.dims}, scale=sqrt({self.d_model})"


class AdaptiveLogSoftmax(nn.Module):
    """Hidden states -> per-token nll (nats) under the banded softmax (see module doc).

    ``tie``: an ``AdaptiveInput`` whose band embeddings and projections this softmax uses
    as its own output weights and projections (the paper); None = untied."""

    def __init__(
        self,
        vocab_size: int,
        d_model: int,
        cutoffs: list[int],
        div: int,
        tie: AdaptiveInput | None = None,
    ) -> None:
        super().__init__()
        self.vocab_size, self.d_model = vocab_size, d_model
        self.bounds = band_bounds(vocab_size, list(cutoffs))
        self.dims = band_dims(d_model, len(self.bounds) - 1, div)
        self.n_clusters = len(self.bounds) - 2
        self.shortlist = self.bounds[1]
        # Parameters are direct attributes (weight{i}, proj{i}, bias{i}) so that every tensor
        # this module's forward reads is registered on it (what ZeRO-3 style parameter
        # gathering on module entry needs); tied, weight{i} / proj{i} are the very Parameter
        # objects of the input's bands and projections (one tensor, counted once).
        if tie is not None and (tie.bounds != self.bounds or tie.dims != self.dims):
            raise ValueError("a tied adaptive softmax needs the input's bands")
        for i, (lo, hi, di) in enumerate(
            zip(self.bounds[:-1], self.bounds[1:], self.dims, strict=False)
        ):
            if tie is not None:
                setattr(self, f"weight{i}", tie.bands[i].weight)
                setattr(self, f"proj{i}", tie.projs[i])
            else:
                setattr(self, f"weight{i}", _linear_weight(hi - lo, di))
                setattr(self, f"proj{i}", _linear_weight(d_model, di))
            setattr(self, f"bias{i}", _linear_bias(hi - lo, di))
        self.cluster = nn.Linear(d_model, self.n_clusters)

    @property
    def weights(self) -> list[nn.Parameter]:
        """[n_i, d_i] output vectors of each band (the input's band embeddings when tied)."""
        return [getattr(self, f"weight{i}") for i in range(len(self.dims))]

    @property
    def projs(self) -> list[nn.Parameter]:
        """[d, d_i] projection of each band (the input's when tied)."""
        return [getattr(self, f"proj{i}") for i in range(len(self.dims))]

    @property
    def biases(self) -> list[nn.Parameter]:
        return [getattr(self, f"bias{i}") for i in range(len(self.dims))]

    def _band_logits(self, h: Tensor, i: int) -> Tensor:
        return F.linear(
            h @ getattr(self, f"proj{i}"), getattr(self, f"weight{i}"), getattr(self, f"bias{i}")
        )

    def _head_logprob(self, h: Tensor) -> Tensor:
        head = torch.cat([self._band_logits(h, 0), self.cluster(h)], dim=-1)
        return F.log_softmax(head.to(_loss_dtype(head.dtype)), dim=-1)

    def forward(self, hidden: Tensor, target: Tensor) -> Tensor:
        """The per-token nll (``nll``); the LM calls the module, so hooks on it fire."""
        return self.nll(hidden, target)

    def nll(self, hidden: Tensor, target: Tensor) -> Tensor:
        """hidden [*, d], target [*] -> nll [*] in nats (float32, float64 for float64 input).
        The tail bands are evaluated only for the tokens that fall in them."""
        shape = target.shape
        h = hidden.reshape(-1, self.d_model)
        t = target.reshape(-1)
        head_lp = self._head_logprob(h)  # [n, c_1 + K]
        nll = head_lp.new_zeros(t.shape[0])
        for i, (lo, hi) in enumerate(zip(self.bounds[:-1], self.bounds[1:], strict=False)):
            rows = ((t >= lo) & (t < hi)).nonzero().squeeze(1)
            if rows.numel() == 0:
                continue
            if i == 0:
                lp = head_lp[rows].gather(1, t[rows, None]).squeeze(1)
            else:
                tail = self._band_logits(h[rows], i)
                tail_lp = F.log_softmax(tail.to(head_lp.dtype), dim=-1)
                lp = head_lp[rows, self.shortlist + i - 1] + tail_lp.gather(
                    1, (t[rows] - lo)[:, None]
                ).squeeze(1)
            nll = nll.index_copy(0, rows, -lp)
        return nll.view(shape)

    def log_prob(self, hidden: Tensor) -> Tensor:
        """hidden [*, d] -> log P(w) for every word, [*, V] (costly for a large vocabulary;
        for inspection and tests, training uses ``nll``)."""
        lead = hidden.shape[:-1]
        h = hidden.reshape(-1, self.d_model)
        head_lp = self._head_logprob(h)
        parts = [head_lp[:, : self.shortlist]]
        for i in range(1, len(self.dims)):
            tail_lp = F.log_softmax(self._band_logits(h, i).to(head_lp.dtype), dim=-1)
            parts.append(head_lp[:, self.shortlist + i - 1, None] + tail_lp)
        return torch.cat(parts, dim=-1).view(*lead, self.vocab_size)

    def band_shares(self, uniform_tokens: bool) -> list[float]:
        """The share of tokens in each band: by the band's size for uniformly drawn tokens,
        else as text's words fall under Zipf's law (the frequency of rank r ~ 1 / r, so the
        ids below k take H(k) / H(V) of the tokens, H the harmonic number ~ ln k + 0.577)."""
        if uniform_tokens:
            return [(hi - lo) / self.vocab_size for lo, hi in pairwise(self.bounds)]
        harmonic = [math.log(b) + 0.5772 if b else 0.0 for b in self.bounds]
        return [(hi - lo) / harmonic[-1] for lo, hi in pairwise(harmonic)]

    def activation_memory(self, tokens: int, dtype: torch.dtype, uniform_tokens: bool):
        """(saved, working) bytes of ``nll`` on ``tokens`` hidden states: the head's float32
        log-probabilities [n, c_1 + K] for every token, and each tail band's [n_i, V_i] for
        the n_i tokens that fall in it (``band_shares``), with the rows of h its projection
        reads; the backward's largest moment holds about two of the largest."""
        e = torch.empty((), dtype=dtype).element_size()
        head = tokens * (self.shortlist + self.n_clusters)
        saved, largest = 4 * head, head
        for share, (lo, hi), di in zip(
            self.band_shares(uniform_tokens)[1:],
            pairwise(self.bounds[1:]),
            self.dims[1:],
            strict=True,
        ):
            rows = math.ceil(tokens * share)
            saved += 4 * rows * (hi - lo) + e * rows * (self.d_model + di)
            largest = max(largest, rows * (hi - lo))
        return saved, (4 + e) * largest

    def extra_repr(self) -> str:
        return f"bounds={self.bounds}, dims={self.dims}"


def _loss_dtype(dtype: torch.dtype) -> torch.dtype:
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32
