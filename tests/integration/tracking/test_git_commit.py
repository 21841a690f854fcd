"""The git commit a tracked run is tagged with is the commit of the code that ran: only when
the package's source tree is itself a git checkout of this project. Git looks for a
repository in every parent directory (and wherever GIT_DIR says): before, a package installed
in a virtual environment inside the user's own repository, or a run from a shell with GIT_DIR
set, was tagged with the user's commit. Real git, in repositories made by each test."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from pipeline.tracking import tracker

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs the git command")


def git(where, *args) -> str:
    return subprocess.run(
        ["git", "-C", str(where), "-c", "user.name=t", "-c", "user.email=t@example.org", *args],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()


def repository(path, files: dict[str, str]) -> str:
    """A git repository at `path` holding `files`, committed: its commit."""
    path.mkdir(parents=True)
    git(path, "init", "-q")
    for name, text in files.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(text)
    git(path, "add", "-A")
    git(path, "commit", "-q", "-m", "first")
    return git(path, "rev-parse", "HEAD")


def tags_with_root(monkeypatch, root) -> dict[str, str]:
    monkeypatch.setattr(tracker, "PROJECT_ROOT", root)
    return {k: v for k, v in tracker.environment_tags().items() if k.startswith("git_")}


def test_a_package_installed_inside_the_users_repository_has_no_commit(tmp_path, monkeypatch):
    user = tmp_path / "user-repo"
    repository(user, {"train.py": "", ".gitignore": ".venv/\n"})
    installed = user / ".venv" / "lib" / "python3" / "site-packages"
    (installed / "pipeline" / "spec").mkdir(parents=True)
    (installed / "pipeline" / "spec" / "yaml_reading.py").write_text("")
    monkeypatch.chdir(user)
    assert tags_with_root(monkeypatch, installed) == {}


def test_the_projects_own_checkout_is_tagged_with_its_commit_not_git_dirs(tmp_path, monkeypatch):
    project = tmp_path / "allattn-pipe"
    commit = repository(project, {"pipeline/spec/yaml_reading.py": "", "README.md": "a\n"})
    user = tmp_path / "user-repo"
    repository(user, {"train.py": ""})
    monkeypatch.chdir(user)
    monkeypatch.setenv("GIT_DIR", str(user / ".git"))  # a shell inside a git hook, say
    monkeypatch.setenv("GIT_WORK_TREE", str(user))
    assert tags_with_root(monkeypatch, project) == {"git_commit": commit, "git_dirty": "false"}
    (project / "README.md").write_text("b\n")
    assert tags_with_root(monkeypatch, project) == {"git_commit": commit, "git_dirty": "true"}


def test_another_projects_checkout_holding_a_copy_of_the_package_has_no_commit(
    tmp_path, monkeypatch
):
    other = tmp_path / "vendored"
    repository(other, {"third_party/pipeline/spec/yaml_reading.py": ""})
    assert tags_with_root(monkeypatch, other / "third_party") == {}
