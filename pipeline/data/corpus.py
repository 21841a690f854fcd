"""Built-in corpora that need no network: real English text every Python installation has.

`python-docs`: the interactive help topics (pydoc_data, the language reference in prose) and
the long docstrings of the standard library's modules, classes and functions, read from
source with `ast` (nothing is imported or executed). About 1.2 MB on CPython 3.11; the exact
text depends on the Python version, so its sha256 is recorded with the download.
"""

from __future__ import annotations

import ast
import sysconfig
from pathlib import Path

MIN_DOCSTRING = 200  # shorter ones are mostly one-line summaries; keep prose


def _stdlib_docstrings(root: Path) -> list[str]:
    texts = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).parts
        # third-party packages, tests and tool scripts are not the library's prose
        if (
            rel[0] in ("site-packages", "dist-packages", "test", "idlelib", "lib2to3")
            or "tests" in rel
            or rel[0].startswith("config-")
        ):
            continue
        try:
            tree = ast.parse(path.read_bytes())
        except (SyntaxError, ValueError, OSError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) >= MIN_DOCSTRING:
                    texts.append(doc.strip())
    return texts


def python_docs() -> bytes:
    from pydoc_data.topics import topics

    parts = [topics[key].strip() for key in sorted(topics)]
    parts += _stdlib_docstrings(Path(sysconfig.get_paths()["stdlib"]))
    return ("\n\n".join(parts) + "\n").encode("utf-8")


BUILTIN = {"python-docs": python_docs}


def build(name: str) -> bytes:
    try:
        return BUILTIN[name]()
    except KeyError:
        raise ValueError(f"no built-in corpus '{name}'; known: {', '.join(BUILTIN)}") from None
