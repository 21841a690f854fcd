"""tests/fixtures/shared_data.py's shared_data: in a checkout with no ../shared beside it a test
that needs the benchmark data skips with its reason; with ALLATTN_REQUIRE_SHARED_DATA set (CI) it
fails naming the missing file; with the data there it runs."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]

USES_SHARED_DATA = """\
from tests.fixtures.shared_data import shared_data

def test_reads_the_corpus():
    assert shared_data("corpus/input.txt").read_text() == "real text\\n"
"""


@pytest.fixture
def clone(tmp_path) -> Path:
    """tmp/clone/tests with the project's tests/fixtures/shared_data.py and one test that
    reads ../shared/data/corpus/input.txt; tmp/shared does not exist."""
    tests = tmp_path / "clone" / "tests"
    (tests / "fixtures").mkdir(parents=True)
    shutil.copy(TESTS / "fixtures" / "shared_data.py", tests / "fixtures")
    for package in (tests, tests / "fixtures"):  # packages, as in the project
        (package / "__init__.py").touch()
    (tests / "test_uses_shared_data.py").write_text(USES_SHARED_DATA)
    return tmp_path / "clone"


def pytest_in(clone: Path, *, require: bool) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "ALLATTN_REQUIRE_SHARED_DATA"}
    if require:
        env["ALLATTN_REQUIRE_SHARED_DATA"] = "1"
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "tests"],
        cwd=clone,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_missing_shared_data_skips_with_the_path(clone):
    r = pytest_in(clone, require=False)
    path = clone.parent / "shared" / "data" / "corpus" / "input.txt"
    assert r.returncode == 0, r.stdout
    reason = f": needs {path} (benchmark data beside the checkout)"
    assert [
        line
        for line in r.stdout.splitlines()
        if line.startswith("SKIPPED [1] tests/fixtures/shared_data.py:") and line.endswith(reason)
    ]
    assert r.stdout.splitlines()[-1].startswith("1 skipped in ")


def test_missing_shared_data_fails_when_required(clone):
    r = pytest_in(clone, require=True)
    path = clone.parent / "shared" / "data" / "corpus" / "input.txt"
    assert r.returncode == 1, r.stdout
    assert f"{path} is missing (ALLATTN_REQUIRE_SHARED_DATA is set)" in r.stdout.splitlines()
    assert r.stdout.splitlines()[-1].startswith("1 failed in ")


def test_present_shared_data_is_read(clone):
    corpus = clone.parent / "shared" / "data" / "corpus"
    corpus.mkdir(parents=True)
    (corpus / "input.txt").write_text("real text\n")
    r = pytest_in(clone, require=True)
    assert r.returncode == 0, r.stdout
    assert r.stdout.splitlines()[-1].startswith("1 passed in ")
