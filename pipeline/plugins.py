"""Model families and stage kinds, found through entry points: the built-ins and an installed
package's alike.

A distribution adds a model family under the entry-point group `allattn_pipe.models` (the
name is the `model.kind` a spec writes; the object a `pipeline.models.protocol.ModelFamily`)
and a stage kind under `allattn_pipe.stages` (the name is what `stages:` lists; the object a
`stages.base.Stage`). This project's pyproject.toml declares its own families and stages in
the same groups, so there is one way a name is registered.

Without this project's installed metadata (a source checkout on PYTHONPATH, as
gpu/check.py runs on a GPU image, or an install older than the entry points) the
built-ins' declarations are read from the pyproject.toml beside `pipeline/`: the table pip
would have installed, not a second list.

A plugin that fails to load, is not what its group expects, or takes a name already taken
is a `PluginError`: one line naming its distribution.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

from pipeline.errors import PipelineError, shown

PROJECT = "allattn-pipe"
MODEL_GROUP = "allattn_pipe.models"
STAGE_GROUP = "allattn_pipe.stages"
PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"

providers: dict[str, dict[str, str]] = {}
"""group -> name -> the distribution that provides it (filled by `load`)."""


class PluginError(PipelineError):
    """An entry point that cannot be registered; the message names its distribution."""


def load(group: str, what: str, check: Callable[[str, object], str | None]) -> dict[str, object]:
    """name -> object of every entry point in `group`: this project's first, then the
    plugins' by distribution, each distribution's by name. `what` names an entry
    in messages ("model kind"); `check(name, obj)` says what is wrong with a loaded object
    (None: nothing)."""
    found: dict[str, object] = {}
    owners: dict[str, str] = {}
    for dist, ep in _entry_points(group):
        where = f"{what} '{shown(ep.name)}' of the distribution '{shown(dist)}' ({ep.value})"
        if ep.name in owners:
            raise PluginError(
                f"{where}: the name is taken by the distribution "
                f"'{shown(owners[ep.name])}'; rename one of them in its "
                f'[project.entry-points."{group}"] table'
            )
        try:
            obj = ep.load()
        except Exception as e:  # whatever a plugin's import raises, said in one line
            raise PluginError(f"{where} failed to load: {type(e).__name__}: {shown(e)}") from None
        problem = check(ep.name, obj)
        if problem:
            raise PluginError(f"{where}: {problem}")
        found[ep.name] = obj
        owners[ep.name] = dist
    providers[group] = owners
    return found


def _entry_points(group: str) -> list[tuple[str, metadata.EntryPoint]]:
    """(distribution name, entry point) pairs of `group`, this project's first. Sorted
    here, not as found: installers write a distribution's entry points in an order of their
    own (setuptools: by name), and the source fallback must give the same."""
    pairs = [
        (ep.dist.name if ep.dist else "unknown", ep) for ep in metadata.entry_points(group=group)
    ]
    ours = [p for p in pairs if _normal(p[0]) == _normal(PROJECT)]
    if not ours:
        ours = [(PROJECT, ep) for ep in _declared_in_source(group)]
    others = [p for p in pairs if _normal(p[0]) != _normal(PROJECT)]
    return sorted(ours, key=lambda p: p[1].name) + sorted(
        others, key=lambda p: (_normal(p[0]), p[1].name)
    )


def _declared_in_source(group: str) -> list[metadata.EntryPoint]:
    try:
        tomllib = importlib.import_module("tomllib")  # Python 3.11 on
    except ModuleNotFoundError:
        raise _not_installed(group) from None

    if not PYPROJECT.is_file():
        raise _not_installed(group)
    table = tomllib.loads(PYPROJECT.read_text(encoding="utf-8"))
    declared = table.get("project", {}).get("entry-points", {}).get(group)
    if not declared:
        raise PluginError(f'{PYPROJECT} declares no [project.entry-points."{group}"]')
    return [metadata.EntryPoint(name, value, group) for name, value in declared.items()]


def _not_installed(group: str) -> PluginError:
    return PluginError(
        f"{PROJECT} is not installed (no entry points in '{group}') and its "
        f"pyproject.toml cannot be read here: install it, `pip install -e .` "
        f"in the project"
    )


def _normal(dist: str) -> str:
    """A distribution name as PyPI compares them (PEP 503)."""
    return dist.lower().replace("_", "-").replace(".", "-")
