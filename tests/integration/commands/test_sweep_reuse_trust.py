"""A sweep reuses a stage another workspace under its root built with the same fingerprint
(`Workspace.built_elsewhere`). A root may be shared: a build another user made, or could have
written, is not adopted (fsutil.not_ours, the rule the corpus cache and the point records
keep), and the sweep says so in one line and builds the stage itself. Before, a build planted
with the fingerprint became every point's data.

Another user is drawn for real: as root (CI), the planted workspace is given to uid 65534
(nobody) with chown."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from pipeline.commands.cli import main

NOBODY = 65534
needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="giving a file to another user (chown) needs root"
)
POINTS = ["pipe-lr0.001-seed1", "pipe-lr0.002-seed1"]
OWN = ["train", "finetune", "evaluate"]  # each point's own stages


def chown_all(path: Path) -> None:
    for top, dirs, files in os.walk(path):
        for name in [".", *dirs, *files]:
            os.chown(Path(top, name), NOBODY, NOBODY)


def plant(cfg: Path, calls: list[str]) -> Path:
    """A workspace under the sweep's root that built every stage with the points' shared
    fingerprints: the stand-in stages' outputs, as a planted build would hold."""
    result = CliRunner().invoke(
        main, ["run", str(cfg), "--set", "name=aaa-planted", "--set", "tracking.enabled=false"]
    )
    assert result.exit_code == 0, result.output
    calls.clear()
    return cfg.parent / "runs" / "aaa-planted"


def sweep(cfg: Path):
    result = CliRunner().invoke(
        main,
        ["sweep", str(cfg), "--grid", "train.optimizer.lr=0.001,0.002", "--seeds", "1",
         "--set", "tracking.enabled=false"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    return result.output


def refused(stage: str, why: str) -> list[str]:
    """The line a sweep says, once, where its first point passes over a planted build."""
    return [f"[{POINTS[0]}] {stage}: not reusing a build another user could have written: {why}"]


@needs_root
def test_a_build_another_user_owns_is_not_reused(tmp_path, calls, cfg):
    planted = plant(cfg, calls)
    chown_all(planted)
    output = sweep(cfg)
    assert calls == ["download", "preprocess", *OWN, *OWN]
    assert [line for line in output.splitlines() if "not reusing" in line] == refused(
        "download", f"{planted} is owned by uid 65534 (nobody), not by this user"
    )
    assert f"reusing {planted}" not in output


@needs_root
def test_a_file_another_user_owns_inside_a_build_of_ours_is_not_reused(tmp_path, calls, cfg):
    planted = plant(cfg, calls)
    os.chown(planted / "preprocess" / "output.txt", NOBODY, NOBODY)
    output = sweep(cfg)
    # download is this user's own, reused; preprocess is built again, once
    assert calls == ["preprocess", *OWN, *OWN]
    assert f"[{POINTS[0]}] download: reusing {planted / 'download'}" in output
    assert [line for line in output.splitlines() if "not reusing" in line] == refused(
        "preprocess",
        f"{planted / 'preprocess' / 'output.txt'} is owned by uid 65534 (nobody), not by this user",
    )


def test_a_build_every_user_can_write_is_not_reused(tmp_path, calls, cfg):
    planted = plant(cfg, calls)
    (planted / "download").chmod(0o777)
    output = sweep(cfg)
    assert calls == ["download", "preprocess", *OWN, *OWN]
    assert [line for line in output.splitlines() if "not reusing" in line] == refused(
        "download", f"{planted / 'download'} is writable by every user (mode 0777)"
    )


def test_a_build_of_this_users_is_reused(tmp_path, calls, cfg):
    planted = plant(cfg, calls)
    output = sweep(cfg)
    assert calls == [*OWN, *OWN]
    assert f"[{POINTS[1]}] preprocess: reusing {planted / 'preprocess'}" in output
    assert "not reusing" not in output
