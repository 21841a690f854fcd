"""A base config (shared through `extends`, no name of its own) run or validated directly
says that it is a base and names configs that extend it, instead of "name: required key is
missing". A base is a file without a name that is under a folder named base/ or that a
config near it extends."""

from __future__ import annotations

import os
import signal

import pytest
from click.testing import CliRunner

from pipeline.commands.cli import main
from pipeline.spec import PROJECT_ROOT

CONFIGS = PROJECT_ROOT / "configs"


def refusal(*args: str) -> str:
    result = CliRunner().invoke(main, list(args))
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0].removeprefix("error: ")


@pytest.mark.parametrize(
    "base, extended_by",
    [
        # through char_small.yaml, itself a base
        ("base/char.yaml", "enwik8_small.yaml"),
        ("base/char_large.yaml", "enwik8_large.yaml"),
        ("base/active_memory_task.yaml", "active_memory/add.yaml"),
    ],
)
def test_validating_a_project_base_says_it_is_one_and_names_a_config_to_run(base, extended_by):
    line = refusal("validate", str(CONFIGS / base))
    assert line.startswith(f"{CONFIGS / base}: a base for `extends`"), line
    assert "required key is missing" not in line, line
    assert str(CONFIGS / extended_by) in line, line


def test_running_a_base_is_refused_the_same_way(monkeypatch):
    monkeypatch.chdir(PROJECT_ROOT)
    line = refusal("run", "configs/base/char_small.yaml", "--dry-run")
    assert line.startswith("configs/base/char_small.yaml: a base for `extends`"), line
    # shown as the user would type it from where they are
    assert "configs/enwik8_small.yaml" in line and str(PROJECT_ROOT) not in line, line


def test_a_users_own_base_is_recognised_by_the_config_that_extends_it(tmp_path):
    (tmp_path / "shared.yaml").write_text("model: {kind: allattn, d_model: 32}\n")
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "mine.yaml").write_text("extends: [../shared.yaml]\nname: mine\n")
    line = refusal("validate", str(tmp_path / "shared.yaml"))
    assert line.startswith(f"{tmp_path / 'shared.yaml'}: a base for `extends`"), line
    assert os.path.join(str(tmp_path), "runs", "mine.yaml") in line, line


def test_a_file_in_a_base_folder_that_nothing_extends_yet_is_a_base(tmp_path):
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "lonely.yaml").write_text("model: {kind: allattn}\n")
    line = refusal("validate", str(tmp_path / "base" / "lonely.yaml"))
    assert "a base for `extends`" in line and "extends: [" in line, line


def test_a_config_that_forgot_its_name_is_still_told_so(tmp_path):
    (tmp_path / "exp.yaml").write_text(f"extends: [{CONFIGS / 'quickstart.yaml'}]\n")
    (tmp_path / "noname.yaml").write_text("model: {kind: allattn}\nstages: [train]\n")
    for path in ("exp.yaml", "noname.yaml"):
        result = CliRunner().invoke(main, ["validate", str(tmp_path / path)])
        assert "a base for" not in result.output, result.output
    result = CliRunner().invoke(main, ["validate", str(tmp_path / "noname.yaml")])
    assert "name: required key is missing" in result.output, result.output


def test_a_neighbour_whose_tag_cannot_be_built_is_passed_over(tmp_path):
    """Looking for what extends a config reads the YAML files beside it: one whose tag's
    constructor fails (`!!int abc`: a ValueError, not a YAML error) is not a config to read,
    and each file gets its own one-line error (the CLI fuzzer's case: a traceback)."""
    (tmp_path / "bad.yaml").write_text("name: !!int abc\n")
    (tmp_path / "shared.yaml").write_text("model: {kind: allattn, d_model: 32}\n")
    (tmp_path / "mine.yaml").write_text("extends: [shared.yaml]\nname: mine\n")
    line = refusal("validate", str(tmp_path / "shared.yaml"))
    assert line.startswith(f"{tmp_path / 'shared.yaml'}: a base for `extends`"), line
    assert refusal("validate", str(tmp_path / "bad.yaml")) == (
        f"{tmp_path / 'bad.yaml'}:1: name: 'abc' is not a valid !!int"
    )


class Hung(BaseException):
    """Raised in a test still waiting after 20 s: no handler of the code under test takes
    it for a failed read (TimeoutError is an OSError)."""


@pytest.fixture
def deadline():
    """A test that would hang fails instead, after 20 s (a FIFO's open waits for a writer)."""

    def expired(signum, frame):
        raise Hung("still waiting after 20 s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(20)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def test_a_fifo_beside_a_config_without_a_name_is_not_waited_on(tmp_path, deadline):
    """Nothing writes to a FIFO among the YAML files near a config: the search for what
    extends the config passes it over (it waited on it for ever)."""
    os.mkfifo(tmp_path / "pipe.yaml")
    (tmp_path / "noname.yaml").write_text("model: {kind: allattn}\nstages: [train]\n")
    result = CliRunner().invoke(main, ["validate", str(tmp_path / "noname.yaml")])
    assert result.exit_code == 2
    assert result.output.startswith(f"error: {tmp_path / 'noname.yaml'}: name: required key")
    line = refusal("validate", str(tmp_path / "pipe.yaml"))
    assert line == f"{tmp_path / 'pipe.yaml'}: not a file"


def test_a_deeply_nested_file_beside_a_config_is_passed_over(tmp_path):
    (tmp_path / "deep.yaml").write_text("a: " + "[" * 3000 + "]" * 3000 + "\n")
    (tmp_path / "shared.yaml").write_text("model: {kind: allattn, d_model: 32}\n")
    (tmp_path / "mine.yaml").write_text("extends: [shared.yaml]\nname: mine\n")
    line = refusal("validate", str(tmp_path / "shared.yaml"))
    assert line.startswith(f"{tmp_path / 'shared.yaml'}: a base for `extends`"), line
    assert refusal("validate", str(tmp_path / "deep.yaml")) == (
        f"{tmp_path / 'deep.yaml'}:1: not valid YAML: nested more than 64 levels deep"
    )


def test_a_config_named_by_its_set_reads_nothing_beside_it(tmp_path, deadline):
    """The files near a config are read only to word the refusal of a config without a
    name: one named by --set loads whatever lies beside it."""
    os.mkfifo(tmp_path / "pipe.yaml")
    (tmp_path / "noname.yaml").write_text(
        "model: {kind: allattn, d_model: 32, n_layers: 1, n_heads: 2, n_persistent: 8}\n"
        "dataset: python_docs\nstages: [download]\n"
    )
    result = CliRunner().invoke(
        main, ["validate", str(tmp_path / "noname.yaml"), "--set", "name=named"]
    )
    assert result.exit_code == 0, result.output
