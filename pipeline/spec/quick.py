"""The workspace a config names, read without validating the config: `run` asks it before
the spec's validation, which imports the models and torch (seconds of a fresh process), so
that a second run on a busy workspace is refused at once. It answers only where it can
tell for sure; anything odd is left to `load_spec`, which says what is wrong in its words."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from pipeline.spec.names import smoke_name
from pipeline.spec.yaml_reading import load_with_extends, parse_override

DEFAULT_ROOT = "runs"  # WorkspaceSpec.root's default (tests/unit/spec/test_quick.py holds it)
NAMING_KEYS = {("name",), ("workspace",), ("workspace", "root")}


def workspace_of(path: str | Path, overrides: Sequence[str], smoke: bool = False) -> Path | None:
    """`Spec.workspace_dir` of the config at `path` with these `--set`, or None where it
    cannot be told without validating."""
    try:
        data = load_with_extends(Path(path), {})
        name, workspace = data.get("name"), data.get("workspace", {})
        if smoke and isinstance(name, str):
            name = smoke_name(name)  # as smoke_data does, before the --set
        for text in overrides:
            if text.startswith("~"):
                if tuple(text[1:].split(".")) in NAMING_KEYS:
                    return None
                continue
            key, value = parse_override(text)
            if key == ("name",):
                name = value
            elif key == ("workspace",):
                workspace = value
            elif key == ("workspace", "root"):
                workspace = {**workspace, "root": value} if isinstance(workspace, dict) else None
    except Exception:
        return None
    if not isinstance(workspace, dict):
        return None
    root = workspace.get("root", DEFAULT_ROOT)
    if not isinstance(name, str) or not name or not isinstance(root, str) or not root:
        return None
    return Path(root) / name
