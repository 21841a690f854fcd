"""The external benchmark corpora (../shared/data beside the checkout) for the tests that read
them. A user's clone has no such folder: those tests skip with a one-line reason. CI has the
data and sets REQUIRE_SHARED_DATA (in .ci/run), which turns a missing file into a failure."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
REQUIRE_SHARED_DATA = "ALLATTN_REQUIRE_SHARED_DATA"


def find_shared_data(relpath: str) -> Path | None:
    """SHARED_DATA / relpath, or None where it is absent (a test failure with
    $ALLATTN_REQUIRE_SHARED_DATA set)."""
    path = SHARED_DATA / relpath
    if path.is_file():
        return path
    if os.environ.get(REQUIRE_SHARED_DATA):
        pytest.fail(f"{path} is missing ({REQUIRE_SHARED_DATA} is set)", pytrace=False)
    return None


def shared_data(relpath: str) -> Path:
    """SHARED_DATA / relpath; where it is absent the test skips (fails under
    $ALLATTN_REQUIRE_SHARED_DATA)."""
    path = find_shared_data(relpath)
    if path is None:
        pytest.skip(f"needs {SHARED_DATA / relpath} (benchmark data beside the checkout)")
    return path
