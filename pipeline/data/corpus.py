"""Built-in corpora that need no network: real English text every Python installation has.

`python-docs`: the interactive help topics (pydoc_data, the language reference in prose) and
the long docstrings of the standard library's modules, classes and functions, read from
source with `ast` (nothing is imported or executed). About 1.2 MB on CPython 3.11; the exact
text depends on the Python version, so its sha256 is recorded with the download.

Building it reads the whole standard library (10-30 s), so it is built once per machine and
Python: `cached` keeps it in the user's cache directory ($XDG_CACHE_HOME/allattn-pipe, else
~/.cache/allattn-pipe), beside its sha256, and every workspace's download reuses it.
"""

from __future__ import annotations

import ast
import hashlib
import os
import sys
import sysconfig
from collections.abc import Callable
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


def cache_dir() -> Path:
    """Where built corpora are kept for every workspace of this user: $XDG_CACHE_HOME (an
    absolute path, as the XDG spec asks; a relative one is ignored) or ~/.cache, then
    allattn-pipe/corpora."""
    base = os.environ.get("XDG_CACHE_HOME", "")
    root = Path(base) if os.path.isabs(base) else Path.home() / ".cache"
    return root / "allattn-pipe" / "corpora"


def _cache_path(name: str) -> Path:
    # the text is the running Python's: one file per version and standard library, so that
    # two interpreters (a venv of another Python) never reuse each other's
    stdlib = sysconfig.get_paths()["stdlib"]
    tag = hashlib.sha256(f"{sys.version}\0{stdlib}".encode()).hexdigest()[:12]
    version = ".".join(map(str, sys.version_info[:3]))
    return cache_dir() / f"{name}-py{version}-{tag}.txt"


def _read_cached(path: Path) -> tuple[bytes, str, str] | None:
    """(bytes, recorded sha256, actual sha256) of a cached corpus, or None when there is none
    (or it cannot be read: rebuilt like a missing one)."""
    from pipeline.fsutil import read_bytes, read_text

    try:
        data = read_bytes(path, "cached corpus")
        recorded = read_text(path.with_name(path.name + ".sha256"), "corpus checksum").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return data, recorded, hashlib.sha256(data).hexdigest()


def cached(name: str, log: Callable[[str], None]) -> bytes:
    """The built-in corpus `name`, from the cache when its bytes match the sha256 kept beside
    them, else built (saying so first, as it takes a while) and cached. A cache that cannot
    be written costs only the next workspace's rebuild: said, not raised."""
    from pipeline.errors import shown
    from pipeline.fsutil import atomic_write_bytes, atomic_write_text

    if name not in BUILTIN:
        build(name)  # raises, naming the known ones
    path = _cache_path(name)
    found = _read_cached(path)
    if found is not None:
        data, recorded, actual = found
        if recorded == actual:
            log(f"reused cached corpus {shown(str(path))} (sha256 ok)")
            return data
        log(
            f"cached corpus {shown(str(path))} does not match its sha256 (recorded "
            f"{recorded[:16]}..., found {actual[:16]}...): rebuilding it"
        )
    log(
        f"building the built-in corpus '{name}' (no network; reads the standard library, "
        f"10-30 s; cached for every workspace in {shown(str(path.parent))})"
    )
    data = build(name)
    try:
        # the bytes first: a checksum without its file is never left behind, and a file
        # without its checksum (a crash between) is rebuilt
        atomic_write_bytes(path, data)
        atomic_write_text(path.with_name(path.name + ".sha256"), hashlib.sha256(data).hexdigest())
    except OSError as e:
        log(
            f"note: cannot cache the built-in corpus in {shown(str(path.parent))}: "
            f"{e.strerror or e}; the next workspace builds it again"
        )
    return data
