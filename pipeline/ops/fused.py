"""Fused backends of the all-attention op (same signature and numbers as
``attend_reference``), and ``auto``, which picks one per call.

Both express the reference as one softmax over [context window ; persistent vectors] of

    s_tc = q_t . k_c / sqrt(d_h) + T[t, x]     T = q_t . u_x / sqrt(d_h) + log m(x)
    s_tn = q_t . M_k[n] / sqrt(d_h)

where x = t - c is the distance and m the adaptive-span mask (``log_span_mask``). softmax(s)
equals the reference's masked, renormalised weights a m / sum(a m), without the reference's
+1e-8 in the denominator: that term is a guard against 0 / 0 which cannot trigger here (the
previous token always has m = 1); leaving it out changes the weights by a relative
1e-8 * sum(a) / sum(a m), below float32 resolution unless the mask removes almost all
of the softmax mass.

- ``sdpa``: ``F.scaled_dot_product_attention`` with T placed in a dense additive bias
  [B, H, M, L' + M + N]. Trains on CPU (math path) and CUDA (memory-efficient kernel). Has
  no attention dropout (SDPA's own drops weights of the joint softmax before the span mask,
  and it does not return the log-sum-exp the construction below needs).
- ``flex``: FlexAttention. q . u / sqrt(d_h) is a [B, H, M, L'] table in q's dtype and log m
  an [H, L'] table in float32, both gathered by score_mod; the block mask keeps the window
  of L' keys before each query and the persistent vectors. Attention dropout: dropped
  entries get -inf in score_mod (a hash of a seed drawn on the device and the weight's
  coordinates, ``pipeline.ops.dropout.flex_keep``), and out = out_kept * exp(lse_kept -
  lse_all) / (1 - p), i.e. the kept weights keep the denominator of all weights; two
  FlexAttention calls per layer (see ``_attend_flex``). On CPU (torch 2.13) forward-only:
  FlexAttention has no backward there, and its compiled form no log-sum-exp, so dropout
  runs uncompiled.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from pipeline.ops.attention import (
    ATTENTION_IMPLS,
    backend_cannot_train_on,
    backends_that_train_on,
    check_shapes,
    log_span_mask,
    skew,
)
from pipeline.ops.dropout import draw_dropout_seed, flex_keep, keep_threshold
from pipeline.ops.triton_attention import attend_triton

__all__ = [
    "attend_auto",
    "attend_flex",
    "attend_sdpa",
    "compile_count",
    "describe_auto",
    "flex_bucket",
    "pick_attention_impl",
]


def _position_table(q: Tensor, pos: Tensor, span_mask: Tensor | None) -> Tensor:
    """T = q . u / sqrt(d_h) + log m: [B, H, M, L'], column j = distance L' - j."""
    table = torch.matmul(q, pos.to(q.dtype)) / math.sqrt(q.shape[-1])
    if span_mask is not None:
        table = table + log_span_mask(span_mask).to(q.dtype)[:, None, :]
    return table


def _with_persistent(k: Tensor, pk: Tensor | None) -> Tensor:
    """[B, H, L' + M, d] keys (or values) followed by the [H, N, d] persistent ones."""
    if pk is None:
        return k
    return torch.cat([k, pk.to(k.dtype).expand(k.shape[0], -1, -1, -1)], dim=2)


# --------------------------------------------------------------------------------------
# sdpa
# --------------------------------------------------------------------------------------


def attend_sdpa(
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
    """The all-attention op through ``scaled_dot_product_attention`` with a float bias."""
    check_shapes(q, k, pos, persistent_k, persistent_v)
    if dropout_p > 0.0 and training:
        raise ValueError(
            "attention impl sdpa has no attention dropout; use flex, reference or auto"
        )
    # skew puts T's row i at key columns i .. i + L' - 1, -inf elsewhere (own position, and
    # the keys after it); the persistent vectors get a zero bias.
    bias = skew(_position_table(q, pos, span_mask), float("-inf"))
    if persistent_k is not None:
        bias = F.pad(bias, (0, persistent_k.shape[-2]))
    return F.scaled_dot_product_attention(
        q, _with_persistent(k, persistent_k), _with_persistent(v, persistent_v), attn_mask=bias
    )


# --------------------------------------------------------------------------------------
# flex
# --------------------------------------------------------------------------------------


def flex_bucket(span_len: int) -> int:
    """The context length FlexAttention is compiled for: L' rounded up to 64 * 2^i or
    96 * 2^i. Spans change every step; a compiled kernel is specialised to its shapes, so
    this bounds the compilations to ~2 per doubling of the span (15 up to 8192) at the
    cost of at most 50% padded (fully masked) key blocks."""
    bucket = 64
    while bucket < span_len:
        bucket = bucket * 3 // 2 if bucket & (bucket - 1) == 0 else bucket * 4 // 3
    return bucket


_compiles = 0
_flex_compiled = None
_block_masks: dict = {}


def compile_count() -> int:
    """How many graphs the fused (flex) path has compiled in this process."""
    return _compiles


def _counting_inductor(gm, example_inputs):
    global _compiles
    from torch._inductor.compile_fx import compile_fx

    _compiles += 1
    return compile_fx(gm, example_inputs)


def _flex():
    global _flex_compiled
    if _flex_compiled is None:
        import torch._dynamo
        from torch.nn.attention.flex_attention import flex_attention

        # one graph per bucket, batch size, and with/without dropout or persistent vectors:
        # more than dynamo's default limit of 8 per function over a whole training run
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 128)
        _flex_compiled = torch.compile(
            flex_attention, backend=_counting_inductor, fullgraph=True, dynamic=False
        )
    return _flex_compiled


def _block_mask(m: int, bucket: int, n: int, device: torch.device):
    """Query i (key index bucket + i) sees keys i .. bucket + i - 1 and the N persistent
    keys at bucket + M ...; cached per shape (building one evaluates the mask everywhere)."""
    key = (m, bucket, n, str(device))
    if key not in _block_masks:
        from torch.nn.attention.flex_attention import create_block_mask

        def window_or_persistent(b, h, qi, kv):
            return ((kv >= qi) & (kv < qi + bucket)) | (kv >= bucket + m)

        _block_masks[key] = create_block_mask(
            window_or_persistent, None, None, m, bucket + m + n, device=device
        )
    return _block_masks[key]


# FlexAttention's forward tile, tried in this order until one compiles. torch's own choice
# comes first; on an H100/H200 in bf16 at d_h 64 that is 128 queries x 128 keys in 3 stages,
# which with the two tables score_mod gathers asks for 242 KiB of shared memory where the
# chip has 227 KiB ("out of resource", make gpu-check 2026-11-26). The first tile that
# compiled is kept per device, dtype and head size.
FLEX_TILES: tuple[dict, ...] = (
    {},
    {"BLOCK_N": 64},
    {"BLOCK_M": 64, "BLOCK_N": 64, "num_stages": 2},
    {"BLOCK_M": 32, "BLOCK_N": 32, "num_stages": 1},
)
_flex_tile: dict = {}


def flex_tiles_in_use() -> dict[tuple, dict]:
    """{(device, dtype, d_h): the kernel options of the FLEX_TILES entry that compiled there}
    ({} for torch's default tile), for the benchmarks to report."""
    return {where: FLEX_TILES[i] for where, i in _flex_tile.items()}


def _run_flex(flex, q, keys, values, score_mod, block_mask, lse: bool = False):
    """``flex`` on these inputs in the first tile of ``FLEX_TILES`` that fits the device;
    with ``lse`` the output and its log-sum-exp (``return_aux`` where torch has it, the
    deprecated ``return_lse`` before)."""
    kwargs: dict = {"score_mod": score_mod, "block_mask": block_mask}
    if lse:
        try:
            from torch.nn.attention.flex_attention import AuxRequest

            kwargs["return_aux"] = AuxRequest(lse=True)
        except ImportError:
            kwargs["return_lse"] = True
    where = (str(q.device), q.dtype, q.shape[-1])
    first = _flex_tile.get(where, 0)
    for i in range(first, len(FLEX_TILES)):
        tile = {"kernel_options": FLEX_TILES[i]} if FLEX_TILES[i] else {}
        try:
            result = flex(q, keys, values, **kwargs, **tile)
        except Exception as error:  # inductor wraps triton's OutOfResources in its own types
            if "out of resource" in str(error) and i + 1 < len(FLEX_TILES):
                continue
            raise
        break
    _flex_tile[where] = i
    if "return_aux" in kwargs:
        out, aux = result
        return out, aux.lse
    return result


def attend_flex(
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
    """The all-attention op through FlexAttention (see the module docstring).

    dropout_seed: int32 scalar tensor on q's device seeding the dropout mask
    (``pipeline.ops.dropout.flex_keep``); None draws one there from torch's generator."""
    if (
        q.device.type == "cpu"
        and torch.is_grad_enabled()
        and any(
            t is not None and t.requires_grad
            for t in (q, k, v, pos, persistent_k, persistent_v, span_mask)
        )
    ):
        raise ValueError(
            f"attention impl {backend_cannot_train_on('flex', 'cpu')}, and this call needs "
            f"gradients: use {backends_that_train_on('cpu')} to train on CPU"
        )
    return _attend_flex(
        q,
        k,
        v,
        pos,
        persistent_k=persistent_k,
        persistent_v=persistent_v,
        span_mask=span_mask,
        dropout_p=dropout_p,
        training=training,
        dropout_seed=dropout_seed,
    )


def _attend_flex(
    q,
    k,
    v,
    pos,
    *,
    persistent_k,
    persistent_v,
    span_mask,
    dropout_p,
    training,
    dropout_seed,
    flex=None,
) -> Tensor:
    """``attend_flex`` without its CPU guard; ``flex``: the flex_attention to call (None:
    compiled, or eager on CPU with dropout). The CPU tests pass torch's eager flex_attention,
    whose backward is torch's own math (dense) implementation."""
    span_len = check_shapes(q, k, pos, persistent_k, persistent_v)
    drop = dropout_p > 0.0 and training
    b, _, m, _ = q.shape
    bucket = flex_bucket(span_len)
    pad = bucket - span_len
    # Pad the context in front to the bucket: padded keys are zeros and their table columns
    # -inf, so they get exactly zero weight. The position term stays in q's dtype; log m is a
    # separate [H, L'] table in float32 (in bf16, log m near the ramp's end is off by up to
    # 1/4, and the spans' gradient, a sum of large terms of both signs, by 10-30%).
    table = F.pad(
        torch.matmul(q, pos.to(q.dtype)) / math.sqrt(q.shape[-1]), (pad, 0), value=float("-inf")
    )
    log_m = None if span_mask is None else F.pad(log_span_mask(span_mask), (pad, 0))
    keys = _with_persistent(F.pad(k, (0, 0, pad, 0)), persistent_k)
    values = _with_persistent(F.pad(v, (0, 0, pad, 0)), persistent_v)
    block_mask = _block_mask(m, bucket, keys.shape[2] - bucket - m, q.device)
    ctx_end = bucket + m

    def add_position(score, bi, hi, qi, kv):
        x = (kv - qi).clamp(0, bucket - 1)  # table column; clamped outside the window
        t = table[bi, hi, qi, x]
        if log_m is not None:
            t = t + log_m[hi, x]
        return torch.where(kv < ctx_end, score + t, score)

    if flex is None:
        # torch 2.13 compiles FlexAttention's log-sum-exp output for CUDA only; on CPU the
        # dropout construction runs through flex_attention uncompiled (exact, not fused)
        if drop and q.device.type == "cpu":
            from torch.nn.attention.flex_attention import flex_attention as flex
        else:
            flex = _flex()
    if not drop:
        return _run_flex(flex, q, keys, values, add_position, block_mask)

    seed = draw_dropout_seed(q.device) if dropout_seed is None else dropout_seed
    threshold = keep_threshold(dropout_p)

    def add_position_and_drop(score, bi, hi, qi, kv):
        # key coordinate of pipeline.ops.dropout: the key's index in k for context (kv less
        # the padding), -1 - n for persistent
        c = torch.where(kv < ctx_end, kv - pad, ctx_end - 1 - kv)
        keep = flex_keep(seed, bi, hi, qi, c, threshold)
        return torch.where(keep, add_position(score, bi, hi, qi, kv), float("-inf"))

    # Two passes: a score_mod changes a score in the numerator and in the softmax's
    # normaliser alike, while dropout after the softmax removes a weight from the numerator
    # only. The kept pass gives out_kept = sum_kept e^s v / sum_kept e^s and lse_kept; the
    # normaliser of all weights, lse_all, needs every score once more.
    out_kept, lse_kept = _run_flex(
        flex, q, keys, values, add_position_and_drop, block_mask, lse=True
    )
    _, lse_all = _run_flex(flex, q, keys, values, add_position, block_mask, lse=True)
    # a row whose weights were all dropped: out_kept 0 and lse_kept -inf (FlexAttention's
    # convention for an empty row), so its output is 0 * 0 = 0
    scale = (torch.exp(lse_kept - lse_all) / (1.0 - dropout_p)).unsqueeze(-1)
    return (out_kept * scale).to(q.dtype)


# --------------------------------------------------------------------------------------
# auto
# --------------------------------------------------------------------------------------


def pick_attention_impl(device_type: str, dtype: torch.dtype, dropout: bool, grad: bool) -> str:
    """The backend ``auto`` uses for a call on this device and dtype, with attention
    dropout on or off and autograd recording or not.

    From the step times measured on an H200 (docs/benchmarks.md, "auto"): on CUDA the
    reference wins in every dtype. In bf16 an enwik8_large step takes 102 / 301 ms with it
    at span 1/16 / 1 and 853 / 1,584 ms with flex (flex needs 16 GiB where the reference
    needs 35, but the reference fits micro-batch 14 on the H200); in float32 flex has no
    tensor cores. On CPU: sdpa trains without dropout, flex evaluates."""
    if device_type == "cuda":
        return "reference"
    if device_type == "cpu" and dtype == torch.float32 and not dropout:
        return "flex" if not grad else "sdpa"  # flex is forward-only on CPU
    return "reference"


def describe_auto(device_type: str, dtype: torch.dtype, dropout_p: float) -> str:
    """One line saying what ``auto`` runs for training and for evaluation."""
    dt = str(dtype).replace("torch.", "")
    train = pick_attention_impl(device_type, dtype, dropout_p > 0.0, True)
    evaluate = pick_attention_impl(device_type, dtype, False, False)
    return (
        f"attention impl auto on {device_type} {dt} (attention dropout {dropout_p}): "
        f"{train} for training, {evaluate} for evaluation"
    )


def attend_auto(
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
    """Dispatch each call to ``pick_attention_impl``'s choice."""
    name = pick_attention_impl(
        q.device.type, q.dtype, dropout_p > 0.0 and training, torch.is_grad_enabled()
    )
    return ATTENTION_IMPLS[name](
        q,
        k,
        v,
        pos,
        persistent_k=persistent_k,
        persistent_v=persistent_v,
        span_mask=span_mask,
        dropout_p=dropout_p,
        training=training,
        dropout_seed=dropout_seed,
    )


ATTENTION_IMPLS.update(sdpa=attend_sdpa, flex=attend_flex, triton=attend_triton, auto=attend_auto)
