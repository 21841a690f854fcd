"""Every request to a tracking server ends, answered or not, within its deadline, whole: a
server that trickles its answer a byte every 2 s (each wait shorter than MLflow's
MLFLOW_HTTP_REQUEST_TIMEOUT, which `requests` applies between two bytes) held `compare`,
`run`, `sync` and `export --register` for as long as it liked. And a tracking variable the
user set that MLflow cannot use is named in one line, not blamed on the server.

The commands run through click in a thread, so one that hangs fails its test instead of
holding the suite.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest
from click.testing import CliRunner

from pipeline.commands.cli import main
from pipeline.spec import load_spec
from pipeline.tracking.backlog import append_records
from pipeline.tracking.tracker import BACKLOG
from tests.fixtures.trickling_server import TricklingServer

GIVE_UP_S = 60  # a command still running by then hangs (the deadline is 3 or 5 s)


@pytest.fixture
def trickling():
    server = TricklingServer()
    server.start()
    yield server
    server.stop()  # and with it the requests the commands left behind


def timed(*args: str):
    results: list = []
    worker = threading.Thread(
        target=lambda: results.append(CliRunner().invoke(main, list(args))), daemon=True
    )
    started = time.monotonic()
    worker.start()
    worker.join(GIVE_UP_S)
    elapsed = time.monotonic() - started
    assert results, f"{args[0]} still waiting after {elapsed:.0f} s on a server that trickles"
    return results[0], elapsed


def config(tmp_path, uri: str, **more: str) -> str:
    path = tmp_path / "trickle.yaml"
    path.write_text(f"""\
name: trickle
dataset: python_docs
model: {{kind: allattn, d_model: 32, n_layers: 1, n_heads: 2, n_persistent: 4, max_span: 64}}
train: {{steps: 2, batch_size: 2, seq_len: 8,
        optimizer: {{type: adam, lr: 1.0e-3, clip: global, clip_norm: 1.0}}}}
tracking: {{uri: "{uri}"}}
workspace: {{root: {tmp_path / "runs"}}}
stages: [download]
""")
    return str(path)


def one_error_line(result) -> str:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output, result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


def test_compare_ends_within_the_default_deadline_on_a_server_that_trickles(trickling, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", trickling.url)
    result, elapsed = timed("compare", "some-experiment")
    assert one_error_line(result).startswith(
        f"error: tracking server {trickling.url} is not answering (no answer in time); "
    )
    assert 5 <= elapsed < 30  # the default deadline, 5 s, then one line
    assert trickling.requests == 1


@pytest.mark.parametrize("command", ["run", "sync"])
def test_run_and_sync_end_within_their_deadline(command, trickling, tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "3")  # a user's setting stands
    cfg = config(tmp_path, trickling.url)
    if command == "sync":  # something to send
        spec = load_spec(cfg, [])
        spec.workspace_dir.mkdir(parents=True)
        append_records(spec.workspace_dir / BACKLOG, [{"op": "end", "key": "k"}])
    result, elapsed = timed(command, cfg)
    assert one_error_line(result).startswith(
        f"error: tracking server {trickling.url} is not answering (no answer in time); "
    )
    assert 3 <= elapsed < 30
    assert not (tmp_path / "runs" / "trickle" / "download").exists()  # nothing ran


def test_export_register_ends_within_its_deadline(trickling, tmp_path, monkeypatch, trained):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "3")
    out = tmp_path / "out"
    result, elapsed = timed(
        "export",
        str(trained),
        "--set",
        "tracking.enabled=true",
        "--set",
        f"tracking.uri={trickling.url}",
        "--out",
        str(out),
        "--register",
        "m",
    )
    assert one_error_line(result) == (
        f"error: --register: the tracking store {trickling.url} is not answering (no answer "
        f"in time)"
    )
    assert 3 <= elapsed < 30
    assert not out.exists()  # refused before anything was written


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(
    "name, value, expected",
    [
        # a number that is none: reported as "no answer in time", for the word "TIMEOUT"
        ("MLFLOW_HTTP_REQUEST_TIMEOUT", "abc", "a whole number"),
        # below 1 s: every request failed at once, "not answering"
        ("MLFLOW_HTTP_REQUEST_TIMEOUT", "0", "a number of seconds above 0"),
        ("MLFLOW_HTTP_REQUEST_TIMEOUT", "-1", "a number of seconds above 0"),
        ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "x", "a whole number"),
        (
            "MLFLOW_HTTP_REQUEST_MAX_RETRIES",
            "50",
            "a number of retries from 0 to MLflow's limit, 10",
        ),
        ("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "q", "a whole number"),
        ("MLFLOW_TRACKING_INSECURE_TLS", "maybe", "true, false, 1 or 0"),
    ],
)
def test_a_tracking_variable_mlflow_cannot_use_is_named_not_the_server(
    name, value, expected, monkeypatch
):
    """Each was "tracking server ... refused a request" or "... is not answering"."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{_closed_port()}")
    monkeypatch.setenv(name, value)
    result = CliRunner().invoke(main, ["compare", "some-experiment"])
    assert one_error_line(result) == (
        f"error: {name}={value}: MLflow cannot use this value (expected {expected}); "
        f"fix or unset it"
    )


def test_run_names_the_variable_too(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2.5")  # MLflow reads whole seconds
    cfg = config(tmp_path, f"http://127.0.0.1:{_closed_port()}")
    result = CliRunner().invoke(main, ["run", cfg])
    assert one_error_line(result) == (
        "error: MLFLOW_HTTP_REQUEST_TIMEOUT=2.5: MLflow cannot use this value (expected a "
        "whole number); fix or unset it"
    )


def test_a_tracking_uri_no_request_can_use_is_one_line(monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://[::1")  # was a traceback (urllib's)
    result = CliRunner().invoke(main, ["compare", "some-experiment"])
    assert one_error_line(result) == (
        "error: MLFLOW_TRACKING_URI http://[::1: not a URL a request can use (Invalid IPv6 "
        "URL); fix it"
    )
