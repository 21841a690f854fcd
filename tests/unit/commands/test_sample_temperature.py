"""`sample`'s draw at temperatures near 0: the limit of softmax(logits / T) is the greedy
pick, and a temperature small enough to overflow the division must still give it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pipeline.commands.sample import generate


class FixedLogits:
    """A model whose next-token scores are always the same."""

    def __init__(self, logits):
        self.logits = torch.tensor(logits)

    def init_state(self, batch, device=None):
        return []

    def __call__(self, x, y, state):
        return SimpleNamespace(logits=self.logits.expand(1, x.shape[1], -1), state=state)


@pytest.mark.parametrize("temperature", [1e-40, 5e-324, 1e-30])
def test_a_tiny_temperature_draws_the_most_likely_token(temperature):
    model = FixedLogits([1.0, 30.0, -20.0, 29.0])
    assert list(generate(model, [0], 20, temperature=temperature, seed=3)) == [1] * 20


def test_a_tiny_temperature_shares_the_draw_between_tied_best_tokens():
    model = FixedLogits([5.0, -1.0, 5.0])
    drawn = set(generate(model, [0], 60, temperature=1e-40, seed=0))
    assert drawn == {0, 2}
