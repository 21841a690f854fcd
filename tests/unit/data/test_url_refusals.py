"""A dataset URL or tracking URI that urllib.parse accepts but no request can be made with is
refused when the spec is read, in one line naming the key and the problem (issue 45, item 7):
before, `validate` passed it and `run` ended in urllib's ValueError traceback."""

from __future__ import annotations

import json

import pydantic
import pytest

from pipeline.data.fetch import fetch, url_problem
from pipeline.errors import PipelineError
from pipeline.spec.dataset_schema import DatasetSpec
from pipeline.spec.schema import TrackingSpec, store_path

MALFORMED = [
    ("http://h:abc/x", "port 'abc' is not a number from 1 to 65535"),
    ("http://h:99999/x", "port '99999' is not a number from 1 to 65535"),
    ("http://h:-1/x", "port '-1' is not a number"),
    ("http://h:80:80/x", "port '80:80' is not a number"),
    ("https://[::1]:abc/x", "port 'abc' is not a number"),
    ("https://h:0/x", "port 0 is not a port a server listens on"),
    ("http://[::1/x", "unbalanced [ ] around the host"),
    ("http://::1]/x", "unbalanced [ ] around the host"),
    ("http://[zz]/x", "the host in [ ] is not an IPv6 address"),
    ("http:///x", "no host name"),
    ("http://:80/x", "no host name"),
    ("http://a..b/x", "host name 'a..b' is not valid"),
    ("http://" + "a" * 64 + ".org/x", "is not valid (an empty label, or one longer than 63"),
    ("http://h x/x", "holds a space or a control character"),
    ("ftp://h/x", "unsupported scheme 'ftp'"),
    ("h/x", "no scheme"),
]

FINE = [
    "http://h/x",
    "https://h:8443/x",
    "http://[::1]:8080/x",
    "http://127.0.0.1:1/x",
    "https://u:p@h/x?token=t",
    "https://${env:USER}:${env:TOKEN}@h/x",
    "http://h:${env:PORT}/x",  # filled in when the request is made
    "file:///data/x.txt",
    "builtin://python_docs",
    "http://é.example/x",
]


@pytest.mark.parametrize(("url", "problem"), MALFORMED, ids=[u for u, _ in MALFORMED])
def test_a_malformed_dataset_url_is_refused_naming_the_problem(url, problem):
    assert problem in (url_problem(url) or "")
    with pytest.raises(pydantic.ValidationError) as e:
        DatasetSpec(name="d", url=url, sha256="0" * 64)
    assert problem in str(e.value)


@pytest.mark.parametrize("url", FINE)
def test_a_fetchable_url_passes(url):
    assert url_problem(url) is None
    DatasetSpec(name="d", url=url)


@pytest.mark.parametrize(("url", "problem"), MALFORMED[:12], ids=[u for u, _ in MALFORMED[:12]])
def test_fetch_refuses_in_one_line_with_the_password_masked(url, problem, tmp_path):
    """fetch, called without a validated spec, says the same: a PipelineError, never the
    ValueError urllib raises when the request is made."""
    secret = url.replace("://", "://u:hunter2@", 1)
    with pytest.raises(PipelineError) as e:
        fetch(secret, tmp_path, sha256="0" * 64, log=lambda m: None, retries=0, timeout=1)
    message = str(e.value)
    assert message.startswith("dataset.url ") and problem in message
    assert "hunter2" not in message and "\n" not in message


def test_a_port_given_as_a_placeholder_is_checked_once_filled_in(tmp_path, monkeypatch):
    monkeypatch.setenv("PORT", "99999")
    with pytest.raises(PipelineError) as e:
        fetch("http://h:${env:PORT}/x", tmp_path, sha256="0" * 64, log=lambda m: None)
    assert str(e.value) == (
        "dataset.url http://h:${env:PORT}/x: with its ${env:...} values filled in, "
        "port '99999' is not a number from 1 to 65535"
    )


@pytest.mark.parametrize(("uri", "problem"), MALFORMED[:11], ids=[u for u, _ in MALFORMED[:11]])
def test_a_malformed_tracking_server_uri_is_refused(uri, problem):
    with pytest.raises(pydantic.ValidationError) as e:
        TrackingSpec(uri=uri)
    assert problem in str(e.value)


@pytest.mark.parametrize(
    ("uri", "path"),
    [
        ("sqlite:///runs/mlflow.db", "/runs/mlflow.db"),
        ("file:///tmp/store", "/tmp/store"),
        ("runs/store", "runs/store"),
    ],
)
def test_a_tracking_store_is_not_an_http_server_to_check(uri, path):
    """A store is kept as written, and what is checked of it is its path."""
    assert TrackingSpec(uri=uri).uri == uri
    assert store_path(uri) == path


@pytest.mark.parametrize("uri", ["databricks", "https://u:p@h:8443/x", None])
def test_a_tracking_uri_that_passes_is_kept_as_written(uri):
    assert TrackingSpec(uri=uri).uri == uri


@pytest.mark.parametrize(("url", "problem"), MALFORMED, ids=[u for u, _ in MALFORMED])
def test_a_refused_url_s_password_is_masked_in_the_spec_s_error(url, problem, tmp_path):
    # the secret fuzzer's 34 leaks: the line quoted the refused value as it was written
    # ("found 'ftp://user:PASSWORD@...'"), the password in it
    from pipeline.spec import SpecError, load_spec

    secret = "S3CRET'!$&()*+,;=%41"
    scheme, sep, rest = url.partition("://")
    with_password = f"{scheme}://user:{secret}@{rest}" if sep else url
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        "name: c\nmodel: {kind: allattn}\nstages: [download]\n"
        f"dataset: {{name: d, url: {json.dumps(with_password)}, sha256: {'0' * 64}}}\n"
    )
    with pytest.raises(SpecError) as e:
        load_spec(cfg)
    assert "S3CRET" not in str(e.value)
