"""Issue 10, item 1: an edited config never deletes an interrupted run's checkpoints.

End to end through the real stages and the CLI, in this process (each DeepSpeed start costs seconds,
a subprocess far more): a tiny train run is preempted right after its step-4 checkpoint, then re-run
with edits. tests/integration/workspace/test_runner.py covers the same decisions with stand-in
stages, and the crash-safe publish."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from pipeline.commands.cli import main
from tests.fixtures.quickstart import tiny_config
from tests.fixtures.runs import final_weights, preempted_at_first_checkpoint

# lr 0.01 (tiny_config's); embedding dropout so that the run draws random numbers every step
BASE = [
    "train.steps=8",
    "train.checkpoint_every=4",
    "train.eval_every=4",
    "model.emb_dropout=0.1",
    "tracking.enabled=false",
]
RUNTIME_EDITS = [
    "train.log_every=1",
    "train.eval_every=2",
    "train.checkpoint_every=3",
    "train.keep_checkpoints=1",
    "model.attention.impl=sdpa",
]


def test_validation_draws_no_random_numbers_and_restores_train_mode():
    """Why train.eval_every / eval_batches are runtime-only (without finetune.patience)."""
    from pipeline.models import build_model
    from pipeline.training.evaluation import evaluate_nll

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
            "emb_dropout": 0.1,
            "out_dropout": 0.1,
        },
        vocab_size=11,
    )
    tokens = np.arange(300, dtype=np.int64) % 11
    states = torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate()
    evaluate_nll(model, tokens, batch_size=2, seq_len=8, device=torch.device("cpu"), max_batches=4)
    assert torch.equal(torch.get_rng_state(), states[0])
    assert np.array_equal(np.random.get_state()[1], states[1])
    assert random.getstate() == states[2]
    assert model.training


@pytest.fixture
def cli():
    def invoke(cfg: Path, *sets: str, args: tuple[str, ...] = ()):
        argv = ["run", str(cfg), "--only", "download,preprocess,train", *args]
        for item in [*BASE, *sets]:
            argv += ["--set", item]
        return CliRunner().invoke(main, argv)

    return invoke


def preempted(cli, monkeypatch, cfg: Path, *sets: str, args: tuple[str, ...] = ()):
    """Run, stopping as a preemption would right after train's first checkpoint."""
    with preempted_at_first_checkpoint(monkeypatch):
        result = cli(cfg, *sets, args=args)
    assert result.exit_code == 143, result.output
    return result


def test_config_edits_after_a_preemption(tmp_path, cli, monkeypatch):
    straight = cli(tiny_config(tmp_path, "straight"), "train.optimizer.lr=0.005")
    assert straight.exit_code == 0, straight.output

    cfg = tiny_config(tmp_path)
    partial = tmp_path / "runs" / "tiny" / "train.partial"
    preempted(cli, monkeypatch, cfg)
    saved = sorted(p.name for p in (partial / "checkpoints").iterdir())
    assert saved == ["best", "latest", "step-00000004"]

    refused = cli(cfg, "train.optimizer.lr=0.005", *RUNTIME_EDITS)
    assert refused.exit_code == 2
    assert refused.stderr == (
        f"error: train: {partial} holds an interrupted run with checkpoints up to step 4, "
        f"started with other settings that change its result: train.optimizer.lr 0.01 -> "
        f"0.005. Set them back to resume it, or re-run with --force train to discard its "
        f"checkpoints and start over (nothing was deleted)\n"
    )
    assert sorted(p.name for p in (partial / "checkpoints").iterdir()) == saved

    plan = cli(cfg, *RUNTIME_EDITS, args=("--dry-run",)).output
    assert "  train       run   not done yet; resume from step 4\n" in plan
    plan = cli(cfg, "train.optimizer.lr=0.005", args=("--dry-run", "--force", "train")).output
    assert "  train       run   forced (--force); would discard checkpoints up to step 4\n" in plan

    forced = preempted(cli, monkeypatch, cfg, "train.optimizer.lr=0.005", args=("--force", "train"))
    assert "[train] discarding the interrupted run's checkpoints up to step 4\n" in forced.output
    assert "resuming" not in forced.output
    # started over: its first checkpoint is step 4 again (resumed, it would have been step 8)
    assert (partial / "checkpoints" / "latest").read_text() == "step-00000004\n"

    resumed = cli(cfg, "train.optimizer.lr=0.005", *RUNTIME_EDITS)
    assert resumed.exit_code == 0, resumed.output
    assert "[train] resuming from step 4\n" in resumed.output
    done = partial.parent / "train"
    assert json.loads((done / "stage.json").read_text())["summary"]["step"] == 8
    # the uninterrupted run's weights: sdpa differs from the reference op by float rounding
    # only, and validating at other steps drew no random numbers (dropout is on). Rounding
    # is absolute in size, relative to the tensor: 4e-6 in a pos_table of entries up to 3.9
    # on some CPUs' sdpa kernels (a dropped or repeated update moves weights by ~1e-2).
    a, b = final_weights(tmp_path / "runs" / "straight" / "train"), final_weights(done)
    assert a.keys() == b.keys()
    for key in a:
        scale = max(a[key].abs().max().item(), 1.0)
        torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=1e-5 * scale, msg=key)

    again = cli(cfg, "train.optimizer.lr=0.005", "train.log_every=2", "train.eval_every=0")
    assert "[train] skipped: up to date" in again.output and "running" not in again.output
