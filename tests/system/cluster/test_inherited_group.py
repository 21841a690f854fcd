"""`show --estimate` (which builds the run's engine and times updates) in a fresh process
whose environment names a launch of two processes at a busy port, as a torchrun step's or a
training pod's does: it finishes as one process, saying it ignored them. It waited at that
rendezvous for hours (the collective timeout is 180 minutes). ~30 s on 2 loaded cores."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

from tests.fixtures.runs import five_stage_config


def test_show_estimate_in_a_launchs_environment_runs_as_one_process(tmp_path):
    cfg = five_stage_config(tmp_path)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        env = dict(os.environ, RANK="1", LOCAL_RANK="0", WORLD_SIZE="2")
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(busy.getsockname()[1]))
        result = subprocess.run(
            [sys.executable, "-m", "pipeline.commands.cli", "show", str(cfg), "--estimate"],
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=240,  # the old rendezvous waited 180 minutes
        )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stderr.startswith("note: ignoring LOCAL_RANK, MASTER_ADDR, MASTER_PORT,")
    assert "update time here:" in result.stdout
