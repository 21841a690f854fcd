"""What each attention backend keeps for backward, counted from the shapes: the part of a
training step's memory that the op, not the model, decides (the memory plan of `show
--estimate`, pipeline/training/memory_plan.py, adds it up per layer through the model's
``activation_memory`` hook).

The counts follow the ops as written here and are checked against autograd's own record of
what it saved (tests/unit/ops/test_op_memory.py, ``saved_tensors_hooks``), the reference op to
within a few percent:

- ``reference`` keeps the whole weight matrix of each head: the joint softmax's output
  [B, H, M, L' + N], the skewed context weights the value product reads [B, H, M, L' + M + 1]
  (``skew`` pads each row), with dropout the dropped persistent weights [B, H, M, N] and a
  bool mask per part; its matmuls copy the head views of the queries (once per product:
  with keys, positions and persistent keys), keys and values, and the persistent vectors
  broadcast over the batch [B, H, N, d_h] twice. The backward's largest moment adds about
  one softmax-sized and one skew-sized gradient.
- ``triton`` (and ``flex``) keep no matrix of weights: the queries, keys and values it was
  given (views of the projections, no copies), its output and a float32 log-sum-exp per row;
  the backward recomputes the weights tile by tile, holding gradients of q, k and v.
- ``sdpa`` (CPU, no dropout) materialises the skewed float bias [B, H, M, L' + M + N] and
  torch's math kernel keeps the weights it computes from it.

A count is an ``OpMemory`` in bytes, for one call on one micro-batch."""

from __future__ import annotations

from typing import NamedTuple

import torch

MASK_BYTES = 1
"""A dropout mask is bool on every device (``pipeline.ops.dropout.attention_dropout``)."""


class OpMemory(NamedTuple):
    saved: int
    """Bytes kept for backward until the backward reaches the op."""
    working: int
    """The most bytes the op's backward holds at once beyond ``saved`` (its gradients)."""


def dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def attention_memory(
    impl: str,
    device_type: str,
    dtype: torch.dtype,
    *,
    batch: int,
    heads: int,
    queries: int,
    span: int,
    persistent: int,
    head_dim: int,
    dropout: bool,
    span_mask: bool,
) -> OpMemory:
    """One training call of the joint op (``AttendFn``) with ``heads`` heads of ``head_dim``,
    ``queries`` queries (M), ``span`` context columns (L') and ``persistent`` vectors per head
    (N, 0 for none), its inputs the head views of [B, T, d] projections as the model hands
    them. ``auto`` counts what it picks on ``device_type``."""
    if impl == "auto":
        from pipeline.ops.fused import pick_attention_impl

        impl = pick_attention_impl(device_type, dtype, dropout, True)
    e = dtype_bytes(dtype)
    rows = batch * heads * queries  # one row of weights per head and query
    keys = span + queries
    if impl in ("triton", "flex"):
        # q, k, v as given (views: no copy), the output, the float32 log-sum-exp per row
        saved = e * (rows * head_dim * 2 + 2 * batch * heads * keys * head_dim) + 4 * rows
        if persistent:
            saved += 2 * e * heads * persistent * head_dim
        if span_mask:
            saved += 4 * heads * span
        return OpMemory(saved, e * (rows * head_dim + 2 * batch * heads * keys * head_dim))
    if impl == "sdpa":
        # the skewed bias (position terms, -inf outside the window, zeros for the
        # persistent vectors), the keys and values with the persistent vectors appended, and
        # the math kernel's weights
        width = keys + persistent
        saved = e * (2 * rows * width + 2 * batch * heads * width * head_dim + 2 * rows * head_dim)
        return OpMemory(saved, 2 * e * rows * width)
    # the reference op (pipeline.ops.attention.attend_reference)
    q_copies = 3 if persistent else 2  # one per product: with the keys, positions, M_k
    saved = e * (
        q_copies * rows * head_dim
        + 2 * batch * heads * keys * head_dim  # k and v, copied for the batched products
        + rows * (span + persistent)  # the joint softmax's output
        + rows * (keys + 1)  # the skewed context weights the value product reads
    )
    if persistent:
        saved += 2 * e * batch * heads * persistent * head_dim  # M_k, M_v over the batch
    if dropout:
        saved += MASK_BYTES * rows * (span + persistent)
        saved += e * rows * persistent  # the dropped persistent weights
    if span_mask:  # the renormalisation: the output, 1 / (sum + 1e-8) and the sum
        saved += e * (rows * head_dim + 2 * rows) + 2 * e * heads * span
    return OpMemory(saved, e * rows * (span + persistent + keys + 1))


def persistent_memory(
    device_type: str,
    dtype: torch.dtype,
    *,
    batch: int,
    groups: int,
    queries: int,
    persistent: int,
    dim: int,
    dropout: bool,
    copies_query: bool = True,
) -> OpMemory:
    """One training call of ``attend_persistent``: ``groups`` groups of ``persistent`` vectors
    of ``dim``; ``copies_query``: the queries arrive as a head view (copied by the product)
    rather than contiguous."""
    e = dtype_bytes(dtype)
    rows = batch * groups * queries
    # M_k, M_v broadcast over the batch: copied per row and group, unless one group's
    # broadcast stays a view (stride 0) of the vectors
    copies = 1 if groups == 1 else batch * groups
    saved = e * (rows * persistent + 2 * copies * persistent * dim)
    if copies_query:
        saved += e * rows * dim
    if dropout:
        saved += e * rows * persistent + MASK_BYTES * rows * persistent
    return OpMemory(saved, 2 * e * rows * persistent)
