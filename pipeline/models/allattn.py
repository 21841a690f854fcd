"""All-attention language model (Sukhbaatar et al. 2019, "Augmenting Self-attention with
Persistent Memory"), following the authors' code: the adaptive-span codebase with its
persistent-memory option. Character level (full softmax output).

Where the paper and the code differ, this module does what the code does:
- a query attends to the L' tokens *before* it, never to itself;
- relative positions are a key-side term only (the paper's eq. 13 also adds p(t, c) to the
  values; the code does not);
- the adaptive-span mask is evaluated at distance - 1 and padded with 1 for the persistent
  vectors; weights are renormalised jointly (+1e-8) and dropout comes after that;
- W_{q,k,v,o} have no bias and PyTorch's default Linear init (not U(-sqrt d, sqrt d));
- the cache holds each layer's input hidden states, detached, starting as zeros (unmasked).
The attention math itself lives in ``pipeline.ops.attention`` (the reference op).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from pipeline.ops.attention import AttendFn, adaptive_span_mask, get_attention_impl

__all__ = ["AllAttnConfig", "AllAttnLM", "AllAttnLayer", "AllAttention", "LMOutput"]

SPAN_GRANULARITY = 64
"""Attention spans are trimmed in steps of this many tokens, and the cache keeps this many
extra tokens so a span may grow between two blocks (authors' code)."""


@dataclass
class AllAttnConfig:
    """Architecture of an all-attention LM. Defaults: the paper's enwik8 / text8 small model."""

    d_model: int = 512
    """Model width d (paper: 512)."""
    n_layers: int = 18
    """Number of layers (paper, character level: 18 small, 36 large)."""
    n_heads: int = 8
    """Attention heads H; head size d_h = d_model / n_heads (paper: 8)."""
    n_persistent: int = 1024
    """Persistent key/value vectors N per head and layer; 0 = none (paper: 1024 small,
    2048 large)."""
    ff_dim: int = 0
    """Feed-forward inner size: 0 = all-attention layer without feed-forward (the paper's
    model); > 0 = Transformer layer with a ReLU feed-forward sublayer (the baseline)."""
    max_span: int = 8192
    """L: the maximum attention span and the length of the relative position table
    (paper: 8192 character level, 2048 word level)."""
    adaptive_span: bool = True
    """Learn a span per head with the adaptive-span soft mask (paper: on). Off = every
    query attends to exactly max_span previous tokens."""
    span_ramp: int = 32
    """R: length of the soft mask's linear ramp in tokens (paper: 32)."""
    span_init: float = 0.0
    """Initial span of every head as a fraction of max_span, in [0, 1] (code: 0)."""
    span_loss_coef: float = 1e-7
    """Lambda of the L1 span penalty lambda * sum_layers mean_heads(z), z in tokens
    (paper: 1e-7 character level, 5e-7 word level)."""
    attn_dropout: float = 0.3
    """Dropout on attention weights (and, as in the code, on the feed-forward hidden units
    when ff_dim > 0) (paper: 0.3 small, 0.4 large)."""
    emb_dropout: float = 0.0
    """Dropout on the input embeddings (paper: 0 character level, 0.1 word level)."""
    out_dropout: float = 0.0
    """Dropout on the final representation before the output layer (paper: 0 character
    level, 0.1 word level)."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type in ("int", int) and (not isinstance(value, int) or isinstance(value, bool)):
                raise ValueError(f"{f.name} must be an int, got {value!r}")
            if f.type in ("bool", bool) and not isinstance(value, bool):
                raise ValueError(f"{f.name} must be a bool, got {value!r}")
            if f.type in ("float", float) and (
                not isinstance(value, (int, float)) or isinstance(value, bool)
            ):
                raise ValueError(f"{f.name} must be a number, got {value!r}")
        for name in ("d_model", "n_layers", "n_heads", "max_span", "span_ramp"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("n_persistent", "ff_dim"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.d_model % self.n_heads != 0:
            raise ValueError(
                f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})"
            )
        if not 0.0 <= self.span_init <= 1.0:
            raise ValueError(
                f"span_init must be in [0, 1] (a fraction of max_span), got {self.span_init}"
            )
        if not (self.span_loss_coef >= 0.0 and math.isfinite(self.span_loss_coef)):
            raise ValueError(f"span_loss_coef must be finite and >= 0, got {self.span_loss_coef}")
        for name in ("attn_dropout", "emb_dropout", "out_dropout"):
            p = getattr(self, name)
            if not 0.0 <= p < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {p}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


class LMOutput(NamedTuple):
    logits: Tensor
    """[B, M, V] unnormalised next-token scores."""
    nll: Tensor | None
    """[B, M] per-token negative log-likelihood in nats; None without targets."""
    cache: list[Tensor]
    """Per layer [B, C_l, d] input hidden states to carry to the next block (detached)."""


# --------------------------------------------------------------------------------------
# adaptive span
# --------------------------------------------------------------------------------------


def attn_span_len(max_frac: float, max_span: int, ramp: int) -> int:
    """L': how many previous tokens a layer attends to, from its largest head span.

    The authors' code: s = ceil(max_h z_h) + R clipped to [0, L]; trim the oldest
    floor(min(L - 1, L - s) / 64) * 64 positions. For L a multiple of 64 this is
    ceil_to_64(s) (at least 64), never more than L and never less than 1.
    """
    needed = max(0, min(max_span, math.ceil(max_frac * max_span) + ramp))
    trim = min(max_span - 1, max_span - needed)
    trim = (trim // SPAN_GRANULARITY) * SPAN_GRANULARITY
    return max_span - trim


def cache_len(span_len: int, max_span: int) -> int:
    """Hidden states a layer keeps for the next block: L' + 64 (room for the span to grow
    by one step of granularity), at most L."""
    return min(max_span, span_len + SPAN_GRANULARITY)


class AdaptiveSpan(nn.Module):
    """One learned span per head, stored as a fraction of max_span (``frac``, in [0, 1])."""

    def __init__(self, n_heads: int, max_span: int, ramp: int, init: float) -> None:
        super().__init__()
        self.max_span = max_span
        self.ramp = ramp
        self.frac = nn.Parameter(torch.full((n_heads,), float(init)))

    def span(self) -> Tensor:
        """[H] z in tokens (differentiable)."""
        return self.frac * self.max_span

    def mask(self, span_len: int) -> Tensor:
        """[H, L'] soft mask for the last L' distances (column j = distance L' - j)."""
        return adaptive_span_mask(self.span(), self.ramp, span_len)

    def extra_repr(self) -> str:
        return f"n_heads={self.frac.numel()}, max_span={self.max_span}, ramp={self.ramp}"


# --------------------------------------------------------------------------------------
# layers
# --------------------------------------------------------------------------------------


class AllAttention(nn.Module):
    """Multi-head attention over the previous L' tokens plus N persistent vectors per head."""

    def __init__(self, cfg: AllAttnConfig) -> None:
        super().__init__()
        d, h, n = cfg.d_model, cfg.n_heads, cfg.n_persistent
        self.n_heads, self.head_dim, self.n_persistent = h, cfg.head_dim, n
        self.max_span = cfg.max_span
        self.dropout_p = cfg.attn_dropout
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, d, bias=False)
        self.v_proj = nn.Linear(d, d, bias=False)
        self.o_proj = nn.Linear(d, d, bias=False)
        if n > 0:
            # Reparameterised persistent vectors: k = sqrt(d_h) k', v = sqrt(N) v' with
            # k' ~ N(0, 1/d_h), v' ~ N(0, 1/N): unit variance at init, like context vectors.
            dh = self.head_dim
            self.persistent_k = nn.Parameter(torch.randn(h, n, dh) / math.sqrt(dh))
            self.persistent_v = nn.Parameter(torch.randn(h, n, dh) / math.sqrt(n))
        else:
            self.register_parameter("persistent_k", None)
            self.register_parameter("persistent_v", None)
        self.adaptive_span = None
        if cfg.adaptive_span:
            self.adaptive_span = AdaptiveSpan(h, cfg.max_span, cfg.span_ramp, cfg.span_init)
        self.attend: AttendFn = get_attention_impl("reference")

    def span_len(self) -> int:
        """L' for the current spans (one host sync when adaptive)."""
        if self.adaptive_span is None:
            return self.max_span
        span = self.adaptive_span
        return attn_span_len(float(span.frac.detach().max()), self.max_span, span.ramp)

    def _heads(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        return x.view(b, t, self.n_heads, self.head_dim).transpose(1, 2)  # [B, H, T, d_h]

    def forward(
        self, h: Tensor, context: Tensor, pos_table: Tensor, span_len: int | None = None
    ) -> Tensor:
        """h: [B, M, d] the block; context: [B, C, d] hidden states before it (cache);
        pos_table: [d_h, max_span] the model's shared relative position table
        (column L - x = distance x); span_len: L' (computed if None).
        Attends to the last L' rows of context (zero rows in front if C < L')."""
        if span_len is None:
            span_len = self.span_len()
        c = context.shape[1]
        if c >= span_len:
            context = context[:, c - span_len :]
        else:  # cache shorter than the span (spans grew, or a short cache): zero states
            context = F.pad(context, (0, 0, span_len - c, 0))
        h_all = torch.cat([context, h], dim=1)  # [B, L' + M, d]

        q = self._heads(self.q_proj(h))
        k = self._heads(self.k_proj(h_all))
        v = self._heads(self.v_proj(h_all))
        pos = pos_table[:, self.max_span - span_len :]  # [d_h, L'], last column = distance 1
        pk = pv = None
        if self.persistent_k is not None:
            pk = self.persistent_k * math.sqrt(self.head_dim)
            pv = self.persistent_v * math.sqrt(self.n_persistent)
        mask = self.adaptive_span.mask(span_len) if self.adaptive_span is not None else None
        out = self.attend(
            q, k, v, pos,
            persistent_k=pk, persistent_v=pv, span_mask=mask,
            dropout_p=self.dropout_p, training=self.training,
        )  # [B, H, M, d_h]
        b, _, m, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(b, m, -1))


class FeedForward(nn.Module):
    """Transformer baseline sublayer: Linear -> ReLU -> dropout -> Linear (with biases)."""

    def __init__(self, d: int, ff_dim: int, dropout: float) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, ff_dim)
        self.fc2 = nn.Linear(ff_dim, d)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.dropout(F.relu(self.fc1(x))))


class AllAttnLayer(nn.Module):
    """Post-norm layer: h = LN(x + AllAttn(x)); with ff_dim > 0 also h = LN(h + FF(h))."""

    def __init__(self, cfg: AllAttnConfig) -> None:
        super().__init__()
        self.attn = AllAttention(cfg)
        self.norm1 = nn.LayerNorm(cfg.d_model)
        if cfg.ff_dim > 0:
            self.ff = FeedForward(cfg.d_model, cfg.ff_dim, cfg.attn_dropout)
            self.norm2 = nn.LayerNorm(cfg.d_model)
        else:
            self.ff = None
            self.norm2 = None

    def forward(
        self, x: Tensor, context: Tensor, pos_table: Tensor, span_len: int | None = None
    ) -> Tensor:
        h = self.norm1(x + self.attn(x, context, pos_table, span_len))
        if self.ff is not None:
            h = self.norm2(h + self.ff(h))
        return h


# --------------------------------------------------------------------------------------
# language model
# --------------------------------------------------------------------------------------


class AllAttnLM(nn.Module):
    """Embedding -> n_layers all-attention layers -> linear output over the vocabulary.

    Streams a text in blocks: ``forward`` takes the previous block's ``cache`` (each layer's
    input hidden states, detached) and returns the next one.
    """

    def __init__(self, cfg: AllAttnConfig, vocab_size: int) -> None:
        super().__init__()
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        self.cfg = cfg
        self.vocab_size = vocab_size
        self.embed = nn.Embedding(vocab_size, cfg.d_model)  # default init N(0, 1), as the code
        # One key-side relative position table shared by all heads and layers, N(0, 1);
        # column L - x holds u_x, the embedding of distance x in [1, L].
        self.pos_table = nn.Parameter(torch.randn(cfg.head_dim, cfg.max_span))
        self.layers = nn.ModuleList(AllAttnLayer(cfg) for _ in range(cfg.n_layers))
        self.emb_dropout = nn.Dropout(cfg.emb_dropout)
        self.out_dropout = nn.Dropout(cfg.out_dropout)
        self.out = nn.Linear(cfg.d_model, vocab_size)

    # ---- spans -------------------------------------------------------------------------

    def _span_fracs(self) -> list[list[float]] | None:
        if not self.cfg.adaptive_span:
            return None
        fracs = torch.stack([layer.attn.adaptive_span.frac.detach() for layer in self.layers])
        return fracs.cpu().tolist()  # one host sync for all layers

    def span_lens(self) -> list[int]:
        """L' per layer: how many previous tokens each layer attends to right now."""
        fracs = self._span_fracs()
        if fracs is None:
            return [self.cfg.max_span] * self.cfg.n_layers
        return [attn_span_len(max(f), self.cfg.max_span, self.cfg.span_ramp) for f in fracs]

    def cache_lens(self) -> list[int]:
        """Hidden states each layer carries to the next block."""
        return [cache_len(s, self.cfg.max_span) for s in self.span_lens()]

    def spans(self) -> list[list[float]]:
        """Current span z in tokens, per layer per head (max_span everywhere when fixed)."""
        fracs = self._span_fracs()
        if fracs is None:
            return [[float(self.cfg.max_span)] * self.cfg.n_heads for _ in self.layers]
        return [[f * self.cfg.max_span for f in row] for row in fracs]

    def span_loss(self) -> Tensor:
        """lambda * sum_layers mean_heads(z), z in tokens; zero when spans are fixed.
        The trainer adds it to the loss in training only."""
        if not self.cfg.adaptive_span:
            return self.pos_table.new_zeros(())
        total = sum(layer.attn.adaptive_span.span().mean() for layer in self.layers)
        return self.cfg.span_loss_coef * total

    def clamp_spans_(self) -> None:
        """Clamp the span fractions to [0, 1]; call after every optimizer step."""
        if not self.cfg.adaptive_span:
            return
        with torch.no_grad():
            for layer in self.layers:
                layer.attn.adaptive_span.frac.clamp_(0.0, 1.0)

    # ---- backends ----------------------------------------------------------------------

    def set_attention_impl(self, impl: str | AttendFn) -> None:
        """Use another attention backend (a name in ``ATTENTION_IMPLS`` or a callable)."""
        fn = get_attention_impl(impl) if isinstance(impl, str) else impl
        for layer in self.layers:
            layer.attn.attend = fn

    # ---- streaming ---------------------------------------------------------------------

    def init_cache(self, batch_size: int, device=None, dtype=None) -> list[Tensor]:
        """Zero hidden states, one [B, C_l, d] tensor per layer (C_l = ``cache_lens()``)."""
        ref = self.pos_table
        device = ref.device if device is None else device
        dtype = ref.dtype if dtype is None else dtype
        return [
            torch.zeros(batch_size, c, self.cfg.d_model, device=device, dtype=dtype)
            for c in self.cache_lens()
        ]

    def forward(
        self,
        tokens: Tensor,
        targets: Tensor | None = None,
        cache: list[Tensor] | None = None,
    ) -> LMOutput:
        """tokens, targets: [B, M] int64; cache: the previous block's ``LMOutput.cache``
        (None = zeros). Returns logits [B, M, V], nll [B, M] (nats) and the next cache."""
        bsz, m = tokens.shape
        if cache is None:
            cache = self.init_cache(bsz, device=tokens.device)
        if len(cache) != len(self.layers):
            raise ValueError(f"cache has {len(cache)} entries for {len(self.layers)} layers")
        span_lens = self.span_lens()  # fixed for the whole block
        h = self.emb_dropout(self.embed(tokens))
        new_cache: list[Tensor] = []
        for layer, past, span_len in zip(self.layers, cache, span_lens):
            keep = cache_len(span_len, self.cfg.max_span)  # = max_span for a fixed span
            past = past.to(h.dtype)
            if keep > m:
                nxt = torch.cat([past[:, max(0, past.shape[1] - (keep - m)) :], h], dim=1)
            else:
                nxt = h[:, m - keep :]
            new_cache.append(nxt.detach())
            h = layer(h, past, self.pos_table, span_len)
        logits = self.out(self.out_dropout(h))
        nll = None
        if targets is not None:
            lg = logits if logits.dtype in (torch.float32, torch.float64) else logits.float()
            nll = F.cross_entropy(
                lg.reshape(-1, lg.shape[-1]), targets.reshape(-1), reduction="none"
            ).view(bsz, m)
        return LMOutput(logits=logits, nll=nll, cache=new_cache)
