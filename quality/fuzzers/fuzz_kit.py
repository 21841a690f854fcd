"""What the secret, injection and planted-link fuzzers share (quality/fuzzers/secret_fuzz.py,
injection_fuzz.py, link_fuzz.py): the derandomized driver, a command run in this process
with everything it prints caught (file descriptors 1 and 2 as well as click's streams), a
local HTTP server, and recorders standing in for Slurm, the remote shells and Python.

The tiny trained pipeline they run on is quality/fuzzers/cli_fuzz.py's `World`.
"""

from __future__ import annotations

import hashlib
import http.server
import os
import socket
import stat
import sys
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from click.testing import CliRunner

from pipeline.commands.cli import main

HANG_SECONDS = 30


def derandomized(cases: int, body) -> None:
    """`body(draw)` `cases` times, drawn the same way on every call."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    @settings(
        max_examples=cases,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(data=st.data())
    def one_case(data):
        body(data.draw)

    one_case()


# ---------------------------------------------------------------- one command


class working_directory:
    def __init__(self, path: Path):
        self.path, self.previous = path, None

    def __enter__(self):
        self.previous = os.getcwd()
        os.chdir(self.path)

    def __exit__(self, *exc):
        os.chdir(self.previous)


@dataclass
class Case:
    """A path fuzzer's case (path_fuzz, archive_fuzz): a command and the paths it owns."""

    command: str
    args: list[str]
    owned: list[str] = field(default_factory=list)  # as the user gave them
    concurrent: bool = False
    world_owned: bool = True  # the whole copied world is the command's (else: `owned` only)
    verify: Callable[[], str | None] | None = None  # after exit 0: a problem, or None


def crash_problem(result, hang: type[BaseException]) -> str | None:
    """A CliRunner result's hang (`hang` raised by the alarm) or traceback (an exception
    other than SystemExit, or an exit status other than 0 and 2); None for neither."""
    code = result.exit_code
    if isinstance(result.exception, hang):
        return f"hang: {result.exception}"
    if (
        result.exception is not None
        and not isinstance(result.exception, SystemExit)
        or code not in (0, 2)
    ):
        return f"traceback: exit {code}: {result.exception!r}"
    return None


class Hang(BaseException):
    """Raised by the alarm: a BaseException, so that no retry loop in a library swallows it."""


@dataclass
class Invocation:
    exit_code: int | None
    output: str  # stdout and stderr, click's and the file descriptors'
    stdout: str  # click's
    stderr: str  # click's
    seconds: float
    problem: str | None  # a hang, a traceback, a refusal that is not one line


@contextmanager
def environment(changes: dict[str, str | None]):
    saved = {k: os.environ.get(k) for k in changes}
    for k, v in changes.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _alarm(signum, frame):
    raise Hang(f"still running after {HANG_SECONDS} s")


def invoke(
    args: list[str], cwd: Path, env: dict[str, str | None] | None = None, timeout=HANG_SECONDS
) -> Invocation:
    """`allattn-pipe ARGS` in this process, in `cwd`, with `env` changes; what it printed on
    file descriptors 1 and 2 (a library's logger, a child process) is caught too."""
    import signal

    start = time.monotonic()
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 1)
        os.dup2(caught.fileno(), 2)
        previous = signal.signal(signal.SIGALRM, _alarm)
        signal.alarm(timeout)
        result, problem = None, None
        try:
            with working_directory(cwd), environment(env or {}):
                result = CliRunner().invoke(main, args)
        except Hang as e:
            problem = f"hang: {e}"
        finally:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, previous)
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
        caught.seek(0)
        fd_text = caught.read().decode("utf-8", "replace")
    seconds = time.monotonic() - start
    if result is None:
        return Invocation(None, fd_text, "", "", seconds, problem)
    stderr = result.stderr
    output = result.stdout + stderr + fd_text
    code = result.exit_code
    problem = crash_problem(result, Hang)
    errors = sum(line.startswith("error: ") for line in stderr.splitlines())
    if problem is None and "Traceback (most recent call last)" in output:
        problem = f"traceback: exit {code}: in the output: {output[-300:]!r}"
    elif problem is None and code == 2 and errors != 1:
        problem = f"not one 'error: ...' line: {stderr[-300:]!r}"
    return Invocation(code, output, result.stdout, stderr, seconds, problem)


# ---------------------------------------------------------------- a local HTTP server

CORPUS = b"".join(b"line %d of a tiny corpus, served over HTTP\n" % i for i in range(200))
CORPUS_SHA256 = hashlib.sha256(CORPUS).hexdigest()  # the dataset.sha256 that lets it through


class Server:
    """A local HTTP server on its own thread: /corpus.txt (CORPUS), /denied (401), /broken
    (500), /redirect?to=URL (302 to URL, its SECRET replaced by `secret`), anything else
    404; an absolute-form request (a proxy's) is answered for its path. `requests` holds
    each request line and its headers. `closed_port` has no listener; `silent_port` accepts
    connections and never answers."""

    def __init__(self):
        requests: list[str] = []
        self.requests = requests
        self.secret = "none"  # what /redirect-secret puts in the URL it redirects to
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                requests.append(self.requestline + "\n" + str(self.headers))
                url = urllib.parse.urlsplit(self.path)
                query = urllib.parse.parse_qs(url.query)
                if url.path == "/corpus.txt":
                    self._answer(200, CORPUS)
                elif url.path in ("/redirect", "/redirect-secret"):
                    to = query.get("to", ["/corpus.txt"])[0]
                    self.send_response(302)
                    self.send_header("Location", to.replace("SECRET", server.secret))
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                elif url.path == "/denied":
                    self._answer(401, b"no")
                elif url.path == "/broken":
                    self._answer(500, b"broken")
                else:
                    self._answer(404, b"not here")

            do_POST = do_GET

            def _answer(self, code: int, body: bytes):
                self.send_response(code)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.silent = socket.socket()
        self.silent.bind(("127.0.0.1", 0))
        self.silent.listen(128)
        self.silent_port = self.silent.getsockname()[1]
        probe = socket.socket()
        probe.bind(("127.0.0.1", 0))
        self.closed_port = probe.getsockname()[1]
        probe.close()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()
        self.silent.close()


# ---------------------------------------------------------------- recorders

CANARY_WORD = "allattn_canary"  # a command on the recorders' PATH: running it is recorded

_RECORD = 'printf "%s\\0" "$0" "$@" > "$RECORD_DIR/$(basename "$0").$$.$RANDOM"\n'
# a remote shell runs its command line with the user's shell, as pdsh and ssh do; the
# project's interpreter on it is the python recorder (nothing trains)
_REMOTE = (
    'line="$*"\nline="${line//%n/$n}"\nline="${line//"$FUZZ_PYTHON"/"$FUZZ_BIN/python"}"\n'
    'bash -c "$line"\n'
)
RECORDERS = {
    "sbatch": _RECORD + "echo 4242\n",
    "srun": _RECORD,
    "scancel": _RECORD,
    # a launched rank's arguments file (`--args-file`, removed when the launch ends): kept
    "python": _RECORD
    + 'prev=\nfor a in "$@"; do\n'
    + '  [ "$prev" = --args-file ] && cp "$a" "$RECORD_DIR/args-file.json"\n'
    + "  prev=$a\ndone\n",
    "allattn-pipe": _RECORD,
    "deepspeed": _RECORD,
    "scontrol": _RECORD
    + 'case "$2" in hostnames) echo node1 ;; node) echo "NodeName=$3 NodeAddr=127.0.0.1" ;;'
    " esac\n",
    CANARY_WORD: _RECORD + 'touch "$CANARY_DIR/ran-$$-$RANDOM"\n',
    # pdsh [-S] [-f N] [-w host,host] [-R rcmd] COMMAND...
    "pdsh": _RECORD + 'hosts=localhost\nwhile [ $# -gt 0 ]; do case "$1" in\n'
    "  -S) shift ;; -f|-R|-l|-u) shift 2 ;; -w) hosts=$2; shift 2 ;; *) break ;;\nesac; done\n"
    "n=0\nfor h in ${hosts//,/ }; do\n  (\n" + _REMOTE + "  ) || exit $?\n  n=$((n+1))\ndone\n",
    # ssh [-o OPT] [-p PORT] ... HOST COMMAND...
    "ssh": _RECORD
    + 'while [ $# -gt 0 ]; do case "$1" in\n  -o|-p|-i|-l|-F) shift 2 ;; -*) shift ;;'
    " *) break ;;\nesac; done\nshift\nn=0\n" + _REMOTE,
}


@dataclass
class Recorders:
    bin: Path  # the recorders, first on PATH
    records: Path  # one file per call: argv, NUL-separated
    canary: Path  # what a canary command leaves

    def env(self) -> dict[str, str]:
        return {
            "PATH": f"{self.bin}{os.pathsep}{os.environ.get('PATH', '')}",
            "RECORD_DIR": str(self.records),
            "CANARY_DIR": str(self.canary),
            "FUZZ_BIN": str(self.bin),
            "FUZZ_PYTHON": sys.executable,
        }

    def calls(self, name: str) -> list[list[str]]:
        out = []
        for p in sorted(self.records.glob(f"{name}.*"), key=lambda p: p.stat().st_mtime_ns):
            out.append(p.read_bytes().decode("utf-8", "surrogateescape").split("\0")[1:-1])
        return out

    def ran(self) -> list[str]:
        return sorted(p.name for p in self.canary.iterdir())

    def reset(self) -> None:
        for d in (self.records, self.canary):
            for p in d.iterdir():
                p.unlink()


def make_recorders(root: Path) -> Recorders:
    rec = Recorders(root / "bin", root / "records", root / "canary")
    for d in (rec.bin, rec.records, rec.canary):
        d.mkdir(parents=True, exist_ok=True)
    for name, body in RECORDERS.items():
        p = rec.bin / name
        p.write_text("#!/bin/bash\n" + body)
        p.chmod(p.stat().st_mode | stat.S_IXUSR)
    return rec
