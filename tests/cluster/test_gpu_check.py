"""`make gpu-check` on a machine without a GPU: one line saying so, then the dry run of the same
script (the CUDA tests collected, the benches started), exit 0; and the models, ops and
benches it runs import without deepspeed, mlflow or webdataset, as on the GPU machine."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the dry run is the no-GPU mode")
def test_make_gpu_check_without_a_gpu_is_a_dry_run(tmp_path):
    done = subprocess.run(["make", "-s", "gpu-check", f"PYTHON={sys.executable}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "MAKEFLAGS": ""})
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("gpu-check: no CUDA GPU here (torch ")
    assert lines[0].endswith("); dry run only")
    report = (ROOT / "gpu-check.md").read_text()
    assert "## CUDA tests (collected): ok" in report
    collected = report.split("## CUDA tests (collected): ok\n\n")[1].split()[0]
    assert int(collected.split("/")[0]) >= 5          # the cuda-marked tests exist
    assert "## bench/attention.py (--help): ok" in report
    assert "## bench/train_step.py (--help): ok" in report
    assert report.rstrip().endswith("all parts passed")


def test_models_ops_and_benches_import_without_deepspeed_mlflow_webdataset():
    blocked = "; ".join(f"sys.modules[{m!r}] = None" for m in
                        ("deepspeed", "mlflow", "webdataset"))
    code = (f"import sys; {blocked}; sys.path.insert(0, 'bench'); "
            "import pipeline.models, pipeline.ops, pipeline.training.optim, pipeline.spec, "
            "pipeline.commands.report, pipeline.cluster.device, pipeline.cluster.distributed; "
            "import runpy; sys.argv = ['train_step.py', 'configs/quickstart.yaml', "
            "'--steps', '1', '--warmup', '0', '--batch', '2']; "
            "runpy.run_path('bench/train_step.py', run_name='__main__')")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "| span frac |" in done.stdout
