"""Built-in corpora that need no network: real English text every Python installation has.

`python-docs`: the interactive help topics (pydoc_data, the language reference in prose) and
the long docstrings of the standard library's modules, classes and functions, read from
source with `ast` (nothing is imported or executed). About 1.2 MB on CPython 3.11; the exact
text depends on the Python version, so its sha256 is recorded with the download.

Building it reads the whole standard library (10-30 s), so it is built once per machine and
Python: `cached` keeps it in the user's cache directory ($XDG_CACHE_HOME/allattn-pipe, else
~/.cache/allattn-pipe), beside its sha256, and every workspace's download reuses it. A cache
is read only where this user (or root) wrote it and no one else can write to it
(`fsutil.not_ours`): a shared or world-writable cache could hold a planted text whose sha256
file matches it.
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
    allattn-pipe/corpora. RuntimeError where there is neither (no HOME, no passwd entry)."""
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
    (or it cannot be read: rebuilt like a missing one). A file another user could have
    written is a PipelineError saying so."""
    from pipeline.fsutil import read_ours

    try:
        data = read_ours(path, "cached corpus")
        checksum = read_ours(path.with_name(path.name + ".sha256"), "corpus checksum")
        recorded = checksum.decode("utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return data, recorded, hashlib.sha256(data).hexdigest()


def _foreign_cache(folder: Path) -> str | None:
    """Why the cache directory `folder` is not read or written (another user owns it, or
    others can write to it), or None: it is ours, or missing."""
    from pipeline.errors import shown
    from pipeline.fsutil import not_ours

    try:
        why = not_ours(folder)
    except OSError:  # missing (made when the corpus is cached), or not ours to look in
        return None
    return f"{shown(str(folder))} is {why}" if why else None


def _make_cache_dir(folder: Path) -> None:
    # writable by this user alone whatever the umask (002 would let the group write), or the
    # next run could not trust what it finds there
    folder.parent.mkdir(parents=True, exist_ok=True)
    folder.mkdir(mode=0o755, exist_ok=True)


def cached(name: str, log: Callable[[str], None]) -> bytes:
    """The built-in corpus `name`, from the cache when its bytes match the sha256 kept beside
    them, else built (saying so first, as it takes a while) and cached. A cache that cannot
    be written costs only the next workspace's rebuild: said, not raised. A cache that
    another user owns or can write to is neither read nor written: said, and built here."""
    from pipeline.errors import PipelineError, Preempted, shown
    from pipeline.fsutil import atomic_write_bytes, atomic_write_text

    if name not in BUILTIN:
        build(name)  # raises, naming the known ones
    try:
        path = _cache_path(name)
    except RuntimeError:  # no home directory: a container's user with no passwd entry
        log(
            f"building the built-in corpus '{name}' (no network; reads the standard library, "
            f"10-30 s); not cached: neither XDG_CACHE_HOME nor a home directory is set"
        )
        return build(name)
    foreign = _foreign_cache(path.parent)
    if foreign:
        log(
            f"the corpus cache is not used: {foreign}; building the corpus here (set "
            f"XDG_CACHE_HOME to a directory only you can write to)"
        )
        found = None
    else:
        try:
            found = _read_cached(path)
        except Preempted:  # a signal, not the file
            raise
        except PipelineError as e:
            log(f"not reading the cached corpus: {e}; rebuilding it")
            found = None
    if found is not None:
        data, recorded, actual = found
        if recorded == actual:
            log(f"reused cached corpus {shown(str(path))} (sha256 ok)")
            return data
        log(
            f"cached corpus {shown(str(path))} does not match its sha256 (recorded "
            f"{recorded[:16]}..., found {actual[:16]}...): rebuilding it"
        )
    where = "" if foreign else f"; cached for every workspace in {shown(str(path.parent))}"
    log(
        f"building the built-in corpus '{name}' (no network; reads the standard library, "
        f"10-30 s{where})"
    )
    data = build(name)
    if foreign:
        return data
    try:
        # the bytes first: a checksum without its file is never left behind, and a file
        # without its checksum (a crash between) is rebuilt. Private: only this user's
        # files are read back.
        _make_cache_dir(path.parent)
        atomic_write_bytes(path, data, private=True)
        digest = hashlib.sha256(data).hexdigest()
        atomic_write_text(path.with_name(path.name + ".sha256"), digest, private=True)
    except OSError as e:
        log(
            f"note: cannot cache the built-in corpus in {shown(str(path.parent))}: "
            f"{e.strerror or e}; the next workspace builds it again"
        )
    return data
