"""A tracking server that is down, or goes down, never stops the pipeline; runs that end badly
are marked FAILED / KILLED in MLflow.

The server is MLflow's own tracking server (its Flask app) served on a loopback port inside
the test process, so a test can stop it and start it again on the same port in milliseconds.
The stages are stand-ins (as in test_runner.py) that log like the real ones.
"""

from __future__ import annotations

import json
import signal
import socket
import threading
import time
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from pipeline.commands.cli import main
from pipeline.spec import PROJECT_ROOT, load_spec
from pipeline.tracking.tracker import BACKLOG, MlflowTracker
from pipeline.workspace.runner import Runner
from tests.fixtures.stand_in_stages import ORDER, logging_stand_ins

STEPS = 12


class MlflowServer:
    """MLflow's tracking server over a file store, in a thread; `stop` closes the port."""

    def __init__(self, root):
        self.store_uri = (root / "store").as_uri()
        self.artifacts = root / "artifacts"
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.httpd = None

    def start(self) -> None:
        from mlflow.server import app
        from werkzeug.serving import WSGIRequestHandler, make_server

        class Quiet(WSGIRequestHandler):
            def log(self, *args) -> None: ...

        self.httpd = make_server("127.0.0.1", self.port, app, threaded=True, request_handler=Quiet)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def client(self):
        from mlflow.tracking import MlflowClient

        return MlflowClient(self.store_uri)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        root = tmp_path_factory.mktemp("mlflow")
        srv = MlflowServer(root)
        # read by MLflow's server handlers when they first open their store
        mp.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
        mp.setenv("_MLFLOW_SERVER_FILE_STORE", srv.store_uri)
        mp.setenv("_MLFLOW_SERVER_ARTIFACT_ROOT", str(srv.artifacts))
        srv.start()
        yield srv
        srv.stop()


@pytest.fixture
def stand_ins(monkeypatch):
    return logging_stand_ins(monkeypatch, STEPS)


def config(tmp_path, uri: str, name: str = "pipe"):
    path = tmp_path / f"{name}.yaml"
    path.write_text(f"""\
name: {name}
dataset: python_docs
model: {{kind: allattn, d_model: 32, n_layers: 1, n_heads: 2, n_persistent: 4, max_span: 64}}
train: {{steps: 2, batch_size: 2, seq_len: 8,
        optimizer: {{type: adam, lr: 1.0e-3, clip: global, clip_norm: 1.0}}}}
finetune: {{steps: 1}}
tracking: {{uri: "{uri}"}}
workspace: {{root: {tmp_path / "runs"}}}
stages: [download, preprocess, train, finetune, evaluate]
""")
    return path


def runs_of(server, experiment: str) -> dict[str, object]:
    """{'pipeline' or stage name: the run}, for an experiment with one pipeline run."""
    client = server.client()
    found = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    return {r.data.tags.get("stage", "pipeline"): r for r in found}


def run_pipeline(cfg, warnings: list[str], retry_s: float = 0.2, flush_s: float = 1.0):
    tracker = MlflowTracker(
        load_spec(cfg, []).tracking.uri, retry_s=retry_s, flush_s=flush_s, warn=warnings.append
    )
    return Runner(load_spec(cfg, []), log=lambda m: None).run(tracker)


def loss_steps(server, run) -> list[int]:
    return [m.step for m in server.client().get_metric_history(run.info.run_id, "loss")]


def test_a_server_down_from_the_start_is_one_line_and_exit_2_in_seconds(tmp_path, stand_ins):
    import mlflow.tracking  # noqa: F401  (the time measured is the check's, not the import's)

    uri = f"http://127.0.0.1:{_free_port()}"
    started = time.monotonic()
    result = CliRunner().invoke(main, ["run", str(config(tmp_path, uri))])
    seconds = time.monotonic() - started
    assert result.exit_code == 2, result.output
    assert result.stderr == (
        f"error: tracking server {uri} is not answering (Connection refused); start it, or "
        f"unset tracking.uri and "
        f"MLFLOW_TRACKING_URI to record runs in the local store "
        f"sqlite:///{(tmp_path / 'runs' / 'mlflow.db').resolve()}\n"
    )
    assert seconds < 5
    assert not (tmp_path / "runs" / "pipe" / "download").exists()


def test_healthy_server_gets_every_record_once_and_the_stage_run_ids(tmp_path, server, stand_ins):
    warnings: list[str] = []
    records = run_pipeline(config(tmp_path, server.url, "healthy"), warnings)
    assert warnings == []
    runs = runs_of(server, "healthy")
    assert sorted(runs) == sorted(ORDER + ["pipeline"])
    parent = runs["pipeline"].info.run_id
    for name in ORDER:
        run = runs[name]
        assert (run.info.status, run.data.tags["mlflow.parentRunId"]) == ("FINISHED", parent)
        assert run.info.run_id == records[name]["mlflow_run_id"]
        assert loss_steps(server, run) == list(range(1, STEPS + 1))
        assert (run.data.params["stand_in"], run.data.tags["done"]) == (name, "yes")
        assert [a.path for a in server.client().list_artifacts(run.info.run_id)] == ["result.json"]
    assert runs["pipeline"].info.status == "FINISHED"
    assert not (tmp_path / "runs" / "healthy" / BACKLOG).exists()


def test_server_down_mid_train_and_back_later_gets_the_kept_records(tmp_path, server, stand_ins):
    """Down at step 4 of train, back at step 10: nothing waits, nothing lost, nothing twice."""

    def outage(ctx, step):
        if step == 4:
            server.stop()
        if step == 10:
            time.sleep(0.5)  # long enough for a failed retry in between
            server.start()
            time.sleep(0.5)

    stand_ins["train"] = outage
    warnings: list[str] = []
    # 5 s: a create that the shutdown cut off after it was sent is looked for before it is
    # made again (tracking.sender.Delivery), a search of the file store, slow on a busy machine
    run_pipeline(config(tmp_path, server.url, "outage"), warnings, flush_s=5.0)
    url = server.url
    assert [w.split(" (")[0] for w in warnings] == [
        f"MLflow {url}: tracking server not answering",
        f"MLflow {url}: tracking server answers again; sending the records kept meanwhile",
    ]
    runs = runs_of(server, "outage")
    assert {n: r.info.status for n, r in runs.items()} == {n: "FINISHED" for n in runs}
    assert len(runs) == 6
    assert loss_steps(server, runs["train"]) == list(range(1, STEPS + 1))
    assert not (tmp_path / "runs" / "outage" / BACKLOG).exists()


def test_server_down_until_the_end_leaves_a_backlog_that_sync_sends(tmp_path, server, stand_ins):
    """Down from step 5 of train on: the run finishes, the records wait in the backlog file,
    `sync` sends them once the server is back, and a second `sync` has nothing to send."""
    stand_ins["train"] = lambda ctx, step: step == 5 and server.stop()
    cfg = config(tmp_path, server.url, "backlog")
    backlog = tmp_path / "runs" / "backlog" / BACKLOG
    warnings: list[str] = []
    try:
        records = run_pipeline(cfg, warnings)
        sync_refused = CliRunner().invoke(main, ["sync", str(cfg)])
    finally:
        server.start()
    assert sorted(records) == sorted(ORDER)  # every stage ran and was published
    assert records["finetune"]["mlflow_run_id"] is None  # not created yet
    assert len(warnings) == 2, warnings
    assert warnings[0].startswith(f"MLflow {server.url}: tracking server not answering")
    assert warnings[1].endswith(
        f"they are in {backlog}, and so will be the rest of this "
        f"run's: `allattn-pipe sync {cfg}` sends them when the "
        f"server is back"
    )
    assert sync_refused.exit_code == 2
    assert sync_refused.stderr.startswith(
        f"error: tracking server {server.url} is not answering (Connection refused)"
    )

    waiting = [json.loads(line)["op"] for line in backlog.read_text().splitlines()]
    result = CliRunner().invoke(main, ["sync", str(cfg)])
    assert result.exit_code == 0, result.output
    assert not backlog.exists()
    runs = runs_of(server, "backlog")
    assert sorted(runs) == sorted(ORDER + ["pipeline"])
    assert {n: r.info.status for n, r in runs.items()} == {n: "FINISHED" for n in runs}
    for name in ORDER:
        assert loss_steps(server, runs[name]) == list(range(1, STEPS + 1))
        assert runs[name].data.tags["mlflow.parentRunId"] == runs["pipeline"].info.run_id
    assert [a.path for a in server.client().list_artifacts(runs["evaluate"].info.run_id)] == [
        "result.json"
    ]
    sent = len(waiting) - waiting.count("bind")
    assert result.output.splitlines()[-1] == f"{sent} tracking records sent to {server.url}"
    again = CliRunner().invoke(main, ["sync", str(cfg)])
    assert again.output == f"{backlog}: no tracking records waiting\n"


def test_a_failing_stage_is_marked_failed(tmp_path, server, stand_ins):
    def fail(ctx, step):
        if step == 3:
            raise RuntimeError("preprocess broke")

    stand_ins["preprocess"] = fail
    with pytest.raises(RuntimeError, match="preprocess broke"):
        run_pipeline(config(tmp_path, server.url, "failing"), [])
    runs = runs_of(server, "failing")
    assert {n: r.info.status for n, r in runs.items()} == {
        "pipeline": "FAILED",
        "download": "FINISHED",
        "preprocess": "FAILED",
    }
    assert loss_steps(server, runs["preprocess"]) == [1, 2]


@pytest.mark.parametrize(
    "stage, sig, code", [("download", signal.SIGTERM, 143), ("preprocess", signal.SIGINT, 130)]
)
def test_a_signal_outside_training_ends_the_runs_killed_with_one_line(
    tmp_path, server, stand_ins, stage, sig, code
):
    stand_ins[stage] = lambda ctx, step: step == 3 and signal.raise_signal(sig)
    name = f"signal-{stage}"
    # the original code had no handler: a SIGTERM would end pytest itself
    previous = signal.signal(signal.SIGTERM, lambda *a: pytest.fail("SIGTERM not handled"))
    # what SIGINT did before: Python's handler, or SIG_IGN in a process started in the
    # background (a non-interactive shell's `&`)
    sigint_before = signal.getsignal(signal.SIGINT)
    try:
        result = CliRunner().invoke(main, ["run", str(config(tmp_path, server.url, name))])
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert result.exit_code == code, result.output
    assert result.stderr == (
        f"error: stopped by {sig.name}: the stage that was running is "
        f"left unfinished; run the pipeline again to redo it\n"
    )
    runs = runs_of(server, name)
    expected = {"pipeline": "KILLED", stage: "KILLED"}
    if stage == "preprocess":
        expected["download"] = "FINISHED"
    assert {n: r.info.status for n, r in runs.items()} == expected
    assert loss_steps(server, runs[stage]) == [1, 2]
    assert signal.getsignal(signal.SIGINT) is sigint_before  # the run's handler is gone


def test_a_signal_before_any_stage_began_says_so(tmp_path, server, monkeypatch):
    """A SIGTERM while the run opens its tracking (the pipeline run being created): no stage
    was running, and the line does not say one was left unfinished."""
    import pipeline.tracking.tracker as tracker

    def signalled():
        signal.raise_signal(signal.SIGTERM)
        return {}

    monkeypatch.setattr(tracker, "environment_tags", signalled)
    previous = signal.signal(signal.SIGTERM, lambda *a: pytest.fail("SIGTERM not handled"))
    try:
        result = CliRunner().invoke(main, ["run", str(config(tmp_path, server.url, "early"))])
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert result.exit_code == 143, result.output
    assert result.stderr == (
        "error: stopped by SIGTERM: no stage had started; run the pipeline again\n"
    )
    assert not (tmp_path / "runs" / "early" / "download").exists()


def test_a_record_mlflow_refuses_is_reported_and_dropped_and_the_rest_goes_on(
    tmp_path, server, stand_ins
):
    """A param logged again with another value: MLflow answers with an error (a 500 from
    its server) that no retry fixes."""
    stand_ins["evaluate"] = lambda ctx, step: (
        step == 1 and ctx.tracker.log_params({"stand_in": "another value"})
    )
    warnings: list[str] = []
    run_pipeline(config(tmp_path, server.url, "refused"), warnings)
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith(f"MLflow {server.url}: MLflow refused a batch record for run ")
    assert warnings[0].endswith(" (HTTP 500); dropped it")
    runs = runs_of(server, "refused")
    assert runs["evaluate"].info.status == "FINISHED"
    assert loss_steps(server, runs["evaluate"]) == list(range(1, STEPS + 1))


class FlakyClient:
    """Stands in for MlflowClient: notes each write; the `fail_at`-th one finds no server."""

    def __init__(self, fail_at: int | None = None):
        self.calls: list[tuple] = []
        self.fail_at, self.count = fail_at, 0

    def _write(self, call: tuple) -> None:
        self.count += 1
        if self.count == self.fail_at:
            raise ConnectionRefusedError(111, "Connection refused")
        self.calls.append(call)

    def get_experiment_by_name(self, name):
        return SimpleNamespace(experiment_id="7")

    def create_run(self, experiment_id, start_time, tags):
        name = tags["mlflow.runName"]
        self._write(("create", name, tags.get("mlflow.parentRunId")))
        return SimpleNamespace(info=SimpleNamespace(run_id=f"id-{name}"))

    def log_batch(self, run_id, metrics, params, tags):
        self._write(("metrics", run_id, [(m.key, m.value, m.step) for m in metrics]))

    def set_terminated(self, run_id, status, end_time):
        self._write(("end", run_id, status))


def test_sync_cut_short_keeps_exactly_what_was_not_sent(tmp_path):
    """A replay that loses the server half-way leaves the rest, and the run ids it learnt, in
    the file; the next replay sends only that: no run created twice, no metric twice."""
    from pipeline.tracking.backlog import append_records
    from pipeline.tracking.sender import Delivery, replay

    def create(key, name, parent=None):
        return {
            "op": "create",
            "key": key,
            "experiment": "e",
            "artifact_location": None,
            "tags": {"mlflow.runName": name},
            "parent": parent,
            "time": 1,
        }

    backlog = tmp_path / BACKLOG
    append_records(
        backlog,
        [
            create("p", "pipe"),
            create("t", "train", parent="p"),
            *({"op": "batch", "key": "t", "metrics": [["loss", 1 / s, 5, s]]} for s in (1, 2, 3)),
            {"op": "end", "key": "t", "status": "FINISHED", "time": 9},
            {"op": "end", "key": "p", "status": "FINISHED", "time": 9},
        ],
    )
    first = FlakyClient(fail_at=4)
    assert replay(backlog, Delivery(first), warn=pytest.fail) == (3, 4)
    second = FlakyClient()
    assert replay(backlog, Delivery(second), warn=pytest.fail) == (4, 0)
    assert not backlog.exists()
    assert first.calls + second.calls == [
        ("create", "pipe", None),
        ("create", "train", "id-pipe"),
        ("metrics", "id-train", [("loss", 1.0, 1)]),
        ("metrics", "id-train", [("loss", 0.5, 2)]),
        ("metrics", "id-train", [("loss", 1 / 3, 3)]),
        ("end", "id-train", "FINISHED"),
        ("end", "id-pipe", "FINISHED"),
    ]


def test_a_torn_last_line_is_set_aside_and_every_whole_record_sent(tmp_path):
    """A kill during an append tears the backlog's last line; a later append starts on a new
    line. The replay sends every whole record and keeps the torn ones aside, named."""
    from pipeline.tracking.backlog import append_records, torn_path
    from pipeline.tracking.sender import Delivery, replay

    backlog = tmp_path / BACKLOG
    create = {
        "op": "create",
        "key": "t",
        "experiment": "e",
        "artifact_location": None,
        "tags": {"mlflow.runName": "train"},
        "parent": None,
        "time": 1,
    }
    append_records(backlog, [create, {"op": "batch", "key": "t", "metrics": [["loss", 1.0, 5, 1]]}])
    torn = '{"op": "batch", "key": "t", "metrics": [["loss", 0.5, 6, '
    with open(backlog, "a") as f:
        f.write(torn)  # killed mid-line
    append_records(backlog, [{"op": "batch", "key": "t", "metrics": [["loss", 0.25, 7, 3]]}])
    warnings: list[str] = []
    client = FlakyClient()
    assert replay(backlog, Delivery(client), warn=warnings.append) == (3, 0)
    assert client.calls == [
        ("create", "train", None),
        ("metrics", "id-train", [("loss", 1.0, 1)]),
        ("metrics", "id-train", [("loss", 0.25, 3)]),
    ]
    assert torn_path(backlog).read_text() == torn + "\n"
    assert len(warnings) == 1 and str(torn_path(backlog)) in warnings[0]


@pytest.mark.parametrize(
    "foreign",
    [
        '{"key": "t", "metrics": []}',
        '{"op": "batch"}',
        "[1, 2]",
        '"text"',
        '{"op": "bind", "key": "t"}',
        '{"op": "drop_table", "key": "t"}',
    ],
)
def test_json_lines_no_tracker_wrote_are_set_aside_like_torn_ones(tmp_path, foreign):
    """A backlog line that is JSON but no record (no op, no run key, an op the tracker
    never writes: an edited file) is set aside, named, and the records around it sent."""
    from pipeline.tracking.backlog import append_records, torn_path
    from pipeline.tracking.sender import Delivery, replay

    backlog = tmp_path / BACKLOG
    create = {
        "op": "create",
        "key": "t",
        "experiment": "e",
        "artifact_location": None,
        "tags": {"mlflow.runName": "train"},
        "parent": None,
        "time": 1,
    }
    append_records(backlog, [create])
    with open(backlog, "a") as f:
        f.write(foreign + "\n")
    append_records(backlog, [{"op": "batch", "key": "t", "metrics": [["loss", 0.25, 7, 3]]}])
    warnings: list[str] = []
    client = FlakyClient()
    assert replay(backlog, Delivery(client), warn=warnings.append) == (2, 0)
    assert client.calls == [("create", "train", None), ("metrics", "id-train", [("loss", 0.25, 3)])]
    assert torn_path(backlog).read_text() == foreign + "\n"
    assert len(warnings) == 1 and str(torn_path(backlog)) in warnings[0]


def test_the_training_loops_handler_takes_over_inside_and_hands_back_after():
    from pipeline.cluster.signals import RaiseOnSignal, StopSignal
    from pipeline.errors import Interrupted

    before = signal.getsignal(signal.SIGTERM)
    with RaiseOnSignal():
        with StopSignal() as stop:
            signal.raise_signal(signal.SIGTERM)  # the loop's: a flag, checkpoint next
        assert stop.received == "SIGTERM"
        # handed back, with the signal it took: the same SIGTERM again is the preemption's
        # duplicate (tests/unit/cluster/test_signals.py), a ctrl-C now stops the bookkeeping
        signal.raise_signal(signal.SIGTERM)
        with pytest.raises(Interrupted) as raised:
            signal.raise_signal(signal.SIGINT)
    assert raised.value.exit_code == 130
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_store_mlflow_refuses_is_one_line(tmp_path, monkeypatch):
    """MLflow 3 refuses a `file:` store unless MLFLOW_ALLOW_FILE_STORE is set: one line naming
    the store and the way out, exit 2, nothing run."""
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    cfg = tmp_path / "fs.yaml"
    store = (tmp_path / "store").as_uri()
    cfg.write_text(
        f"extends: [{PROJECT_ROOT / 'configs' / 'quickstart.yaml'}]\n"
        f"tracking: {{uri: '{store}'}}\nworkspace: {{root: {tmp_path / 'runs'}}}\n"
        f"stages: [download]\n"
    )
    result = CliRunner().invoke(main, ["run", str(cfg)])
    assert result.exit_code == 2, result.output
    assert result.output.startswith(f"error: tracking store {store}: MLflow refuses it: ")
    assert result.output.rstrip().endswith("(its opt-out: MLFLOW_ALLOW_FILE_STORE=true)")
    assert len(result.output.strip().splitlines()) == 1
    assert not list((tmp_path / "runs").glob("*/download*"))  # no stage started


def test_a_500_reads_http_500_whether_or_not_it_was_retried():
    """urllib3's "too many 500 error responses" (MLflow retried) and MLflow's INTERNAL_ERROR
    (the 500 handed back unretried, as a loaded CI machine saw) are one reason; a 4xx keeps
    MLflow's own words."""
    from mlflow.exceptions import RestException

    from pipeline.tracking.sender import reason

    retried = Exception(
        "Max retries exceeded (Caused by ResponseError('too many 500 error responses'))"
    )
    unretried = RestException(
        {"error_code": "INTERNAL_ERROR", "message": "Changing param values is not allowed"}
    )
    missing = RestException(
        {"error_code": "RESOURCE_DOES_NOT_EXIST", "message": "Run 'x' not found"}
    )
    assert reason(retried) == reason(unretried) == "HTTP 500"
    assert reason(missing) == "RESOURCE_DOES_NOT_EXIST: Run 'x' not found"
