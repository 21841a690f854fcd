"""Issue 45, item 7, through the commands: a URL no request can be made with is refused by
`validate` (and `run`) in one line naming the key; a write that does not fit (a full disk,
a file past `ulimit -f`) at the download's copy, the shards or a checkpoint ends the run in
one line naming the file and the cause, and what was written before is intact.

EFBIG is real (RLIMIT_FSIZE lowered around the write, tests/fixtures/file_limits.py); ENOSPC
is raised by os.fsync for the shards only, where a filesystem with delayed allocation
reports a full disk (quality/fuzzers/write_fuzz.py fills a real tmpfs instead)."""

from __future__ import annotations

import errno
import os
import re
import resource
from pathlib import Path

import pytest
from click.testing import CliRunner

from pipeline.commands.cli import main
from pipeline.data import fetch
from pipeline.errors import PipelineError
from tests.fixtures.download_server import config, payload, sha
from tests.fixtures.file_limits import file_size_limit

ROOT = Path(__file__).resolve().parents[3]

pytestmark = pytest.mark.usefixtures("offline_and_fast")


def one_error_line(result) -> str:
    lines = result.stderr.splitlines()
    errors = [line for line in lines if line.startswith("error: ")]
    assert result.exit_code == 2 and len(errors) == 1, (result.exit_code, result.output)
    assert "Traceback" not in result.output
    return errors[0]


def corpus_config(tmp_path: Path) -> Path:
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes((ROOT / "README.md").read_bytes() * 4)
    return config(tmp_path, {"url": corpus.as_uri()})


@pytest.mark.parametrize(
    ("key", "value", "problem"),
    [
        ("dataset.url", "http://u:hunter2@h:abc/x", "port 'abc' is not a number from 1 to 65535"),
        ("dataset.url", "http://h:99999/x", "port '99999' is not a number from 1 to 65535"),
        ("dataset.url", "http://[::1/x", "unbalanced [ ] around the host"),
        ("dataset.url", "ftp://h/x", "unsupported scheme 'ftp'"),
        ("tracking.uri", "http://u:hunter2@h:abc/", "port 'abc' is not a number"),
        ("tracking.uri", "http://[::1/", "unbalanced [ ] around the host"),
    ],
)
@pytest.mark.parametrize("command", ["validate", "run"])
def test_a_malformed_url_is_refused_before_anything_runs(tmp_path, command, key, value, problem):
    cfg = corpus_config(tmp_path)
    result = CliRunner().invoke(main, [command, str(cfg), "--set", f"{key}={value}"])
    line = one_error_line(result)
    assert f"{key}: {problem}" in line
    assert "hunter2" not in result.output
    assert not (tmp_path / "runs").exists()  # refused before the workspace is made


def test_a_download_past_the_file_size_limit_keeps_what_it_received(server, tmp_path):
    data = payload(300_000)
    server.files["big"] = data
    downloads = tmp_path / "cache" / "downloads"
    with file_size_limit(100_000), pytest.raises(PipelineError) as e:
        fetch.fetch(server.url("big"), tmp_path / "cache", sha256=sha(data), log=lambda m: None)
    part = downloads / f"{sha(data)}.part"
    assert str(e.value).startswith(
        f"dataset.url {server.url('big')}: file larger than this filesystem or ulimit -f "
        f"allows writing {part} (File too large); "
    )
    assert "raise `ulimit -f`" in str(e.value) and "100,000 bytes kept" in str(e.value)
    assert part.stat().st_size == 100_000 and not (downloads / sha(data)).exists()
    done = fetch.fetch(server.url("big"), tmp_path / "cache", sha256=sha(data), log=lambda m: None)
    assert server.requests[-1]["range"] == "bytes=100000-"  # the limit raised: it resumes
    assert done.path.read_bytes() == data


def test_a_full_disk_while_preprocess_writes_shards_is_one_line(tmp_path, monkeypatch):
    cfg = corpus_config(tmp_path)
    runner = CliRunner()
    assert runner.invoke(main, ["run", str(cfg), "--only", "download"]).exit_code == 0
    ws = tmp_path / "runs" / "dl"
    download = {p: p.read_bytes() for p in (ws / "download").rglob("*") if p.is_file()}
    real_fsync = os.fsync

    def fsync(fd):  # a shard's bytes reach the disk at fsync, and find it full
        if re.search(r"/shards/\.[a-z]+-\d+\.tar\.\w+\.tmp$", os.readlink(f"/proc/self/fd/{fd}")):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    line = one_error_line(runner.invoke(main, ["run", str(cfg)]))
    shards = ws / "preprocess.partial" / "shards"
    assert line == (
        f"error: cannot write {shards / 'train-000000.tar'}: disk full (No space left on "
        f"device); nothing already written was replaced: free space and run again"
    )
    assert list(shards.iterdir()) == []  # no partial shard, no temporary
    assert {p: p.read_bytes() for p in (ws / "download").rglob("*") if p.is_file()} == download


CKPT_SPEC = """\
extends: [{root}/configs/quickstart.yaml]
name: big
model: {{d_model: 16, n_layers: 1, n_heads: 2, n_persistent: 4, max_span: 32}}
train: {{steps: 8, batch_size: 4, seq_len: 16, log_every: 8, eval_every: 0,
        checkpoint_every: 4, optimizer: {{lr: 0.01, warmup_steps: 2}}}}
tracking: {{enabled: false}}
workspace: {{root: {tmp}/runs}}
stages: [download, preprocess, train]
"""


def test_a_checkpoint_past_the_file_size_limit_keeps_the_previous_one(tmp_path, monkeypatch):
    """torch's writer says only that its stream failed: the file at the limit tells why."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    from pipeline.training.checkpoint_dirs import damage, step_dirs

    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes((ROOT / "README.md").read_bytes() * 3)
    cfg = tmp_path / "big.yaml"
    cfg.write_text(CKPT_SPEC.format(root=ROOT, tmp=tmp_path))
    real_save = DeepSpeedEngine.save_checkpoint

    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)

    def save_checkpoint(self, save_dir, **kw):
        if kw["tag"] == "tmp-step-00000008":  # from here on, as under `ulimit -f`
            resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, hard))  # the states are larger
        return real_save(self, save_dir, **kw)

    monkeypatch.setattr(DeepSpeedEngine, "save_checkpoint", save_checkpoint)
    try:
        result = CliRunner().invoke(
            main, ["run", str(cfg), "--set", f"dataset.url={corpus.as_uri()}"]
        )
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    line = one_error_line(result)
    ckpts = tmp_path / "runs" / "big" / "train.partial" / "checkpoints"
    assert line == (
        f"error: checkpoint {ckpts / 'step-00000008'}: file larger than this filesystem or "
        f"ulimit -f allows (File too large); the checkpoints already there are as they were: "
        f"raise `ulimit -f` or use a filesystem that takes larger files, and run again to "
        f"resume from the newest one"
    )
    assert [p.name for p in step_dirs(ckpts)] == ["step-00000004"]
    assert damage(ckpts / "step-00000004") is None
    assert not list(ckpts.glob("tmp-*"))
