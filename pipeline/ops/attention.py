"""Reference (plain PyTorch) all-attention op: equations 10-13 of the all-attention paper
with the adaptive-span soft mask, written the way the authors' code computes them.

This is the op every faster backend has to match (same signature, same numbers up to
floating-point reordering). It favours readability over speed, but it keeps the authors'
memory layout: the attention matrix of a block is M x (L' + M), reduced to M x L' by the
pad-and-reshape ("skew") trick, never (L' + M)^2.

Context convention (the authors' code, where the paper is loose)
---------------------------------------------------------------
Keys and values of one block are ``[B, H, L' + M, d_h]``: the first L' rows come from the
L' hidden states *before* the block (the cache), the last M rows from the block itself.
Query i of the block sits at key index L' + i and attends to exactly the previous L'
tokens, key indices i .. i + L' - 1, i.e. distances x = t - c = L', ..., 1. A token never
attends to itself (its own information arrives through the residual connection), and every
query sees the same number of context tokens whatever its place in the block.

Every context-shaped tensor of size L' (the score rows after unskewing, the position table
slice, the span mask) is indexed by a column j in [0, L') with

    column j  <->  key index i + j  <->  distance x = L' - j

so column L' - 1 is the previous token (x = 1) and column 0 the oldest one (x = L').

The computation, per batch element and head (d_h = head size, N = persistent vectors):

    k_1..k_{L'+N} = Concat(W_k x_c for c in C_t, M_k)                         (10)
    v_1..v_{L'+N} = Concat(W_v x_c for c in C_t, M_v)                         (11)
    s_tc = q_t . (k_c + u_{t-c})   context c,  u = key-side relative position (12)
    s_tn = q_t . M_k[n]            persistent n (zero position term)
    a_t  = softmax over [s_t,context ; s_t,persistent] / sqrt(d_h)  (jointly)   (13)
    a_tc <- a_tc * m_z(t - c - 1) for context c; persistent weights untouched
    a_t  <- a_t / (sum(a_t) + 1e-8)            (joint renormalisation)
    a_t  <- dropout(a_t)
    y_t  = sum_c a_tc v_c + sum_n a_tn M_v[n]   (no value-side position term, as in the code)

Only the masking / renormalisation step is skipped when no span mask is given (fixed span).

The paper's ablations that give the persistent vectors a softmax of their own (attn-split,
head-split, single-head, FF-attn) are built from two pieces: this op *without* persistent
vectors (context only: softmax over the L' context scores, span mask, renormalisation over
the context alone, as the adaptive-span code does without persistent memory) and
``attend_persistent`` (softmax over the persistent vectors alone). Backends only implement
the joint op; the model combines the pieces (``pipeline.models.allattn.layers.AllAttention``).
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from pipeline.ops.dropout import attention_dropout

__all__ = [
    "AttendFn",
    "ATTENTION_IMPLS",
    "RENORM_EPS",
    "adaptive_span_mask",
    "attend_persistent",
    "attend_reference",
    "attention_weights",
    "backends_that_train_on",
    "check_shapes",
    "get_attention_impl",
    "log_span_mask",
    "skew",
    "backend_cannot_train_on",
    "unskew",
]

RENORM_EPS = 1e-8
"""Added to the denominator of the renormalisation after the span mask (authors' code)."""


class AttendFn(Protocol):
    """The signature every all-attention backend implements (see ``attend_reference``)."""

    def __call__(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        pos: Tensor,
        *,
        persistent_k: Tensor | None = None,
        persistent_v: Tensor | None = None,
        span_mask: Tensor | None = None,
        dropout_p: float = 0.0,
        training: bool = False,
        dropout_seed: Tensor | None = None,
    ) -> Tensor: ...


# --------------------------------------------------------------------------------------
# pad-and-reshape helpers
# --------------------------------------------------------------------------------------


def unskew(x: Tensor) -> Tensor:
    """[..., M, L + M] -> [..., M, L] with ``out[..., i, j] = x[..., i, i + j]``.

    Row i of a query-by-key score matrix keeps the L keys just before query i (key index
    L + i), oldest first. Works by padding each row with M zeros and re-reading the
    flat buffer with rows one element longer, which shifts row i left by i.
    """
    *lead, m, lm = x.shape
    ell = lm - m
    x = x.reshape(*lead, m * lm)
    x = F.pad(x, (0, m))  # [..., M*(L+M) + M] = [..., M*(L+M+1)]
    x = x.view(*lead, m, lm + 1)
    return x[..., :ell]


def skew(x: Tensor, pad_value: float = 0.0) -> Tensor:
    """[..., M, L] -> [..., M, L + M], the inverse placement of ``unskew``:
    ``out[..., i, i + j] = x[..., i, j]``; every other entry is ``pad_value``."""
    *lead, m, ell = x.shape
    x = F.pad(x, (0, m + 1), value=pad_value)  # [..., M, L+M+1]
    x = x.reshape(*lead, m * (ell + m + 1))
    x = x[..., : m * (ell + m)]  # drop the trailing M entries
    return x.view(*lead, m, ell + m)


# --------------------------------------------------------------------------------------
# adaptive-span soft mask
# --------------------------------------------------------------------------------------


def adaptive_span_mask(span: Tensor, ramp: int, span_len: int) -> Tensor:
    """Soft mask m_z(x) = clamp((R + z - x) / R, 0, 1) for every head and context column.

    span: [H] current span z of each head, in tokens (differentiable).
    ramp: R, the length of the linear ramp from 1 down to 0.
    span_len: L', the number of context columns.
    Returns [H, L'] in at least float32 (cast it to the attention's dtype where it is used);
    column j has distance t - c = L' - j and, as in the authors' code, the mask is evaluated
    at x = distance - 1 (the previous token always gets weight 1 for z >= 0).

    In at least float32 whatever ``span``'s dtype: bf16 holds integers exactly only up to
    256, so at distances of thousands the 32-token ramp would be a staircase (errors up to
    ~0.5 in the mask, a wrong gradient for z).
    """
    span = span.to(torch.promote_types(span.dtype, torch.float32))
    dist = torch.arange(span_len, 0, -1, device=span.device, dtype=span.dtype)  # L'..1
    x = dist - 1
    return ((ramp + span[:, None] - x) / ramp).clamp(0.0, 1.0)


def log_span_mask(span_mask: Tensor) -> Tensor:
    """log m, in at least float32, for the backends that add it to the scores instead of multiplying
    the weights by m.

    log(m + 1e-30), not log m: where m = 0 a weight of 1e-30 a is zero to every float
    precision, and the backward stays finite (a plain log sends 0 * inf = NaN back to the
    span). It also keeps the reference's gradient where the ramp ends exactly (m = 0 at
    x = z + R, e.g. spans at 0), which the clamp in ``adaptive_span_mask`` lets through.
    """
    return torch.log(span_mask.to(torch.promote_types(span_mask.dtype, torch.float32)) + 1e-30)


# --------------------------------------------------------------------------------------
# the op
# --------------------------------------------------------------------------------------


def check_shapes(q: Tensor, k: Tensor, pos: Tensor, pk: Tensor | None, pv: Tensor | None) -> int:
    """L' of a backend's inputs, or a ValueError naming what does not fit."""
    if (pk is None) != (pv is None):
        raise ValueError("persistent_k and persistent_v go together")
    span_len = k.shape[-2] - q.shape[-2]
    if span_len < 1 or pos.shape != (q.shape[-1], span_len):
        raise ValueError(
            f"keys {tuple(k.shape)}, queries {tuple(q.shape)}, pos {tuple(pos.shape)}: "
            "need L' >= 1 context rows and pos [d_h, L']"
        )
    return span_len


def _weights(
    q: Tensor,
    k: Tensor,
    pos: Tensor,
    persistent_k: Tensor | None,
    span_mask: Tensor | None,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Equations 12-13 up to the renormalisation: ``(w_ctx, w_pers, r)`` with the attention
    weights ``a = [w_ctx, w_pers] * r``: w = softmax(s) with the span mask applied to the
    context part, r = 1 / (sum(w) + 1e-8) per query row ([B, H, M, 1]; None without a span
    mask: no renormalisation). ``w_pers`` is None without persistent vectors."""
    m, d_h = q.shape[-2], q.shape[-1]
    span_len = k.shape[-2] - m
    if span_len < 1:
        raise ValueError(f"keys hold {k.shape[-2]} rows for {m} queries: no context (L' < 1)")
    if pos.shape != (d_h, span_len):
        raise ValueError(f"pos must be [d_h, L'] = {(d_h, span_len)}, got {tuple(pos.shape)}")

    # 1 / sqrt(d_h) on the queries ([B, H, M, d_h]) rather than on the scores (L' + N times
    # larger): the same scores up to rounding.
    q = q * (1.0 / math.sqrt(d_h))
    # (12), context part: q_t . k_c for the L' keys before each query, then q_t . u_{t-c}.
    s = unskew(torch.matmul(q, k.transpose(-1, -2))) + torch.matmul(q, pos)  # [B, H, M, L']
    if persistent_k is not None:
        # (12), persistent part: position term is zero. persistent_k: [H, N, d_h].
        s = torch.cat([s, torch.matmul(q, persistent_k.transpose(-1, -2))], dim=-1)

    # (13): one softmax over context and persistent vectors jointly.
    a = F.softmax(s, dim=-1)
    # split, not two slices: in backward the parts' gradients are joined in one pass instead
    # of each slice writing a zero-filled copy of the whole [B, H, M, L' + N]
    if persistent_k is not None:
        a_ctx, a_pers = a.split([span_len, a.shape[-1] - span_len], dim=-1)
    else:
        a_ctx, a_pers = a, None
    if span_mask is None:
        return a_ctx, a_pers, None
    # Adaptive span: mask the context weights only, then renormalise jointly.
    a_ctx = a_ctx * span_mask.to(a.dtype)[:, None, :]  # span_mask: [H, L']
    total = a_ctx.sum(dim=-1, keepdim=True)
    if a_pers is not None:
        total = total + a_pers.sum(dim=-1, keepdim=True)
    return a_ctx, a_pers, 1.0 / (total + RENORM_EPS)


def attention_weights(
    q: Tensor,
    k: Tensor,
    pos: Tensor,
    *,
    persistent_k: Tensor | None = None,
    span_mask: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Attention weights (before dropout) of equations 12-13 with the span mask.

    Shapes as in ``attend_reference``. Returns ``(a_ctx [B, H, M, L'], a_pers [B, H, M, N])``
    (``a_pers`` None without persistent vectors); column j of ``a_ctx`` is distance L' - j.
    """
    a_ctx, a_pers, r = _weights(q, k, pos, persistent_k, span_mask)
    if r is not None:
        a_ctx = a_ctx * r
        a_pers = None if a_pers is None else a_pers * r
    return a_ctx, a_pers


def attend_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    pos: Tensor,
    *,
    persistent_k: Tensor | None = None,
    persistent_v: Tensor | None = None,
    span_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    training: bool = False,
    dropout_seed: Tensor | None = None,
) -> Tensor:
    """All-attention of one block, per head, in plain PyTorch.

    q: [B, H, M, d_h] queries of the block (W_q x_t, not yet scaled).
    k, v: [B, H, L' + M, d_h] keys / values of the L' context tokens before the block
        followed by the block's own M tokens (see the module docstring).
    pos: [d_h, L'] key-side relative position embeddings, shared by the heads; column j is
        u_{L'-j} (so the last column is distance 1). Usually the last L' columns of the
        model's (d_h x max_span) table.
    persistent_k, persistent_v: [H, N, d_h] persistent key / value vectors of each head,
        already reparameterised (sqrt(d_h) k', sqrt(N) v'); both or neither.
    span_mask: [H, L'] adaptive-span soft mask (``adaptive_span_mask``); None = fixed span,
        plain softmax without renormalisation.
    dropout_p, training: dropout on the (joint, renormalised) attention weights, drawn with
        torch's RNG on the weights' device (``pipeline.ops.dropout.attention_dropout``).
    dropout_seed: must be None: it seeds the hashed mask of the flex backend, which this op
        does not draw.
    Returns [B, H, M, d_h].

    Memory: autograd keeps the softmax output, the skewed context weights (after dropout),
    the persistent weights (after dropout) and the dropout masks, no more than the authors'
    code. The renormalisation 1 / (sum + 1e-8) is a per-row factor, and dropout and the
    value product are linear in the weights, so it is applied to the [B, H, M, d_h] output
    instead of to the [B, H, M, L' + N] weights: the same numbers up to rounding, and no
    copy of the masked weights kept for the division's backward.
    """
    if (persistent_k is None) != (persistent_v is None):
        raise ValueError("persistent_k and persistent_v go together")
    if dropout_seed is not None:
        raise ValueError(
            "attend_reference draws its dropout mask with torch's RNG; dropout_seed is the "
            "flex backend's"
        )
    a_ctx, a_pers, r = _weights(q, k, pos, persistent_k, span_mask)
    owed = 1.0  # the dropout's 1 / (1 - p) where it is left to the output (the CPU)
    if dropout_p > 0.0 and training:
        # Dropout after the joint renormalisation (here: before the row factor r, which
        # commutes with it), on context and persistent weights alike; one call per part, so
        # the persistent part is a tensor of its own, not a view that keeps all weights.
        a_ctx, owed = attention_dropout(a_ctx, dropout_p)
        if a_pers is not None:
            a_pers, _ = attention_dropout(a_pers, dropout_p)

    # y_t = sum_c a_tc v_c: place row i's L' weights back at key indices i..i+L'-1.
    out = torch.matmul(skew(a_ctx, 0.0), v)  # [B, H, M, d_h]
    if a_pers is not None:
        assert persistent_v is not None  # both or neither
        out = out + torch.matmul(a_pers, persistent_v)  # [H, N, d_h] broadcast over B
    if r is None:
        return out if owed == 1.0 else out * owed
    return out * (r if owed == 1.0 else r * owed)


def attend_persistent(
    q: Tensor,
    persistent_k: Tensor,
    persistent_v: Tensor,
    *,
    dropout_p: float = 0.0,
    training: bool = False,
) -> Tensor:
    """Attention over persistent vectors only, with a softmax of its own (no context, no
    position term, no span mask): the persistent half of the ablations that do not share the
    softmax with the context (attn-split, head-split, single-head) and the FF-attn sublayer.

        a_tn = softmax_n(q_t . M_k[n] / sqrt(e))      y_t = sum_n dropout(a)_tn M_v[n]

    q: [B, G, M, e] queries of G groups (the heads, or G = 1 for one set of vectors of the
        model width, e = d); persistent_k, persistent_v: [G, N, e], already reparameterised.
    Returns [B, G, M, e]. Plain PyTorch; not a backend hook (the joint op is).
    """
    if persistent_k.shape != persistent_v.shape or persistent_k.shape[-1] != q.shape[-1]:
        raise ValueError(
            f"persistent_k {tuple(persistent_k.shape)} / persistent_v "
            f"{tuple(persistent_v.shape)} do not fit queries {tuple(q.shape)}"
        )
    s = torch.matmul(q, persistent_k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    a = F.softmax(s, dim=-1)
    if dropout_p > 0.0 and training:
        a, owed = attention_dropout(a, dropout_p)
        if owed != 1.0:
            return torch.matmul(a, persistent_v) * owed
    return torch.matmul(a, persistent_v)


ATTENTION_IMPLS: dict[str, AttendFn] = {"reference": attend_reference}
"""Attention backends by name; fused ones register here with the same signature."""


def get_attention_impl(name: str) -> AttendFn:
    try:
        return ATTENTION_IMPLS[name]
    except KeyError:
        raise ValueError(
            f"unknown attention impl {name!r}; known: {sorted(ATTENTION_IMPLS)}"
        ) from None


CANNOT_TRAIN: dict[tuple[str, str], str] = {
    ("flex", "cpu"): "flex runs forward only on CPU (torch has no CPU backward for FlexAttention)",
    ("triton", "cpu"): (
        "triton runs its kernels on CUDA (on the CPU only in Triton's interpreter, for tests: "
        "minutes a step)"
    ),
}
"""(backend, device type): why that backend cannot train on that device; every pair not here
trains. The one table spec validation, the models (``cannot_train_on``) and the ops consult,
through ``backend_cannot_train_on``."""


def backend_cannot_train_on(impl: str, device_type: str) -> str | None:
    """Why attention backend ``impl`` cannot train on ``device_type`` (``"cpu"``, ``"cuda"``),
    in words that name the backend and the device; None when it can (or when ``impl`` is not
    one of these ops, a plugin's own). Callers add where the device came from and what to use
    instead (``backends_that_train_on``)."""
    return CANNOT_TRAIN.get((impl, device_type))


def backends_that_train_on(device_type: str) -> str:
    """The backends that can train on ``device_type``, in words: "reference, sdpa or auto"."""
    names = [name for name in ATTENTION_IMPLS if backend_cannot_train_on(name, device_type) is None]
    return ", ".join(names[:-1]) + " or " + names[-1] if len(names) > 1 else names[0]
