"""The active-memory paper's "loss per token", beside the per-token NLL it is not.

The authors' WikiText-103 script (Anon-111/Active-Memory, WT3/main.py with Utils/
Active_Memory_Transformer.py) feeds a batch of 64 lines, each line's pieces on their own
(no context from earlier lines), padded with 0 to the longest line of the batch; inputs are
the row without its last column, targets without its first, and the loss is

    mean over every (row, column) of nll * [input is not padding]

(`tf.reduce_mean(cost * loss_mask)`): the padded positions count in the denominator with a
loss of zero, so the reported number is the true mean NLL scaled down by the batch's share of
real positions, and it depends on how lines of unequal length share batches. The test loss
is the mean of those batch means (over 100 batches there; over every line here). Lines of
more than 300 pieces are drawn again there; here they are skipped (and counted).

Our lines end with the tokenizer's end-of-line id, which plays the role of their padding id
as the target after a line's last piece (both are "the line ends here").

`line_losses` reports that number (`paper_loss`) and, on the same batches, the proper mean
NLL per scored token (`line_nll`); the evaluate stage's stream loss (every token scored once
with its left context) is the third, and the one to compare models with.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from pipeline.training.evaluation import accumulation_dtype

# the authors' script skips longer lines
MAX_LINE_PIECES = 300


def split_lines(tokens: np.ndarray, eos_id: int) -> list[np.ndarray]:
    """The lines of a token stream: the tokens up to each end-of-line id, without it; a last
    line without one is kept."""
    ends = np.flatnonzero(tokens == eos_id)
    starts = np.concatenate([[0], ends + 1])
    lines = [tokens[s:e] for s, e in zip(starts, ends, strict=False)]
    if starts[-1] < len(tokens):
        lines.append(tokens[starts[-1] :])
    return lines


def line_batches(
    lines: list[np.ndarray], eos_id: int, batch_size: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(inputs, targets, mask), each [B, W]: `batch_size` consecutive lines, each row a line
    padded to the batch's longest (W = longest - 1, as the authors cut the padded rows);
    mask = the input is a piece, not padding. Targets past a line's end are `eos_id`."""
    for first in range(0, len(lines), batch_size):
        batch = lines[first : first + batch_size]
        width = max(len(line) for line in batch)
        if width < 2:
            continue  # no (input, target) pair in any row: nothing to score
        rows = np.full((len(batch), width), -1, dtype=np.int64)
        for i, line in enumerate(batch):
            rows[i, : len(line)] = line
        inputs, targets = rows[:, :-1], rows[:, 1:]
        mask = inputs >= 0
        yield (
            torch.from_numpy(np.where(mask, inputs, eos_id)),
            torch.from_numpy(np.where(targets >= 0, targets, eos_id)),
            torch.from_numpy(mask),
        )


@torch.no_grad()
def line_losses(
    model,
    tokens: np.ndarray,
    eos_id: int,
    batch_size: int,
    device,
    max_pieces: int = MAX_LINE_PIECES,
) -> dict:
    """{"paper_loss", "line_nll", "lines", "skipped_lines", "tokens"} over a split, each line
    scored on its own (a fresh state per batch)."""
    lines = split_lines(tokens, eos_id)
    kept = [line for line in lines if len(line) <= max_pieces]
    was_training = model.training
    model.eval()
    # the sums stay on the device and are read once at the end
    dtype = accumulation_dtype(torch.device(device))
    total = torch.zeros(3, dtype=dtype, device=device)  # sum of batch means, of nll; count
    batches = 0
    for inputs, targets, mask in line_batches(kept, eos_id, batch_size):
        out = model(inputs.to(device), targets.to(device), None)
        mask = mask.to(device)
        nll = out.nll.to(dtype) * mask
        total += torch.stack([nll.mean(), nll.sum(), mask.sum().to(dtype)])
        batches += 1
    model.train(was_training)
    sum_of_means, nll_sum, count = total.tolist()
    count = int(count)
    return {
        "paper_loss": sum_of_means / batches if batches else float("nan"),
        "line_nll": nll_sum / count if count else float("nan"),
        "lines": len(kept),
        "skipped_lines": len(lines) - len(kept),
        "tokens": count,
    }
