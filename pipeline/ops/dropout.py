"""Seeded attention dropout: keep or drop attention weight (batch b, head h, query q, key c)
as a pure function of a seed, so that every attention backend draws the same mask.

A fused kernel never holds the attention matrix, so it cannot be handed a mask drawn by
torch's RNG; it recomputes keep / drop from the counters inside the kernel. The reference
op computes the same function on whole tensors. Only int32 arithmetic with wrap-around
multiplication is used (identical in eager PyTorch, C++ and Triton); right shifts are masked
so they are logical shifts on negative int32 values too.

The key coordinate ``c`` does not depend on how a backend lays out its keys: context key at
distance x (1..L') has c = x, persistent vector n has c = -1 - n.
"""

from __future__ import annotations

import torch
from torch import Tensor

_MULT = 0x45D9F3B
"""Multiplier of the integer mixing function (a well-known 32-bit avalanche constant)."""
_KEY_MULT = 0x2C1B3C6D


def _shr(x: Tensor, n: int) -> Tensor:
    """Logical right shift of int32 values."""
    return (x >> n) & ((1 << (32 - n)) - 1)


def _mix(x: Tensor) -> Tensor:
    """A 32-bit integer hash (xorshift-multiply, two rounds); int32 in, int32 out."""
    x = x ^ _shr(x, 16)
    x = x * _MULT
    x = x ^ _shr(x, 16)
    x = x * _MULT
    return x ^ _shr(x, 16)


def dropout_row_hash(seed: Tensor, b: Tensor, h: Tensor, q: Tensor) -> Tensor:
    """Hash of (seed, batch, head, query): int32 tensors, broadcast together."""
    return _mix(_mix(_mix(seed ^ b) ^ h) ^ q)


def dropout_key_hash(c: Tensor) -> Tensor:
    """Hash of the key coordinate c (distance, or -1 - n for persistent vector n)."""
    return _mix(c * _KEY_MULT)


def keep_threshold(p: float) -> int:
    """An entry is kept when its 24-bit uniform draw is >= this (keep probability 1 - p
    to within 2**-24)."""
    return round(p * (1 << 24))


def dropout_keep(row: Tensor, key: Tensor, threshold: int) -> Tensor:
    """Keep (True) or drop attention weight (row, key) from the two hashes above.

    Split so that the reference can hash the [B, H, M] rows and the [L' + N] keys once and
    pay only these three elementwise operations per attention weight."""
    return _shr((row ^ key) * _MULT, 8) >= threshold


def seeded_keep_mask(seed: Tensor, shape: tuple[int, int, int], keys: Tensor, p: float) -> Tensor:
    """[B, H, M, len(keys)] keep mask for key coordinates ``keys`` (int32, any device).

    seed: int32 scalar tensor; shape: (B, H, M)."""
    dev = keys.device
    b, h, m = (torch.arange(n, device=dev, dtype=torch.int32) for n in shape)
    row = dropout_row_hash(seed.to(dev), b[:, None, None], h[None, :, None], m[None, None, :])
    return dropout_keep(row[..., None], dropout_key_hash(keys), keep_threshold(p))


def draw_dropout_seed() -> Tensor:
    """A fresh int32 seed from torch's (CPU) generator: a training run that restores torch's
    RNG state draws the same seeds again (checkpoint resume, activation recomputation)."""
    return torch.randint(0, 2**31 - 1, (), dtype=torch.int32)


def key_coords(span_len: int, n_persistent: int, device=None) -> Tensor:
    """Key coordinates in the reference layout: context columns (distances L'..1), then the
    persistent vectors (-1..-N)."""
    ctx = torch.arange(span_len, 0, -1, device=device, dtype=torch.int32)
    pers = -1 - torch.arange(n_persistent, device=device, dtype=torch.int32)
    return torch.cat([ctx, pers])
