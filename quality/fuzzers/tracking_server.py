"""A real MLflow tracking server (MLflow's own Flask app over a sqlite store, artifacts in a
local folder) on a loopback port, in a thread of the fuzzer's worker, that can go down and
come back on the same port: what the stateful and signal fuzzers' commands track to.

Down, the port refuses connections, as a stopped server's does: a run that started while it
was up keeps its records in memory, then in its workspace's backlog (`sync` sends them).
MLflow's server keeps its store in module globals, opened on the first request: one server
per process, its store swapped (`restart`) only while it is down.
"""

from __future__ import annotations

import os
import socket
import threading
import urllib.request
from pathlib import Path
from typing import Any

SERVER_VARIABLES = (
    "_MLFLOW_SERVER_FILE_STORE",
    "_MLFLOW_SERVER_REGISTRY_STORE",
    "_MLFLOW_SERVER_ARTIFACT_ROOT",
)


class TrackingServer:
    """`url` serves the store in `root` (server.db, artifacts/) while up."""

    def __init__(self, root: Path, port: int | None = None):
        self.root = root
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.httpd: Any = None
        self.thread: threading.Thread | None = None
        self.saved: dict[str, str | None] | None = None  # the environment before the first start

    @property
    def store_uri(self) -> str:
        return f"sqlite:///{self.root / 'server.db'}"

    def client(self):
        """A client of the store itself (not through the server): reads what it holds."""
        from mlflow.tracking import MlflowClient

        return MlflowClient(self.store_uri, self.store_uri)

    @property
    def up(self) -> bool:
        return self.httpd is not None

    def start(self) -> None:
        """Serve the store in `root` (made on the first start)."""
        import logging
        import warnings

        with warnings.catch_warnings():  # starlette's, about a module MLflow imports
            warnings.simplefilter("ignore")
            import mlflow.server.fastapi_app  # noqa: F401  (imported later otherwise, on a request)
            import mlflow.server.handlers as handlers
            from mlflow.server import app
        from werkzeug.serving import WSGIRequestHandler, make_server

        logging.getLogger("mlflow.store.db.utils").setLevel(logging.WARNING)  # "Creating tables"

        class Quiet(WSGIRequestHandler):
            def log(self, *args) -> None: ...

        self.root.mkdir(parents=True, exist_ok=True)
        if self.saved is None:
            self.saved = {k: os.environ.get(k) for k in SERVER_VARIABLES}
        # the store the handlers open on their first request: this root's
        handlers._tracking_store = None
        handlers._model_registry_store = None
        os.environ["_MLFLOW_SERVER_FILE_STORE"] = self.store_uri
        os.environ["_MLFLOW_SERVER_REGISTRY_STORE"] = self.store_uri
        os.environ["_MLFLOW_SERVER_ARTIFACT_ROOT"] = str(self.root / "artifacts")
        self.httpd = make_server("127.0.0.1", self.port, app, threaded=True, request_handler=Quiet)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()
        # the store's tables are made (or checked) on its first request and its registry's
        # on the first of those: before any command's short request timeouts
        for api in ("experiments/search", "registered-models/search"):
            urllib.request.urlopen(f"{self.url}/api/2.0/mlflow/{api}?max_results=1", timeout=300)

    def stop(self) -> None:
        """Down: the port refuses connections (requests being answered finish first)."""
        if self.httpd is None:
            return
        self.httpd.shutdown()
        self.httpd.server_close()
        assert self.thread is not None
        self.thread.join()
        self.httpd = self.thread = None

    def close(self) -> None:
        """Down for good: the process's environment and MLflow's handlers as they were (a
        test process serves other stores after this one)."""
        import mlflow.server.handlers as handlers

        self.stop()
        handlers._tracking_store = None
        handlers._model_registry_store = None
        for name, value in (self.saved or {}).items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
