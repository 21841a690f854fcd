"""Damaged or edited preprocessed data is refused with one line that names the file and the
way out (`--force preprocess`), and a local source replaced in place is downloaded again."""

from __future__ import annotations

import json
import os

import pytest

from pipeline.data.manifest import load_manifest, load_split
from pipeline.errors import PipelineError
from tests.fixtures.local_corpus import config
from tests.fixtures.runs import cli as run_cli

TEXT = b"".join(b"line %d of a small local corpus, read as bytes.\n" % i for i in range(3000))


def cli(*args):
    return run_cli(*args, check=False, timeout=300)


@pytest.fixture()
def workspace(tmp_path):
    source = tmp_path / "corpus.txt"
    source.write_bytes(TEXT)
    cfg = config(tmp_path, source)
    result = cli("run", cfg)
    assert result.returncode == 0, result.stdout + result.stderr
    return cfg, source, tmp_path / "runs" / "damaged" / "preprocess"


def one_line_error(result, *needles: str) -> str:
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def test_a_flipped_truncated_or_deleted_shard_names_the_file_and_the_rebuild(workspace):
    _, _, pre = workspace
    shard = pre / "shards" / load_manifest(pre)["splits"]["valid"]["shards"][0]["name"]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    for damage in ("flipped", "truncated", "deleted"):
        with pytest.raises(PipelineError) as e:
            load_split(pre, "valid")
        message = str(e.value)
        assert shard.name in message and "--force preprocess" in message, message
        assert "\n" not in message
        if damage == "flipped":
            shard.write_bytes(bytes(data[:100]))
        elif damage == "truncated":
            shard.unlink()


def test_a_manifest_that_is_not_json_is_refused_by_run_and_show(workspace):
    cfg, _, pre = workspace
    (pre / "manifest.json").write_text('{"vocab_size": 111,')
    one_line_error(cli("show", cfg), "manifest.json", "unreadable", "--force preprocess")
    with pytest.raises(PipelineError, match="manifest.json: unreadable"):
        load_split(pre, "train")


@pytest.mark.parametrize("edit", [{"vocab_size": 116}, {"vocab_size": 50}, {"dtype": "uint16"}])
def test_an_edited_manifest_is_refused(workspace, edit):
    cfg, _, pre = workspace
    manifest = json.loads((pre / "manifest.json").read_text())
    (pre / "manifest.json").write_text(json.dumps(manifest | edit))
    one_line_error(
        cli("show", cfg), "manifest.json", "does not match its sha256", "--force preprocess"
    )
    with pytest.raises(PipelineError, match="does not match its sha256"):
        load_manifest(pre)


def test_a_local_source_replaced_in_place_is_downloaded_again(workspace):
    cfg, source, pre = workspace
    before = load_manifest(pre)["source_sha256"]
    os.utime(source)  # touched, same bytes: still up to date
    again = cli("run", cfg)
    assert again.returncode == 0 and "running" not in again.stdout, again.stdout
    source.write_bytes(TEXT.replace(b"small", b"SMALL"))  # same size, new content
    rerun = cli("run", cfg)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert "[download] running" in rerun.stdout and "[preprocess] running" in rerun.stdout
    assert load_manifest(pre)["source_sha256"] != before


@pytest.mark.parametrize("damage", ["flipped", "truncated"])
def test_run_rebuilds_a_damaged_shard_and_keeps_the_build_what_reads_it_used(workspace, damage):
    cfg, _, pre = workspace
    shard = pre / "shards" / load_manifest(pre)["splits"]["valid"]["shards"][0]["name"]
    whole = shard.read_bytes()
    build = json.loads((pre / "stage.json").read_text())["build"]
    if damage == "flipped":
        shard.write_bytes(whole[:100] + bytes([whole[100] ^ 0xFF]) + whole[101:])
        why = f"shards/{shard.name} does not match its checksum"
    else:
        shard.write_bytes(whole[:100])
        why = f"shards/{shard.name} has 100 bytes, {len(whole):,} were written"
    result = cli("run", cfg)
    assert result.returncode == 0, result.stdout + result.stderr
    assert (
        f"[preprocess] running: {why} (damaged since it was published); rebuilding it"
        in result.stdout
        and "[download] skipped" in result.stdout
    ), result.stdout
    assert shard.read_bytes() == whole
    # byte-identical, so a train stage built from the damaged output would stay up to date
    assert json.loads((pre / "stage.json").read_text())["build"] == build
    assert len(load_split(pre, "valid"))
