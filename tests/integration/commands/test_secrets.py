"""No secret is recorded or printed, and every command that talks to a tracking server checks
it first, in one line and seconds.

A canary string stands for the secret: put into a dataset URL's query, its `user:password@`,
an environment variable a URL names, or a tracking URI's password, it must appear nowhere
afterwards: not in the bytes of any file under the test's directory (the MLflow store, the
workspace, the download cache), not in what the command printed. The data comes from a
loopback HTTP server that checks the credentials it was sent, so the full URL did reach the
request.
"""

from __future__ import annotations

import base64
import hashlib
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest
import yaml
from click.testing import CliRunner

from pipeline.commands.cli import main
from pipeline.data import fetch

ROOT = Path(__file__).resolve().parents[3]
CANARY = "CaNaRy7f3e9d1"
DATA = b"the quick brown fox jumps over the lazy dog\n" * 200
SHA = hashlib.sha256(DATA).hexdigest()


class _Handler(BaseHTTPRequestHandler):
    timeout = 10

    def log_message(self, *args):
        pass

    def do_GET(self):
        srv = self.server.owner
        srv.requests.append({"path": self.path, "headers": dict(self.headers)})
        route = srv.routes.get(urlsplit(self.path).path)
        if route is None:
            self.send_error(404)
            return
        status, headers, body = route(self)
        self.send_response(status)
        for k, v in {"Content-Length": str(len(body)), **headers}.items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)


class Server:
    def __init__(self):
        self.routes: dict = {}
        self.requests: list[dict] = []
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self.httpd.owner = self
        threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True).start()

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server():
    s = Server()
    yield s
    s.close()


@pytest.fixture
def other():
    """A second server: another origin (another port) to redirect to."""
    s = Server()
    yield s
    s.close()


def query_token(handler):
    """200 with the data when every credential-like parameter holds the canary, else 403."""
    query = parse_qs(urlsplit(handler.path).query)
    ok = query and all(v == [CANARY] for k, v in query.items() if k != "v")
    return (200, {}, DATA) if ok else (403, {}, b"forbidden")


def basic_auth(handler):
    wanted = "Basic " + base64.b64encode(f"alice:{CANARY}".encode()).decode()
    if handler.headers.get("Authorization") == wanted:
        return 200, {}, DATA
    return 401, {"WWW-Authenticate": 'Basic realm="t"'}, b"who?"


@pytest.fixture(autouse=True)
def _offline(monkeypatch, tmp_path):
    for var in ("http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setattr(fetch, "RETRY_WAIT_S", 0.0)
    monkeypatch.setattr(fetch, "TIMEOUT_S", 10.0)


def config(tmp_path: Path, url: str, tracking: dict | None = None) -> Path:
    """A download-only pipeline shaped like configs/quickstart.yaml, tracked in a file store
    under tmp_path."""
    spec = {
        "name": "sec",
        "dataset": {"name": "secret-data", "tokenizer": "byte", "url": url, "sha256": SHA},
        "model": {
            "kind": "allattn",
            "d_model": 32,
            "n_layers": 1,
            "n_heads": 2,
            "n_persistent": 4,
            "max_span": 64,
        },
        "train": {"steps": 2, "batch_size": 2, "seq_len": 8},
        "tracking": tracking or {"uri": (tmp_path / "store").as_uri(), "experiment": "sec"},
        "workspace": {"root": str(tmp_path / "runs")},
        "stages": ["download", "preprocess"],
    }
    path = tmp_path / "sec.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def cli(*args: str):
    return CliRunner().invoke(main, list(args))


def leaks(tmp_path: Path, *texts: str) -> list[str]:
    """Where the canary is: files under tmp_path (their bytes; not the config, where the
    user wrote it) and the texts given."""
    found = [f"output {i}" for i, t in enumerate(texts) if CANARY in t]
    for path in tmp_path.rglob("*"):
        if path.name == "sec.yaml" or not path.is_file() or path.is_symlink():
            continue
        if CANARY.encode() in path.read_bytes():
            found.append(str(path.relative_to(tmp_path)))
    return found


def store_text(tmp_path: Path) -> str:
    return "\n".join(
        p.read_text(errors="replace") for p in (tmp_path / "store").rglob("*") if p.is_file()
    )


# ---------------------------------------------------------------- credentials in a dataset URL


def test_a_signed_url_works_and_its_secrets_are_recorded_nowhere(server, tmp_path, monkeypatch):
    server.routes["/data.txt"] = query_token
    url = (
        f"{server.base}/data.txt?v=2&token={CANARY}&X-Amz-Signature={CANARY}"
        f"&X-Amz-Credential={CANARY}&sig={CANARY}&API_KEY={CANARY}"
    )
    cfg = config(tmp_path, f"{server.base}/placeholder.txt")
    # the parent run's argv tag is the command line, where the URL was given
    monkeypatch.setattr(
        sys, "argv", ["allattn-pipe", "run", str(cfg), "--set", f"dataset.url={url}"]
    )
    done = cli("run", str(cfg), "--only", "download", "--set", f"dataset.url={url}")
    assert done.exit_code == 0, done.output
    assert server.requests[-1]["path"].endswith(f"&API_KEY={CANARY}")  # the request had it all
    shown = cli("show", str(cfg), "--set", f"dataset.url={url}")
    assert shown.exit_code == 0, shown.output
    compared = cli("compare", str(cfg), "--set", f"dataset.url={url}", "--format", "json")
    assert compared.exit_code == 0, compared.output
    assert leaks(tmp_path, done.output, shown.output, compared.output) == []
    masked = f"{server.base}/data.txt?v=2&token=***&X-Amz-Signature=***"
    assert masked in store_text(tmp_path)  # the params, the argv tag and the artifacts
    assert masked in (tmp_path / "runs" / "sec" / "download" / "download.json").read_text()
    assert masked in shown.output


def test_an_error_line_masks_the_url_it_names(server, tmp_path):
    url = f"{server.base}/missing.txt?token={CANARY}"
    failed = cli("run", str(config(tmp_path, url)), "--only", "download")
    assert failed.exit_code == 2
    assert failed.stderr == (
        f"error: dataset.url {server.base}/missing.txt?token=***: HTTP 404 Not Found; the file "
        f"may have moved: point --set dataset.url=... at a mirror\n"
    )
    assert leaks(tmp_path, failed.output) == []


def test_user_and_password_in_the_url_are_basic_auth_and_kept_secret(server, tmp_path):
    server.routes["/data.txt"] = basic_auth
    url = f"http://alice:{CANARY}@127.0.0.1:{server.httpd.server_address[1]}/data.txt"
    done = cli("run", str(config(tmp_path, url)), "--only", "download")
    assert done.exit_code == 0, done.output
    assert "Authorization" in server.requests[-1]["headers"]
    assert "@127.0.0.1" not in server.requests[-1]["path"]
    assert leaks(tmp_path, done.output) == []
    assert f"alice:***@127.0.0.1:{server.httpd.server_address[1]}" in store_text(tmp_path)


def test_basic_auth_is_not_sent_to_another_host_a_redirect_names(server, other, tmp_path):
    other.routes["/data.txt"] = lambda h: (200, {}, DATA)
    server.routes["/moved"] = lambda h: (302, {"Location": f"{other.base}/data.txt"}, b"")
    url = f"http://alice:{CANARY}@127.0.0.1:{server.httpd.server_address[1]}/moved"
    done = cli("run", str(config(tmp_path, url)), "--only", "download")
    assert done.exit_code == 0, done.output
    assert "Authorization" in server.requests[-1]["headers"]
    assert [r["path"] for r in other.requests] == ["/data.txt"]
    assert "Authorization" not in other.requests[0]["headers"]
    assert leaks(tmp_path, done.output) == []


def test_basic_auth_follows_a_redirect_on_the_same_origin(server, tmp_path):
    server.routes["/data.txt"] = basic_auth
    server.routes["/moved"] = lambda h: (301, {"Location": "/data.txt"}, b"")
    url = f"http://alice:{CANARY}@127.0.0.1:{server.httpd.server_address[1]}/moved"
    done = cli("run", str(config(tmp_path, url)), "--only", "download")
    assert done.exit_code == 0, done.output
    assert [r["path"] for r in server.requests] == ["/moved", "/data.txt"]
    assert leaks(tmp_path, done.output) == []


def test_a_file_url_with_a_user_is_refused_without_its_password(tmp_path):
    failed = cli("run", str(config(tmp_path, f"file://alice:{CANARY}@/tmp/x.txt")))
    assert failed.exit_code == 2
    assert failed.stderr.count("\n") == 1, failed.stderr
    assert leaks(tmp_path, failed.output) == []


def test_a_secret_named_by_an_environment_variable(server, tmp_path, monkeypatch):
    server.routes["/data.txt"] = query_token
    url = f"{server.base}/data.txt?token=${{env:ALLATTN_TEST_TOKEN}}"
    cfg = config(tmp_path, url)
    monkeypatch.delenv("ALLATTN_TEST_TOKEN", raising=False)
    missing = cli("run", str(cfg), "--only", "download")
    assert missing.exit_code == 2
    assert missing.stderr == (
        "error: dataset.url "
        f"{server.base}/data.txt?token=${{env:ALLATTN_TEST_TOKEN}}: the environment variable "
        "ALLATTN_TEST_TOKEN that it names is not set\n"
    )
    monkeypatch.setenv("ALLATTN_TEST_TOKEN", CANARY)
    done = cli("run", str(cfg), "--only", "download")
    assert done.exit_code == 0, done.output
    assert server.requests[-1]["path"] == f"/data.txt?token={CANARY}"
    assert leaks(tmp_path, done.output) == []
    assert "token=${env:ALLATTN_TEST_TOKEN}" in store_text(tmp_path)  # the record says where


@pytest.mark.parametrize("target", ["ftp://mirror.invalid/data.txt", "file:///etc/hostname"])
def test_a_redirect_to_a_scheme_not_fetched_names_the_target(server, tmp_path, target):
    server.routes["/r"] = lambda h: (302, {"Location": f"{target}?token={CANARY}"}, b"")
    url = f"{server.base}/r"
    failed = cli("run", str(config(tmp_path, url)), "--only", "download")
    assert failed.exit_code == 2
    scheme = target.split(":")[0]
    assert failed.stderr == (
        f"error: dataset.url {url}: the server redirected to {target}?token=***, a {scheme}:// "
        f"URL, which the downloader does not fetch (only http:// and https://)\n"
    )
    assert leaks(tmp_path, failed.output) == []


def test_a_builtin_corpus_with_a_query_is_refused_without_echoing_it(tmp_path):
    failed = cli("run", str(config(tmp_path, f"builtin://python-docs?token={CANARY}")))
    assert failed.exit_code == 2
    assert failed.stderr == (
        "error: dataset.url builtin://python-docs?token=***: a built-in corpus takes no query "
        "or fragment: builtin://python-docs\n"
    )
    assert leaks(tmp_path, failed.output) == []


def test_a_sweep_over_secret_urls_prints_and_records_no_secret(server, tmp_path):
    """Each point's failure is a line of the sweep's output, and its name is made from the
    values of the grid."""
    urls = ",".join(f"{server.base}/{name}?token={CANARY}" for name in ("a.txt", "b.txt"))
    cfg = config(tmp_path, f"{server.base}/data.txt", {"enabled": False})
    failed = cli("sweep", str(cfg), "--grid", f"dataset.url={urls}")
    assert failed.exit_code == 2, failed.output
    assert f"failed: dataset.url {server.base}/a.txt?token=***: HTTP 404" in failed.output
    assert leaks(tmp_path, failed.output) == []


# ---------------------------------------------------------------- the tracking server


@pytest.fixture
def silent_server():
    """A tracking server that accepts connections and never answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(64)
        yield f"http://bob:{CANARY}@127.0.0.1:{s.getsockname()[1]}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_compare_against_a_tracking_server_that_does_not_answer(silent_server, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", silent_server)
    monkeypatch.delenv("MLFLOW_HTTP_REQUEST_TIMEOUT", raising=False)  # our default, not a test's
    monkeypatch.delenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", raising=False)
    results: list = []
    # in a thread: compare hung for minutes here, which must fail the test, not stall the suite
    worker = threading.Thread(target=lambda: results.append(cli("compare")), daemon=True)
    started = time.monotonic()
    worker.start()
    worker.join(40)
    assert results, "compare did not answer in 40 s"
    result = results[0]
    assert result.exit_code == 2, result.output
    masked = silent_server.replace(CANARY, "***")
    assert result.stdout == ""
    assert result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith(f"error: tracking server {masked} is not answering ("), (
        result.stderr
    )
    assert CANARY not in result.output
    assert time.monotonic() - started < 15


@pytest.mark.parametrize("command", ["run", "compare", "sweep", "export"])
def test_every_command_checks_the_tracking_server_in_one_masked_line(tmp_path, command):
    port = _free_port()
    uri = f"http://bob:{CANARY}@127.0.0.1:{port}"
    cfg = config(tmp_path, "builtin://python_docs", {"uri": uri})
    args = {
        "run": ["run", str(cfg)],
        "compare": ["compare", str(cfg)],
        "sweep": ["sweep", str(cfg), "--seeds", "1,2"],
        "export": ["export", str(cfg), "--out", str(tmp_path / "out"), "--register", "m"],
    }[command]
    started = time.monotonic()
    result = cli(*args)
    assert result.exit_code == 2, result.output
    what = "--register: the tracking store" if command == "export" else "tracking server"
    assert result.stderr.startswith(
        f"error: {what} http://bob:***@127.0.0.1:{port} is not answering (Connection refused)"
    ), result.output
    assert result.stderr.count("\n") == 1, result.output
    assert time.monotonic() - started < 15
    assert leaks(tmp_path, result.output) == []


def test_tracking_warnings_mask_the_uri(tmp_path):
    from pipeline.tracking.tracker import MlflowTracker

    said: list[str] = []
    tracker = MlflowTracker(f"http://bob:{CANARY}@127.0.0.1:{_free_port()}", warn=said.append)
    tracker.warn_server("tracking server not answering (Connection refused)")
    assert said and CANARY not in "".join(said) and "bob:***@" in said[0]


def test_the_masking_rule():
    from pipeline.redact import mask

    assert mask(
        "see https://u:pw@h.example/p?Token=a&X-Amz-Security-Token=b&v=1#access_token=c."
    ) == ("see https://u:***@h.example/p?Token=***&X-Amz-Security-Token=***&v=1#access_token=***.")
    for name in (
        "sig",
        "Signature",
        "key",
        "api_key",
        "ACCESS_TOKEN",
        "password",
        "passwd",
        "secret",
        "auth",
        "credential",
        "X-Amz-Credential",
        "X-Goog-Signature",
        "client_secret",
        "AccessKey",
    ):
        assert mask(f"https://h/x?{name}=s3cr3t") == f"https://h/x?{name}=***", name
    assert mask("https://h/x?page=2&name=k") == "https://h/x?page=2&name=k"
    assert mask("https://ghp_tok@h/x") == "https://***@h/x"  # a token as the user name
    assert mask("https://h/x?token=${env:TOK}") == "https://h/x?token=${env:TOK}"
    assert mask({"a": ["postgresql://me:pw@db/x"], "n": 3}) == {
        "a": ["postgresql://me:***@db/x"],
        "n": 3,
    }
    assert mask("sqlite:////tmp/mlflow.db") == "sqlite:////tmp/mlflow.db"
