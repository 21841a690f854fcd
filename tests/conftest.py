"""What every test shares.

- The environment: each test starts from the session's, less the variables that would point
  it at a user's tracking server, and whatever it sets is undone after it (`environment`).
- The external benchmark corpora (../shared/data beside the checkout) for the tests that read
  them. A user's clone has no such folder: those tests skip with a one-line reason. CI has the
  data and sets REQUIRE_SHARED_DATA (in .ci/run), which turns a missing file into a failure.
- Triton's interpreter on a machine without CUDA (the attention kernels' tests run there):
  on before anything imports triton, which is when Triton reads it.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path

import pytest

import pipeline.ops  # noqa: F401  (on a machine without CUDA, it turns Triton's interpreter on)

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
REQUIRE_SHARED_DATA = "ALLATTN_REQUIRE_SHARED_DATA"
# A user's tracking server (and registry), and the HTTP limits MlflowTracker exports for
# one: never a test's.
TRACKING_VARIABLES = (
    "MLFLOW_TRACKING_URI",
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES",
    "MLFLOW_HTTP_REQUEST_TIMEOUT",
    "MLFLOW_REGISTRY_URI",
)


@contextmanager
def _restored_environment():
    saved = dict(os.environ)
    for name in TRACKING_VARIABLES:
        os.environ.pop(name, None)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(autouse=True)
def environment():
    """os.environ as the session had it, less TRACKING_VARIABLES, restored after the test.

    Stages run in the test's process export RANK, MASTER_PORT... (the process group's set-up)
    and MlflowTracker its HTTP limits; left behind, they would make another test's subprocess
    join a process group that is not its own (its MASTER_PORT is this process's store:
    EADDRINUSE), or track to another test's server. The process group itself stays for the
    session: DeepSpeed caches its groups in module globals, so a group destroyed and made
    again in one process breaks the next in-process engine."""
    with _restored_environment():
        yield


@pytest.fixture(scope="module", autouse=True)
def module_environment():
    """The same around a module: what its module-scoped fixtures set (a run in this process,
    shared by the module's tests) is undone when the module ends. Autouse fixtures come
    first within their scope, so this one saves before any of them runs."""
    with _restored_environment():
        yield


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
