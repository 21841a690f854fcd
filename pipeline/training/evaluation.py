"""Scoring a token stream with any registered model (pipeline.models.protocol)."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch

LN2 = math.log(2)
"""nats per bit: a mean nll in nats divided by LN2 is bits per token (bpc for characters)."""


@torch.no_grad()
def evaluate_nll(
    model,
    tokens: np.ndarray,
    batch_size: int,
    seq_len: int,
    device,
    max_batches: int | None = None,
    progress: Callable[[int], None] | None = None,
) -> tuple[float, int]:
    """Sum of per-token nll (nats) and token count over a split, streamed in blocks with the
    model's state carried from each block to the next. In eval mode (no dropout, no random
    numbers drawn); the model's train / eval mode is restored afterwards.

    Every target is scored once (pipeline.data.eval_batches masks the ragged tail). The sum
    stays on the device (float64 where the device has it) and is read once at the end: no
    batch waits for the one before it to reach the host (the count is the batch layout's).
    The result depends on batch_size: each of the batch_size streams starts without context.

    `progress(tokens)`: called after each batch with the targets scored so far (counted on
    the host from the batch layout, so it reads nothing from the device)."""
    from pipeline.data import eval_batches, eval_num_batches

    device = torch.device(device)
    was_training = model.training
    model.eval()
    state = model.init_state(batch_size, device=device)
    total = torch.zeros((), dtype=accumulation_dtype(device), device=device)
    n_batches = eval_num_batches(len(tokens), batch_size, seq_len)
    if max_batches is not None:
        n_batches = min(n_batches, max_batches)
    pin = device.type == "cuda"
    for i, (x, y, mask) in enumerate(eval_batches(tokens, batch_size, seq_len)):
        if i >= n_batches:
            break
        if pin:  # copied without the host waiting for the device's queue
            x, y, mask = x.pin_memory(), y.pin_memory(), mask.pin_memory()
        out = model(x.to(device, non_blocking=pin), y.to(device, non_blocking=pin), state)
        state = out.state
        mask = mask.to(device, non_blocking=pin)
        total += (out.nll.to(total.dtype) * mask).sum()
        if progress is not None:
            progress(targets_scored(len(tokens), batch_size, seq_len, i + 1))
    model.train(was_training)
    # the mask's count is the layout's: only the sum is read from the device
    return float(total), targets_scored(len(tokens), batch_size, seq_len, n_batches)


def accumulation_dtype(device: torch.device) -> torch.dtype:
    """float64 for the running sums, except where the device has none (Apple's MPS)."""
    return torch.float32 if device.type == "mps" else torch.float64


def targets_scored(n_tokens: int, batch_size: int, seq_len: int, batches: int) -> int:
    """How many targets the first `batches` batches of eval_batches score: the split's
    n_tokens - 1 targets cut into batch_size streams (the first `extra` one longer), each
    scored seq_len at a time."""
    base, extra = divmod(n_tokens - 1, batch_size)
    done = batches * seq_len
    return (batch_size - extra) * min(base, done) + extra * min(base + 1, done)
