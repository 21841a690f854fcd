"""No code from where the user stands, no secret from any process (issue 45, items 1 and 2).

A user runs `allattn-pipe` in a directory that holds `mlflow.py`, `yaml.py` and `json.py`
(planted: each writes a marker file and raises when imported). The processes we start (the
deepspeed runner, its launcher, the ranks, a parallel sweep's points) import the installed
packages, never those: no marker appears and the runs succeed. A URL password given on the
command line is masked in every line any of those processes prints (our launch line,
deepspeed's `cmd =` and `spawned with command` lines, the ranks' output)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.fixtures.planted import plant

ROOT = Path(__file__).resolve().parents[3]
CLI = Path(sys.executable).parent / "allattn-pipe"  # the console script a user runs
CANARY = "CANARY-pa'ss!$(w)*+,;=%41rd"


def allattn(where: Path, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_TRACKING")}
    env.update(DS_ACCELERATOR="cpu", MLFLOW_ALLOW_FILE_STORE="true")
    env.pop("PYTHONPATH", None)  # the installed package, as a user has it
    return subprocess.run(
        [str(CLI), *args], cwd=where, env=env, capture_output=True, text=True, timeout=timeout
    )


def small_config(tmp: Path, procs: int = 1) -> Path:
    """A pipeline of seconds: a small local corpus, a tiny model, one training step."""
    corpus = tmp / "corpus.txt"
    corpus.write_bytes(b"".join(b"line %d of a small corpus.\n" % i for i in range(500)))
    cfg = tmp / "pipe.yaml"
    cfg.write_text(f"""\
name: pipe
dataset: {{name: python_docs, url: "{corpus.as_uri()}", tokenizer: byte,
          split: {{kind: tail, valid: 0.05, test: 0.05}}}}
model: {{kind: allattn, d_model: 16, n_layers: 1, n_heads: 2, n_persistent: 4, max_span: 16,
        adaptive_span: false}}
train: {{steps: 1, batch_size: 2, seq_len: 8, log_every: 1, launcher: {{procs_per_node: {procs}}},
        optimizer: {{type: adam, lr: 1.0e-3, clip: global, clip_norm: 1.0}}}}
tracking: {{uri: "{(tmp / "store").as_uri()}"}}
workspace: {{root: {tmp / "runs"}}}
stages: [download, preprocess, train]
""")
    return cfg


def test_a_two_process_run_imports_nothing_from_the_working_directory_and_prints_no_secret(
    tmp_path,
):
    here = tmp_path / "here"
    here.mkdir()
    marker = plant(here)
    cfg = small_config(tmp_path, procs=2)
    secret = f"http://user:{CANARY}@example.invalid/about"  # printed, never requested
    done = allattn(here, "run", str(cfg), "--set", f"dataset.description={secret}")
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    assert not marker.exists(), marker.read_text()
    assert "starting 2 processes:" in output
    assert "cmd = " in output and "spawned with command" in output  # deepspeed's own lines
    assert "http://user:***@example.invalid/about" in output
    assert "CANARY" not in output


def test_a_parallel_sweep_imports_nothing_from_the_working_directory(tmp_path):
    here = tmp_path / "here"
    here.mkdir()
    marker = plant(here)
    cfg = small_config(tmp_path)
    done = allattn(here, "sweep", str(cfg), "--seeds", "1,2", "--parallel", "2")
    output = done.stdout + done.stderr
    logs = "".join(p.read_text() for p in (tmp_path / "runs").glob("*/sweep.log"))
    assert done.returncode == 0, output[-3000:] + logs[-3000:]
    assert not marker.exists(), marker.read_text() + logs[-3000:]
    assert output.splitlines()[-1] == "2 of 2 points done", output
