"""Every program's ``main`` fits on a screen: at most 60 lines (``def`` to its last line), in
the package and in every tool folder. A longer one hands a step to a helper whose name says
what the step does (issue 44)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("pipeline", "stages", "launch", "gpu", "bench", "quality", "reproduce")
LIMIT = 60


def mains(folder: str) -> list[tuple[str, int]]:
    """(where, length in lines) of every function named main under ``folder``."""
    found = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == "main":
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                found.append((f"{path.relative_to(ROOT)}:{node.lineno}", length))
    return found


@pytest.mark.parametrize("folder", FOLDERS)
def test_every_main_is_at_most_60_lines(folder):
    found = mains(folder)
    too_long = [f"{where} is {length} lines" for where, length in found if length > LIMIT]
    assert not too_long, f"main longer than {LIMIT} lines: {too_long}"


def test_the_rule_sees_the_programs():
    """The walk finds the entry points it is about (a rule over no files passes forever)."""
    where = {w.split(":")[0] for folder in FOLDERS for w, _ in mains(folder)}
    assert {"gpu/check.py", "bench/train_step.py", "pipeline/commands/launched.py"} <= where
