"""Scoring a token stream with any registered model (pipeline.models.protocol)."""

from __future__ import annotations

import math

import numpy as np
import torch

LN2 = math.log(2)
"""nats per bit: a mean nll in nats divided by LN2 is bits per token (bpc for characters)."""


@torch.no_grad()
def evaluate_nll(
    model, tokens: np.ndarray, batch_size: int, seq_len: int, device, max_batches: int | None = None
) -> tuple[float, int]:
    """Sum of per-token nll (nats) and token count over a split, streamed in blocks with the
    model's state carried from each block to the next. In eval mode (no dropout, no random
    numbers drawn); the model's train / eval mode is restored afterwards.

    Every target is scored once (pipeline.data.eval_batches masks the ragged tail)."""
    from pipeline.data import eval_batches

    was_training = model.training
    model.eval()
    state = model.init_state(batch_size, device=device)
    total, count = 0.0, 0
    for i, (x, y, mask) in enumerate(eval_batches(tokens, batch_size, seq_len)):
        if max_batches is not None and i >= max_batches:
            break
        out = model(x.to(device), y.to(device), state)
        state = out.state
        mask = mask.to(device=device, dtype=out.nll.dtype)
        total += float((out.nll.float() * mask).sum())
        count += int(mask.sum())
    model.train(was_training)
    return total, count
