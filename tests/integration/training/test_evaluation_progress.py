"""Scoring and what it shows: evaluate_nll keeps its sums on the device and reads them once;
the evaluate stage's progress (tokens done / total, tokens/s, ETA); the training log's ETA,
smoothed over reports; the GPU log line's peak memory beside MFU (CUDA's calls patched)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.data import eval_batches, eval_num_batches
from pipeline.diagnostics.host_syncs import HostSyncCounter
from pipeline.models.allattn import AllAttnLM
from pipeline.training.evaluation import evaluate_nll, targets_scored
from pipeline.training.progress import EtaEstimate, LossWindow, ScoringProgress, gpu_memory_text
from tests.fixtures.tiny_models import tiny_allattn

VOCAB = 50
CPU = torch.device("cpu")


def fixed_span_model() -> AllAttnLM:
    """A model whose forward reads nothing on the host (no adaptive span to plan from)."""
    return tiny_allattn(  # the ramp and dropout: AllAttnConfig's defaults
        VOCAB, n_persistent=4, max_span=32, adaptive_span=False, span_ramp=32, attn_dropout=0.3
    )


def split(n: int) -> np.ndarray:
    return np.random.default_rng(0).integers(0, VOCAB, n).astype(np.int64)


def test_scoring_reads_the_device_once_not_per_batch():
    model, tokens = fixed_span_model(), split(1500)
    with HostSyncCounter() as counter:
        evaluate_nll(model, tokens, batch_size=4, seq_len=16, device=CPU)
    # 24 batches: one read at the end, none per batch
    assert len(counter.syncs) == 1, counter.syncs


@torch.no_grad()
def test_the_sum_and_count_are_every_target_once_in_float64():
    model, tokens = fixed_span_model(), split(1001)
    model.eval()
    state, expected = model.init_state(3, device=CPU), 0.0
    for x, y, mask in eval_batches(tokens, 3, 16):
        out = model(x, y, state)
        state = out.state
        expected += float((out.nll.double() * mask).sum())
    total, count = evaluate_nll(model, tokens, batch_size=3, seq_len=16, device=CPU)
    assert count == len(tokens) - 1
    assert total == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("n, batch, seq", [(1001, 3, 16), (50, 8, 4), (5, 8, 4), (129, 4, 32)])
def test_targets_scored_is_the_masks_count_batch_by_batch(n, batch, seq):
    seen = 0
    for i, (_, _, mask) in enumerate(eval_batches(split(n), batch, seq)):
        seen += int(mask.sum())
        assert targets_scored(n, batch, seq, i + 1) == seen
    assert seen == n - 1


def test_progress_is_called_with_the_tokens_scored_up_to_the_total():
    model, tokens, calls = fixed_span_model(), split(700), []
    evaluate_nll(model, tokens, 4, 16, CPU, progress=calls.append)
    assert calls == sorted(calls) and calls[-1] == len(tokens) - 1
    assert len(calls) == eval_num_batches(len(tokens), 4, 16)  # one per batch


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_log_gets_a_line_per_tenth_or_per_interval_with_rate_and_eta():
    clock, lines = FakeClock(), []
    shown = ScoringProgress("evaluate valid", 1000, lines.append, 30.0, clock, terminal=False)
    for done in range(10, 1001, 10):  # 100 batches of 10 tokens, 0.1 s each
        clock.now += 0.1
        shown(done)
    assert len(lines) == 10
    assert lines[0] == "evaluate valid: 100/1,000 tokens (10%)  100 tok/s  eta 9s"
    assert lines[-1].startswith("evaluate valid: 1,000/1,000 tokens (100%)")
    # slow: a line every 30 s between tenths
    clock, lines = FakeClock(), []
    shown = ScoringProgress("evaluate test", 10**6, lines.append, 30.0, clock, terminal=False)
    for done in range(1, 6):
        clock.now += 20.0
        shown(done * 10)
    assert len(lines) == 2 and "eta " in lines[0], lines


def test_a_terminal_gets_a_bar_and_no_log_lines(capsys):
    lines = []
    with ScoringProgress("evaluate valid", 500, lines.append, terminal=True) as shown:
        for done in (100, 300, 500):
            shown(done)
        assert shown.bar is not None and shown.bar.n == 500
    assert lines == []
    assert "evaluate valid" in capsys.readouterr().err


def test_the_eta_stays_in_a_band_when_step_times_swing():
    """Steps of 0.1 s on average, a slow first window (start-up) and windows now and then 5x
    slower (a compile, a busy machine): the raw per-window ETA leaves [0.5, 2] x the true
    remaining time, the smoothed one does not."""
    clock, steps, until, every = FakeClock(), 0, 2000, 50
    window, estimate = LossWindow(tokens_per_step=1, clock=clock), EtaEstimate()
    raw, smoothed, truth = [], [], []
    for report in range(until // every):
        for _ in range(every):
            slow = report == 0 or report % 7 == 3
            clock.now += 0.5 if slow else 0.08
            window.add(1.0)
            steps += 1
        _, seconds_per_step, _ = window.take()
        estimate.update(seconds_per_step)
        left = until - steps
        raw.append(left * seconds_per_step)
        smoothed.append(estimate.remaining(left))
        truth.append(left * 0.1)
    band = [(e / t) for e, t in zip(smoothed[1:-1], truth[1:-1], strict=True)]
    assert all(0.5 <= r <= 2.0 for r in band), band
    assert any(not 0.5 <= e / t <= 2.0 for e, t in zip(raw[1:-1], truth[1:-1], strict=True))


def test_the_gpu_line_has_peak_memory(monkeypatch):
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 1234 * 2**20)
    assert gpu_memory_text(torch.device("cuda", 0)) == "  peak mem 1,234 MiB"
    assert gpu_memory_text(CPU) == ""


def test_the_trainer_line_on_a_gpu_has_mfu_and_peak_memory(tmp_path, monkeypatch):
    import pipeline.training.trainer as trainer_module
    from tests.fixtures.runs import short_run

    # a GPU's figures for the CPU trainer: its dense peak and its allocator's peak
    monkeypatch.setattr(trainer_module, "dense_peak_tflops", lambda device, dtype: 50.0)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 2048 * 2**20)
    monkeypatch.setattr(
        trainer_module, "gpu_memory_text", lambda device: gpu_memory_text(torch.device("cuda"))
    )
    _, _, reports = short_run(tmp_path, monkeypatch)
    assert all(" mfu " in line and "peak mem 2,048 MiB  eta " in line for line in reports)
