"""The download stage and pipeline.data.fetch against a real HTTP server on 127.0.0.1.

The server (a thread, loopback only, a bounded number of requests) serves byte strings,
honours `Range: bytes=N-` with 206 (or ignores it, when told to), answers 404 for unknown
names and can cut a response after K body bytes to simulate a dropped connection. Every
request is recorded, so a test can say exactly what went over the wire.
"""

from __future__ import annotations

import errno
import gzip
import os
import re
import socket
import subprocess
import time
import zipfile
from pathlib import Path

import pytest

from pipeline.data import corpus, extract, fetch
from pipeline.errors import PipelineError
from tests.fixtures import download_server
from tests.fixtures.download_server import (
    config,
    listing,
    make_zip,
    md5,
    payload,
    record,
    run_download,
    sha,
)

ROOT = Path(__file__).resolve().parents[3]

pytestmark = pytest.mark.usefixtures("offline_and_fast")

TRAIN, VALID, TEST = payload(90_000, 1), payload(5_000, 2), payload(5_000, 3)
MEMBERS = {
    "wt/wiki.train.tokens": TRAIN,
    "wt/wiki.valid.tokens": VALID,
    "wt/wiki.test.tokens": TEST,
}
FILES = {
    "train": {"path": "wt/wiki.train.tokens", "sha256": sha(TRAIN)},
    "valid": {"path": "wt/wiki.valid.tokens", "md5": md5(VALID)},
    "test": {"path": "wt/wiki.test.tokens", "sha256": sha(TEST), "md5": md5(TEST)},
}


# ---------------------------------------------------------------- plain http


def test_http_download_is_verified_cached_and_recorded(server, tmp_path):
    data = payload(300_000)
    server.files["enwik8"] = data
    out, summary, _ = run_download(
        config(tmp_path, {"url": server.url("enwik8"), "sha256": sha(data)})
    )
    assert record(out) == {
        "url": server.url("enwik8"),
        "sha256": sha(data),
        "files": {"all": {"path": "files/enwik8", "sha256": sha(data), "bytes": 300_000}},
    }
    assert listing(out / "files") == ["enwik8"]
    assert (out / "files" / "enwik8").read_bytes() == data
    downloads = tmp_path / "runs" / "cache" / "downloads"
    assert (downloads / sha(data)).read_bytes() == data
    assert not [n for n in listing(downloads) if n.endswith(".part")]
    assert [(r["range"], r["status"]) for r in server.requests] == [(None, 200)]
    assert summary["sha256"] == sha(data) and summary["cached"] is False


def test_http_without_sha256_is_refused_with_how_to_set_it(server, tmp_path):
    server.files["enwik8"] = b"x" * 100
    with pytest.raises(PipelineError, match=r"needs the file's sha256.*--set dataset\.sha256="):
        run_download(config(tmp_path, {"url": server.url("enwik8")}))
    assert server.requests == []


def test_checksum_mismatch_names_expected_and_found(server, tmp_path):
    data, wrong = payload(50_000), sha(b"something else")
    server.files["enwik8"] = data
    cfg = config(tmp_path, {"url": server.url("enwik8"), "sha256": wrong})
    with pytest.raises(PipelineError) as e:
        run_download(cfg)
    msg = str(e.value)
    assert server.url("enwik8") in msg and "sha256 mismatch" in msg
    assert f"expected {wrong}" in msg and f"found {sha(data)}" in msg and "\n" not in msg
    downloads = tmp_path / "runs" / "cache" / "downloads"
    assert not (downloads / wrong).exists() and not (downloads / f"{wrong}.part").exists()
    # the complete file is kept under its own checksum: accepting it costs no new request
    out, summary, _ = run_download(cfg, f"dataset.sha256={sha(data)}")
    assert summary["cached"] and len(server.requests) == 1
    assert (out / "files" / "enwik8").read_bytes() == data


def test_http_404_is_one_clear_line(server, tmp_path):
    cfg = config(tmp_path, {"url": server.url("gone.zip"), "sha256": sha(b""), "archive": "zip"})
    with pytest.raises(
        PipelineError,
        match=r"^dataset\.url http://127\.0\.0\.1:\d+/gone\.zip: "
        r"HTTP 404 Not Found",
    ) as e:
        run_download(cfg)
    assert "\n" not in str(e.value)
    assert not list((tmp_path / "runs" / "cache" / "downloads").glob("*.part"))


def test_unreachable_host_suggests_a_local_mirror(tmp_path):
    with socket.socket() as s:  # a loopback port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/enwik8.zip"
    with pytest.raises(PipelineError) as e:
        run_download(config(tmp_path, {"url": url, "sha256": sha(b"x"), "archive": "zip"}))
    msg = str(e.value)
    assert f"cannot reach 127.0.0.1:{port}" in msg and "refused" in msg.lower()
    assert "--set dataset.url=file:///path/to/enwik8.zip" in msg


# ---------------------------------------------------------------- resume


def test_interrupted_download_resumes_with_range_on_the_next_run(server, tmp_path):
    data = payload(300_000)
    server.files["enwik8"] = data
    server.cut_after, server.cuts = 120_000, 1
    cache, key, logs = tmp_path / "cache", sha(data), []
    part, final = cache / "downloads" / f"{key}.part", cache / "downloads" / key
    with pytest.raises(
        PipelineError,
        match=r"interrupted.*120,000 bytes received are kept "
        r".*run again to resume",
    ):
        fetch.fetch(server.url("enwik8"), cache, sha256=key, log=logs.append, retries=0)
    assert part.stat().st_size == 120_000 and not final.exists()

    got = fetch.fetch(server.url("enwik8"), cache, sha256=key, log=logs.append, retries=0)
    second = server.requests[1]
    assert (second["range"], second["status"], second["sent"]) == ("bytes=120000-", 206, 180_000)
    assert got.path == final and final.read_bytes() == data and not part.exists()


class LingeringWriter:
    """A handler's socket writer that lingers after each write: the client has every byte
    while the handler that sent them has not yet counted them (what load once did)."""

    def __init__(self, raw):
        self.raw = raw

    def write(self, data):
        written = self.raw.write(data)
        time.sleep(0.5)
        return written

    def __getattr__(self, name):
        return getattr(self.raw, name)


def test_the_servers_counts_are_final_once_the_client_has_its_bytes(server, tmp_path, monkeypatch):
    """The resume test once read the second request's count of bytes sent as 0 under load:
    the client had the response's last byte before the handler counted it."""
    setup = download_server._Handler.setup

    def lingering(handler):
        setup(handler)
        handler.wfile = LingeringWriter(handler.wfile)

    monkeypatch.setattr(download_server._Handler, "setup", lingering)
    data = payload(50_000)
    server.files["enwik8"] = data
    got = fetch.fetch(server.url("enwik8"), tmp_path, sha256=sha(data), log=print, retries=0)
    assert got.path.read_bytes() == data
    assert [(r["status"], r["sent"]) for r in server.requests] == [(200, 50_000)]


def test_stage_resumes_a_dropped_connection_in_process(server, tmp_path):
    data = payload(300_000)
    server.files["enwik8"] = data
    server.cut_after, server.cuts = 100_000, 2
    out, _, logs = run_download(
        config(tmp_path, {"url": server.url("enwik8"), "sha256": sha(data)})
    )
    assert [(r["range"], r["sent"]) for r in server.requests] == [
        (None, 100_000),
        ("bytes=100000-", 100_000),
        ("bytes=200000-", 100_000),
    ]
    assert (out / "files" / "enwik8").read_bytes() == data
    assert sum("resuming" in line for line in logs) >= 2


def test_server_without_range_support_restarts_cleanly(server, tmp_path):
    data = payload(200_000)
    server.files["enwik8"], server.ranges = data, False
    server.cut_after, server.cuts = 70_000, 1
    cache = tmp_path / "cache"
    with pytest.raises(PipelineError, match="interrupted"):
        fetch.fetch(server.url("enwik8"), cache, sha256=sha(data), log=print, retries=0)
    logs: list[str] = []
    got = fetch.fetch(server.url("enwik8"), cache, sha256=sha(data), log=logs.append, retries=0)
    assert server.requests[1]["range"] == "bytes=70000-" and server.requests[1]["status"] == 200
    assert got.path.read_bytes() == data
    assert any("starting over" in line for line in logs)
    assert listing(cache / "downloads") == [sha(data), f"{sha(data)}.lock"]


def test_progress_lines_are_few_and_carry_a_rate(server, tmp_path, monkeypatch):
    monkeypatch.setattr(fetch, "PROGRESS_MIN_BYTES", 0)
    monkeypatch.setattr(fetch, "CHUNK", 4096)  # ~100 chunks
    data = payload(400_000)
    server.files["big"] = data
    logs: list[str] = []
    fetch.fetch(server.url("big"), tmp_path / "c", sha256=sha(data), log=logs.append)
    progress = [line for line in logs if "%" in line]
    assert 5 <= len(progress) <= 10, logs
    assert all(re.search(r"\d+%.* of 0\.4 MB +[\d.]+ MB/s", line) for line in progress)


# ---------------------------------------------------------------- the cache


def test_cache_hit_across_workspaces_makes_no_request(server, tmp_path):
    data = payload(100_000)
    server.files["text8"] = data
    shared = tmp_path / "shared-cache"
    dataset = {"url": server.url("text8"), "sha256": sha(data)}
    out_a, _, _ = run_download(config(tmp_path / "a", dataset, name="a", cache=shared))
    cfg_b = config(tmp_path / "b", dataset, name="b", cache=shared)
    out_b, summary, logs = run_download(cfg_b)
    assert len(server.requests) == 1 and summary["cached"]
    assert any("cache hit" in line for line in logs)
    assert record(out_a) == record(out_b)
    assert (out_b / "files" / "text8").read_bytes() == data

    cached = shared / "downloads" / sha(data)  # a hit re-verifies: corruption is caught
    cached.write_bytes(b"X" + data[1:])
    out_b, summary, logs = run_download(cfg_b)
    assert len(server.requests) == 2 and not summary["cached"]
    assert any("corrupt" in line for line in logs)
    assert cached.read_bytes() == data and (out_b / "files" / "text8").read_bytes() == data


# ---------------------------------------------------------------- zip


@pytest.fixture
def wikizip(server):
    blob = make_zip(MEMBERS)
    server.files["wikitext.zip"] = blob
    return {
        "url": server.url("wikitext.zip"),
        "sha256": sha(blob),
        "archive": "zip",
        "files": FILES,
    }


def test_zip_files_are_extracted_and_checked(wikizip, tmp_path):
    out, _, logs = run_download(config(tmp_path, wikizip))
    assert record(out)["files"] == {
        "train": {"path": "files/wiki.train.tokens", "sha256": sha(TRAIN), "bytes": 90_000},
        "valid": {"path": "files/wiki.valid.tokens", "sha256": sha(VALID), "bytes": 5_000},
        "test": {"path": "files/wiki.test.tokens", "sha256": sha(TEST), "bytes": 5_000},
    }
    assert listing(out / "files") == ["wiki.test.tokens", "wiki.train.tokens", "wiki.valid.tokens"]
    assert (out / "files" / "wiki.train.tokens").read_bytes() == TRAIN
    assert sum("checksum verified" in line for line in logs) == 3


def test_zip_member_missing_lists_what_the_archive_holds(server, tmp_path, wikizip):
    blob = make_zip({k: v for k, v in MEMBERS.items() if "test" not in k})
    server.files["partial.zip"] = blob
    with pytest.raises(PipelineError) as e:
        run_download(
            config(tmp_path, {**wikizip, "url": server.url("partial.zip"), "sha256": sha(blob)})
        )
    msg = str(e.value)
    assert "dataset.files.test.path 'wt/wiki.test.tokens' is not in the zip archive" in msg
    assert "wt/wiki.train.tokens" in msg and "wt/wiki.valid.tokens" in msg


@pytest.mark.parametrize(
    "role,member,algo",
    [("train", "wt/wiki.train.tokens", "sha256"), ("valid", "wt/wiki.valid.tokens", "md5")],
)
def test_zip_modified_member_is_refused(server, tmp_path, wikizip, role, member, algo):
    changed = bytearray(MEMBERS[member])
    changed[100] ^= 1
    blob = make_zip({**MEMBERS, member: bytes(changed)})
    server.files["mirror.zip"] = blob
    # a mirror whose archive checksum is given (it matches): the member check still refuses
    cfg = config(tmp_path, {**wikizip, "url": server.url("mirror.zip"), "sha256": sha(blob)})
    with pytest.raises(PipelineError) as e:
        run_download(cfg)
    msg = str(e.value)
    digest = sha if algo == "sha256" else md5
    assert f"{member} -> {member.split('/')[1]} (dataset.files.{role}): {algo} mismatch" in msg
    assert f"expected {digest(MEMBERS[member])}, found {digest(bytes(changed))}" in msg
    files = tmp_path / "runs" / "dl" / "download.partial" / "files"
    assert member.split("/")[1] not in listing(files)
    assert not [n for n in listing(files) if n.endswith(".part")]


def test_repacked_mirror_is_accepted_with_its_archive_sha256(server, tmp_path, wikizip):
    repacked = make_zip(
        {"README": b"mirror\n", **dict(reversed(list(MEMBERS.items())))},
        compression=zipfile.ZIP_STORED,
    )
    server.files["mirror/wikitext.zip"] = repacked
    cfg = config(tmp_path, wikizip)
    mirror = f"dataset.url={server.url('mirror/wikitext.zip')}"
    with pytest.raises(
        PipelineError,
        match=rf"expected {wikizip['sha256']}, found "
        rf"{sha(repacked)}.*--set dataset\.sha256="
        rf"{sha(repacked)} accepts it",
    ):
        run_download(cfg, mirror)
    out, _, _ = run_download(cfg, mirror, f"dataset.sha256={sha(repacked)}")
    info = record(out)
    assert info["sha256"] == sha(repacked) and info["url"] == server.url("mirror/wikitext.zip")
    assert {r: f["sha256"] for r, f in info["files"].items()} == {
        "train": sha(TRAIN),
        "valid": sha(VALID),
        "test": sha(TEST),
    }
    assert len(server.requests) == 1  # the mismatching download was kept, not refetched


def test_zip_without_files_gives_one_role_per_member(server, tmp_path):
    blob = make_zip(
        {
            "text8/text8": b"anarchism originated",
            "__MACOSX/text8/._text8": b"x",
            "text8/README": b"readme",
        }
    )
    server.files["text8.zip"] = blob
    out, _, _ = run_download(
        config(tmp_path, {"url": server.url("text8.zip"), "sha256": sha(blob), "archive": "zip"})
    )
    files = record(out)["files"]
    assert files == {
        "text8": {"path": "files/text8", "sha256": sha(b"anarchism originated"), "bytes": 20},
        "README": {"path": "files/README", "sha256": sha(b"readme"), "bytes": 6},
    }
    assert listing(out / "files") == ["README", "text8"]


# ---------------------------------------------------------------- gz, not an archive


def test_gz_is_decompressed_and_checked(server, tmp_path):
    data = payload(120_000)
    blob = gzip.compress(data)
    server.files["enwik8.gz"] = blob
    dataset = {"url": server.url("enwik8.gz"), "sha256": sha(blob), "archive": "gz"}
    out, _, _ = run_download(config(tmp_path / "a", dataset))  # name from the URL
    assert record(out)["files"] == {
        "all": {"path": "files/enwik8", "sha256": sha(data), "bytes": 120_000}
    }
    assert record(out)["sha256"] == sha(blob)
    assert (out / "files" / "enwik8").read_bytes() == data
    named = {**dataset, "files": {"all": {"path": "corpus.bin", "sha256": sha(data)}}}
    out, _, _ = run_download(config(tmp_path / "b", named))
    assert listing(out / "files") == ["corpus.bin"]
    bad = {**dataset, "files": {"all": {"path": "corpus.bin", "sha256": sha(b"")}}}
    with pytest.raises(
        PipelineError,
        match=rf"corpus\.bin \(dataset\.files\.all\): sha256 "
        rf"mismatch: expected {sha(b'')}, found {sha(data)}",
    ):
        run_download(config(tmp_path / "c", bad))


@pytest.mark.parametrize(
    "archive,message", [("zip", "not a valid zip archive"), ("gz", "not a valid gzip file")]
)
def test_not_an_archive_is_refused(server, tmp_path, archive, message):
    data = b"just some text, not an archive\n" * 100
    server.files["data.bin"] = data
    with pytest.raises(PipelineError, match=message) as e:
        run_download(
            config(
                tmp_path, {"url": server.url("data.bin"), "sha256": sha(data), "archive": archive}
            )
        )
    assert server.url("data.bin") in str(e.value)
    assert listing(tmp_path / "runs" / "dl" / "download.partial" / "files") == []


# ---------------------------------------------------------------- file://, builtin://


def test_file_source_is_read_in_place(tmp_path):
    blob = make_zip(MEMBERS)
    src = tmp_path / "mirror dir" / "wikitext.zip"
    src.parent.mkdir()
    src.write_bytes(blob)
    url = src.as_uri()  # file:///.../mirror%20dir/wikitext.zip
    dataset = {"url": url, "sha256": sha(blob), "archive": "zip", "files": FILES}
    out, _, _ = run_download(config(tmp_path / "a", dataset))
    assert record(out)["url"] == url and record(out)["sha256"] == sha(blob)
    assert (out / "files" / "wiki.valid.tokens").read_bytes() == VALID
    assert not (tmp_path / "a" / "runs" / "cache" / "downloads").exists()  # not copied
    with pytest.raises(
        PipelineError,
        match=rf"{re.escape(url)}: sha256 mismatch: expected "
        rf"{sha(b'')}, found {sha(blob)}",
    ):
        run_download(config(tmp_path / "b", {**dataset, "sha256": sha(b"")}))
    with pytest.raises(PipelineError, match="no such file"):
        run_download(config(tmp_path / "c", {**dataset, "url": url + ".missing"}))


def test_builtin_source_still_works(tmp_path, monkeypatch):
    text = b"A small corpus built on the machine.\n" * 50
    monkeypatch.setitem(corpus.BUILTIN, "tiny", lambda: text)
    out, _, _ = run_download(config(tmp_path, {"url": "builtin://tiny"}))
    assert record(out) == {
        "url": "builtin://tiny",
        "sha256": sha(text),
        "files": {"all": {"path": "files/tiny.txt", "sha256": sha(text), "bytes": len(text)}},
    }
    assert (out / "files" / "tiny.txt").read_bytes() == text
    with pytest.raises(PipelineError, match="no built-in corpus 'nope'"):
        run_download(config(tmp_path / "b", {"url": "builtin://nope"}))


# ---------------------------------------------------------------- a full disk


def full_disk_after(limit: int):
    """A stand-in for fetch.open_for_write (which extract shares) whose file raises ENOSPC past
    `limit` bytes."""

    def opener(path, mode):
        f = open(path, mode)

        class Full:
            written = 0

            def write(self, block):
                if self.written + len(block) > limit:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                self.written += len(block)
                return f.write(block)

            def flush(self):
                f.flush()

            def fileno(self):
                return f.fileno()

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                f.close()

        return Full()

    return opener


def test_disk_full_while_downloading(server, tmp_path, monkeypatch):
    data = payload(200_000)
    server.files["enwik8"] = data
    cfg = config(tmp_path, {"url": server.url("enwik8"), "sha256": sha(data)})
    downloads = tmp_path / "runs" / "cache" / "downloads"
    with monkeypatch.context() as m:
        m.setattr(fetch, "open_for_write", full_disk_after(50_000))
        with pytest.raises(PipelineError) as e:
            run_download(cfg)
    msg = str(e.value)
    kept = 3 * (16 << 10)  # whole chunks written before the disk filled
    assert f"disk full writing {downloads / sha(data)}.part (No space left on device)" in msg
    assert f"{200_000 - kept:,} more bytes were needed" in msg and "run again to resume" in msg
    assert not (downloads / sha(data)).exists()  # nothing in the final place
    out, _, _ = run_download(cfg)  # space freed: the next run resumes
    assert server.requests[-1]["range"] == f"bytes={kept}-"
    assert (out / "files" / "enwik8").read_bytes() == data


def test_disk_full_while_extracting(tmp_path, monkeypatch):
    src = tmp_path / "wikitext.zip"
    src.write_bytes(make_zip(MEMBERS))
    monkeypatch.setattr(extract, "open_for_write", full_disk_after(40_000))
    with pytest.raises(PipelineError) as e:
        run_download(config(tmp_path, {"url": src.as_uri(), "archive": "zip", "files": FILES}))
    files = tmp_path / "runs" / "dl" / "download.partial" / "files"
    msg = str(e.value)
    assert f"disk full writing {files / 'wiki.train.tokens'}" in msg
    assert f"{90_000 - 32768:,} more bytes were needed (90,000 in all)" in msg
    assert listing(files) == []  # no partial file, no temporary


# ---------------------------------------------------------------- the real CLI


def test_cli_run_only_download(server, tmp_path):
    data = payload(60_000)
    blob = gzip.compress(data)
    server.files["enwik8.gz"] = blob
    cfg = config(
        tmp_path,
        {
            "url": server.url("missing.gz"),
            "sha256": sha(blob),
            "archive": "gz",
            "files": {"all": {"path": "enwik8", "sha256": sha(data)}},
        },
    )
    cli = [str(ROOT / ".venv" / "bin" / "allattn-pipe"), "run", str(cfg), "--only", "download"]
    env = dict(os.environ, no_proxy="127.0.0.1,localhost")
    for var in ("http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY"):
        env.pop(var, None)
    failed = subprocess.run(cli, check=False, capture_output=True, text=True, timeout=120, env=env)
    assert failed.returncode == 2
    assert re.fullmatch(
        r"error: dataset\.url http://127\.0\.0\.1:\d+/missing\.gz: HTTP 404 "
        r"Not Found[^\n]*\n",
        failed.stderr,
    ), failed.stderr

    done = subprocess.run(
        cli + ["--set", f"dataset.url={server.url('enwik8.gz')}"],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    out = tmp_path / "runs" / "dl" / "download"
    assert record(out)["files"] == {
        "all": {"path": "files/enwik8", "sha256": sha(data), "bytes": 60_000}
    }
    assert (out / "files" / "enwik8").read_bytes() == data
    assert "[download] done" in done.stdout
