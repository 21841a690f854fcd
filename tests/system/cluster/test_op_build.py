"""DeepSpeed's shared-memory comm op, which `distributed.init_process_group` builds on first use
on CPU for a rank of several (one process goes without it: tests/integration/cluster/
test_comm_op.py): built once per environment whichever `ninja` comes first on PATH, and never
stuck behind the `lock` file a killed build leaves. Each test starts a fresh process that loads
the op as such a rank does (`_load_comm_op`, then init_process_group) on a copy of the built
op."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.cluster import distributed
from pipeline.cluster.distributed import OP_BUILD_LOCK

ROOT = Path(__file__).resolve().parents[3]
OP = "deepspeed_shm_comm"
# The torch `lock` a build holds in the op's directory (torch.utils.file_baton.FileBaton).
TORCH_LOCK = Path(OP, "lock")
START = (
    "from pipeline.cluster import distributed; distributed.prepare_environment(); "
    "distributed._load_comm_op(); print(distributed.init_process_group())"
)


def start_env(extensions: Path, **extra) -> dict[str, str]:
    return (
        distributed.environment_for_new_group()
        | {
            "TORCH_EXTENSIONS_DIR": str(extensions),
            "DS_ACCELERATOR": "cpu",
            "PYTHONPATH": str(ROOT),
        }
        | extra
    )


def start(extensions: Path, timeout: float = 300, **extra) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", START],
        env=start_env(extensions, **extra),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """A TORCH_EXTENSIONS_DIR holding the built op: a copy of this environment's, brought up to
    date by one start (so a machine builds at most once for these tests)."""
    extensions = tmp_path_factory.mktemp("built") / "torch_extensions"
    ours = Path(os.environ.get("TORCH_EXTENSIONS_DIR", Path(sys.prefix) / "torch_extensions"))
    if (ours / OP).is_dir():
        shutil.copytree(ours / OP, extensions / OP, ignore=shutil.ignore_patterns("lock"))
    r = start(extensions, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return extensions


@pytest.fixture
def extensions(built, tmp_path) -> Path:
    """A private copy of `built` (mtimes kept, so ninja sees it up to date)."""
    shutil.copytree(built, tmp_path / "torch_extensions")
    return tmp_path / "torch_extensions"


def test_a_lock_left_by_a_killed_build_is_removed_and_the_run_goes_on(extensions):
    (extensions / TORCH_LOCK).touch()
    t0 = time.monotonic()
    r = start(extensions, timeout=120)  # the original code waits on the lock forever
    print(f"start with a stale lock: {time.monotonic() - t0:.1f} s")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.splitlines()[-1] == "(0, 1)"
    assert (
        f"removing {extensions / TORCH_LOCK}: an interrupted build of DeepSpeed's {OP} op "
        f"left it (no process is building it now)"
    ) in r.stderr.splitlines()
    assert not (extensions / TORCH_LOCK).exists()


HOLDER = """\
import fcntl, sys
from pathlib import Path
extensions = Path(sys.argv[1])
lock = open(extensions / sys.argv[2], "a")
fcntl.flock(lock, fcntl.LOCK_EX)
(extensions / sys.argv[3]).touch()          # torch's lock, as during a build
print("holding", flush=True)
sys.stdin.read()                            # until the test closes our stdin
(extensions / sys.argv[3]).unlink()         # the build is done
"""


def test_a_build_in_progress_is_waited_for(extensions):
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(extensions), OP_BUILD_LOCK, str(TORCH_LOCK)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    runner = None
    try:
        assert holder.stdout.readline() == "holding\n"
        runner = subprocess.Popen(
            [sys.executable, "-c", START],
            env=start_env(extensions),
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        waiting = f"waiting for another process building DeepSpeed's C++ ops in {extensions}\n"
        seen = []
        while (line := runner.stderr.readline()) and line != waiting:
            seen.append(line)
        assert line == waiting, "".join(seen)[-3000:]
        time.sleep(1.0)
        assert runner.poll() is None  # still waiting while the holder lives
        holder.stdin.close()
        assert holder.wait(timeout=30) == 0
        out, err = runner.communicate(timeout=120)
        assert runner.returncode == 0, err[-3000:]
        assert out.splitlines()[-1] == "(0, 1)"
        assert "removing" not in err  # the finished build's lock was not stale
    finally:
        for p in (holder, runner):
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGKILL)
                p.wait()


def test_another_ninja_first_on_path_neither_runs_nor_rebuilds(extensions, tmp_path):
    """The image's ninja and the virtualenv's rebuild each other's builds from scratch: a run
    uses its environment's ninja whatever PATH says."""
    other = tmp_path / "other-bin"
    other.mkdir()
    calls = tmp_path / "calls"
    (other / "ninja").write_text(f'#!/bin/sh\necho "$@" >> {calls}\nexit 1\n')
    (other / "ninja").chmod(0o755)
    library = extensions / OP / f"{OP}.so"
    before = library.stat().st_mtime_ns
    r = start(extensions, PATH=f"{other}{os.pathsep}{os.environ['PATH']}")
    assert r.returncode == 0, r.stderr[-3000:]
    assert not calls.exists()
    assert library.stat().st_mtime_ns == before
