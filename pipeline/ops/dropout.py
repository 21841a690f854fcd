"""Attention dropout, with its random numbers drawn on the attention's device.

- ``attention_dropout`` (the reference op): on a GPU ``torch.native_dropout``, what
  ``F.dropout`` runs there and what the authors' code runs: one fused kernel per call, torch's
  device generator, and a bool mask kept for backward. On the CPU a cheaper draw of the same
  law (a uniform draw against p, then a masked fill), also keeping a bool mask, its
  1 / (1 - p) left to the caller. Reproducible from
  ``torch.manual_seed``; activation checkpointing replays torch's RNG state, so a
  recomputation draws the same mask.
- ``flex_keep`` (the flex backend): FlexAttention never holds the attention matrix, so it
  cannot be handed a mask; its score_mod recomputes keep / drop for each weight from a
  counter hash of (seed, batch b, head h, query q, key coordinate c): a handful of int32
  operations in the kernel, nothing materialised. The seed is one int32 drawn on the device
  by ``draw_dropout_seed`` (torch's device generator, so no host-to-device copy and no sync;
  reproducible from ``torch.manual_seed`` and replayed by activation checkpointing).

The two backends draw different masks for the same seed; each is tested for exactness (same
seed, same mask, run to run) and statistics (keep rate, E[dropout(a)] = a).

The hash uses int32 arithmetic with wrap-around multiplication; right shifts are masked, so
they are logical shifts on negative values too. Only the low 32 bits of any intermediate
matter, so it gives the same bits when the kernel's indices are int64 (eager FlexAttention)
or int32 (the compiled kernel). The key coordinate does not depend on how a backend pads or
lays out its keys: the context key at distance x (1..L') of query q has c = q + L' - x (its
index in the key sequence of L' + M keys), persistent vector n has c = -1 - n.

Two weights per hash: the weights of keys c = 2s and 2s + 1 of one (b, h, q) share the hash
of the pair index c >> 1 (arithmetic shift: persistent vectors 2s and 2s + 1 pair up too),
the even key drawing the hash's low 16 bits, the odd key its high 16 bits (murmur3's
finaliser mixes every output bit with every input bit, so the halves are independent
draws). A kernel's key tile starts at an even c, so it hashes [T, T / 2] pairs: half a hash
per score. The price is the threshold's resolution: 16 bits quantise p to a multiple of
2**-16 (``keep_threshold``), at most 2**-17 = 7.6e-6 off; p = 0.4 is kept as 26214 / 65536
= 0.3999939, 6.1e-6 (1.5e-5 relative) below 0.4. Eight bits (4 weights per hash) would
quantise p = 0.4 to 102 / 256 = 0.3984, 0.39% off: too coarse.
"""

from __future__ import annotations

import torch
from torch import Tensor

# odd multipliers, one per counter (murmur3 / xxhash constants, as signed int32)
_B, _H, _Q, _C = -0x61C8864F, -0x7A143589, -0x3D4D51C3, 0x27D4EB2F
# murmur3's 32-bit finaliser
_F1, _F2 = -0x7A143595, -0x3D4D51CB


def _shr(x: Tensor, n: int) -> Tensor:
    """Logical right shift of int32 values (masked, so also right on int64 holding them)."""
    return (x >> n) & ((1 << (32 - n)) - 1)


KEEP_BITS = 16
"""Bits of the uniform draw a weight's keep decision reads: two weights per 32-bit hash.
p is quantised to a multiple of 2**-16 (at most 2**-17 = 7.6e-6 off; p = 0.4: 1.5e-5
relative); 8 bits (four weights per hash) would be 0.39% off at p = 0.4."""


def keep_threshold(p: float) -> int:
    """A weight is kept when its 16-bit uniform draw is >= this (keep probability 1 - p to
    within 2**-17)."""
    return round(p * (1 << KEEP_BITS))


def flex_keep(seed: Tensor, b: Tensor, h: Tensor, q: Tensor, c: Tensor, threshold: int) -> Tensor:
    """Keep (True) or drop the attention weight (b, h, q, c): int tensors, broadcast together;
    ``seed`` an int32 scalar tensor. Keys c = 2s and 2s + 1 share the hash of s = c >> 1, the
    even one reading its low 16 bits, the odd one its high 16 bits."""
    x = seed ^ (b * _B) ^ (h * _H) ^ (q * _Q) ^ ((c >> 1) * _C)
    x = (x ^ _shr(x, 16)) * _F1
    x = (x ^ _shr(x, 13)) * _F2
    x = x ^ _shr(x, 16)
    return torch.where((c & 1) == 1, _shr(x, 16), x & 0xFFFF) >= threshold


def draw_dropout_seed(device) -> Tensor:
    """A fresh int32 seed from torch's generator of ``device``, drawn there (no host copy)."""
    return torch.randint(0, 2**31 - 1, (), dtype=torch.int32, device=device)


def attention_dropout(a: Tensor, p: float) -> tuple[Tensor, float]:
    """Dropout of attention weights ``a`` (training), keeping a bool mask for backward.

    Returns the dropped weights and the factor the kept ones are still owed: 1 from the
    fused op, which scales by 1 / (1 - p) itself; 1 / (1 - p) on the CPU, for the caller to
    apply to a smaller tensor (the attention output), since there every pass over the
    weights counts. On the CPU torch's Bernoulli draw costs about 10 ns a weight, a quarter
    of a training step at enwik8's shapes, so a weight is dropped when a float32 uniform draw
    from torch's CPU generator is < p, and the weights are masked in place of scaled: 0.55x
    the time of ``torch.native_dropout`` forward, 0.4x backward, as reproducible from
    ``torch.manual_seed``, and traced by torch.compile as it is (``Tensor.random_`` is not)."""
    if a.device.type == "cpu":
        drop = torch.rand(a.shape) < p
        return a.masked_fill(drop, 0.0), 1.0 / (1.0 - p)
    return torch.native_dropout(a, p, True)[0], 1.0
