"""Two CPU processes (gloo) where rank 0 fails before training (the dataset file is missing):
rank 0 prints its one-line error, rank 1, waiting for rank 0's first stage, prints one line
saying why it stopped instead of gloo's traceback."""

from __future__ import annotations

import os
import subprocess
import sys

from pipeline.spec import PROJECT_ROOT


def test_rank_1_says_rank_0_failed_in_one_line(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"""\
extends: [{PROJECT_ROOT / "configs" / "quickstart.yaml"}]
name: dist
dataset: {{name: missing, url: "file://{tmp_path}/missing.txt", tokenizer: byte,
          split: {{kind: tail, valid: 0.1, test: 0.1}}}}
model: {{d_model: 32, n_layers: 2, n_heads: 2, n_persistent: 8, max_span: 64}}
train: {{steps: 2, batch_size: 8, seq_len: 32, optimizer: {{warmup_steps: 0}},
        launcher: {{procs_per_node: 2}}}}
tracking: {{enabled: false}}
workspace: {{root: {tmp_path / "runs"}}}
stages: [download, preprocess, train]
""")
    done = subprocess.run(
        [sys.executable, "-m", "pipeline.commands.cli", "run", str(cfg)],
        env=dict(os.environ, DS_ACCELERATOR="cpu"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    lines = done.stderr.splitlines()
    assert f"error (rank 0): dataset.url file://{tmp_path}/missing.txt: no such file" in "\n".join(
        lines
    )
    assert "rank 1: stopped because rank 0 failed" in lines, done.stderr[-3000:]
