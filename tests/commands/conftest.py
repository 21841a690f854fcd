"""Fixtures shared by the command tests."""

from __future__ import annotations

import pytest

from pipeline.spec import load_spec


@pytest.fixture(scope="session")
def trained(tmp_path_factory):
    """A tiny all-attention network trained a few steps on the built-in corpus, in process:
    its config path. `export` and `sample` read it and write nothing into its workspace."""
    from pipeline.tracking.tracker import NullTracker
    from pipeline.workspace.runner import Runner

    tmp = tmp_path_factory.mktemp("export")
    cfg = tmp / "tiny.yaml"
    cfg.write_text(f"""\
name: tiny
dataset: python_docs
model: {{kind: allattn, d_model: 32, n_layers: 2, n_heads: 2, n_persistent: 8, max_span: 32,
        adaptive_span: true, span_ramp: 8}}
train: {{steps: 30, batch_size: 8, seq_len: 32, log_every: 10, checkpoint_every: 30,
        optimizer: {{type: adam, lr: 0.01, warmup_steps: 4, clip: global, clip_norm: 1.0}}}}
tracking: {{enabled: false}}
workspace: {{root: {tmp / "runs"}}}
stages: [download, preprocess, train]
""")
    Runner(load_spec(cfg, []), log=lambda m: None).run(NullTracker())
    return cfg
