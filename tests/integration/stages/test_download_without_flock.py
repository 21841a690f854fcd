"""Two downloads of one file into one cache on a file system without flock (Lustre mounted
`noflock`, some FUSE and NFS mounts; tests.fixtures.no_flock): the second waits for the first,
under the lock file that stands in for flock (pipeline.locks), then takes the file from the
cache, as it does where flock works. Before, the download went on with no lock at all, and two
jobs of an array starting together wrote one partial file at once."""

from __future__ import annotations

import errno
import fcntl
import os
import threading
import time

import pytest

from pipeline.data import fetch
from pipeline.locks import filesystem_type, try_lock
from tests.fixtures.download_server import payload, sha
from tests.fixtures.no_flock import failing_flock

pytestmark = pytest.mark.usefixtures("offline_and_fast")


def test_a_second_download_waits_for_the_first_without_flock(server, tmp_path, monkeypatch):
    monkeypatch.setattr(fcntl, "flock", failing_flock(str(tmp_path), errno.ENOLCK))
    data = payload(50_000)
    server.files["text8"] = data
    downloads = tmp_path / "cache" / "downloads"
    downloads.mkdir(parents=True)
    lock = downloads / f"{sha(data)}.lock"
    fd = os.open(lock, os.O_RDWR | os.O_CREAT)
    first = try_lock(fd, lock, "the first download")  # at work, in another process
    assert first is not None and first.soft == downloads / f"{sha(data)}.lock.soft"

    logs: list[str] = []
    done: dict = {}
    second = threading.Thread(
        target=lambda: done.update(
            fetched=fetch.fetch(server.url("text8"), tmp_path / "cache", sha256=sha(data),
                                log=logs.append)
        )
    )  # fmt: skip
    second.start()
    deadline = time.monotonic() + 20
    while not logs and second.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert logs == [
        f"another process is downloading into {downloads}; waiting for it (its file system "
        f"({filesystem_type(downloads)}) has no flock, so the lock is the file {first.soft}: "
        f"if that download is gone (killed on another host), remove it)"
    ]
    (downloads / sha(data)).write_bytes(data)  # what the first one published
    first.release()
    os.close(fd)
    second.join(20)
    assert done["fetched"].cached and server.requests == []
    assert sorted(p.name for p in downloads.iterdir()) == [sha(data), lock.name]
