"""A sweep's Slurm array task on a file system without flock (Lustre mounted `noflock`, some
FUSE and NFS mounts): the lock its tasks take turns under, to build the stages every point
shares once, falls back to a lock file (pipeline.locks), as the workspace's does."""

from __future__ import annotations

import fcntl

import pytest
from click.testing import CliRunner

from pipeline.commands.cli import main
from tests.fixtures.no_flock import NO_FLOCK_ERRORS, failing_flock

GRID = ["--grid", "train.optimizer.lr=0.001,0.002", "--seeds", "1"]


@pytest.mark.parametrize("code", NO_FLOCK_ERRORS)
def test_an_array_task_prepares_its_point_without_flock(tmp_path, monkeypatch, calls, cfg, code):
    """The task took its lock with flock alone: a traceback on such a file system."""
    monkeypatch.setattr(fcntl, "flock", failing_flock(str(tmp_path), code))
    args = ["sweep", str(cfg), *GRID, "--set", "tracking.enabled=false"]
    result = CliRunner().invoke(main, [*args, "--array-task-prepare", "1"])
    assert result.exit_code == 0, result.output
    # the stages both points share, built once for the sweep
    assert calls == ["download", "preprocess"]
    assert "sweep point 2 of 2" in result.output
    assert [p.name for p in (tmp_path / "runs").glob(".sweep-*.lock.soft")] == []
    result = CliRunner().invoke(main, [*args, "--array-task-prepare", "0"])
    assert result.exit_code == 0, result.output
    assert calls == ["download", "preprocess"]  # the second task reuses them
