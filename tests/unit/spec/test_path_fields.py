"""Every field that names a file, a folder or a URL's file is refused at `validate` where no
path can hold its value: a NUL byte, a name past 255 bytes, a path of 4096 bytes or more, a
character the file system's encoding cannot write; a file URL without an absolute path too.
They passed `validate` and ended `run` in a ValueError traceback (embedded null byte) or a
failure deep in a stage."""

from __future__ import annotations

import json

import pytest

from pipeline.spec import PROJECT_ROOT, SpecError, load_spec

CONFIG = PROJECT_ROOT / "configs" / "quickstart.yaml"
NUL = "it holds a NUL byte, which no path can hold"
LONG_NAME = f"its part '{'x' * 20}...' is 300 bytes long; a file or folder name has at most 255"
LONG_PATH = "it is 4,505 bytes long; a path has fewer than 4,096"
SAVED_AS = "the file name it is saved as: "
SURROGATE = "it holds '\\ud800', which no path can hold in this system's encoding (utf-8)"
BLANK = "only whitespace or control characters"
ON_PURPOSE = "no name a file is given on purpose"


def refusal(key: str, value: str) -> str:
    # as a user types it: a YAML double-quoted string, where \0 and \ud800 are escapes
    with pytest.raises(SpecError) as refused:
        load_spec(CONFIG, [f"{key}={json.dumps(value)}"])
    line = str(refused.value)
    assert "\n" not in line
    return line.split(f": {key}: ", 1)[1].split("; found ", 1)[0]


@pytest.mark.parametrize(
    "key, value, problem",
    [
        ("workspace.root", "runs/a\x00b", NUL),
        ("workspace.root", "~/\x00", NUL),
        ("workspace.cache", "cache\x00", NUL),
        ("workspace.cache", "/tmp/" + "ab/" * 1500, LONG_PATH),
        ("workspace.root", "runs/a\ud800", SURROGATE),
        # a shell variable gone wrong: a folder named by a newline made in the current one
        ("workspace.root", "\n", f"it is {BLANK} ('\\n'), {ON_PURPOSE}"),
        ("workspace.cache", "cache/ /x", f"its part ' ' is {BLANK}, {ON_PURPOSE}"),
        ("train.launcher.hostfile", "\t", f"it is {BLANK} ('\\t'), {ON_PURPOSE}"),
        ("train.launcher.hostfile", "hosts\x00", NUL),
        ("train.launcher.hostfile", "x" * 300, LONG_NAME),
        ("dataset.files.all.path", "corpus\x00.txt", NUL),
        ("tracking.uri", "a\x00b", f"the store's path: {NUL}"),
        ("tracking.uri", "sqlite:///runs/" + "x" * 300, f"the store's path: {LONG_NAME}"),
        ("tracking.uri", "file:/runs/%00", f"the store's path: {NUL}"),
        ("dataset.url", "file:///data/a%00b", f"its path: {NUL}"),
        ("dataset.url", "file:///data/a\x00b", f"its path: {NUL}"),
        ("dataset.url", "file:///" + "x" * 300, f"its path: {LONG_NAME}"),
        ("dataset.url", "https://example.org/" + "x" * 300, f"{SAVED_AS}{LONG_NAME}"),
        ("dataset.url", "https://example.org/%00", f"{SAVED_AS}{NUL}"),
        (
            "dataset.url",
            "file://data/corpus.txt",
            "a file URL names an absolute path, with three slashes: file:///path/to/file",
        ),
    ],
)  # fmt: skip
def test_a_path_no_file_system_can_hold_is_refused_at_validate(key, value, problem):
    assert refusal(key, value) == problem


@pytest.mark.parametrize(
    "key, value",
    [
        ("workspace.root", "runs with spaces/é☃"),
        ("train.launcher.hostfile", "hosts\nnewline"),  # odd, but a path can hold it
        ("tracking.uri", "http://127.0.0.1:5000"),
        ("tracking.uri", "databricks"),
        ("dataset.url", "file:///data/corpus%20one.txt"),
        ("dataset.url", "https://example.org/data.zip?x=%00"),  # the query is not saved
    ],
)
def test_a_path_any_file_system_can_hold_is_taken(key, value):
    spec = load_spec(CONFIG, [f"{key}={json.dumps(value)}"])
    section, field = key.rsplit(".", 1)
    node = spec
    for part in section.split("."):
        node = getattr(node, part)
    assert getattr(node, field) == value
