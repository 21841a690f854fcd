"""launch/train.py imports the installed package: it never edits the import path (sys.path,
PYTHONPATH, site), so the deepspeed launcher runs the same code as `allattn-pipe` does."""

from __future__ import annotations

import ast
from pathlib import Path

ENTRY = Path(__file__).resolve().parents[2] / "launch" / "train.py"


def test_launch_train_does_not_touch_the_import_path():
    tree = ast.parse(ENTRY.read_text(), str(ENTRY))
    touched = [
        f"line {node.lineno}: {ast.unparse(node)}"
        for node in ast.walk(tree)
        if (isinstance(node, ast.Attribute) and node.attr in ("path", "meta_path", "path_hooks"))
        and isinstance(node.value, ast.Name)
        and node.value.id == "sys"
        or isinstance(node, ast.Constant)
        and node.value == "PYTHONPATH"
        or isinstance(node, ast.Import | ast.ImportFrom)
        and any(alias.name in ("site", "importlib") for alias in node.names)
        or isinstance(node, ast.ImportFrom)
        and node.module in ("site", "importlib")
    ]
    assert not touched, f"{ENTRY.name} edits the import path: {touched}"
