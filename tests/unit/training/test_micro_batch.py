"""Issue 26, item 2: `train.micro_batch_size: auto` and `train.deepspeed.bf16: auto`
(pipeline/training/micro_batch.py).

The search is Composer's auto micro-batching done once: the largest divisor of the per-rank
batch whose forward and backward does not raise CUDA's out-of-memory error. It is tested here
with a step function that raises torch.cuda.OutOfMemoryError above a size (the error is
constructible without a GPU); the record and resume end to end in
tests/system/workspace/test_micro_batch_resume.py.
"""

from __future__ import annotations

import pytest
import torch

from pipeline.errors import PipelineError
from pipeline.training.micro_batch import (
    divisors_largest_first,
    fixed_micro_batch,
    largest_that_fits,
    resolve,
    resolve_bf16,
)


def fits_up_to(limit: int, tried: list[int]):
    def try_step(size: int) -> None:
        tried.append(size)
        if size > limit:
            # what a real step leaves behind: activations referenced from the frame
            _activations = torch.empty(size)
            raise torch.cuda.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {size}")

    return try_step


def test_divisors_of_the_per_rank_batch_largest_first():
    assert divisors_largest_first(64) == [64, 32, 16, 8, 4, 2, 1]
    assert divisors_largest_first(12) == [12, 6, 4, 3, 2, 1]
    assert divisors_largest_first(1) == [1]


@pytest.mark.parametrize("limit, expected", [(64, 64), (63, 32), (20, 16), (4, 4), (1, 1)])
def test_the_largest_size_that_does_not_run_out_of_memory(limit, expected):
    tried, resets, lines = [], [], []
    got = largest_that_fits(
        divisors_largest_first(64),
        fits_up_to(limit, tried),
        lines.append,
        reset=lambda: resets.append(True),
    )
    assert got == expected
    # from the whole batch down, stopping at the first that fits: one try per size
    assert tried == [d for d in divisors_largest_first(64) if d >= expected]
    assert len(resets) == len(tried)  # gradients dropped after every try
    assert lines == [f"micro-batch {s}: out of memory, trying a smaller one" for s in tried[:-1]]


def test_nothing_fits_is_one_line():
    with pytest.raises(
        PipelineError,
        match=r"no micro-batch fits on this device: out of "
        r"memory at 4, 2, 1 row\(s\)",
    ):
        largest_that_fits([4, 2, 1], fits_up_to(0, []))


def test_other_errors_propagate_and_are_not_taken_for_out_of_memory():
    calls = []

    def broken(size):
        calls.append(size)
        raise RuntimeError("shape mismatch")

    with pytest.raises(RuntimeError, match="shape mismatch"):
        largest_that_fits([8, 4], broken)
    assert calls == [8]


def test_bf16_auto_is_float32_on_the_cpu_and_explicit_values_stay():
    cpu = torch.device("cpu")
    assert resolve_bf16("auto", cpu) is False
    assert resolve_bf16(True, cpu) is True
    assert resolve_bf16(False, cpu) is False


class _Spec:
    def __init__(self, batch_size=8, micro="auto", bf16="auto", gas=1):
        from types import SimpleNamespace as NS

        self.train = NS(
            batch_size=batch_size,
            micro_batch_size=micro,
            seq_len=4,
            deepspeed=NS(bf16=bf16, gradient_accumulation_steps=gas),
        )


def test_fixed_micro_batch_from_the_spec():
    assert fixed_micro_batch(_Spec(micro=None, gas=4).train, 1) == 2
    assert fixed_micro_batch(_Spec(micro=2).train, 2) == 2
    assert fixed_micro_batch(_Spec(micro="auto").train, 1) is None
    with pytest.raises(PipelineError, match="does not divide the 4 rows"):
        fixed_micro_batch(_Spec(micro=3).train, 2)


def test_auto_on_the_cpu_is_the_whole_per_rank_batch_and_float32():
    lines = []
    got = resolve(_Spec(), None, 11, None, torch.device("cpu"), 1, None, lines.append)
    assert got == {"micro_batch_size": 8, "bf16": False, "device": "cpu"}
    assert lines == [
        "train.micro_batch_size auto: 8, the whole per-rank batch (no "
        "out-of-memory signal on cpu to search on)"
    ]


def test_a_resume_keeps_the_record_whatever_the_device_would_pick():
    lines = []
    recorded = {"micro_batch_size": 2, "bf16": True, "device": "cuda"}
    got = resolve(_Spec(), None, 11, None, torch.device("cpu"), 1, recorded, lines.append)
    assert got == recorded  # no search; bf16 kept on the CPU
    assert lines == [
        "train.deepspeed.bf16 auto: keeping bf16, which this run started with "
        "on cuda (cpu would pick float32)"
    ]


def test_a_resume_refuses_explicit_values_other_than_the_record():
    recorded = {"micro_batch_size": 2, "bf16": True, "device": "cuda"}
    cpu = torch.device("cpu")
    with pytest.raises(PipelineError, match="written at micro-batch 2 and the spec now gives 4"):
        resolve(_Spec(micro=4), None, 11, None, cpu, 1, recorded, print)
    with pytest.raises(PipelineError, match="written with bf16 true"):
        resolve(_Spec(bf16=False), None, 11, None, cpu, 1, recorded, print)
    assert resolve(_Spec(micro=2, bf16=True), None, 11, None, cpu, 1, recorded, print) == recorded


def test_the_probe_leaves_the_model_and_the_random_generators_as_they_were():
    """On a GPU the search runs the probe; it must not change what training then does."""
    from pipeline.models import build_model
    from pipeline.training.micro_batch import probe
    from pipeline.training.tasks import TokenStreams

    torch.manual_seed(0)
    model = build_model(
        "allattn",
        {
            "d_model": 16,
            "n_layers": 2,
            "n_heads": 2,
            "n_persistent": 4,
            "max_span": 32,
            "attn_dropout": 0.3,
            "adaptive_span": True,
        },
        vocab_size=11,
    )
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    try_step, reset = probe(model, 11, 8, torch.device("cpu"), bf16=False, task=TokenStreams())
    assert largest_that_fits([4, 2], try_step, reset=reset) == 4
    assert torch.equal(torch.get_rng_state(), rng)
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key
    assert all(p.grad is None for p in model.parameters())


def test_a_resume_on_more_processes_keeps_the_micro_batch_where_it_divides():
    recorded = {"micro_batch_size": 2, "bf16": False, "device": "cpu"}
    cpu = torch.device("cpu")
    # batch 8: 4 rows per process at world size 2, 2 accumulation steps of the recorded 2
    assert resolve(_Spec(), None, 11, None, cpu, 2, recorded, print) == recorded
    with pytest.raises(
        PipelineError,
        match="micro-batch 2, which does not divide the 1 rows per process at world size 8",
    ):
        resolve(_Spec(), None, 11, None, cpu, 8, recorded, print)
