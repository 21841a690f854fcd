"""Every path or name the user gives is confined and read one way: `~` expanded, `..`
resolved, and a name that becomes a path component held to `name`'s rule."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from pipeline.commands.cli import main
from pipeline.spec import PROJECT_ROOT, load_spec

QUICKSTART = str(PROJECT_ROOT / "configs" / "quickstart.yaml")


@pytest.mark.parametrize("experiment", ["/any/dir", "../../x", "a/b", "..", ".", "x\ny", ""])
def test_an_experiment_name_that_is_a_path_is_one_line(tmp_path, experiment):
    # before: accepted, and `run` made <root>/mlartifacts/<experiment> outside the root
    result = CliRunner().invoke(
        main,
        [
            "validate",
            QUICKSTART,
            "--set",
            f"workspace.root={tmp_path}",
            "--set",
            f"tracking.experiment={experiment}",
        ],
    )
    assert result.exit_code == 2, result.output
    line = result.output.strip()
    assert "\n" not in line and line.startswith("error: ") and "tracking.experiment" in line
    assert list(tmp_path.iterdir()) == []


def test_a_plain_experiment_name_is_kept(tmp_path):
    spec = load_spec(
        QUICKSTART, [f"workspace.root={tmp_path}", "tracking.experiment=ablations-2.b_x"]
    )
    assert spec.tracking.experiment == "ablations-2.b_x"


def test_workspace_paths_are_read_with_tilde_expanded_and_dotdot_resolved(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    spec = load_spec(QUICKSTART, ["workspace.root=~/runs", "workspace.cache=typo/../cache"])
    assert spec.workspace_dir == tmp_path / "home" / "runs" / spec.name
    assert Path(spec.workspace.cache) == tmp_path / "cache"
    # a path without `..` keeps its form: relative stays relative
    assert load_spec(QUICKSTART, ["workspace.root=runs/./a/"]).workspace.root == "runs/a"


def test_a_workspace_root_through_a_missing_directory_creates_nothing_beside_it(tmp_path):
    # before: `run` made the stray `typo` on its way to `typo/../ws`
    result = CliRunner().invoke(
        main, ["sync", QUICKSTART, "--set", f"workspace.root={tmp_path}/typo/../ws"]
    )
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ws"]


def test_a_path_argument_is_read_with_tilde_expanded_and_dotdot_resolved(tmp_path, monkeypatch):
    # before: `--output typo/../job.sbatch` made a stray `typo`, and `~` was taken literally
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    monkeypatch.chdir(tmp_path)
    for output, written in [
        ("typo/../job.sbatch", tmp_path / "job.sbatch"),
        ("~/job.sbatch", tmp_path / "home" / "job.sbatch"),
    ]:
        result = CliRunner().invoke(
            main,
            [
                "launch",
                "slurm",
                QUICKSTART,
                "--nodes",
                "1",
                "--gpus-per-node",
                "0",
                "--procs-per-node",
                "1",
                "--set",
                f"workspace.root={tmp_path}/runs",
                "--output",
                output,
            ],
        )
        assert result.exit_code == 0, result.output
        assert written.is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["home", "job.sbatch", "runs"]


@pytest.mark.parametrize("shape", ["dangling", "too long"])
def test_a_workspace_that_cannot_be_made_is_one_line_from_sync(tmp_path, shape):
    # found by the path fuzzer: `sync` made the workspace for its lock with a bare mkdir,
    # and a dangling symlink or a name too long on the way was a traceback
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    root = tmp_path / "dangling" / "x" if shape == "dangling" else tmp_path / ("x" * 300)
    result = CliRunner().invoke(main, ["sync", QUICKSTART, "--set", f"workspace.root={root}"])
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit)
    line = result.output.strip()
    assert line.startswith("error: ") and "\n" not in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dangling"]
