"""A backlog replay (`sync`, or the start of a `run`) stopped anywhere resumes without losing a
record or sending one twice: each record is marked in the file as it goes, and a run whose
`create` was sent but not answered is found by its key before it is made again.

Before, a replay stopped by a signal left the whole file, records already sent included: the
next one made every run again. The stops here: a real SIGTERM to this process while the
second `create` is at a real MLflow server (tests/fixtures/stalling_server.py), and a stop
right after each write reached a real store and before the replay could mark it (what a
kill -9 leaves). tests/system/tracking/test_signals_tracking.py does it to `sync` and `run`
as processes.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from pipeline.cluster.signals import RaiseOnSignal
from pipeline.errors import Interrupted
from pipeline.tracking.backlog import read_backlog
from pipeline.tracking.sender import RUN_KEY_TAG, Delivery, replay
from pipeline.tracking.store import open_store
from pipeline.tracking.tracker import BACKLOG
from tests.fixtures.backlogs import RUNS, STEPS, backlog_of_runs
from tests.fixtures.stalling_server import received_whole, serve


def assert_each_record_once(client, experiment: str, keys: list[str]) -> None:
    exp = client.get_experiment_by_name(experiment)
    runs = client.search_runs([exp.experiment_id])
    assert sorted(r.data.tags["mlflow.runName"] for r in runs) == [f"run{i}" for i in range(RUNS)]
    for run in runs:
        i = int(run.data.tags["mlflow.runName"][3:])
        assert run.data.tags[RUN_KEY_TAG] == keys[i]
        assert run.info.status == "FINISHED"
        history = client.get_metric_history(run.info.run_id, "loss")
        assert sorted((m.step, m.value) for m in history) == [
            (s, 1.0 / s + i) for s in range(1, STEPS + 1)
        ]


def wait_for_runs(client, experiment: str, count: int) -> None:
    exp = client.get_experiment_by_name(experiment)
    deadline = time.monotonic() + 30
    while len(client.search_runs([exp.experiment_id])) < count:
        assert time.monotonic() < deadline, f"the server never made {count} runs"
        time.sleep(0.1)


def test_a_sigterm_during_a_request_stops_the_replay_and_the_next_sends_the_rest_once(
    tmp_path, monkeypatch
):
    server = serve(tmp_path / "server", monkeypatch)
    try:
        backlog = tmp_path / BACKLOG
        keys = backlog_of_runs(backlog, "replay")
        creates: list[str] = []

        def on_request(environ) -> None:
            if environ["PATH_INFO"].endswith("/runs/create"):
                creates.append(environ["PATH_INFO"])
                if len(creates) == 2:  # the second run's: the server makes it, all the same
                    received_whole(environ)
                    os.kill(os.getpid(), signal.SIGTERM)
                    time.sleep(0.5)

        server.on_request = on_request
        with RaiseOnSignal(after="run it again"), pytest.raises(Interrupted) as stopped:
            replay(backlog, Delivery(open_store(server.url)), warn=pytest.fail)
        assert str(stopped.value) == "stopped by SIGTERM: run it again"
        assert stopped.value.exit_code == 143
        waiting = read_backlog(backlog).waiting
        assert [r["op"] for _, r in waiting] == ["create", "batch", "batch", "batch", "end"] * 2
        assert waiting[0][1]["key"] == keys[1]  # the first run's records all marked sent

        # the next sync, later: the server has made the run whose answer the signal cut off
        wait_for_runs(server.client(), "replay", 2)
        server.on_request = None
        assert replay(backlog, Delivery(open_store(server.url)), warn=pytest.fail) == (10, 0)
        assert not backlog.exists()
        assert len(creates) == 2  # the second run was found by its key, not made again
        assert_each_record_once(server.client(), "replay", keys)
    finally:
        server.stop()


class Stopped(BaseException):
    """The replay's process dying (kill -9) right after a write reached the store."""


class StopsAfterWrite:
    """An MlflowClient that dies right after its `at`-th write, before the replay marks it."""

    WRITES = ("create_run", "log_batch", "set_terminated")

    def __init__(self, client, at: int):
        self.client, self.at, self.writes = client, at, 0

    def __getattr__(self, name: str):
        attribute = getattr(self.client, name)
        if name not in self.WRITES:
            return attribute

        def write(*args, **kwargs):
            result = attribute(*args, **kwargs)
            self.writes += 1
            if self.writes == self.at:
                raise Stopped
            return result

        return write


def test_a_replay_killed_between_any_write_and_its_mark_sends_nothing_twice(tmp_path):
    """Stopped right after a write of each kind (the backlog: RUNS runs of a create, STEPS
    batches and an end each), then replayed to the end."""
    client = open_store(f"sqlite:///{tmp_path / 'mlflow.db'}")
    writes = RUNS * (STEPS + 2)
    first_create, a_batch, an_end, second_create = 1, 2, STEPS + 2, STEPS + 3
    for at in (first_create, a_batch, an_end, second_create, writes):
        backlog = tmp_path / f"{at}" / BACKLOG
        backlog.parent.mkdir()
        keys = backlog_of_runs(backlog, f"killed-at-{at}")
        with pytest.raises(Stopped):
            replay(backlog, Delivery(StopsAfterWrite(client, at)), warn=pytest.fail)
        sent, left = replay(backlog, Delivery(client), warn=pytest.fail)
        assert (sent, left) == (writes - at + 1, 0), at  # the one unmarked write, again
        assert not backlog.exists()
        assert_each_record_once(client, f"killed-at-{at}", keys)
