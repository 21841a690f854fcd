"""The persistent part of the all-attention op as a dense attention of its own, for the
``triton`` backend's split (``pipeline.ops.triton_attention``, ``persistent_split``).

The N persistent keys and values of a head are shared by the whole batch and carry neither
a position term nor the span mask, so the part of the joint softmax that falls on them is a
plain dense attention once the batch is folded into the query length: the queries
[B, H, M, d_h] as [H, B·M, d_h] (``fold``) against [H, N, d_h]. A part returns its output
normalised over its own keys and its log-sum-exp (natural log, float32, [H, B·M]); the
caller merges it with the window's part by log-sum-exp. Its backward is given the *joint*
output O and log-sum-exp L of the whole op (as ring attention does), so that with the weights
P = exp(s - L) and delta = rowsum(dO * O) it gives the joint op's gradients exactly:

    dS = P * (dP - delta)      dq = dS pk / sqrt(d_h)      dpk = dS^T q / sqrt(d_h)
    dpv = dropout(P)^T dO      (dP = dO pv^T, dropped where the weight was)

(The joint op's +1e-8 renormalisation guard also gives each persistent score a share
-1e-8 * delta * P of dS: below float32's resolution of the delta term it sits next to, so
every backend leaves it out; the window kernel keeps its own share.)

Backends (``BACKENDS``), chosen per call by ``choose_backend``:

- ``flash``, ``efficient``: torch's own CUDA SDPA ops (FlashAttention-2, memory-efficient),
  the private aten ops that return the log-sum-exp and whose backward takes the output and
  log-sum-exp (``torch.ops.aten._scaled_dot_product_{flash,efficient}_attention`` and their
  ``_backward``); dropout from torch's CUDA generator (philox), so the persistent weights
  drop other bits than the window kernel's hash (the same law, keep 1 - p, 1 / (1 - p)).
- ``cpu_flash``: torch's CPU flash op (``_scaled_dot_product_flash_attention_for_cpu`` and its
  backward, which also takes the output and log-sum-exp); no dropout.
- ``math``: the same maths in plain torch, float32 or wider, the [H, B·M, N] scores in memory
  (any device, dtype and head size); dropout from flex's hash (``flex_keep``, key coordinate
  -1 - n), so its masks are the window kernel's own bits for the same seed.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from pipeline.ops.dropout import flex_keep, keep_threshold

__all__ = ["BACKENDS", "choose_backend", "fold", "persistent_backward", "persistent_forward"]

BACKENDS = ("flash", "efficient", "cpu_flash", "math")

aten = torch.ops.aten


def choose_backend(device_type: str, dtype: torch.dtype, head_dim: int, dropout: bool) -> str:
    """The backend of the persistent part for queries of ``dtype`` and ``head_dim`` on
    ``device_type``: on CUDA FlashAttention for fp16 / bf16, else the memory-efficient op
    (float32), each for head sizes it takes (multiples of 8, flash up to 256), else ``math``;
    on the CPU torch's flash op without dropout (it has none), else ``math``."""
    if device_type == "cuda":
        if head_dim % 8 == 0 and head_dim <= 256 and dtype in (torch.float16, torch.bfloat16):
            return "flash"
        if head_dim % 8 == 0 and dtype in (torch.float16, torch.bfloat16, torch.float32):
            return "efficient"
        return "math"
    return "math" if dropout else "cpu_flash"


def fold(x: Tensor) -> Tensor:
    """[B, H, M, d] -> [H, B·M, d] (a view where the batch and row strides allow it, as for
    queries projected as [B, M, H, d] and transposed; else a copy)."""
    b, h, m, d = x.shape
    return x.transpose(0, 1).reshape(h, b * m, d)


def _accumulation(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _keep(seed: Tensor, h: int, rows: int, m: int, n: int, dropout_p: float) -> Tensor:
    """[H, B·M, N] keep mask of flex's hash: row r is query r % M of batch element r // M,
    persistent vector n has key coordinate -1 - n (the window kernel's bits)."""
    device = seed.device
    r = torch.arange(rows, device=device)[None, :, None]
    heads = torch.arange(h, device=device)[:, None, None]
    key = -1 - torch.arange(n, device=device)[None, None, :]
    return flex_keep(seed, r // m, heads, r % m, key, keep_threshold(dropout_p))


def _none_to_empty(x: Tensor | None, like: Tensor) -> Tensor:
    return like.new_empty(0) if x is None else x


def persistent_forward(
    qf: Tensor,
    pk: Tensor,
    pv: Tensor,
    seed: Tensor | None,
    dropout_p: float,
    backend: str,
    m: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The persistent part of folded queries ``qf`` [H, B·M, d] (M = ``m`` rows a batch
    element) over ``pk``, ``pv`` [H, N, d]: (out [H, B·M, d], normalised over the N keys and
    dropped; lse [H, B·M] float32, natural log; and two tensors the backward needs to redraw
    the dropout of the CUDA ops, empty for the others). ``seed``: the int32 device seed of
    the ``math`` backend's hash (None without dropout)."""
    h, rows, d = qf.shape
    scale = 1.0 / math.sqrt(d)
    if backend in ("flash", "efficient"):
        q4, k4, v4 = qf[None], pk[None], pv[None]
        if backend == "flash":
            res = aten._scaled_dot_product_flash_attention(
                q4, k4, v4, dropout_p, False, False, scale=scale
            )
            out, lse, rng_a, rng_b = res[0], res[1], res[6], res[7]
        else:
            out, lse, rng_a, rng_b = aten._scaled_dot_product_efficient_attention(
                q4, k4, v4, None, True, dropout_p, False, scale=scale
            )
        # the memory-efficient op pads the log-sum-exp's rows to a multiple of 32
        return (
            out[0],
            lse[0, :, :rows].float(),
            _none_to_empty(rng_a, lse),
            _none_to_empty(rng_b, lse),
        )
    if backend == "cpu_flash":
        if dropout_p > 0.0:
            raise ValueError("the persistent part's cpu_flash backend has no dropout")
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(
            qf[None], pk[None], pv[None], 0.0, False, scale=scale
        )
        return out[0], lse[0].float(), lse.new_empty(0), lse.new_empty(0)
    if backend != "math":
        raise ValueError(f"persistent part backend {backend!r}; known: {BACKENDS}")
    acc = _accumulation(qf.dtype)
    s = torch.matmul(qf.to(acc), pk.to(acc).transpose(-1, -2)) * scale  # [H, B·M, N]
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None])
    if dropout_p > 0.0:
        assert seed is not None
        p = torch.where(_keep(seed, h, rows, m, pk.shape[1], dropout_p), p, 0.0)
        p = p * (1.0 / (1.0 - dropout_p))
    out = torch.matmul(p, pv.to(acc))
    return out, lse.float(), lse.new_empty(0), lse.new_empty(0)


def persistent_backward(
    grad_f: Tensor,
    qf: Tensor,
    pk: Tensor,
    pv: Tensor,
    seed: Tensor | None,
    out_f: Tensor,
    lse_f: Tensor,
    rng_a: Tensor,
    rng_b: Tensor,
    dropout_p: float,
    backend: str,
    m: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """(dq [H, B·M, d], dpk, dpv [H, N, d]) of the joint op's persistent part, from the
    gradient ``grad_f``, the *joint* output ``out_f`` (folded) and the *joint* log-sum-exp
    ``lse_f`` ([H, B·M], natural log, float32) of the whole op; ``rng_a``, ``rng_b``: what
    ``persistent_forward`` returned for the CUDA ops' dropout."""
    h, rows, d = qf.shape
    n = pk.shape[1]
    scale = 1.0 / math.sqrt(d)
    if backend in ("flash", "efficient"):
        q4, k4, v4, g4, o4 = qf[None], pk[None], pv[None], grad_f[None], out_f[None]
        if backend == "flash":
            rng = [None if x.numel() == 0 else x for x in (rng_a, rng_b)]
            dq, dpk, dpv = aten._scaled_dot_product_flash_attention_backward(
                g4, q4, k4, v4, o4, lse_f[None], None, None, rows, n, dropout_p, False, *rng,
                scale=scale,
            )  # fmt: skip
        else:
            # the rows as the forward laid them out: padded to a multiple of 32 (ROCm: not),
            # the padding +inf (no weight), as the op's own forward writes it
            width = rows if torch.version.hip else -(-rows // 32) * 32
            lse4 = lse_f.new_full((1, h, width), math.inf)
            lse4[0, :, :rows] = lse_f
            dq, dpk, dpv, _ = aten._scaled_dot_product_efficient_attention_backward(
                g4, q4, k4, v4, None, o4, lse4, rng_a, rng_b, dropout_p,
                [True, True, True, False], False, scale=scale,
            )  # fmt: skip
        return dq[0], dpk[0], dpv[0]
    if backend == "cpu_flash":
        dq, dpk, dpv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_f[None], qf[None], pk[None], pv[None], out_f[None],
            lse_f[None].to(qf.dtype), 0.0, False, scale=scale,
        )  # fmt: skip
        return dq[0], dpk[0], dpv[0]
    acc = _accumulation(qf.dtype)
    q, g = qf.to(acc), grad_f.to(acc)
    s = torch.matmul(q, pk.to(acc).transpose(-1, -2)) * scale
    p = torch.exp(s - lse_f.to(acc)[..., None])  # the joint op's weights
    dp = torch.matmul(g, pv.to(acc).transpose(-1, -2))
    dropped = p
    if dropout_p > 0.0:
        assert seed is not None
        keep = _keep(seed, h, rows, m, n, dropout_p)
        keep_scale = 1.0 / (1.0 - dropout_p)
        dp = torch.where(keep, dp * keep_scale, 0.0)
        dropped = torch.where(keep, p * keep_scale, 0.0)
    delta = (g * out_f.to(acc)).sum(-1, keepdim=True)  # the joint output's
    ds = p * (dp - delta)
    dq = torch.matmul(ds, pk.to(acc)) * scale
    dpk = torch.matmul(ds.transpose(-1, -2), q) * scale
    dpv = torch.matmul(dropped.transpose(-1, -2), g)
    return dq.to(qf.dtype), dpk.to(pk.dtype), dpv.to(pv.dtype)
