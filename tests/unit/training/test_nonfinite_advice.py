"""What a non-finite stop advises fits train.nonfinite: a run already in skip mode is not
told to set it; a run in stop mode is."""

from __future__ import annotations

import math

import pytest
import torch

from pipeline.errors import PipelineError
from pipeline.training.nonfinite import NonfiniteGuard

ADVICE = "set train.nonfinite: skip"


def weights_stop(mode: str) -> str:
    guard = NonfiniteGuard(mode, 0, "train", "cpu")
    with pytest.raises(PipelineError) as stopped:
        guard.read_and_check([torch.tensor([1.0, math.nan])], step=3)
    return str(stopped.value)


def zero3_stop() -> str:
    """Skip mode, a non-finite gradient in the second sub-group of an update (ZeRO 3)."""
    guard = NonfiniteGuard("skip", 5, "train", "cpu")
    guard.loss(torch.tensor(1.0))
    assert guard.before_step([torch.ones(2)])
    with pytest.raises(PipelineError) as stopped:
        guard.before_step([torch.tensor([math.inf])])
    return str(stopped.value)


def limit_stop() -> str:
    guard = NonfiniteGuard("skip", 0, "train", "cpu")
    guard.loss(torch.tensor(math.nan))
    with pytest.raises(PipelineError) as stopped:
        guard.before_step([torch.ones(2)])
    return str(stopped.value)


@pytest.mark.parametrize("stop", [lambda: weights_stop("skip"), zero3_stop, limit_stop])
def test_skip_mode_is_not_told_to_set_skip(stop):
    message = stop()
    assert ADVICE not in message
    assert message.endswith("lower train.optimizer.lr (or clip the gradients)")


def test_stop_mode_is_told_it_can_skip():
    assert weights_stop("stop").endswith(ADVICE)
