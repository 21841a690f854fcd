"""Every path or name the user gives is confined and read one way: `~` expanded, `..`
resolved, and a name that becomes a path component held to `name`'s rule."""

from __future__ import annotations

import os
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


@pytest.fixture
def no_home(monkeypatch):
    """A container's user: no HOME, and no entry in the passwd database for its uid."""
    import pwd

    def no_entry(uid):
        raise KeyError(f"getpwuid(): uid not found: {uid}")

    monkeypatch.delenv("HOME", raising=False)
    monkeypatch.setattr(pwd, "getpwuid", no_entry)


NO_HOME = "`~` stands for the home directory, and this user has none (HOME is unset and uid"


@pytest.mark.parametrize("key", ["root", "cache"])
def test_a_workspace_path_under_a_home_that_is_not_there_is_one_line(tmp_path, no_home, key):
    # before: accepted as the relative path `~/dl`, and a download into the cache ended in
    # Path.expanduser's RuntimeError
    root = [] if key == "root" else ["--set", f"workspace.root={tmp_path}"]
    result = CliRunner().invoke(
        main, ["validate", QUICKSTART, *root, "--set", f"workspace.{key}=~/dl"]
    )
    assert result.exit_code == 2, result.output
    assert result.output.strip() == (
        f"error: --set workspace.{key}=~/dl: workspace.{key}: {NO_HOME} {os.getuid()} has no "
        f"passwd entry): give the full path; found '~/dl'"
    )


def test_a_tilde_path_under_a_home_that_is_not_there_is_one_line_wherever_it_is_read(no_home):
    # before: RuntimeError from Path.expanduser, a traceback
    from types import SimpleNamespace

    from pipeline.commands.trained_weights import checkpoint_of
    from pipeline.data.fetch import cache_dir
    from pipeline.errors import PipelineError

    spec = SimpleNamespace(
        workspace=SimpleNamespace(cache="~/dl", root="runs"), workspace_dir=Path("runs/x"),
        stages=["train"],
    )  # fmt: skip
    why = f"{NO_HOME} {os.getuid()} has no passwd entry): give the full path"
    with pytest.raises(PipelineError) as refused:
        cache_dir(spec)
    assert str(refused.value) == f"~/dl: {why}"
    with pytest.raises(PipelineError) as refused:
        checkpoint_of(spec, "~/ckpt/step-00000010", print)
    assert str(refused.value) == f"--checkpoint ~/ckpt/step-00000010: {why}"


def test_a_home_of_a_user_that_does_not_exist_is_one_line(tmp_path):
    result = CliRunner().invoke(
        main, ["validate", QUICKSTART, "--set", "workspace.root=~no-such-user-x/runs"]
    )
    assert result.exit_code == 2, result.output
    assert result.output.strip() == (
        "error: --set workspace.root=~no-such-user-x/runs: workspace.root: `~no-such-user-x` "
        "stands for the home directory of the user no-such-user-x, and there is no such user: "
        "give the full path; found '~no-such-user-x/runs'"
    )
