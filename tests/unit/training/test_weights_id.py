"""The id a score names its weights by (pipeline.training.checkpoint_dirs.weights_id): the sha256
of every file's sha256 by name, computed here with hashlib on the files themselves."""

from __future__ import annotations

import hashlib
import json
import shutil

from pipeline.training.checkpoint_dirs import CHECKSUMS, weights_id, write_checksums


def expected(path) -> str:
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.name != CHECKSUMS)
    digests = {
        f.relative_to(path).as_posix(): hashlib.sha256(f.read_bytes()).hexdigest() for f in files
    }
    return hashlib.sha256(json.dumps(digests, sort_keys=True).encode()).hexdigest()[:16]


def checkpoint(path, weights: bytes):
    path.mkdir(parents=True)
    (path / "mp_rank_00_model_states.pt").write_bytes(weights)
    (path / "trainer-rank0.pt").write_bytes(b"loop state")
    write_checksums(path)
    return path


def test_the_id_is_the_files_content_wherever_the_checkpoint_is(tmp_path):
    one = checkpoint(tmp_path / "step-00000002", b"weights of one run")
    assert weights_id(one) == expected(one)
    copy = shutil.copytree(one, tmp_path / "elsewhere" / "step-00000009")
    assert weights_id(copy) == weights_id(one)
    # a checkpoint from before checksums: its files are hashed, to the same id
    (copy / CHECKSUMS).unlink()
    assert weights_id(copy) == weights_id(one)


def test_other_weights_at_the_same_path_have_another_id(tmp_path):
    first = weights_id(checkpoint(tmp_path / "a" / "step-00000002", b"lr 0.01"))
    again = weights_id(checkpoint(tmp_path / "b" / "step-00000002", b"lr 0.003"))
    assert first != again
    assert again == expected(tmp_path / "b" / "step-00000002")


def test_no_id_for_what_cannot_be_read(tmp_path):
    assert weights_id(tmp_path / "missing") is None
    (tmp_path / "empty").mkdir()
    assert weights_id(tmp_path / "empty") is None
    bad = checkpoint(tmp_path / "step-00000001", b"w")
    (bad / CHECKSUMS).write_text("{not json")
    assert weights_id(bad) is None
