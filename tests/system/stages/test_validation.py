"""Validation during training uses train's own settings (not evaluate's), can cover the whole
valid split, logs how many tokens each estimate covered; evaluate can score the best one."""

from __future__ import annotations

import json
import re

import pytest

from pipeline.spec import SpecError, load_spec
from stages import STAGES
from tests.fixtures.quickstart import EVAL_EVERY, STEPS, tiny_config
from tests.fixtures.runs import cli, metric_history


def train_fingerprint(cfg, *sets):
    return STAGES["train"].fingerprinted(load_spec(cfg, ["finetune.patience=2", *sets]))


def test_train_validation_does_not_read_the_evaluate_section(tmp_path):
    cfg = tiny_config(tmp_path)
    # with patience the validations decide when train stops, so their settings count...
    assert train_fingerprint(cfg) != train_fingerprint(cfg, "train.eval_batch_size=4")
    assert train_fingerprint(cfg) != train_fingerprint(cfg, "train.eval_batches=all")
    # ...and evaluate's, which only the final score reads, do not
    assert train_fingerprint(cfg) == train_fingerprint(
        cfg, "evaluate.batch_size=1", "evaluate.seq_len=7"
    )


def test_best_needs_validations(tmp_path):
    with pytest.raises(SpecError, match="evaluate.checkpoint best .* set train.eval_every"):
        load_spec(tiny_config(tmp_path), ["evaluate.checkpoint=best", "train.eval_every=0"])


def test_whole_split_validation_and_the_best_checkpoint_scored(tmp_path):
    cfg = tiny_config(tmp_path)
    # train validates exactly as evaluate scores (batch 16 x 64), over the whole valid split
    out = cli(
        "run",
        cfg,
        "--set",
        "train.eval_batches=all",
        "--set",
        "train.eval_batch_size=16",
        "--set",
        "train.eval_seq_len=64",
        "--set",
        "evaluate.checkpoint=best",
    ).stdout
    ws = tmp_path / "runs" / "tiny"
    manifest = json.loads((ws / "preprocess" / "manifest.json").read_text())
    every_target = manifest["splits"]["valid"]["tokens"] - 1
    tokens = metric_history(tmp_path / "runs", "tiny", "train", "valid_tokens")
    valid = metric_history(tmp_path / "runs", "tiny", "train", "valid_bpc")
    assert sorted(tokens) == list(range(EVAL_EVERY, STEPS + 1, EVAL_EVERY))
    assert set(tokens.values()) == {every_target}
    assert re.search(rf"valid bpc \d\.\d+ \(the whole split, {every_target:,} tokens\)", out)
    best_step = min(valid, key=valid.get)
    best = (ws / "train" / "checkpoints" / "best").read_text().strip()
    assert best == f"step-{best_step:08d}"
    results = json.loads((ws / "evaluate" / "results.json").read_text())
    assert results["checkpoint"] == f"train/{best}"  # finetune did not validate
    assert results["valid"]["tokens"] == every_target
    assert results["valid"]["bpc"] == pytest.approx(valid[best_step], rel=1e-6)
