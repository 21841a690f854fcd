"""Secrets made of every character the URL grammar allows in a password or a query value
(`'`, `!`, `$`, `&`, `(`, `)`, `*`, `+`, `,`, `;`, `=`, `%XX`), a token holding a space, and
a tag longer than MLflow keeps (issue 45, item 1). Each secret is `SeCrEtL<chars>SeCrEtR`: a
masking rule that stops at one of the characters leaves `SeCrEtL` or `SeCrEtR` in clear."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from pipeline.commands.cli import main
from tests.fixtures.download_server import sha

DATA = b"the quick brown fox jumps over the lazy dog\n" * 200


@pytest.fixture(autouse=True)
def _offline(offline_and_fast, monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


def config(tmp_path: Path, url: str) -> Path:
    """A download-only pipeline, tracked in a file store under tmp_path."""
    spec = {
        "name": "sec",
        "dataset": {"name": "secret-data", "tokenizer": "byte", "url": url, "sha256": sha(DATA)},
        "model": {"kind": "allattn", "d_model": 32, "n_layers": 1, "n_heads": 2,
                  "n_persistent": 4, "max_span": 64},
        "train": {"steps": 2, "batch_size": 2, "seq_len": 8},
        "tracking": {"uri": (tmp_path / "store").as_uri(), "experiment": "sec"},
        "workspace": {"root": str(tmp_path / "runs")},
        "stages": ["download", "preprocess"],
    }  # fmt: skip
    path = tmp_path / "sec.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def cli(*args: str):
    return CliRunner().invoke(main, list(args))


def store_text(tmp_path: Path) -> str:
    return "\n".join(
        p.read_text(errors="replace") for p in (tmp_path / "store").rglob("*") if p.is_file()
    )


PASSWORD = "SeCrEtL'!$&()*+,;=%41SeCrEtR"  # a raw `&` is the password's own in userinfo
TOKEN = "SeCrEtL'!$()*+,;=%41SeCrEtR"  # in a query `&` starts the next parameter


def found(tmp_path, *texts: str) -> list[str]:
    """Where either half of a secret is: the texts given, files under tmp_path (but the
    config, where the user wrote it)."""
    halves = ("SeCrEtL", "SeCrEtR")
    where = [f"output {i}" for i, t in enumerate(texts) if any(h in t for h in halves)]
    for path in tmp_path.rglob("*"):
        if path.name == "sec.yaml" or not path.is_file() or path.is_symlink():
            continue
        data = path.read_bytes()
        if any(h.encode() in data for h in halves):
            where.append(str(path.relative_to(tmp_path)))
    return where


def test_a_password_and_a_token_of_url_characters_are_masked_everywhere(
    server, tmp_path, monkeypatch
):
    server.files[f"data.txt?v=2&token={TOKEN}"] = DATA  # served only for the whole token
    port = server.httpd.server_address[1]
    url = f"http://alice:{PASSWORD}@127.0.0.1:{port}/data.txt?v=2&token={TOKEN}"
    cfg = config(tmp_path, server.url("placeholder.txt"))
    monkeypatch.setattr(
        sys, "argv", ["allattn-pipe", "run", str(cfg), "--set", f"dataset.url={url}"]
    )
    done = cli("run", str(cfg), "--only", "download", "--set", f"dataset.url={url}")
    assert done.exit_code == 0, done.output
    assert server.requests[-1]["path"].endswith(f"&token={TOKEN}")  # the request had it all
    assert server.requests[-1]["status"] == 200
    shown = cli("show", str(cfg), "--set", f"dataset.url={url}")
    assert shown.exit_code == 0, shown.output
    # the params dataset.url and url, the argv tag, spec.resolved.yaml and download.json
    # artifacts, the workspace's download.json and stage.json, the [download] lines
    assert found(tmp_path, done.output, shown.output) == []
    masked = f"http://alice:***@127.0.0.1:{port}/data.txt?v=2&token=***"
    assert masked in store_text(tmp_path)
    assert masked in (tmp_path / "runs" / "sec" / "download" / "download.json").read_text()
    assert masked in shown.output and f"[download] downloading {masked}" in done.output


def test_a_token_with_a_space_is_not_in_the_error_line(server, tmp_path, monkeypatch):
    # http.client refuses the request in an InvalidURL that quotes its path and query
    # without the scheme: '/data.txt?token=Bearer SeCrEt...'
    monkeypatch.setenv("DL_TOKEN", "Bearer SeCrEtL SeCrEtR")
    failed = cli(
        "run", str(config(tmp_path, server.url("data.txt") + "?token=${env:DL_TOKEN}")),
        "--only", "download",
    )  # fmt: skip
    assert failed.exit_code == 2, failed.output
    assert failed.stderr.count("\n") == 1, failed.stderr
    assert "token=${env:DL_TOKEN}" in failed.stderr  # the placeholder, as written
    assert found(tmp_path, failed.output) == []


@pytest.mark.parametrize("cut_inside", ["user", "password"])
def test_the_argv_tag_is_masked_before_it_is_cut(monkeypatch, cut_inside):
    from pipeline.tracking import tracker

    url = f"http://alice:{PASSWORD}@example.invalid/x"
    head = "x" * (tracker._MAX_PARAM - len("allattn-pipe ") - 1 - len("http://alice:SeCrEt"))
    if cut_inside == "user":
        head += "x" * 12
    monkeypatch.setattr(sys, "argv", ["allattn-pipe", head, url])
    tags = tracker.environment_tags()
    assert len(tags["argv"]) <= tracker._MAX_PARAM
    assert "SeCrEt" not in tags["argv"], tags["argv"][-40:]
    params = tracker.flatten({"dataset": {"url": head + " " + url}})
    assert "SeCrEt" not in params["dataset.url"]
