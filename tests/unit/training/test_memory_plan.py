"""The memory plan's arithmetic (pipeline/training/memory_plan.py): DeepSpeed's model states
per ZeRO stage, written out here by hand for the paper's large model, the peak of a step,
the largest micro-batch search, and where this machine's available memory is read."""

from __future__ import annotations

import pytest
import torch

from pipeline.models.capabilities import ActivationMemory, MemoryCounts
from pipeline.training import memory_plan
from pipeline.training.memory_plan import Planner, StepPlan, model_states

PSI = 114_017_773  # enwik8_large's weights
PART, HALF = 2 * PSI // 8, 4 * PSI // 8  # an eighth of them in bf16 and in float32


@pytest.mark.parametrize(
    ("zero", "world", "dtype", "optimizer", "device", "expected"),
    [
        # bf16, ZeRO 1, one GPU, Adagrad (the paper configs): bf16 weights; float32 masters
        # and sum; at the step the bf16 gradients, the float32 copy the optimizer steps and
        # its float32 square root of the sum; the 5e8 bucket
        (1, 1, torch.bfloat16, "adagrad", "cuda", (2 * PSI, 8 * PSI, 10 * PSI, 10**9)),
        # the same on 8 GPUs: masters, moments, the float32 copy and temporary over 8
        (1, 8, torch.bfloat16, "adagrad", "cuda", (2 * PSI, PSI, 2 * PSI + 2 * (PSI // 2), 10**9)),
        # ZeRO 2 on 8: the bf16 gradients over 8 too
        (2, 8, torch.bfloat16, "adam", "cuda", (2 * PSI, 12 * PSI // 8, PART + 2 * HALF, 10**9)),
        # ZeRO 3 on 8: the weights as well; no bucket counted
        (3, 8, torch.bfloat16, "adam", "cuda", (PART, 12 * PSI // 8, PART + 2 * HALF, 0)),
        # bf16 without ZeRO: float32 masters and DeepSpeed's flat float32 gradients, whole
        (0, 1, torch.bfloat16, "adam", "cuda", (2 * PSI, 12 * PSI, 10 * PSI, 0)),
        # float32 on the CPU (the estimate's timing): no masters at ZeRO 0 ...
        (0, 1, torch.float32, "adagrad", "cpu", (4 * PSI, 4 * PSI, 8 * PSI, 0)),
        # ... a float32 copy at ZeRO 1, and the bucket's pages never touched on the CPU
        (1, 1, torch.float32, "adam", "cpu", (4 * PSI, 12 * PSI, 12 * PSI, 0)),
    ],
)
def test_model_states_per_process(zero, world, dtype, optimizer, device, expected):
    s = model_states(PSI, zero, world, dtype, optimizer, device)
    got = (s.weights.bytes, s.optimizer.bytes, s.gradients.bytes, s.bucket.bytes)
    assert got == expected


def test_the_peak_is_the_backward_or_the_optimizer_step_whichever_is_larger():
    states = model_states(1000, 0, 1, torch.float32, "adam", "cpu")  # 4000 + 8000, step 8000
    big = StepPlan(states, 2, ActivationMemory(saved=9000, working=700, state=100), 3)
    assert big.activation_bytes == 9000 + 700 + 3 * 100
    assert big.peak == 4000 + 8000 + 10_000  # the backward: activations over gradients
    small = StepPlan(states, 2, ActivationMemory(saved=100, working=10, state=1), 3)
    assert small.peak == 4000 + 8000 + 8000  # the step: the gradients and the temporary


class Linear(MemoryCounts):
    """A stand-in model whose activations grow by `per_row` bytes a row."""

    def __init__(self, per_row: int):
        self.per_row = per_row

    def activation_memory(self, rows, block_len, dtype, device_type, uniform_tokens=False):
        return ActivationMemory(self.per_row * rows, 0, 10 * rows)


@pytest.mark.parametrize(("limit", "expected"), [(10**9, 64), (12_000 + 50_000, 4), (19_000, 0)])
def test_the_largest_micro_batch_that_fits(limit, expected):
    states = model_states(1000, 0, 1, torch.float32, "adam", "cpu")  # 12,000 fixed
    plan = Planner(Linear(10_000), states, 8, torch.float32, "cpu", 64, documents=True)
    # documents: two states held; a micro-batch of mb costs 12,000 + mb (10,000 + 20)
    assert plan.largest_that_fits(limit) == expected
    if expected:
        assert plan.at(expected).peak <= limit
    if 0 < expected < 64:
        assert plan.at(expected + 1).peak > limit


def test_a_stream_holds_every_micro_batchs_state_and_the_one_in_and_out():
    states = model_states(1000, 0, 1, torch.float32, "adam", "cpu")
    plan = Planner(Linear(0), states, 8, torch.float32, "cpu", 64, documents=False)
    assert plan.at(4).state_copies == 64 // 4 + 1
    assert plan.at(4, rows=4).state_copies == 2


def test_a_cgroup_limit_below_the_machines_available_memory_is_the_room(tmp_path, monkeypatch):
    limit, usage = tmp_path / "memory.max", tmp_path / "memory.current"
    limit.write_text(f"{3 * 2**30}\n")
    usage.write_text(f"{2**30}\n")
    real = memory_plan.Path

    def redirected(name):
        return {"/sys/fs/cgroup/memory.max": limit, "/sys/fs/cgroup/memory.current": usage}.get(
            str(name), real(tmp_path / "absent")
        )

    monkeypatch.setattr(memory_plan, "Path", redirected)
    room, source = memory_plan.available_memory()
    assert (room, source) == (2 * 2**30, "the cgroup's memory limit less its usage")
    limit.write_text("max\n")
    assert memory_plan.available_memory()[1] == "available memory (psutil)"
