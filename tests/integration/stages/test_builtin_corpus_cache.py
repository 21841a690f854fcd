"""The built-in corpus is built once per machine: the download stage of a second workspace
reads it from the user's cache ($XDG_CACHE_HOME/allattn-pipe) after checking its sha256, a
cached copy that does not match is rebuilt with a line saying so, and a build is announced
before it starts. The builder here is a stand-in that counts its calls (the real one reads
the standard library for 10-30 s)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from pipeline.data import corpus
from tests.fixtures.download_server import config, record, run_download

TEXT = b"Prose from the standard library, as the built-in corpus holds.\n" * 40


@pytest.fixture
def builds(tmp_path, monkeypatch) -> list[str]:
    """Each call of the python-docs builder, in a user cache of this test's own."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    calls: list[str] = []

    def builder() -> bytes:
        calls.append("built")
        return TEXT

    monkeypatch.setitem(corpus.BUILTIN, "python-docs", builder)
    return calls


def download(dir: Path):
    return run_download(config(dir, {"url": "builtin://python-docs"}))


def cached_file(tmp_path: Path) -> Path:
    (path,) = (tmp_path / "xdg" / "allattn-pipe" / "corpora").glob("python-docs-*.txt")
    return path


def test_a_second_workspace_reuses_the_cached_corpus(tmp_path, builds):
    first, _, first_logs = download(tmp_path / "a")
    assert builds == ["built"]
    path = cached_file(tmp_path)
    assert path.read_bytes() == TEXT
    assert any(line.startswith("building the built-in corpus 'python-docs'") for line in first_logs)
    second, _, logs = download(tmp_path / "b")
    assert builds == ["built"]  # not built again
    assert f"reused cached corpus {path} (sha256 ok)" in logs
    assert (second / "files" / "python-docs.txt").read_bytes() == TEXT
    assert record(second) == record(first)


def test_a_corrupted_cached_corpus_is_rebuilt_saying_so(tmp_path, builds):
    download(tmp_path / "a")
    path = cached_file(tmp_path)
    path.write_bytes(TEXT[:-10] + b"corrupted\n")
    out, _, logs = download(tmp_path / "b")
    assert builds == ["built", "built"]
    (line,) = [m for m in logs if "does not match its sha256" in m]
    assert line.startswith(f"cached corpus {path} does not match") and "rebuilding it" in line
    assert path.read_bytes() == TEXT  # the cache holds the good copy again
    assert (out / "files" / "python-docs.txt").read_bytes() == TEXT
    assert record(out)["sha256"] == hashlib.sha256(TEXT).hexdigest()


def test_the_build_is_announced_before_it_starts(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    logs: list[str] = []

    def builder() -> bytes:
        logs.append("<builder called>")
        return TEXT

    monkeypatch.setitem(corpus.BUILTIN, "python-docs", builder)
    corpus.cached("python-docs", logs.append)
    announced = next(i for i, m in enumerate(logs) if m.startswith("building the built-in"))
    assert announced < logs.index("<builder called>")
    assert str(tmp_path / "xdg" / "allattn-pipe" / "corpora") in logs[announced]


def test_a_cache_that_cannot_be_written_costs_only_a_rebuild(tmp_path, builds, monkeypatch):
    blocked = tmp_path / "not-a-directory"
    blocked.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocked))
    out, _, logs = download(tmp_path / "a")
    assert (out / "files" / "python-docs.txt").read_bytes() == TEXT
    (note,) = [m for m in logs if m.startswith("note: cannot cache the built-in corpus")]
    assert str(blocked / "allattn-pipe" / "corpora") in note
    assert note.endswith("the next workspace builds it again")
