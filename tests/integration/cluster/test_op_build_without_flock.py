"""The lock that keeps two processes from building DeepSpeed's C++ ops in one
TORCH_EXTENSIONS_DIR at once, on a file system without flock (tests.fixtures.no_flock): a lock
file stands in (pipeline.locks), where it was a traceback."""

from __future__ import annotations

import errno
import fcntl
import threading
import time

from pipeline.cluster import distributed
from pipeline.locks import filesystem_type
from tests.fixtures.no_flock import failing_flock


def test_op_builds_take_turns_without_flock(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(fcntl, "flock", failing_flock(str(tmp_path), errno.EOPNOTSUPP))
    monkeypatch.setattr(distributed, "QUIET_WAIT_S", 0.1)
    extensions = tmp_path / "extensions"
    soft = extensions / f"{distributed.OP_BUILD_LOCK}.soft"
    order: list[str] = []

    def second() -> None:
        with distributed._op_build_lock(extensions):
            order.append("second")

    with distributed._op_build_lock(extensions):
        assert soft.exists()
        waiter = threading.Thread(target=second)
        waiter.start()
        time.sleep(1.0)  # the second waits, and says so after QUIET_WAIT_S
        order.append("first")
    waiter.join(10)
    assert order == ["first", "second"] and not soft.exists()
    assert capsys.readouterr().err.splitlines() == [
        f"waiting for another process building DeepSpeed's C++ ops in {extensions}; its file "
        f"system ({filesystem_type(extensions)}) has no flock, so the lock is the file {soft}: "
        f"if that build is gone (killed on another host), remove it"
    ]
