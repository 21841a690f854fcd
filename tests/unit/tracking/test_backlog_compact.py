"""A backlog's compaction (the rewrite that drops sent records and torn lines) is whole or
not at all, and leaves no temporary behind when it is stopped."""

from __future__ import annotations

import json
import os
import stat

import pytest

from pipeline.errors import Interrupted
from pipeline.tracking.backlog import compact, read_backlog

RECORDS = [
    {"op": "create", "key": "a", "name": "train"},
    {"op": "batch", "key": "a", "metrics": [["loss", 1.5, 0, 1]]},
]


def write_backlog(path, lines):
    path.write_text("".join(lines))


def test_a_compaction_keeps_what_waits_privately_and_sets_torn_lines_aside(tmp_path):
    path = tmp_path / "tracking-backlog.jsonl"
    write_backlog(path, [json.dumps(r) + "\n" for r in RECORDS] + ['{"op": "cre\n'])
    warnings = []
    after = compact(path, read_backlog(path), warnings.append)
    assert [json.loads(line) for line in path.read_text().splitlines()] == RECORDS
    assert [r for _, r in after.waiting] == RECORDS and after.torn == []
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert (tmp_path / "tracking-backlog.jsonl.torn").read_text() == '{"op": "cre\n'
    assert len(warnings) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name, path.name + ".torn"]


def test_a_compaction_stopped_before_its_rename_leaves_the_file_and_no_temporary(
    tmp_path, monkeypatch
):
    path = tmp_path / "tracking-backlog.jsonl"
    before = "".join(json.dumps(r) + "\n" for r in RECORDS) + "torn\n"
    write_backlog(path, [before])

    def stopped(*args):
        raise Interrupted("SIGTERM", 15)

    monkeypatch.setattr(os, "replace", stopped)
    with pytest.raises(Interrupted):
        compact(path, read_backlog(path), lambda message: None)
    assert path.read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name, path.name + ".torn"]
