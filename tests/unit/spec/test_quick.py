"""spec/quick.py: the workspace `run` reads off a config before validating it (its busy
check) is the validated spec's workspace, for every config of the repository and the --set
and --smoke that change it; where it cannot tell, it says nothing rather than guess."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.spec import load_spec
from pipeline.spec.quick import DEFAULT_ROOT, workspace_of
from pipeline.spec.schema import WorkspaceSpec
from tests.fixtures.runs import ROOT

CONFIGS = sorted(
    p for p in (ROOT / "configs").rglob("*.yaml") if "base" not in p.relative_to(ROOT).parts
)


def test_the_default_root_is_the_schemas():
    assert WorkspaceSpec().root == DEFAULT_ROOT


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_config_names_the_workspace_its_spec_has(config):
    for sets, smoke in [([], False), ([], True), (["name=other"], True)]:
        expected = load_spec(config, sets, smoke=smoke).workspace_dir
        assert workspace_of(config, sets, smoke) == expected, (sets, smoke)


def test_the_sets_that_move_the_workspace(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text((ROOT / "configs" / "quickstart.yaml").read_text())
    for sets in (
        ["workspace.root=elsewhere"],
        ["workspace={root: there}"],
        ["workspace.root=a", "name=b"],
        ["workspace={cache: c}"],  # the root back to its default
    ):
        assert workspace_of(cfg, sets) == load_spec(cfg, sets).workspace_dir, sets
    assert workspace_of(cfg, ["workspace={root: there}"]) == Path("there/quickstart")


@pytest.mark.parametrize(
    "text, sets",
    [
        ("name: x\n", ["~name"]),  # removed: the validation's error, not a guess
        ("name: [a]\n", []),
        ("name: x\nworkspace: 3\n", []),
        ("name: x\n", ["workspace.root="]),
        ("a: [\n", []),  # not YAML
    ],
)
def test_what_it_cannot_tell_it_leaves_to_the_validation(tmp_path, text, sets):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(text)
    assert workspace_of(cfg, sets) is None
    assert workspace_of(tmp_path / "missing.yaml", []) is None
