"""The tests' one environment fixture (tests/fixtures/environment.py), run on tests of its own
in a pytest of their own, started the way a user starts the suite after `make quickstart`:
from a directory holding the quickstart's `runs/`, in a shell with a tracking server, a
process group and a Slurm job exported. No test sees any of it; what one test sets or writes
is gone for the next."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from pipeline.cluster.distributed import GROUP_VARIABLES
from tests.fixtures.environment import LAUNCHED, is_user_state

ENVIRONMENT = Path(__file__).resolve().parents[1] / "fixtures" / "environment.py"

TESTS = """
import os
from pathlib import Path

import pytest

USER_STATE = ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "RANK", "WORLD_SIZE",
              "MASTER_PORT", "SLURM_JOB_ID", "ALLATTN_DIST_TIMEOUT_MIN")

@pytest.fixture(scope="module")
def made_by_the_module():
    return Path.cwd()

def test_a_stage_in_this_process_exports_its_process_group(made_by_the_module):
    assert not [k for k in USER_STATE if k in os.environ]
    assert list(Path.cwd().iterdir()) == []           # its own directory, empty
    assert not Path("runs").exists()                 # not the user's
    os.environ.update(RANK="0", MASTER_PORT="29999", MLFLOW_HTTP_REQUEST_TIMEOUT="5")
    Path("runs").mkdir()

def test_the_next_test_starts_without_it(made_by_the_module, tmp_path_factory):
    leaked = {k for k in ("RANK", "MASTER_PORT", "MLFLOW_HTTP_REQUEST_TIMEOUT",
                          "MLFLOW_TRACKING_URI") if k in os.environ}
    assert not leaked
    assert not Path("runs").exists() and list(Path.cwd().iterdir()) == []
    assert Path.cwd() != made_by_the_module
    for here in (Path.cwd(), made_by_the_module):
        assert here.is_relative_to(tmp_path_factory.getbasetemp())
    assert os.environ["KEPT"] == "yes"      # the session's own variables stay
    assert os.environ["ALLATTN_REQUIRE_SHARED_DATA"] == "1"   # and the suite's switches

def test_the_user_cache_is_the_sessions_own(tmp_path_factory):
    cache = os.environ.get("XDG_CACHE_HOME", "")
    assert cache.startswith(str(tmp_path_factory.getbasetemp())), cache
"""


def test_no_test_sees_the_users_runs_variables_or_cache(tmp_path):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "conftest.py").write_text(ENVIRONMENT.read_text())
    (tmp_path / "tests" / "test_pair.py").write_text(TESTS)
    (tmp_path / "runs").mkdir()  # the quickstart's, where the user starts the suite
    (tmp_path / "runs" / "mlflow.db").write_text("a user's tracking store")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "MASTER_PORT")}
    env.update(
        MLFLOW_TRACKING_URI="http://a-users-server:5000",
        MLFLOW_EXPERIMENT_NAME="theirs",
        RANK="3",
        WORLD_SIZE="8",
        MASTER_PORT="29500",
        SLURM_JOB_ID="1234",
        ALLATTN_DIST_TIMEOUT_MIN="1",
        ALLATTN_REQUIRE_SHARED_DATA="1",
        KEPT="yes",
        XDG_CACHE_HOME=str(Path.home() / ".cache"),
    )
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "3 passed" in result.stdout
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["mlflow.db"]


def test_every_process_group_variable_is_the_users_state():
    """LAUNCHED is written out (the pipeline module that has them reads the user's state when
    imported): it holds every variable a launcher exports to describe a process group."""
    assert set(GROUP_VARIABLES) <= set(LAUNCHED)
    assert all(is_user_state(name) for name in GROUP_VARIABLES)
    assert not any(
        is_user_state(name)
        for name in ("PATH", "HOME", "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "DS_ACCELERATOR")
    )
