"""pipeline.training.paper_loss: the active-memory paper's padded "loss per token" and the
proper NLL."""

from __future__ import annotations

import math

import numpy as np
import torch

from pipeline.models.protocol import ModelOutput, SequenceModel
from pipeline.training.paper_loss import line_batches, line_losses, split_lines

EOS = 9


class Uniform(SequenceModel):
    """log(V) nats on every token: the padded mean is then log(V) x the real share."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab = vocab
        self.unused = torch.nn.Parameter(torch.zeros(1))

    def forward(self, tokens, targets=None, state=None):
        logits = torch.zeros(*tokens.shape, self.vocab)
        nll = torch.full(tokens.shape, math.log(self.vocab), dtype=torch.float64)
        return ModelOutput(logits, nll, [])


def test_lines_split_at_the_end_of_line_id():
    tokens = np.array([1, 2, EOS, EOS, 3, EOS, 4, 5])
    assert [line.tolist() for line in split_lines(tokens, EOS)] == [[1, 2], [], [3], [4, 5]]


def test_rows_are_padded_lines_cut_as_the_authors_cut_them():
    lines = [np.array([1, 2, 3]), np.array([4]), np.array([5, 6])]
    ((x, y, mask),) = line_batches(lines, EOS, batch_size=4)
    # authors: rows [1 2 3], [4 _ _], [5 6 _]; inputs = rows[:, :-1], targets = rows[:, 1:]
    assert x.tolist() == [[1, 2], [4, EOS], [5, 6]]
    assert y.tolist() == [[2, 3], [EOS, EOS], [6, EOS]]
    assert mask.tolist() == [[True, True], [True, False], [True, True]]


def test_paper_loss_is_the_nll_diluted_by_padding():
    tokens = np.array([1, 2, 3, EOS, 4, EOS, 5, 6, EOS, 7, 8, 1, 2, 3, EOS])
    out = line_losses(Uniform(10), tokens, EOS, batch_size=2, device="cpu")
    log_v = math.log(10)
    # batches: [[1 2 3], [4]] -> width 2, real 3 of 4; [[5 6], [7 8 1 2 3]] -> width 4,
    # real 2 + 4 of 8
    assert math.isclose(out["line_nll"], log_v)
    assert math.isclose(out["paper_loss"], log_v * (3 / 4 + 6 / 8) / 2)
    assert out["tokens"] == 9 and out["lines"] == 4 and out["skipped_lines"] == 0


def test_long_lines_are_skipped_and_counted():
    tokens = np.array([1] * 5 + [EOS] + [2, 3, EOS])
    out = line_losses(Uniform(10), tokens, EOS, batch_size=4, device="cpu", max_pieces=4)
    assert out["lines"] == 1 and out["skipped_lines"] == 1 and out["tokens"] == 1
