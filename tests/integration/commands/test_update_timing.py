"""`show --estimate`'s update time against the run's: the same tiny config timed by the
estimate and trained for real, in one test under the same load (issue 46: timing micro-batch
1 and multiplying by the batch was 6 to 13 times too high), and what it prints when this
machine has not the memory to time an update (issue 45)."""

from __future__ import annotations

import time

import pytest
from click.testing import CliRunner

from bench.estimate_vs_run import in_turns
from pipeline.commands.cli import main
from pipeline.commands.estimate import format_duration
from pipeline.commands.update_timing import out_of_memory
from pipeline.spec import PROJECT_ROOT, load_spec

STEPS, TURN = 32, 4  # 8 turns each: the first (first calls) dropped, the median of 7

QUICKSTART = """\
extends: [{configs}/quickstart.yaml]
name: quick
model: {{d_model: 32, n_layers: 2, n_heads: 2, n_persistent: 8, max_span: 64, span_ramp: 8}}
train: {{batch_size: 16, seq_len: 32, optimizer: {{warmup_steps: 2}},
        deepspeed: {{gradient_accumulation_steps: 2}}}}
stages: [download, preprocess, train]
"""

ACTIVE_MEMORY_LM = """\
extends: [{configs}/base/active_memory_lm.yaml]
name: am_lm
dataset: python_docs
model: {{mixer: conv, d_model: 32, n_layers: 2, ff_dim: 64, kernel_size: 5}}
train: {{batch_size: 16, seq_len: 32, optimizer: {{warmup_steps: 2}}}}
stages: [download, preprocess, train]
"""

ACTIVE_MEMORY_TASK = """\
extends: [{configs}/active_memory/sort.yaml]
name: am_task
model: {{d_model: 32, n_layers: 2, ff_dim: 64, kernel_size: 5, dropout: 0.0}}
train: {{batch_size: 16}}
stages: [curriculum]
"""

INFINITY_FORMER = """\
extends: [{configs}/infinity_former/sort_4k_cpu.yaml]
name: inf
dataset: {{name: sort_synthetic, generator: {{frequency_sort: {{length: 96,
          sequences: {{train: 512, valid: 16, test: 16}}}}}}}}
model: {{d_model: 32, n_heads: 2, ff_dim: 64, mem_len: 32, n_basis: 16, n_samples: 16}}
train: {{batch_size: 8, seq_len: 32}}
stages: [download, preprocess, train]
"""

COMMON = ["tracking.enabled=false"]


def write_config(tmp_path, text: str):
    from tests.fixtures.runs import ROOT

    path = tmp_path / "cfg.yaml"
    path.write_text(text.format(configs=ROOT / "configs"))
    return path


@pytest.fixture
def one_thread():
    """Two OpenMP threads on a machine with more runnable jobs than cores swing an update's
    time tenfold from one update to the next; on one thread both measures hold still."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


TRAIN = f"train.steps={STEPS}"
CURRICULUM = (
    f"dataset.generator.algorithmic.curriculum={{epochs: 1, steps_per_epoch: {STEPS}, "
    f"check_cases: 8, start_length: 12}}"
)


@pytest.mark.parametrize(
    ("config", "sets"),
    [
        (QUICKSTART, [TRAIN]),
        (ACTIVE_MEMORY_LM, [TRAIN]),
        (ACTIVE_MEMORY_TASK, [CURRICULUM]),
        (INFINITY_FORMER, [TRAIN]),
    ],
    ids=["quickstart", "active_memory_lm", "active_memory_task", "infinity_former"],
)
def test_the_estimated_update_time_is_within_30_percent_of_the_runs(
    config, sets, tmp_path, one_thread
):
    path = write_config(tmp_path, config)
    spec = load_spec(path, [*COMMON, *sets, f"workspace.root={tmp_path / 'runs'}"])
    # the two in turns (bench/estimate_vs_run.py), each update of the run counted, on the
    # thread's CPU time: CI's other worker (a Slurm cluster, several trainings) preempts this
    # one, and on wall time moved the ratio to 0.69 and 1.31 in one run
    predicted, measured = in_turns(spec, TURN, clock=time.thread_time)
    print(f"predicted {predicted:.4f} s, measured {measured:.4f} s per update")
    assert 0.7 <= predicted / measured <= 1.3, (predicted, measured)


def test_without_the_memory_to_time_an_update_the_gpu_time_is_still_printed(tmp_path, monkeypatch):
    from pipeline.training import trainer

    def too_large(*args, **kwargs):
        raise RuntimeError(
            "[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate "
            "memory: you tried to allocate 1099511627776 bytes. Error code 12"
        )

    monkeypatch.setattr(trainer, "build_model", too_large)
    result = CliRunner().invoke(
        main,
        ["show", str(PROJECT_ROOT / "configs" / "quickstart.yaml"), "--estimate"]
        + ["--set", f"workspace.root={tmp_path}"],
    )
    assert result.exit_code == 0, result.output
    out = result.output
    assert "time here: not timed: this machine ran out of memory for an update" in out
    assert "can't allocate memory" in out
    assert "H100 time at the full span: train" in out
    assert "H200 time at span 1/16: train" in out


def test_errors_other_than_memory_are_not_taken_for_it():
    assert out_of_memory(MemoryError())
    assert out_of_memory(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert not out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not out_of_memory(ValueError("out of memory"))


@pytest.mark.parametrize(
    ("seconds", "shown"),
    [
        (0.28, "0.28 s"),
        (2.73, "2.7 s"),
        (42, "42 s"),
        (90, "1.5 min"),
        (23 * 60, "23 min"),
        (2.1 * 3600, "2.1 h"),
        (3818 * 3600, "3,818 h"),
    ],
)
def test_a_duration_is_printed_in_the_unit_its_size_reads_in(seconds, shown):
    assert format_duration(seconds / 3600) == shown
