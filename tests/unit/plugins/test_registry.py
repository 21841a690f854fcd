"""The registry of model families and stage kinds (pipeline/plugins.py) on faked entry
points: the built-ins' declarations, the fallback without installed metadata, and the one-line
refusals of a plugin that clashes, fails to import or is not what its group expects."""

from __future__ import annotations

import importlib.metadata as md
from pathlib import Path
from types import SimpleNamespace

import pytest
import tomllib

from pipeline import plugins
from pipeline.plugins import MODEL_GROUP, STAGE_GROUP, PluginError, load

ROOT = Path(__file__).resolve().parents[3]


def fake(name: str, dist: str, obj=None, value: str = "fake_module:THING", error=None):
    def load_it():
        if error is not None:
            raise error
        return obj

    return SimpleNamespace(
        name=name, value=value, group=MODEL_GROUP, dist=SimpleNamespace(name=dist), load=load_it
    )


@pytest.fixture
def entry_points(monkeypatch):
    """Replace the installed entry points of the model group with the given ones, after
    this project's own."""
    installed = list(md.entry_points(group=MODEL_GROUP))

    def use(*extra, ours=True):
        monkeypatch.setattr(
            md, "entry_points", lambda group: (installed if ours else []) + list(extra)
        )

    return use


def accept(name, obj):
    return None


def test_builtins_register_through_entry_points(entry_points):
    """pyproject.toml's tables are the only list of the built-ins."""
    from pipeline.models import MODELS
    from stages import STAGES

    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
    entry_points()
    assert (
        list(load(MODEL_GROUP, "model kind", accept))
        == list(MODELS)
        == sorted(declared[MODEL_GROUP])
        == ["active_memory", "allattn", "infinity_former"]
    )
    assert set(plugins.providers[MODEL_GROUP].values()) == {"allattn-pipe"}
    # each stage after those it may read
    assert list(STAGES) == ["curriculum", "download", "preprocess", "train", "finetune", "evaluate"]
    assert set(STAGES) == set(declared[STAGE_GROUP])


def test_without_installed_metadata_the_builtins_come_from_pyproject(entry_points):
    from pipeline.models import MODELS

    entry_points(ours=False)
    assert load(MODEL_GROUP, "model kind", accept) == MODELS


def test_a_plugin_taking_a_builtin_name_is_one_line(entry_points):
    entry_points(fake("allattn", "clash-plugin"))
    with pytest.raises(PluginError) as e:
        load(MODEL_GROUP, "model kind", accept)
    assert str(e.value) == (
        "model kind 'allattn' of the distribution 'clash-plugin' (fake_module:THING): the "
        "name is taken by the distribution 'allattn-pipe'; rename one of them in its "
        '[project.entry-points."allattn_pipe.models"] table'
    )


def test_two_plugins_with_one_name_are_one_line(entry_points):
    entry_points(fake("gru", "b-plugin"), fake("gru", "a-plugin"))
    with pytest.raises(
        PluginError,
        match=r"^model kind 'gru' of the distribution 'b-plugin' "
        r"\(fake_module:THING\): the name is taken by the "
        r"distribution 'a-plugin'; rename one",
    ):
        load(MODEL_GROUP, "model kind", accept)


def test_a_plugin_that_fails_to_import_is_one_line(entry_points):
    entry_points(fake("gru", "gru-plugin", error=ImportError("cannot import name 'x'\nfrom y")))
    with pytest.raises(PluginError) as e:
        load(MODEL_GROUP, "model kind", accept)
    assert str(e.value) == (
        "model kind 'gru' of the distribution 'gru-plugin' "
        "(fake_module:THING) failed to load: ImportError: cannot import "
        "name 'x'\\nfrom y"
    )


def test_a_plugin_that_is_not_a_family_or_stage_is_one_line(entry_points):
    from pipeline.models import _not_a_family
    from stages import STAGES, _not_a_stage

    entry_points(fake("gru", "gru-plugin", obj=object()))
    with pytest.raises(
        PluginError,
        match=r"^model kind 'gru' of the distribution "
        r"'gru-plugin' \(fake_module:THING\): expected a "
        r"pipeline\.models\.protocol\.ModelFamily",
    ):
        load(MODEL_GROUP, "model kind", _not_a_family)
    assert _not_a_stage("training", STAGES["train"]) == (
        "its Stage.name is 'train': it must be the entry point's name"
    )
