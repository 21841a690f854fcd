"""The tests' one environment fixture (tests/fixtures/environment.py), run on three tests of its
own in a pytest of their own: what the first sets is gone for the second, and neither a user's
tracking server nor a user's cache directory reaches any."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ENVIRONMENT = Path(__file__).resolve().parents[1] / "fixtures" / "environment.py"

TESTS = """
import os

def test_a_stage_in_this_process_exports_its_process_group():
    assert "MLFLOW_TRACKING_URI" not in os.environ
    os.environ.update(RANK="0", MASTER_PORT="29999", MLFLOW_HTTP_REQUEST_TIMEOUT="5")

def test_the_next_test_starts_without_it():
    leaked = {k for k in ("RANK", "MASTER_PORT", "MLFLOW_HTTP_REQUEST_TIMEOUT",
                          "MLFLOW_TRACKING_URI") if k in os.environ}
    assert not leaked
    assert os.environ["KEPT"] == "yes"      # the session's own variables stay

def test_the_user_cache_is_the_sessions_own(tmp_path_factory):
    cache = os.environ.get("XDG_CACHE_HOME", "")
    assert cache.startswith(str(tmp_path_factory.getbasetemp())), cache
"""


def test_a_variable_one_test_sets_never_reaches_the_next(tmp_path):
    (tmp_path / "conftest.py").write_text(ENVIRONMENT.read_text())
    (tmp_path / "test_pair.py").write_text(TESTS)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "MASTER_PORT")}
    env.update(
        MLFLOW_TRACKING_URI="http://a-users-server:5000",
        KEPT="yes",
        XDG_CACHE_HOME=str(Path.home() / ".cache"),
    )
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "3 passed" in result.stdout
