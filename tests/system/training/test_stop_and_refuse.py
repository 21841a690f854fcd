"""A checkpoint write that has begun completes on a signal; a checkpoint directory that turns
read-only under a running job is one line with the real cause."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys

import pytest

from pipeline.errors import Interrupted, Preempted
from pipeline.spec import PROJECT_ROOT, load_spec

CONFIG = """\
name: tiny
dataset: python_docs
model: {{kind: allattn, d_model: 32, n_layers: 2, n_heads: 2, n_persistent: 8, max_span: 32,
        adaptive_span: true, span_ramp: 8}}
train: {{steps: 12, batch_size: 8, seq_len: 32, log_every: 4, checkpoint_every: 4,
        optimizer: {{type: adam, lr: 0.01, warmup_steps: 4, clip: global, clip_norm: 1.0}}}}
tracking: {{enabled: false}}
workspace: {{root: {root}}}
stages: [download, preprocess, train]
"""


def _config(tmp_path):
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(CONFIG.format(root=tmp_path / "runs"))
    return cfg


def test_sigterm_during_the_last_checkpoint_write_lets_it_complete(tmp_path, monkeypatch):
    # before: the signal arrived after the loop's handler was gone, so it cut the write
    # short and the re-run resumed from step 8, contradicting docs/running.md
    from pipeline.tracking.tracker import NullTracker
    from pipeline.training import engine_checkpoints
    from pipeline.workspace.runner import Runner

    write = engine_checkpoints.CheckpointIO._write

    def signalled(self, root, tag, loop):
        if loop.step == 12:
            signal.raise_signal(signal.SIGTERM)
        return write(self, root, tag, loop)

    monkeypatch.setattr(engine_checkpoints.CheckpointIO, "_write", signalled)
    spec = load_spec(_config(tmp_path), [])
    logs = []
    with pytest.raises(Preempted) as stopped:
        Runner(spec, log=logs.append).run(NullTracker())
    assert not isinstance(stopped.value, Interrupted), stopped.value
    assert "during the last checkpoint, step 12" in str(stopped.value)
    assert stopped.value.exit_code == 143
    checkpoints = spec.workspace_dir / "train.partial" / "checkpoints"
    assert (checkpoints / "latest").read_text().strip() == "step-00000012"
    assert (checkpoints / "step-00000012" / "checksums.json").is_file()

    monkeypatch.setattr(engine_checkpoints.CheckpointIO, "_write", write)
    logs.clear()
    Runner(spec, log=logs.append).run(NullTracker())
    assert "[train] resuming from step 12" in logs, logs
    assert (spec.workspace_dir / "train" / "stage.json").is_file()


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None,
    reason="needs root and unshare for a read-only bind mount",
)
def test_a_checkpoint_directory_turned_read_only_is_one_line(tmp_path):
    # before: a traceback ending in torch's "Parent directory ... does not exist"
    cfg = _config(tmp_path)
    worker = PROJECT_ROOT / "tests" / "fixtures" / "workers" / "readonly_checkpoints_worker.py"
    done = subprocess.run(
        ["unshare", "-m", sys.executable, str(worker), str(cfg), "8"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(PROJECT_ROOT)},
    )
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    checkpoints = tmp_path / "runs" / "tiny" / "train.partial" / "checkpoints"
    assert done.stderr.splitlines()[-1] == (
        f"error: checkpoint {checkpoints / 'step-00000008'}: cannot write it: Read-only file "
        f"system (in {checkpoints}); the checkpoints already there are as they were: make "
        f"{checkpoints} writable and run again to resume from the newest one"
    )
    assert "Failed saving" not in done.stderr and "does not exist" not in done.stderr
    assert (checkpoints / "latest").read_text().strip() == "step-00000004"
    assert (checkpoints / "step-00000004" / "checksums.json").is_file()
