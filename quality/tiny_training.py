"""A tiny training run the way a user starts it (`allattn-pipe run` in a subprocess, on the CPU):
the config and the runner shared by the multi-process tests
(tests/system/cluster/test_distributed.py) and the kill -9 check (quality/kill9_tracking.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEPS = 12

# The paper's optimizer (Adagrad, step clipped per tensor) unless a test says otherwise.
ADAGRAD = "{type: adagrad, lr: 0.07, clip: per_param, clip_norm: 0.03, warmup_steps: 4}"
ADAM = "{type: adam, lr: 0.01, clip: global, clip_norm: 1.0, warmup_steps: 4}"


def tiny_config(
    tmp: Path,
    *,
    procs: int,
    zero: int,
    adaptive_span: bool = True,
    root: str = "runs",
    optimizer: str = ADAGRAD,
    steps: int = STEPS,
    evaluate: bool = False,
) -> Path:
    path = tmp / f"tiny-{procs}-{zero}-{int(adaptive_span)}.yaml"
    path.write_text(f"""\
extends: [{ROOT / "configs" / "quickstart.yaml"}]
name: dist
model: {{d_model: 32, n_layers: 2, n_heads: 2, n_persistent: 8, max_span: 64,
        adaptive_span: {str(adaptive_span).lower()}}}
train:
  steps: {steps}
  batch_size: 8
  seq_len: 32
  log_every: 1
  checkpoint_every: 4
  optimizer: {optimizer}
  deepspeed: {{zero_stage: {zero}}}
  launcher: {{procs_per_node: {procs}}}
tracking: {{experiment: procs{procs}-zero{zero}-span{int(adaptive_span)}}}
workspace: {{root: {tmp / root}}}
evaluate: {{splits: [valid]}}
stages: [download, preprocess, train{", evaluate" if evaluate else ""}]
""")
    return path


def cli(*args, env=None, timeout=600, **popen):
    env = dict(os.environ, DS_ACCELERATOR="cpu", **(env or {}))
    cmd = [sys.executable, "-m", "pipeline.commands.cli", *map(str, args)]
    if popen:
        return subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            **popen,
        )
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
    if result.returncode != 0:
        raise AssertionError(f"exit {result.returncode}\n{result.stdout}\n{result.stderr}")
    return result
