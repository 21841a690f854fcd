"""Recognising a base config: a file shared through `extends` that has no name of its own, so
it cannot run by itself. Run or validated directly, it is refused with what it is and the
configs that extend it, instead of "name: required key is missing".

A file without a name is a base when it lies in a folder named base/ (the project's
configs/base/) or when a config near it extends it: in its own folder or, for a file in a
base/ folder, in the folder above, a few levels deep (a user's own bases are found the
same way). The files near it are read only to word that refusal, for a config that has no
name once its --set are applied, and each is read as a spec is (regular files only, bounded):
loading a config never depends on what lies beside it.
"""

from __future__ import annotations

import os
from collections import deque
from pathlib import Path

from pipeline.spec.yaml_reading import SpecError, read_yaml

BASE_FOLDER = "base"
SCAN_DEPTH = 2  # folders below the scanned one: configs/active_memory/add.yaml from configs/
SCAN_FILES = 2000  # the YAML files read at most, so a base in a large folder costs little
EXAMPLES = 2


def _yaml_files(root: Path):
    """The .yaml / .yml files under `root`, at most SCAN_DEPTH folders down, hidden folders
    skipped, SCAN_FILES at most."""
    count = 0
    for folder, dirs, files in os.walk(root):
        depth = len(Path(folder).relative_to(root).parts)
        dirs[:] = sorted(d for d in dirs if not d.startswith(".")) if depth < SCAN_DEPTH else []
        for name in sorted(files):
            if name.endswith((".yaml", ".yml")):
                count += 1
                if count > SCAN_FILES:
                    return
                yield Path(folder) / name


def _read(path: Path) -> dict | None:
    """The YAML mapping in `path`, read as a spec is (a regular file, opened without waiting
    on a FIFO, bounded in size, nesting and values), or None where it is not one."""
    try:
        data = read_yaml(path)
    except SpecError:
        # not a config: it extends nothing (the config being run gets its own one-line
        # error from the spec)
        return None
    return data if isinstance(data, dict) else None


def _extenders(root: Path) -> tuple[dict[Path, list[Path]], set[Path]]:
    """Under `root`: each extended file (resolved) -> the files that extend it, and the
    files that have a name of their own (runnable, or nearly)."""
    extended_by: dict[Path, list[Path]] = {}
    named: set[Path] = set()
    for path in _yaml_files(root):
        data = _read(path)
        if data is None:
            continue
        if "name" in data:
            named.add(path)
        parents = data.get("extends", [])
        for parent in [parents] if isinstance(parents, str) else parents:
            if isinstance(parent, str):
                target = (path.parent / parent).resolve()
                extended_by.setdefault(target, []).append(path)
    return extended_by, named


def _runnable_extenders(path: Path, extended_by, named) -> list[Path]:
    """The named configs that extend `path`, through other bases too: the nearest first."""
    found: list[tuple[int, int, str, Path]] = []
    seen = {path.resolve()}
    queue = deque([(path.resolve(), 0)])
    while queue:
        current, depth = queue.popleft()
        for child in extended_by.get(current, []):
            if child.resolve() in seen:
                continue
            seen.add(child.resolve())
            if child in named:
                found.append((depth, len(child.parts), str(child), child))
            else:
                queue.append((child.resolve(), depth + 1))
    return [child for *_, child in sorted(found)]


def _as_typed(path: Path, like: Path) -> str:
    """`path` as the user would type it: relative where `like` (the path they gave) was."""
    if like.is_absolute():
        return str(path.resolve())
    try:
        return os.path.relpath(path.resolve())
    except ValueError:  # another drive
        return str(path.resolve())


def base_config_problem(path: Path, shown: str) -> str | None:
    """The one-line refusal for running or validating the base config `path` directly (a
    file whose merged keys have no name), or None where it is not a base."""
    in_base_folder = path.resolve().parent.name == BASE_FOLDER
    root = path.resolve().parent.parent if in_base_folder else path.resolve().parent
    extended_by, named = _extenders(root)
    extenders = _runnable_extenders(path, extended_by, named)
    if not in_base_folder and path.resolve() not in extended_by:
        return None
    what = f"{shown}: a base for `extends` (no name of its own)"
    if extenders:
        examples = " or ".join(_as_typed(p, path) for p in extenders[:EXAMPLES])
        return f"{what}; run a config that extends it, e.g. {examples}"
    return (
        f"{what}; run a config with `extends: [{_as_typed(path, path)}]` and a name, "
        f"or give this file a name"
    )
