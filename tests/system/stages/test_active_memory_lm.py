"""The active-memory language-model setting end to end: configs/active_memory/wt103_*.yaml at
toy size on the first lines of WikiText-2 (../shared/data) in sentencepiece BPE pieces, every
mixer through download, preprocess, train and evaluate, with the paper's padded loss beside
the NLL."""

from __future__ import annotations

import gzip
import hashlib
import json
import math
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from pipeline.models.active_memory import MIXERS
from tests.fixtures.shared_data import shared_data

ROOT = Path(__file__).resolve().parents[3]


# lines of each split kept: WikiText-2 cut to a size a CPU test trains and scores quickly
LINES = {"train": 3000, "valid": 300, "test": 600}


@pytest.fixture(scope="module")
def wikitext2_head(tmp_path_factory) -> tuple[Path, list[str]]:
    """A wikitext-2-v1.zip of the splits' first LINES, and the --set lines that read it."""
    path = tmp_path_factory.mktemp("wt2") / "wikitext-2-v1.zip"
    sets = []
    with zipfile.ZipFile(path, "w") as z:
        for split, n in LINES.items():
            data = gzip.decompress(shared_data(f"wikitext-2/wiki.{split}.tokens.gz").read_bytes())
            head = b"".join(data.splitlines(keepends=True)[:n])
            z.writestr(f"wikitext-2/wiki.{split}.tokens", head)
            sets.append(f"dataset.files.{split}.sha256={hashlib.sha256(head).hexdigest()}")
    sets += [
        f"dataset.url={path.as_uri()}",
        f"dataset.sha256={hashlib.sha256(path.read_bytes()).hexdigest()}",
    ]
    return path, sets


def toy_config(tmp: Path, mixer: str) -> Path:
    """The paper's LM config with WikiText-2 for WikiText-103 and every size cut down (in a
    base of its own, as configs/base does: a mixer without attention ignores n_heads)."""
    name = "wt103_" + mixer.replace("+", "_")
    (tmp / "toy_sizes.yaml").write_text(
        "model: {d_model: 16, n_layers: 2, ff_dim: 32, kernel_size: 4, n_heads: 2, head_dim: 8}\n"
    )
    path = tmp / f"{name}.yaml"
    path.write_text(f"""\
name: lm
extends: [{ROOT / "configs" / "active_memory" / name}.yaml, toy_sizes.yaml]
dataset: wikitext2
train:
  steps: 3
  batch_size: 4
  seq_len: 32
  optimizer: {{warmup_steps: 2}}
  log_every: 1
  eval_every: 0
  checkpoint_every: 0
evaluate: {{splits: [test], batch_size: 16, line_losses: true}}
workspace: {{root: {tmp / "runs"}}}
""")
    return path


def run(cfg: Path, *sets: str) -> subprocess.CompletedProcess:
    args = [sys.executable, "-m", "pipeline.commands.cli", "run", str(cfg)]
    for s in sets:
        args += ["--set", s]
    result = subprocess.run(
        args,
        capture_output=True,
        text=True,
        timeout=900,
        env=dict(os.environ, DS_ACCELERATOR="cpu"),
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def test_every_mixer_runs_the_language_model_pipeline(tmp_path, wikitext2_head):
    data = wikitext2_head[1] + [
        "dataset.tokenizer.kind=sentencepiece",
        "dataset.tokenizer.vocab_size=500",
        "dataset.vocab_size=500",
    ]
    results = {}
    for mixer in MIXERS:
        out = run(toy_config(tmp_path, mixer), *data)
        if mixer != MIXERS[0]:  # one preprocess serves every mixer
            assert "[preprocess] skipped: up to date" in out.stdout, out.stdout
        results[mixer] = json.loads(
            (tmp_path / "runs" / "lm" / "evaluate" / "results.json").read_text()
        )["test"]
    for mixer, test in results.items():
        # a few updates from random weights: near log(500) = 6.2 nats, and every number sane
        assert 4.0 < test["loss"] < 8.0, (mixer, test)
        assert math.isclose(test["ppl"], math.exp(test["loss"]))
        lines = test["lines"]
        # the padded mean is the line NLL diluted by padding: strictly smaller
        assert 0 < lines["paper_loss"] < lines["line_nll"], (mixer, lines)
        # every line of the split is scored or, past 300 pieces, skipped and counted
        assert lines["lines"] + lines["skipped_lines"] == LINES["test"]
        assert lines["lines"] > LINES["test"] // 2 and lines["tokens"] > 10_000
    assert len({round(r["loss"], 6) for r in results.values()}) == len(MIXERS)
