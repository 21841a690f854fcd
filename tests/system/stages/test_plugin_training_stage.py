"""A training stage from a plugin, registered through a real entry point
(tests/fixtures/polish_stage.py), is estimated, timed, trained, resumed and reprinted as the
built-in ones are, and nothing under pipeline/commands names it: each reads the stage's plan
(pipeline/training/plan.py). The CLI in child processes (the entry point is read at start):
four runs of a tiny pipeline, about 40 s on 2 cores: the slow tier, as it starts processes."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.fixtures.polish_stage import NAME, entry_point_site

ROOT = Path(__file__).resolve().parents[3]
STEPS = 4


def config(tmp: Path) -> Path:
    path = tmp / "pipe.yaml"
    path.write_text(
        "name: pipe\n"
        "dataset: python_docs\n"
        "model: {kind: allattn, d_model: 32, n_layers: 1, n_heads: 2, n_persistent: 4, "
        "max_span: 64}\n"
        f"train: {{steps: {STEPS}, batch_size: 2, seq_len: 8, checkpoint_every: 1, log_every: 1,\n"
        "        optimizer: {type: adam, lr: 1.0e-3, clip: global, clip_norm: 1.0}}\n"
        "tracking: {enabled: false}\n"
        f"workspace: {{root: {tmp / 'runs'}}}\n"
        f"stages: [download, preprocess, train, {NAME}]\n"
    )
    return path


def cli(site: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    environment = os.environ | {"PYTHONPATH": f"{site}{os.pathsep}{ROOT}"} | env
    return subprocess.run(
        [sys.executable, "-m", "pipeline.commands.cli", *args],
        capture_output=True,
        text=True,
        timeout=600,
        env=environment,
    )


def test_a_plugins_training_stage_is_estimated_trained_resumed_and_reprinted(tmp_path):
    site, cfg = entry_point_site(tmp_path), str(config(tmp_path))

    shown = cli(site, "show", cfg, "--estimate")
    assert shown.returncode == 0, shown.stderr
    tokens = STEPS * 2 * 8  # updates x train.batch_size x train.seq_len
    assert f"    {NAME:<10} {tokens:,} tokens = {STEPS} updates (train.steps)" in shown.stdout
    assert re.search(rf"  time here: train [^,]+, {NAME} [^,]+, total ", shown.stdout)
    assert re.search(rf"  H100 time[^:]*: train [^,]+, {NAME} [^,]+, total ", shown.stdout)
    assert "not estimated" not in shown.stdout

    stopped = cli(site, "run", cfg, POLISH_SIGTERM_AT=str(STEPS + 1))
    assert stopped.returncode == 143, stopped.stderr
    resumed = cli(site, "run", cfg)
    assert resumed.returncode == 0, resumed.stderr
    assert f"polish: resuming from step {STEPS + 1}" in resumed.stdout + resumed.stderr
    again = cli(site, "run", cfg)
    assert again.returncode == 0, again.stderr
    assert f"polished from step {STEPS} to {2 * STEPS}" in again.stdout

    named = [p for p in (ROOT / "pipeline" / "commands").rglob("*.py") if NAME in p.read_text()]
    assert named == []
