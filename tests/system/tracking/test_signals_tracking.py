"""A SIGTERM while a backlog is being sent ends `sync` and `run` as every signal ends a
command (exit 143, one line), and what was sent before it is not sent again.

Before: `sync` died of the SIGTERM with its whole backlog left, records already sent included,
and the next `sync` made those runs again (5 runs for 3); `run`, whose start sends an
earlier run's backlog, took the SIGTERM in the middle of a request for a silent server, went
on and exited 0.

The tracking server is MLflow's own, in this test's process (tests/fixtures/stalling_server.py);
the command is a process of its own, which the server signals once the second run's `create`
has reached it whole (and then makes that run, as a server does with a request whose client is
gone).
Cost: three processes, about 20 s on 2 idle cores.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from pipeline.spec import load_spec
from pipeline.tracking.backlog import read_backlog
from pipeline.tracking.tracker import BACKLOG
from tests.fixtures.backlogs import RUNS, STEPS, backlog_of_runs
from tests.fixtures.stalling_server import received_whole, serve

CLI = [sys.executable, "-m", "pipeline.commands.cli"]
# A request's deadline far beyond what a busy CI machine takes to answer: these tests stop a
# request with a signal, and a create cut by its 5 s deadline (then made again: a second
# create of the same run) is another case (test_request_deadline.py), not this one
PATIENT = {**os.environ, "MLFLOW_HTTP_REQUEST_TIMEOUT": "60"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        srv = serve(tmp_path_factory.mktemp("server"), mp)
        yield srv
        srv.on_request = None
        srv.stop()


def config(tmp_path, url: str, name: str) -> str:
    path = tmp_path / f"{name}.yaml"
    path.write_text(f"""\
name: {name}
dataset: python_docs
model: {{kind: allattn, d_model: 32, n_layers: 1, n_heads: 2, n_persistent: 4, max_span: 64}}
train: {{steps: 2, batch_size: 2, seq_len: 8,
        optimizer: {{type: adam, lr: 1.0e-3, clip: global, clip_norm: 1.0}}}}
tracking: {{uri: "{url}"}}
workspace: {{root: {tmp_path / "runs"}}}
stages: [download]
""")
    return str(path)


def sigterm_at_the_second_create(server, proc_of) -> None:
    """The command gets a SIGTERM once the second `create` has reached the server whole,
    while it waits for the answer."""
    creates = []

    def on_request(environ) -> None:
        if environ["PATH_INFO"].endswith("/runs/create"):
            creates.append(1)
            if len(creates) == 2:
                # on a busy machine a signal at the headers stopped the client before the
                # body left: no run was made (the CI failure of the sync test)
                received_whole(environ)
                proc_of[0].send_signal(15)
                time.sleep(0.5)  # the signal lands while the request is in flight

    server.on_request = on_request


def runs_by_name(server, experiment: str) -> dict:
    client = server.client()
    exp = client.get_experiment_by_name(experiment)
    return {r.data.tags["mlflow.runName"]: r for r in client.search_runs([exp.experiment_id])}


def wait_for_runs(server, experiment: str, count: int) -> None:
    deadline = time.monotonic() + 60
    while len(runs_by_name(server, experiment)) < count:
        assert time.monotonic() < deadline, (
            f"the server never made {count} runs; its answers: {server.answers}"
        )
        time.sleep(0.1)


def test_a_sync_stopped_by_sigterm_leaves_what_it_sent_marked_and_the_next_sends_the_rest(
    tmp_path, server
):
    cfg = config(tmp_path, server.url, "sig-sync")
    backlog = load_spec(cfg, []).workspace_dir / BACKLOG
    backlog_of_runs(backlog, "sig-sync")
    proc: list[subprocess.Popen] = []
    sigterm_at_the_second_create(server, proc)
    started = subprocess.Popen([*CLI, "sync", cfg], stderr=subprocess.PIPE, text=True, env=PATIENT)
    proc.append(started)
    _, stderr = proc[0].communicate(timeout=300)
    assert proc[0].returncode == 143, stderr
    assert stderr.splitlines() == [
        f"error: stopped by SIGTERM: it was sending the tracking records an earlier run left; "
        f"those not sent stay in {backlog} for the next `allattn-pipe sync {cfg}` or run"
    ]
    wait_for_runs(server, "sig-sync", 2)  # the second run, made for a client that is gone

    server.on_request = None
    again = subprocess.run(
        [*CLI, "sync", cfg], capture_output=True, text=True, timeout=300, env=PATIENT
    )
    assert again.returncode == 0, again.stderr
    assert again.stdout.endswith(f"10 tracking records sent to {server.url}\n")
    runs = runs_by_name(server, "sig-sync")
    assert len(server.client().search_runs([runs["run0"].info.experiment_id])) == RUNS
    for i in range(RUNS):
        history = server.client().get_metric_history(runs[f"run{i}"].info.run_id, "loss")
        assert sorted((m.step, m.value) for m in history) == [
            (s, 1.0 / s + i) for s in range(1, STEPS + 1)
        ]
        assert runs[f"run{i}"].info.status == "FINISHED"
    assert not backlog.exists()


def test_a_sigterm_while_run_sends_an_earlier_backlog_stops_the_run(tmp_path, server):
    cfg = config(tmp_path, server.url, "sig-run")
    workspace = load_spec(cfg, []).workspace_dir
    backlog_of_runs(workspace / BACKLOG, "sig-run")
    proc: list[subprocess.Popen] = []
    sigterm_at_the_second_create(server, proc)
    started = subprocess.Popen([*CLI, "run", cfg], stderr=subprocess.PIPE, text=True, env=PATIENT)
    proc.append(started)
    _, stderr = proc[0].communicate(timeout=300)
    assert proc[0].returncode == 143, stderr
    # before, it said "the stage that was running is left unfinished": no stage had started
    assert stderr.splitlines()[-1] == (
        f"error: stopped by SIGTERM: no stage had started, it was sending the tracking records "
        f"an earlier run left; those not sent stay in {workspace / BACKLOG} for the next "
        f"`allattn-pipe sync {cfg}` or run"
    )
    assert "Traceback" not in stderr
    assert not (workspace / "download").exists()  # no stage ran after the signal
    waiting = read_backlog(workspace / BACKLOG).waiting
    assert [r["tags"]["mlflow.runName"] for _, r in waiting if r["op"] == "create"] == [
        "run1",
        "run2",
    ]
