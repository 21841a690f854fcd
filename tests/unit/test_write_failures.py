"""A write that does not fit (disk full, over quota, past `ulimit -f` or the filesystem's
largest file) is one line naming the file and the cause, and what was published before is
kept whole (issue 45, item 7): the errno mapping in pipeline/errors.py, reached by every
atomic write (fsutil) and so by the shards, manifests, records and pointers."""

from __future__ import annotations

import errno
import signal

import numpy as np
import pytest

from pipeline.data.shards import write_shards
from pipeline.errors import did_not_fit, write_cause
from pipeline.fsutil import atomic_write_bytes
from tests.fixtures.file_limits import file_size_limit


def test_python_ignores_sigxfsz_so_a_write_past_the_limit_raises():
    """What the mapping relies on: without SIG_IGN the process would be killed by SIGXFSZ."""
    assert signal.getsignal(signal.SIGXFSZ) == signal.SIG_IGN


@pytest.mark.parametrize(
    ("number", "cause", "hint"),
    [
        (errno.ENOSPC, "disk full", "free space and run again"),
        (errno.EDQUOT, "disk quota exceeded", "free space within your quota"),
        (
            errno.EFBIG,
            "file larger than this filesystem or ulimit -f allows",
            "raise `ulimit -f` or use a filesystem that takes larger files",
        ),
    ],
)
def test_each_write_failure_is_one_line_naming_the_file_and_the_cause(number, cause, hint):
    error = OSError(number, "strerror", "/w/x\ny.tar")
    assert write_cause(error) == cause
    line = str(did_not_fit(error))
    assert line.startswith(f"cannot write /w/x\\ny.tar: {cause} (strerror); ")
    assert hint in line and "\n" not in line


def test_other_errors_are_not_write_failures():
    assert write_cause(OSError(errno.EACCES, "Permission denied")) is None
    assert write_cause(ValueError("x")) is None


def test_an_atomic_write_past_the_limit_names_the_file_and_keeps_the_old_one(tmp_path):
    target = tmp_path / "manifest.json"
    target.write_bytes(b"the earlier manifest\n")
    with file_size_limit(4096), pytest.raises(OSError) as e:
        atomic_write_bytes(target, b"x" * 100_000)
    assert e.value.errno == errno.EFBIG
    assert e.value.filename == str(target)  # the file it was for, not the temporary
    assert target.read_bytes() == b"the earlier manifest\n"
    assert [p.name for p in tmp_path.iterdir()] == ["manifest.json"]  # no temporary left


def test_a_shard_past_the_limit_leaves_the_earlier_shards_and_no_partial_one(tmp_path):
    tokens = np.arange(60_000, dtype=np.uint16) % 256
    # blocks of 1,000 tokens (2,000 bytes): 5 a shard is a 20,480-byte tar, 10 one of 40,960
    earlier = write_shards(tokens[:5_000], tmp_path, "train", 1_000, 5)
    before = (tmp_path / "train-000000.tar").read_bytes()
    with file_size_limit(30_000), pytest.raises(OSError) as e:
        write_shards(tokens, tmp_path, "train", 1_000, 10)
    assert e.value.errno == errno.EFBIG and e.value.filename == str(tmp_path / "train-000000.tar")
    assert [p.name for p in tmp_path.iterdir()] == [earlier[0]["name"]]
    assert (tmp_path / "train-000000.tar").read_bytes() == before


def test_no_temporary_directory_past_the_limit_is_one_line_with_its_cause(monkeypatch):
    """Found by the write fuzzer in CI: under `ulimit -f 0` the import of torch (dill, which
    lm-eval brings, asks tempfile for a directory at import; torch._dynamo and MLflow ask
    later) ended in tempfile's traceback "No usable temporary directory found", which says
    nothing of why. The command here asks as they do, through the CLI's Main."""
    import tempfile

    import click
    from click.testing import CliRunner

    from pipeline.commands.click_types import Main

    @click.group(cls=Main)
    def cli():
        pass

    @cli.command()
    def work():
        with tempfile.TemporaryDirectory():
            pass

    monkeypatch.setattr(tempfile, "tempdir", None)  # asked again, as in a new process
    monkeypatch.delenv("TMPDIR", raising=False)
    with file_size_limit(0):
        result = CliRunner().invoke(cli, ["work"])
    assert result.exit_code == 2, result.output
    assert result.stderr == (
        "error: cannot write a temporary file in /tmp (nor in any other temporary directory): "
        "file larger than this filesystem or ulimit -f allows (File too large); nothing "
        "already written was replaced: raise `ulimit -f` or use a filesystem that takes larger "
        "files and run again\n"
    )


def test_a_temporary_directory_failure_is_only_tempfiles_and_only_while_it_lasts(monkeypatch):
    from pipeline.fsutil import temporary_dir_failure

    monkeypatch.delenv("TMPDIR", raising=False)
    none_usable = FileNotFoundError(errno.ENOENT, "No usable temporary directory found in [...]")
    with file_size_limit(0):
        failure = temporary_dir_failure(none_usable)
    assert failure is not None
    assert (failure.errno, failure.filename) == (errno.EFBIG, "/tmp")
    assert temporary_dir_failure(none_usable) is None  # /tmp takes a write again
    assert temporary_dir_failure(FileNotFoundError(errno.ENOENT, "No such file", "x")) is None
