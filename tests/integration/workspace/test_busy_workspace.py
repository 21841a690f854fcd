"""A workspace another run holds: `run` is refused at once, before MLflow's store or the
launcher's processes are started, `--dry-run` says it is in use, and a lock that cannot be
written (a full disk) is one line that leaves no lock behind."""

from __future__ import annotations

import errno
import os
import socket
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner

from pipeline.commands.cli import main
from pipeline.errors import PipelineError
from pipeline.spec import load_spec
from pipeline.workspace.lock import WorkspaceLock, lock_is_free
from tests.fixtures.runs import five_stage_config

# The refusal itself takes milliseconds; 2 s leaves room for a loaded 2-core machine. Before,
# the run made MLflow's store first and was refused after 12-14 s here (~30 s reported).
REFUSED_WITHIN_S = 2.0


def test_a_run_on_a_busy_workspace_is_refused_at_once(tmp_path):
    cfg = five_stage_config(tmp_path)
    ws = load_spec(str(cfg)).workspace_dir
    with WorkspaceLock(ws):
        t0 = time.monotonic()
        result = CliRunner().invoke(main, ["run", str(cfg)])
        took = time.monotonic() - t0
    print(f"refused in {took:.3f} s")
    assert result.exit_code != 0
    lines = result.output.strip().splitlines()
    assert len(lines) == 1, result.output
    assert "in use by another run" in lines[0]
    assert f"pid {os.getpid()} on host {socket.gethostname()} since " in lines[0]
    assert not (tmp_path / "runs" / "mlflow.db").exists()  # nothing slow was started
    assert took < REFUSED_WITHIN_S


def test_dry_run_on_a_busy_workspace_says_it_is_in_use(tmp_path):
    cfg = five_stage_config(tmp_path)
    ws = load_spec(str(cfg)).workspace_dir
    with WorkspaceLock(ws):
        busy = CliRunner().invoke(main, ["run", str(cfg), "--dry-run"])
    assert busy.exit_code == 0, busy.output
    assert f"in use by another run (pid {os.getpid()} on host " in busy.output
    assert "a run now would be refused" in busy.output
    free = CliRunner().invoke(main, ["run", str(cfg), "--dry-run"])
    assert "in use" not in free.output


def test_a_full_disk_while_writing_the_lock_is_one_line_and_leaves_no_lock(tmp_path, monkeypatch):
    ws = tmp_path / "ws"

    def full(fd, data, offset):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with monkeypatch.context() as m:
        m.setattr(os, "pwrite", full)
        with pytest.raises(PipelineError) as info:
            WorkspaceLock(ws).__enter__()
    msg = str(info.value)
    assert "\n" not in msg
    assert f"cannot write its lock file {ws / '.lock'}" in msg
    assert os.strerror(errno.ENOSPC) in msg
    assert lock_is_free(ws)  # not held by the process that failed
    assert (ws / ".lock").read_bytes() == b""  # no holder line, whole or partial
    with WorkspaceLock(ws):  # the next run takes it
        assert "pid " in (ws / ".lock").read_text()


def test_a_fresh_process_is_refused_before_it_imports_torch(tmp_path):
    """The refusal in a new `allattn-pipe run` comes before the spec's validation, which
    imports the models and torch (most of a fresh process's start): the busy check reads
    the workspace off the file (pipeline/spec/quick.py)."""
    cfg = five_stage_config(tmp_path)
    ws = load_spec(str(cfg)).workspace_dir
    probe = (
        "import atexit, sys\n"
        "atexit.register(lambda: print('torch imported:', 'torch' in sys.modules))\n"
        "from pipeline.commands.cli import main\n"
        "main(['run', sys.argv[1]])\n"
    )
    with WorkspaceLock(ws):
        done = subprocess.run(
            [sys.executable, "-c", probe, str(cfg)],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert done.returncode == 2, done.stderr
    assert "is in use by another run (pid" in done.stderr
    assert "torch imported: False" in done.stdout
