"""A tracking server that answers and then hangs (every later request accepted, none
answered): each request gets one try of MLFLOW_HTTP_REQUEST_TIMEOUT seconds, 5 unless the
user says otherwise, for the whole command. `compare`, `sync`, `sweep` and `export
--register` end in one line naming the server (its password masked) at the first request
left unanswered; `run` trains on and keeps what the server did not take in the backlog,
which `sync` sends once the server answers again.

The server is MLflow's own over a sqlite store, behind a wrapper that holds the requests
it does not answer (tests/fixtures/stalling_server.py). The commands run through click in a
thread, so a command that hangs fails its test instead of holding the suite; most tests
set MLFLOW_HTTP_REQUEST_TIMEOUT=3 (a user's setting, which stands), `compare` runs on the
default bound.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import pytest
from click.testing import CliRunner

from pipeline.commands.cli import main
from pipeline.spec import load_spec
from pipeline.tracking.backlog import append_records, read_records
from pipeline.tracking.tracker import BACKLOG
from tests.fixtures.stalling_server import serve
from tests.fixtures.stand_in_stages import ORDER, logging_stand_ins

CANARY = "Canary-pw-77"  # the URI's password: in no line a command prints
STEPS = 8
WITHIN_S = 45  # "one line within about 30 s", with room for a busy test machine
TEST_TIMEOUT = "3"  # seconds a request waits in the tests that set their own bound


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        srv = serve(tmp_path_factory.mktemp("stalling"), mp)
        yield srv
        srv.stop()


@pytest.fixture
def stalling(server, monkeypatch):
    """The server, answering every request until the test says; the requests it held are
    let go (503) when the test ends."""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", TEST_TIMEOUT)
    server.answer(None)
    yield server
    server.release()


@pytest.fixture
def stand_ins(monkeypatch):
    return logging_stand_ins(monkeypatch, STEPS)


def uri(server) -> str:
    return f"http://bob:{CANARY}@127.0.0.1:{server.port}"


def masked(server) -> str:
    return f"http://bob:***@127.0.0.1:{server.port}"


def config(tmp_path, server, name: str, stages_list=ORDER) -> str:
    path = tmp_path / f"{name}.yaml"
    path.write_text(f"""\
name: {name}
dataset: python_docs
model: {{kind: allattn, d_model: 32, n_layers: 1, n_heads: 2, n_persistent: 4, max_span: 64}}
train: {{steps: 2, batch_size: 2, seq_len: 8,
        optimizer: {{type: adam, lr: 1.0e-3, clip: global, clip_norm: 1.0}}}}
finetune: {{steps: 1}}
tracking: {{uri: "{uri(server)}"}}
workspace: {{root: {tmp_path / "runs"}}}
stages: [{", ".join(stages_list)}]
""")
    return str(path)


def timed(*args: str):
    """The command's result and its seconds; a command still running after 2 × WITHIN_S
    fails the test here (the held requests are let go when the test ends)."""
    results: list = []
    worker = threading.Thread(
        target=lambda: results.append(CliRunner().invoke(main, list(args))), daemon=True
    )
    started = time.monotonic()
    worker.start()
    worker.join(2 * WITHIN_S)
    elapsed = time.monotonic() - started
    assert results, f"{args[0]} still waiting after {elapsed:.0f} s on a server that hangs"
    return results[0], elapsed


def assert_one_error_line(result, starts: str) -> None:
    assert result.exit_code == 2, result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors == [result.stderr.splitlines()[-1]], result.stderr
    assert errors[0].startswith(starts), result.stderr
    assert "Traceback" not in result.output
    assert CANARY not in result.output


def test_the_default_bound_is_one_try_of_seconds_and_a_users_setting_stands(monkeypatch):
    from pipeline.tracking.store import bound_requests, request_limit_s

    bound_requests("sqlite:////tmp/mlflow.db")  # a local store: no HTTP to bound
    assert "MLFLOW_HTTP_REQUEST_TIMEOUT" not in os.environ
    bound_requests("https://mlflow.example.org")
    assert os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == "0"
    assert request_limit_s() == 5 <= 30
    from mlflow.environment_variables import (
        MLFLOW_HTTP_REQUEST_MAX_RETRIES,
        MLFLOW_HTTP_REQUEST_TIMEOUT,
    )

    # what MLflow itself reads at each request
    assert (MLFLOW_HTTP_REQUEST_TIMEOUT.get(), MLFLOW_HTTP_REQUEST_MAX_RETRIES.get()) == (5, 0)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "60")
    bound_requests("https://mlflow.example.org")
    assert request_limit_s() == 60


def test_compare_ends_at_the_first_request_left_unanswered_on_the_default_bound(
    tmp_path, stalling, monkeypatch
):
    monkeypatch.delenv("MLFLOW_HTTP_REQUEST_TIMEOUT")  # ours, 5 s
    cfg = config(tmp_path, stalling, "stall-compare")
    stalling.answer(1)  # compare's first request, the check; not the next one
    result, elapsed = timed("compare", cfg)
    assert_one_error_line(
        result, f"error: tracking server {masked(stalling)} is not answering (no answer in time)"
    )
    assert result.stdout == ""
    assert stalling.stalled == 1  # one try, not MLflow's eight
    assert elapsed < 30


def test_run_trains_on_and_keeps_what_the_hung_server_did_not_take(tmp_path, stalling, stand_ins):
    """The server hangs from step 3 of train: the run finishes every stage, within the
    bound; what the server did not take is in the backlog, which sync sends once it
    answers again, every step of every stage."""
    stand_ins["train"] = lambda ctx, step: step == 3 and stalling.answer(0)
    cfg = config(tmp_path, stalling, "stall-run")
    backlog = tmp_path / "runs" / "stall-run" / BACKLOG
    result, elapsed = timed("run", cfg)
    assert result.exit_code == 0, result.output
    assert elapsed < WITHIN_S
    assert "Traceback" not in result.output and CANARY not in result.output
    assert "tracking server not answering (no answer in time)" in result.stderr
    assert f"they are in {backlog}" in result.stderr
    waiting = [r["op"] for r in read_records(backlog)[0]]
    assert waiting.count("create") >= 3  # finetune's and evaluate's runs, at least

    stalling.release()
    sent, _ = timed("sync", cfg)
    assert sent.exit_code == 0, sent.output
    assert not backlog.exists()
    client = stalling.client()
    exp = client.get_experiment_by_name("stall-run")
    runs = {
        r.data.tags.get("stage", "pipeline"): r for r in client.search_runs([exp.experiment_id])
    }
    assert sorted(runs) == sorted([*ORDER, "pipeline"])
    assert {r.info.status for r in runs.values()} == {"FINISHED"}
    for name in ORDER:
        steps = [m.step for m in client.get_metric_history(runs[name].info.run_id, "loss")]
        assert sorted(steps) == list(range(1, STEPS + 1)), name


def test_sync_ends_at_the_first_request_left_unanswered_and_keeps_every_record(tmp_path, stalling):
    cfg = config(tmp_path, stalling, "stall-sync")
    spec = load_spec(cfg, [])
    spec.workspace_dir.mkdir(parents=True)
    backlog = spec.workspace_dir / BACKLOG
    now = int(time.time() * 1000)
    records: list[dict[str, Any]] = [
        {
            "op": "create",
            "key": "k",
            "experiment": "stall-sync",
            "artifact_location": None,
            "tags": {"mlflow.runName": "stall-sync"},
            "parent": None,
            "time": now,
        },
        {"op": "batch", "key": "k", "metrics": [["loss", 0.5, now, 1]]},
        {"op": "end", "key": "k", "status": "FINISHED", "time": now},
    ]
    append_records(backlog, records)
    stalling.answer(1)  # the check
    result, elapsed = timed("sync", cfg)
    assert_one_error_line(
        result,
        f"error: tracking server {masked(stalling)} stopped answering: 0 records sent, 3 "
        f"still in {backlog}",
    )
    assert elapsed < WITHIN_S
    assert read_records(backlog)[0] == records  # nothing lost

    stalling.release()
    again, _ = timed("sync", cfg)
    assert again.exit_code == 0, again.output
    assert again.stdout.endswith(f"3 tracking records sent to {masked(stalling)}\n")


def test_sweep_ends_at_the_first_point_whose_server_hangs(tmp_path, stalling, stand_ins):
    """The server hangs during the first point's training: that point finishes (its
    records in its backlog); the next point's first request is not answered, and the sweep
    ends there in one line, the third point not started."""
    stand_ins["train"] = lambda ctx, step: step == 3 and stalling.answer(0)
    cfg = config(tmp_path, stalling, "stall-sweep")
    result, elapsed = timed("sweep", cfg, "--seeds", "1,2,3")
    assert_one_error_line(
        result, f"error: tracking server {masked(stalling)} is not answering (no answer in time)"
    )
    assert elapsed < WITHIN_S
    points = sorted(p.name for p in (tmp_path / "runs").iterdir() if p.is_dir())
    assert len(points) == 3, points
    first, _, third = points
    assert (tmp_path / "runs" / first / BACKLOG).is_file()
    assert f"[{first}] [evaluate] done" in result.output
    assert f"[{third}] [train]" not in result.output  # never started


def test_export_register_ends_in_one_line_and_keeps_the_export(trained, tmp_path, stalling):
    stalling.answer(2)  # the checks before the export: the store, the registry
    out = tmp_path / "export"
    result, elapsed = timed(
        "export",
        str(trained),
        "--set",
        "tracking.enabled=true",
        "--set",
        f"tracking.uri={uri(stalling)}",
        "--out",
        str(out),
        "--register",
        "stall-model",
    )
    assert_one_error_line(
        result,
        f"error: --register 'stall-model': MLflow ({masked(stalling)}) is not answering "
        f"(no answer in time); the export in {out} is written",
    )
    assert elapsed < WITHIN_S
    assert any(out.iterdir())
