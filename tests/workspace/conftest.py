"""Fixtures shared by the workspace tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def cfg(tmp_path):
    """A five-stage pipeline with a tiny model: run with stand-in stages, it costs nothing."""
    path = tmp_path / "pipe.yaml"
    path.write_text(f"""\
name: pipe
dataset: python_docs
model: {{kind: allattn, d_model: 32, n_layers: 1, n_heads: 2, n_persistent: 4, max_span: 64}}
train: {{steps: 2, batch_size: 2, seq_len: 8,
        optimizer: {{type: adam, lr: 1.0e-3, clip: global, clip_norm: 1.0}}}}
finetune: {{steps: 1}}
workspace: {{root: {tmp_path / "runs"}}}
stages: [download, preprocess, train, finetune, evaluate]
""")
    return path
