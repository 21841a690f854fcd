"""`export` stopped by a signal ends as every command does (128 + the signal's number, one
line) and leaves no partial directory beside its target; one that a kill -9 left is removed
by the next export. Before, SIGTERM and SIGHUP killed the export silently (their default
action) and left a hidden directory of partial weights that no later export removed.

The export runs as a process of its own (tests/fixtures/workers/paused_cli_worker.py), which
waits right after writing its weights, where the test signals it. Cost: three exports of the
session's tiny trained model, about 20 s on 2 idle cores.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from pipeline.commands.cli import main

ROOT = Path(__file__).resolve().parents[3]
WORKER = ROOT / "tests" / "fixtures" / "workers" / "paused_cli_worker.py"


def paused_export(trained, out: Path, tmp_path) -> subprocess.Popen:
    """An `export` of `trained` to `out`, waiting with its weights written."""
    ready = tmp_path / "ready"
    proc = subprocess.Popen(
        [sys.executable, str(WORKER), "export", str(trained), "--out", str(out)],
        env={
            **os.environ,
            "PAUSE_AT": "export-weights",
            "PAUSE_READY": str(ready),
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        },
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 300
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            out_text, err_text = proc.communicate()
            pytest.fail(f"the export never wrote its weights: {out_text}{err_text}")
        time.sleep(0.1)
    return proc


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_an_export_stopped_by_a_signal_exits_with_its_code_and_leaves_nothing(
    trained, tmp_path, sig
):
    out = tmp_path / "exports" / "model"
    out.parent.mkdir()
    proc = paused_export(trained, out, tmp_path)
    assert [p.name for p in out.parent.iterdir()][0].startswith(".model.")  # its partial dir
    proc.send_signal(sig)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + sig, stderr
    assert stderr.splitlines() == [
        f"error: stopped by {sig.name}: the command did not finish; run it again"
    ]
    assert list(out.parent.iterdir()) == []  # neither an export nor its partial weights


def test_a_later_export_removes_the_partial_directory_a_kill_9_left(trained, tmp_path):
    out = tmp_path / "exports" / "model"
    out.parent.mkdir()
    proc = paused_export(trained, out, tmp_path)
    proc.kill()
    proc.communicate(timeout=120)
    (left,) = out.parent.iterdir()
    assert left.name.startswith(".model.") and (left / "model.safetensors").is_file()

    result = CliRunner().invoke(main, ["export", str(trained), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert [p.name for p in out.parent.iterdir()] == ["model"]
