"""No command makes files where it was started: MLflow opens a store of its own default, in
the working directory (`./mlflow.db`, `./mlruns/`), wherever it makes a client that names no
store, as its model registry does inside `create_model_version` on a file store. Before,
`export --register` against a `file:` tracking store left a stray `mlflow.db` in the working
directory. Each command here runs from an empty working directory, against each kind of
store the project supports: a sqlite database, a `file:` store and (a system case: it starts
a real `mlflow server`-like process, seconds of imports) a tracking server."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request

import pytest
from click.testing import CliRunner

from pipeline.commands.cli import main
from tests.fixtures.runs import five_stage_config
from tests.fixtures.stand_in_stages import logging_stand_ins

SERVER = """\
import sys
from mlflow.server import app
from werkzeug.serving import make_server
make_server("127.0.0.1", int(sys.argv[1]), app, threaded=True).serve_forever()
"""


def cli(*args) -> str:
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    return result.output


@pytest.fixture
def server(tmp_path):
    """A tracking server (MLflow's own app over a sqlite store) in a process of its own, in a
    directory of its own: its URL."""
    import socket

    root = tmp_path / "server"
    root.mkdir()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(
        os.environ,
        _MLFLOW_SERVER_FILE_STORE=f"sqlite:///{root / 'server.db'}",
        _MLFLOW_SERVER_REGISTRY_STORE=f"sqlite:///{root / 'server.db'}",
        _MLFLOW_SERVER_ARTIFACT_ROOT=str(root / "artifacts"),
        _MLFLOW_SERVER_SERVE_ARTIFACTS="false",
    )
    process = subprocess.Popen(
        [sys.executable, "-c", SERVER, str(port)],
        cwd=root,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:  # its tables made by the first requests, before the commands' short waits
            try:
                for api in ("experiments/search", "registered-models/search"):
                    urllib.request.urlopen(f"{url}/api/2.0/mlflow/{api}?max_results=1", timeout=60)
                break
            except OSError:
                assert process.poll() is None, "the tracking server ended"
                assert time.monotonic() < deadline, "the tracking server never answered"
                time.sleep(0.2)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)


@pytest.mark.parametrize(
    "kind", ["sqlite", "file", pytest.param("server", marks=pytest.mark.system)]
)
def test_run_compare_and_export_register_make_nothing_in_the_working_directory(
    kind, trained, tmp_path, monkeypatch, request
):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # the file: store's opt-in
    uri = {
        "sqlite": lambda: f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}",
        "file": lambda: (tmp_path / "store").as_uri(),
        "server": lambda: request.getfixturevalue("server"),
    }[kind]()
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    cfg = five_stage_config(tmp_path)
    logging_stand_ins(monkeypatch, steps=2)
    tracked = ("--set", f"tracking.uri={uri}")
    cli("run", cfg, *tracked)
    assert cli("compare", cfg, *tracked).splitlines()[0].split()[:2] == ["name", "status"]
    out = cli(
        "export", trained, *tracked, "--set", "tracking.enabled=true",
        "--out", tmp_path / "export", "--register", "m",
    )  # fmt: skip
    assert "registered as model 'm' version 1" in out
    assert sorted(os.listdir(cwd)) == []
