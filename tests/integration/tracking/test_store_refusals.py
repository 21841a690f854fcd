"""A local tracking store that refuses (locked, read-only), two runs creating one at once, and
a tracking backlog that cannot be written: each is one line with the real cause, or a wait
with a message, never a traceback."""

from __future__ import annotations

import errno
import multiprocessing
import sqlite3

import pytest
from click.testing import CliRunner

from pipeline.commands.cli import main
from pipeline.errors import PipelineError
from pipeline.tracking import sender as sender_module
from pipeline.tracking import store as store_module
from pipeline.tracking.tracker import MlflowTracker, default_tracking_uri
from tests.fixtures.file_limits import file_size_limit

CONFIG = """\
name: tiny
dataset: python_docs
model: {{kind: allattn, d_model: 32, n_layers: 2, n_heads: 2, n_persistent: 8, max_span: 32}}
train: {{steps: 4, batch_size: 8, seq_len: 32, log_every: 2}}
workspace: {{root: {root}}}
stages: [download, preprocess, train]
"""


def _open_at_once(root, barrier, results) -> None:
    barrier.wait()
    try:
        MlflowTracker(default_tracking_uri(root), warn=lambda m: None)
        results.put("ok")
    except BaseException as e:
        results.put(f"{type(e).__name__}: {str(e)[:300]}")


def test_two_processes_creating_a_new_store_at_once_both_open_it(tmp_path):
    # before: MLflow's table creation and migrations raced; one of the two runs (sometimes
    # both, leaving a half-migrated store) ended in a traceback, every time
    ctx = multiprocessing.get_context("fork")
    for attempt in range(3):
        root = tmp_path / f"ws{attempt}"
        root.mkdir()
        barrier, results = ctx.Barrier(2), ctx.Queue()
        procs = [ctx.Process(target=_open_at_once, args=(root, barrier, results)) for _ in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(120)
        assert [results.get(timeout=5) for _ in procs] == ["ok", "ok"]


def _run(tmp_path, *sets):
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(CONFIG.format(root=tmp_path / "runs"))
    args = ["run", str(cfg)] + [a for s in sets for a in ("--set", s)]
    return CliRunner().invoke(main, args)


def _one_line_error(result) -> str:
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit), result.exception
    assert "Traceback" not in result.output and "SQL:" not in result.output, result.output
    last = result.output.strip().splitlines()[-1]
    assert last.startswith("error: "), result.output
    return last


def test_a_store_another_process_holds_locked_is_waited_for_then_one_line(tmp_path, monkeypatch):
    # before: a traceback from SQLAlchemy
    root = tmp_path / "runs"
    root.mkdir()
    MlflowTracker(default_tracking_uri(root), warn=lambda m: None)
    holder = sqlite3.connect(root / "mlflow.db", isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    monkeypatch.setattr(store_module, "STORE_WAIT_S", 1.0)
    try:
        result = _run(tmp_path)
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    line = _one_line_error(result)
    assert line.startswith(f"error: tracking store {root / 'mlflow.db'}: database is locked"), line
    assert "waiting up to 1 s" in result.output
    assert not (root / "tiny" / "download").exists()


def test_a_read_only_store_is_refused_before_anything_runs(tmp_path, monkeypatch):
    # before: every record was "tracking server not answering" with MLflow's tracebacks, and
    # the run went on to exit 0; and MLflow, reading the `file:` URI as a relative path, made
    # a directory `file:` in the working directory
    root = tmp_path / "runs"
    root.mkdir()
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    MlflowTracker(default_tracking_uri(root), warn=lambda m: None)
    result = _run(tmp_path, f"tracking.uri=sqlite:///file:{root / 'mlflow.db'}?mode=ro&uri=true")
    line = _one_line_error(result)
    assert line.startswith(
        f"error: tracking store {root / 'mlflow.db'}: attempt to write a readonly database; make it"
    ), line
    assert "not answering" not in result.output
    assert not (root / "tiny" / "download").exists()
    assert list(cwd.iterdir()) == []


def test_a_store_past_the_file_size_limit_names_that_cause(tmp_path):
    # before: sqlite ended the probe's transaction itself on the failed journal write, the
    # probe's own ROLLBACK then failed, and the line read "cannot rollback - no transaction is
    # active; make it and its directory writable" (the write-failure fuzzer's 3 of 80 cases)
    uri = default_tracking_uri(tmp_path)
    MlflowTracker(uri, warn=lambda m: None)
    with file_size_limit(4096), pytest.raises(PipelineError) as info:
        store_module.check_writable(uri, warn=lambda m: None)
    line = str(info.value)
    assert "\n" not in line
    assert line.startswith(f"tracking store {tmp_path / 'mlflow.db'}: disk I/O error, most likely")
    assert "ulimit -f allows (4,096 bytes); raise `ulimit -f`" in line
    assert "rollback" not in line
    store_module.check_writable(uri, warn=lambda m: None)  # the limit gone, the store takes writes


def test_a_store_named_by_a_file_uri_records_and_makes_nothing_in_the_working_directory(
    tmp_path, monkeypatch
):
    """SQLite's URI form (a read-only store, another vfs) names the same store as the plain
    path: what is recorded through one is read through the other, and MLflow is never given a
    `file:` path to take as relative (it made `./file:/...`)."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    db = tmp_path / "store" / "mlflow.db"
    client = store_module.open_store(f"sqlite:///file:{db}?uri=true", make_parent=True)
    client.create_experiment("through-the-uri-form", artifact_location=str(tmp_path / "art"))
    plain = store_module.open_existing_store(f"sqlite:///{db}")
    assert plain.get_experiment_by_name("through-the-uri-form") is not None
    assert list(cwd.iterdir()) == []


def test_a_backlog_on_a_full_disk_is_one_line_and_keeps_the_records(tmp_path, monkeypatch):
    # before: the OSError of the backlog's append ended the run in a traceback
    class Down:
        run_ids: dict = {}

        def send(self, record):
            raise OSError(errno.ECONNREFUSED, "Connection refused")

    def full(path, records):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(sender_module, "append_records", full)
    s = sender_module.Sender(Down(), warn=lambda m: None, retry_s=60)
    s.submit({"op": "batch", "key": "k", "metrics": [["loss", 1.0, 0, 1]]})
    backlog = tmp_path / "tracking-backlog.jsonl"
    with pytest.raises(PipelineError) as e:
        s.spill(backlog, join_s=1)
    assert str(e.value).startswith(
        f"tracking backlog {backlog}: cannot write it (No space left on device)"
    )
    s.submit({"op": "end", "key": "k", "status": "FAILED", "time": 0})  # the cleanup's
    assert [r["op"] for r in s.unwritten] == ["batch", "end"]
