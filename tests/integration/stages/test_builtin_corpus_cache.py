"""The built-in corpus is built once per machine: the download stage of a second workspace
reads it from the user's cache ($XDG_CACHE_HOME/allattn-pipe) after checking its sha256, a
cached copy that does not match is rebuilt with a line saying so, and a build is announced
before it starts. The builder here is a stand-in that counts its calls (the real one reads
the standard library for 10-30 s)."""

from __future__ import annotations

import grp
import hashlib
import os
import pwd
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


# ---------------------------------------------------------------- a cache another user wrote
#
# Another user is drawn for real: as root (CI), files are given to uid 65534 (nobody) with
# chown. A planted text with its own matching sha256 must never become the corpus.

NOBODY = 65534
PLANTED = b"A text another user planted in the cache.\n" * 40
needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="giving a file to another user (chown) needs root"
)


def plant(tmp_path: Path) -> Path:
    """A cached corpus whose sha256 file matches it, where the cache keeps python-docs."""
    path = corpus._cache_path("python-docs")
    assert str(path).startswith(str(tmp_path / "xdg"))
    path.parent.mkdir(parents=True)
    path.write_bytes(PLANTED)
    path.with_name(path.name + ".sha256").write_text(hashlib.sha256(PLANTED).hexdigest())
    return path


@needs_root
def test_a_cache_directory_another_user_owns_is_not_read(tmp_path, builds):
    path = plant(tmp_path)
    for p in (path.parent, path, path.with_name(path.name + ".sha256")):
        os.chown(p, NOBODY, NOBODY)
    out, _, logs = download(tmp_path / "a")
    assert (out / "files" / "python-docs.txt").read_bytes() == TEXT
    assert builds == ["built"]
    assert logs[0] == (
        f"the corpus cache is not used: {path.parent} is owned by uid 65534 (nobody), not by "
        f"this user; building the corpus here (set XDG_CACHE_HOME to a directory only you "
        f"can write to)"
    )
    assert not any("reused cached corpus" in m for m in logs)
    assert path.read_bytes() == PLANTED  # nothing written into another user's directory


@needs_root
def test_a_cache_directory_another_group_can_write_is_not_read(tmp_path, builds):
    path = plant(tmp_path)
    os.chown(path.parent, 0, NOBODY)
    path.parent.chmod(0o775)
    out, _, logs = download(tmp_path / "a")
    assert (out / "files" / "python-docs.txt").read_bytes() == TEXT
    assert f"{path.parent} is writable by group nogroup (mode 0775)" in logs[0]


def test_a_cache_directory_every_user_can_write_is_not_read(tmp_path, builds):
    path = plant(tmp_path)
    path.parent.chmod(0o777)  # a cache under /tmp that anyone made
    out, _, logs = download(tmp_path / "a")
    assert (out / "files" / "python-docs.txt").read_bytes() == TEXT
    assert f"{path.parent} is writable by every user (mode 0777)" in logs[0]


@needs_root
def test_a_cached_file_another_user_owns_is_rebuilt_in_our_own_directory(tmp_path, builds):
    path = plant(tmp_path)
    os.chown(path, NOBODY, NOBODY)
    out, _, logs = download(tmp_path / "a")
    assert (out / "files" / "python-docs.txt").read_bytes() == TEXT
    assert logs[0] == (
        f"not reading the cached corpus: cached corpus {path} is owned by uid 65534 "
        f"(nobody), not by this user; rebuilding it"
    )
    assert path.read_bytes() == TEXT and path.stat().st_uid == os.geteuid()
    _, _, again = download(tmp_path / "b")  # ours now: reused
    assert f"reused cached corpus {path} (sha256 ok)" in again and builds == ["built"]


def test_a_cache_made_under_umask_002_is_ours_to_read_back(tmp_path, builds):
    old = os.umask(0o002)
    try:
        download(tmp_path / "a")
    finally:
        os.umask(old)
    path = cached_file(tmp_path)
    for p in (path.parent, path, path.with_name(path.name + ".sha256")):
        assert p.stat().st_mode & 0o022 == 0, oct(p.stat().st_mode)
    _, _, logs = download(tmp_path / "b")
    assert f"reused cached corpus {path} (sha256 ok)" in logs and builds == ["built"]


def test_a_group_of_ones_own_may_write_to_the_cache(tmp_path, builds):
    """A umask of 002 where each user has a group of their own (the user private groups of
    Debian and Red Hat): such a group-writable cache is only this user's, and is read."""
    user, group = pwd.getpwuid(os.geteuid()), grp.getgrgid(os.getegid())
    if group.gr_name != user.pw_name or set(group.gr_mem) - {user.pw_name}:
        pytest.skip(f"group {group.gr_name} is not a private group of user {user.pw_name}")
    download(tmp_path / "a")
    path = cached_file(tmp_path)
    path.parent.chmod(0o775)
    path.chmod(0o664)
    _, _, logs = download(tmp_path / "b")
    assert f"reused cached corpus {path} (sha256 ok)" in logs and builds == ["built"]


def test_a_user_without_a_home_directory_builds_the_corpus(tmp_path, builds, monkeypatch):
    """A container's user with no HOME and no passwd entry (an arbitrary uid): Path.home()
    raised RuntimeError, a traceback in the download stage."""

    def no_entry(uid):
        raise KeyError(f"getpwuid(): uid not found: {uid}")

    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.delenv("HOME", raising=False)
    monkeypatch.setattr(pwd, "getpwuid", no_entry)
    logs: list[str] = []
    assert corpus.cached("python-docs", logs.append) == TEXT
    assert logs == [
        "building the built-in corpus 'python-docs' (no network; reads the standard library, "
        "10-30 s); not cached: neither XDG_CACHE_HOME nor a home directory is set"
    ]
