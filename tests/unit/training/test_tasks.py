"""The loss every training update minimises (pipeline.training.tasks.objective) and how each
task cuts an update's rows into micro-batches."""

from __future__ import annotations

import torch

from pipeline.training.tasks import Documents, TokenStreams, objective


def test_the_objective_is_the_float32_mean_nll_plus_the_aux_loss():
    gen = torch.Generator().manual_seed(3)
    nll = (torch.rand(3, 7, generator=gen) * 5).to(torch.bfloat16)
    aux = torch.tensor(0.25)
    mean, minimised = objective(nll, aux)
    values = [float(v) for v in nll.flatten().tolist()]
    expected = sum(values) / len(values)  # in float64, from the bf16 values
    assert mean.dtype == torch.float32 and minimised.dtype == torch.float32
    assert abs(float(mean) - expected) < 1e-6
    assert abs(float(minimised) - (expected + 0.25)) < 1e-6


class Rows:
    """Batches of a fixed update: x = 0..11 as 6 rows of 2, y = x + 100."""

    def batch(self, step: int):
        x = torch.arange(12).reshape(6, 2) + 1000 * step
        return x, x + 100


def test_streams_cut_an_update_into_micro_batches_of_consecutive_rows():
    parts = TokenStreams().micro_batches(Rows(), 1, 2, lambda t: t)
    assert [(x.tolist(), y.tolist()) for x, y in parts] == [
        (
            [[1000 + 2 * r + c for c in range(2)] for r in rows],
            [[1100 + 2 * r + c for c in range(2)] for r in rows],
        )
        for rows in ([0, 1], [2, 3], [4, 5])
    ]


def test_documents_cut_an_update_into_micro_batches_of_whole_documents():
    class Docs:
        def batch(self, step: int):
            return torch.arange(20).reshape(4, 5) + step

    task = Documents({"length": 5, "input_length": 2}, seq_len=3)
    parts = task.micro_batches(Docs(), 2, 1, lambda t: t)
    assert [p.tolist() for p in parts] == [[[5 * r + c + 2 for c in range(5)]] for r in range(4)]
    assert task.initial_state(None, 1, torch.device("cpu")) == []
    assert not task.restarts(Docs(), 4)
