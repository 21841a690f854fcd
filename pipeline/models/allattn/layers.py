"""The layers of the all-attention family: adaptive span, multi-head attention with persistent
vectors (all four `persistent_mode`s), the feed-forward variants, and the post-norm layer.
What each ablation means is written out in pipeline/models/allattn/model.py's docstring.
"""

from __future__ import annotations

import math
from typing import Any, cast

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from pipeline.models.allattn.config import AllAttnConfig
from pipeline.ops.attention import (
    AttendFn,
    adaptive_span_mask,
    attend_persistent,
    attention_weights,
    get_attention_impl,
)
from pipeline.ops.memory import OpMemory, attention_memory, dtype_bytes, persistent_memory

SPAN_GRANULARITY = 64
"""Attention spans are trimmed in steps of this many tokens, and the cache keeps this many
extra tokens so a span may grow between two blocks (authors' code)."""


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


def planned_span_len(max_frac: float, max_span: int, ramp: int) -> int:
    """L' planned ahead from a span fraction read some updates earlier: the synchronous L'
    (``attn_span_len``) plus SPAN_GRANULARITY tokens of room to grow, rounded up to a span
    bucket (``pipeline.ops.fused.flex_bucket``: 64 * 2^i or 96 * 2^i, so that compiled code
    sees ~2 shapes per doubling of the span), at most max_span."""
    from pipeline.ops.fused import flex_bucket

    return min(max_span, flex_bucket(attn_span_len(max_frac, max_span, ramp) + SPAN_GRANULARITY))


def cache_len(span_len: int, max_span: int) -> int:
    """Hidden states a layer keeps for the next block: L' + 64 (room for the span to grow
    by one step of granularity), at most L."""
    return min(max_span, span_len + SPAN_GRANULARITY)


class AdaptiveSpan(nn.Module):
    """One learned span per head, stored as a fraction of max_span (``frac``, in [0, 1]).

    ``frac`` stays float32 when the module is cast to bf16 or fp16 (``model.to(dtype)``,
    ``.bfloat16()``, ``.half()``): in bf16 a span near 3000 tokens moves in steps of 8 to 16
    tokens, a large part of the 32-token ramp, and updates of lr * grad vanish in rounding."""

    def __init__(self, n_heads: int, max_span: int, ramp: int, init: float) -> None:
        super().__init__()
        self.max_span = max_span
        self.ramp = ramp
        self.frac = nn.Parameter(torch.full((n_heads,), float(init)))

    def _apply(self, fn, recurse=True):
        value, grad = self.frac.data, self.frac.grad
        super()._apply(fn, recurse)
        low = (torch.bfloat16, torch.float16)
        if self.frac.dtype in low and value.dtype not in low:  # this call cast it down
            # keep the values from before the cast, not their rounding, on fn's device
            self.frac.data = value.to(self.frac.device, torch.float32)
            if grad is not None:
                self.frac.grad = grad.to(self.frac.device, torch.float32)
        return self

    def span(self) -> Tensor:
        """[H] z in tokens (differentiable), float32 or wider."""
        return self.frac * self.max_span

    def mask(self, span_len: int) -> Tensor:
        """[H, L'] soft mask for the last L' distances (column j = distance L' - j), in float32
        or wider whatever the model's dtype (``adaptive_span_mask``)."""
        return adaptive_span_mask(self.span(), self.ramp, span_len)

    def extra_repr(self) -> str:
        return f"n_heads={self.frac.numel()}, max_span={self.max_span}, ramp={self.ramp}"


# --------------------------------------------------------------------------------------
# layers
# --------------------------------------------------------------------------------------


class PersistentShareSum:
    """What a layer accumulates while the persistent share is measured: per head, the
    attention weight on the persistent vectors summed over query rows (float64), and how
    many query rows (per head) that is."""

    def __init__(self, n_heads: int, device) -> None:
        self.weight = torch.zeros(n_heads, dtype=torch.float64, device=device)
        self.rows = 0

    def add(self, persistent_weights: Tensor) -> None:
        """persistent_weights: [B, H, M, N], the joint softmax's weights (before dropout)."""
        b, _, m, _ = persistent_weights.shape
        self.weight += persistent_weights.to(torch.float64).sum(dim=(0, 2, 3))
        self.rows += b * m

    def mean(self) -> list[float]:
        """Per head, the mean share of a query row's weight on the persistent vectors."""
        return (self.weight / self.rows).tolist()


class AllAttention(nn.Module):
    """Multi-head attention over the previous L' tokens plus N persistent vectors per head,
    combined as ``persistent_mode`` says (see the module doc)."""

    def __init__(self, cfg: AllAttnConfig) -> None:
        super().__init__()
        d, h, n = cfg.d_model, cfg.n_heads, cfg.n_persistent
        self.n_heads, self.head_dim, self.n_persistent = h, cfg.head_dim, n
        self.mode = cfg.persistent_mode
        # heads that attend to the context (all but the persistent-only half of head_split)
        self.n_ctx_heads = h // 2 if self.mode == "head_split" else h
        self.max_span = cfg.max_span
        self.dropout_p = cfg.attn_dropout
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, d, bias=False)
        self.v_proj = nn.Linear(d, d, bias=False)
        self.o_proj = nn.Linear(d, d, bias=False)
        if n > 0:
            # Reparameterised persistent vectors: k = sqrt(e) k', v = sqrt(N) v' with
            # k' ~ N(0, 1/e), v' ~ N(0, 1/N): unit variance at init, like context vectors.
            # e = d_h per head ([G, N, d_h], G heads that have them), e = d for single_head.
            if self.mode == "single_head":
                groups, e = 1, d
            else:
                groups, e = h - (self.n_ctx_heads if self.mode == "head_split" else 0), cfg.head_dim
            self.persistent_dim = e
            self.persistent_k = nn.Parameter(torch.randn(groups, n, e) / math.sqrt(e))
            self.persistent_v = nn.Parameter(torch.randn(groups, n, e) / math.sqrt(n))
        else:
            self.persistent_dim = 0
            self.register_parameter("persistent_k", None)
            self.register_parameter("persistent_v", None)
        self.adaptive_span: AdaptiveSpan | None = None
        if cfg.adaptive_span:
            self.adaptive_span = AdaptiveSpan(
                self.n_ctx_heads, cfg.max_span, cfg.span_ramp, cfg.span_init
            )
        self.attend: AttendFn = get_attention_impl("reference")
        self.persistent_share: PersistentShareSum | None = None
        """Set while the model measures the persistent share (all_attn mode only)."""

    def span_len(self) -> int:
        """L' for the current spans (one host sync when adaptive)."""
        if self.adaptive_span is None:
            return self.max_span
        span = self.adaptive_span
        return attn_span_len(float(span.frac.detach().max()), self.max_span, span.ramp)

    def _heads(self, x: Tensor, n_heads: int | None = None) -> Tensor:
        b, t, _ = x.shape
        n_heads = self.n_heads if n_heads is None else n_heads
        return x.view(b, t, n_heads, self.head_dim).transpose(1, 2)  # [B, H, T, d_h]

    def persistent_vectors(self) -> tuple[Tensor | None, Tensor | None]:
        """The effective (reparameterised) persistent keys and values, [G, N, e]."""
        if self.persistent_k is None:
            return None, None
        return (
            self.persistent_k * math.sqrt(self.persistent_dim),
            self.persistent_v * math.sqrt(self.n_persistent),
        )

    def activation_memory(
        self, rows: int, m: int, span_len: int, dtype: torch.dtype, device_type: str, impl: str
    ) -> OpMemory:
        """What ``forward`` keeps for backward on ``rows`` x ``m`` queries at L' = ``span_len``
        with backend ``impl`` (pipeline.ops.memory): the op's or ops' count for this
        ``persistent_mode``, and the rows of context and block the K / V projections read
        and the heads' output the output projection reads."""
        d, h, hc, n = (
            self.n_heads * self.head_dim,
            self.n_heads,
            self.n_ctx_heads,
            self.n_persistent,
        )
        e = dtype_bytes(dtype)
        shape: dict[str, Any] = dict(
            batch=rows, queries=m, span=span_len, head_dim=self.head_dim, dropout=self.dropout_p > 0
        )
        masked = self.adaptive_span is not None
        own = e * (rows * (span_len + m) * d + rows * m * d)  # K / V input, o_proj input
        if self.mode == "all_attn":
            parts = [
                attention_memory(
                    impl, device_type, dtype, heads=h, persistent=n, span_mask=masked, **shape
                )
            ]
        else:
            ctx = attention_memory(
                impl, device_type, dtype, heads=hc, persistent=0, span_mask=masked, **shape
            )
            # attn_split: every head; head_split: the other half; single_head: one group of d
            groups = {"attn_split": h, "head_split": h - hc, "single_head": 1}[self.mode]
            pers = persistent_memory(
                device_type,
                dtype,
                batch=rows,
                groups=groups,
                queries=m,
                persistent=n,
                dim=d if self.mode == "single_head" else self.head_dim,
                dropout=self.dropout_p > 0,
                copies_query=self.mode != "single_head",  # a head view, or the whole query
            )
            parts = [ctx, pers]
        return OpMemory(own + sum(p.saved for p in parts), max(p.working for p in parts))

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

        hc = self.n_ctx_heads  # head_split: only the first H/2 heads' keys / values are read
        q_full = self.q_proj(h)  # [B, M, d]
        q = self._heads(q_full)
        k = self._heads(self.k_proj(h_all))[:, :hc]
        v = self._heads(self.v_proj(h_all))[:, :hc]
        pos = pos_table[:, self.max_span - span_len :]  # [d_h, L'], last column = distance 1
        pk, pv = self.persistent_vectors()
        mask = self.adaptive_span.mask(span_len) if self.adaptive_span is not None else None
        drop: dict[str, Any] = dict(dropout_p=self.dropout_p, training=self.training)
        # each backend draws its attention dropout on the device (pipeline.ops.dropout)
        b, m = h.shape[0], h.shape[1]
        if self.mode == "all_attn":  # eq. 13: one softmax over context + persistent
            if self.persistent_share is not None and pk is not None:
                # the reference op's weights for the same inputs (every backend matches
                # them); the output still comes from the configured backend
                _, a_pers = attention_weights(q, k, pos, persistent_k=pk, span_mask=mask)
                assert a_pers is not None  # persistent_k given: its weights come back
                self.persistent_share.add(a_pers)
            out = self.attend(
                q,
                k,
                v,
                pos,
                persistent_k=pk,
                persistent_v=pv,
                span_mask=mask,
                **drop,
            )
        elif self.mode == "attn_split":  # two softmaxes, outputs summed
            assert pk is not None and pv is not None  # the split modes always have them
            out = self.attend(q, k, v, pos, span_mask=mask, **drop)
            out = out + attend_persistent(q, pk, pv, **drop)
        elif self.mode == "head_split":  # first half: context only; second: persistent only
            assert pk is not None and pv is not None
            ctx = self.attend(q[:, :hc], k, v, pos, span_mask=mask, **drop)
            out = torch.cat([ctx, attend_persistent(q[:, hc:], pk, pv, **drop)], dim=1)
        else:  # single_head: one d-dimensional set of persistent vectors, own softmax
            assert pk is not None and pv is not None
            out = self.attend(q, k, v, pos, span_mask=mask, **drop)
            pers = attend_persistent(q_full[:, None], pk, pv, **drop)[:, 0]  # [B, M, d]
            return self.o_proj(out.transpose(1, 2).reshape(b, m, -1) + pers)
        return self.o_proj(out.transpose(1, 2).reshape(b, m, -1))  # out: [B, H, M, d_h]


class FeedForward(nn.Module):
    """Transformer baseline sublayer: Linear -> ReLU -> dropout -> Linear (with biases)."""

    def __init__(self, d: int, ff_dim: int, dropout: float) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, ff_dim)
        self.fc2 = nn.Linear(ff_dim, d)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.dropout(F.relu(self.fc1(x))))


class SoftmaxFeedForward(nn.Module):
    """Eq. 9 of the paper taken literally: y = U softmax(V x), no biases (``ff_kind:
    softmax``); dropout on the softmax weights."""

    def __init__(self, d: int, ff_dim: int, dropout: float) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, ff_dim, bias=False)  # V
        self.fc2 = nn.Linear(ff_dim, d, bias=False)  # U
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.dropout(F.softmax(self.fc1(x), dim=-1)))


class AttnFeedForward(nn.Module):
    """The ablation's FF-attn sublayer (``ff_kind: ff_attn``): the single-head persistent
    attention on its own, y = W_o' sum_n softmax_n(W_q' x . M_k[n] / sqrt(d)) M_v[n], with
    ff_dim persistent vectors of dimension d (reparameterised as in the attention), dropout
    on the weights, no biases."""

    def __init__(self, d: int, ff_dim: int, dropout: float) -> None:
        super().__init__()
        self.d, self.n = d, ff_dim
        self.q_proj = nn.Linear(d, d, bias=False)
        self.o_proj = nn.Linear(d, d, bias=False)
        self.persistent_k = nn.Parameter(torch.randn(1, ff_dim, d) / math.sqrt(d))
        self.persistent_v = nn.Parameter(torch.randn(1, ff_dim, d) / math.sqrt(ff_dim))
        self.dropout_p = dropout

    def forward(self, x: Tensor) -> Tensor:
        pk = self.persistent_k * math.sqrt(self.d)
        pv = self.persistent_v * math.sqrt(self.n)
        y = attend_persistent(
            self.q_proj(x)[:, None], pk, pv, dropout_p=self.dropout_p, training=self.training
        )[:, 0]
        return self.o_proj(y)


_FF_CLASSES = {"relu": FeedForward, "softmax": SoftmaxFeedForward, "ff_attn": AttnFeedForward}


class AllAttnLayer(nn.Module):
    """Post-norm layer: h = LN(x + AllAttn(x)); with ff_dim > 0 also h = LN(h + FF(h))."""

    def __init__(self, cfg: AllAttnConfig) -> None:
        super().__init__()
        self.attn = AllAttention(cfg)
        self.norm1 = nn.LayerNorm(cfg.d_model)
        self.ff: nn.Module | None
        self.norm2: nn.LayerNorm | None
        if cfg.ff_dim > 0:
            self.ff = _FF_CLASSES[cfg.ff_kind](cfg.d_model, cfg.ff_dim, cfg.attn_dropout)
            self.norm2 = nn.LayerNorm(cfg.d_model)
        else:
            self.ff = None
            self.norm2 = None

    def activation_memory(
        self, rows: int, m: int, span_len: int, dtype: torch.dtype, device_type: str, impl: str
    ) -> OpMemory:
        """What ``forward`` keeps for backward (see ``AllAttention.activation_memory``): its
        input (read by the query projection), each LayerNorm's input and float32 statistics,
        and the feed-forward sublayer's hidden units (a dropout mask is bool on a GPU, of the
        dtype on the CPU, where torch's dropout keeps its scaled noise)."""
        e = dtype_bytes(dtype)
        tokens, d = rows * m, self.norm1.normalized_shape[0]
        attn = self.attn.activation_memory(rows, m, span_len, dtype, device_type, impl)
        norms = 1 if self.ff is None else 2
        saved = attn.saved + e * tokens * d * (1 + norms) + 8 * tokens * norms
        working = attn.working
        if isinstance(self.ff, AttnFeedForward):
            ff = persistent_memory(
                device_type,
                dtype,
                batch=rows,
                groups=1,
                queries=m,
                persistent=self.ff.n,
                dim=d,
                dropout=self.ff.dropout_p > 0,
                copies_query=False,
            )
            saved += ff.saved + 3 * e * tokens * d  # q_proj's input and output, o_proj's input
            working = max(working, ff.working)
        elif self.ff is not None:  # relu / softmax: fc1's input, its activation, fc2's input
            hidden = tokens * cast(nn.Linear, self.ff.fc1).out_features
            saved += e * (tokens * d + hidden)
            if cast(nn.Dropout, self.ff.dropout).p > 0:
                saved += hidden * (e + (1 if device_type == "cuda" else e))
            working = max(working, 2 * e * hidden)
        return OpMemory(saved, working)

    def forward(
        self, x: Tensor, context: Tensor, pos_table: Tensor, span_len: int | None = None
    ) -> Tensor:
        h = self.norm1(x + self.attn(x, context, pos_table, span_len))
        if self.ff is not None and self.norm2 is not None:  # both or neither
            h = self.norm2(h + self.ff(h))
        return h
