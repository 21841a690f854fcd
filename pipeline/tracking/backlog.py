"""The tracking backlog, `<workspace>/tracking-backlog.jsonl`: the records a run could not
send while its tracking store did not answer, kept for `sync` (or the next run) to send. It
is the user's only copy of those metrics, so a record is never lost nor sent twice, and a
kill at any moment leaves a file that the next replay reads right.

One JSON object a line, appended to and never edited in place:

- a record (`create`, `batch`, `artifact`, `end`; pipeline.tracking.sender): one MLflow call,
  naming its run by a key of the pipeline's own;
- `{"op": "bind", "key", "run_id"}`: the MLflow run that a key became, written when its
  `create` went through (so a later record finds its run, and the `create` is done);
- `{"op": "sent", "line": N}`: the record on line N (counted from 0) was delivered, or
  refused for good; a replay writes one as each record goes.

A replay stopped anywhere (the server gone, a signal, kill -9) thus leaves in the file what
it sent; the next sends the rest. The file is rewritten only whole, a temporary file renamed
over it (`compact`): to set torn lines aside and drop what was sent.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

RECORD_OPS = ("create", "batch", "artifact", "end")
OPS = (*RECORD_OPS, "bind", "sent")


def append_records(path: Path, records: list[dict]) -> None:
    """Append `records` a line each. After a line torn by a kill during an earlier append,
    start on a new line, so that the torn one stays alone and the new ones whole. Private
    (0600): it holds every record bound for the tracking store, whose readers may not be
    the workspace's; never written through a link planted at its name."""
    from pipeline.fsutil import open_for_write

    with open_for_write(path, "tracking backlog", append=True, private=True, text=True) as f:
        f.write(
            ("" if _ends_a_line(path) else "\n") + "".join(json.dumps(r) + "\n" for r in records)
        )
        f.flush()


def _ends_a_line(path: Path) -> bool:
    """True for an empty or absent file, or one whose last byte ends a line."""
    from pipeline.fsutil import open_regular_for_read

    try:
        with open_regular_for_read(path, "tracking backlog") as f:
            if f.seek(0, os.SEEK_END) == 0:
                return True
            f.seek(-1, os.SEEK_END)
            return f.read(1) == b"\n"
    except FileNotFoundError:
        return True


@dataclass
class Backlog:
    """A backlog file as read: what waits, and what a rewrite would drop."""

    waiting: list[tuple[int, dict]] = field(default_factory=list)  # (line, record), in order
    run_ids: dict[str, str] = field(default_factory=dict)  # key -> MLflow run id (binds)
    torn: list[str] = field(default_factory=list)  # lines that are no record
    done: int = 0  # lines of records sent or dropped, and of their marks

    def count(self) -> int:
        return len(self.waiting)


def read_backlog(path: Path) -> Backlog:
    """The backlog in `path`. Torn lines (what a kill during an append leaves) and JSON that
    no tracker wrote (no known `op`, no run `key`, a mark naming no record before it: an
    edited or foreign file) are `torn`. A record is done when a `sent` mark names it, a
    `create` also when its key is bound; so is every record of a run whose `create` MLflow
    refused (marked sent, never bound): it has no run to go to."""
    from pipeline.fsutil import read_bytes

    text = read_bytes(path, "tracking backlog").decode("utf-8", errors="replace")
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()  # after the last newline
    records: dict[int, dict] = {}
    sent: set[int] = set()
    backlog = Backlog()
    for index, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            backlog.torn.append(line)
            continue
        op = entry.get("op") if isinstance(entry, dict) else None
        if op == "sent" and _names_a_record(entry.get("line"), index, records):
            sent.add(entry["line"])
        elif op in RECORD_OPS and isinstance(entry.get("key"), str):
            records[index] = entry
        elif op == "bind" and isinstance(entry.get("key"), str):
            if isinstance(entry.get("run_id"), str):
                backlog.run_ids[entry["key"]] = entry["run_id"]
            else:
                backlog.torn.append(line)
        else:
            backlog.torn.append(line)
    refused = {
        r["key"]
        for i, r in records.items()
        if r["op"] == "create" and i in sent and r["key"] not in backlog.run_ids
    }
    for index, record in records.items():
        created = record["op"] == "create" and record["key"] in backlog.run_ids
        if index in sent or created or record["key"] in refused:
            backlog.done += 1
        else:
            backlog.waiting.append((index, record))
    backlog.done += len(sent)
    return backlog


def _names_a_record(line, index: int, records: dict[int, dict]) -> bool:
    return isinstance(line, int) and not isinstance(line, bool) and line in records and line < index


def read_records(path: Path) -> tuple[list[dict], list[str]]:
    """What waits in a backlog file, as the records a rewrite would keep (the binds, then
    the records not yet sent), and its lines that are no record."""
    backlog = read_backlog(path)
    return _kept(backlog), backlog.torn


def _kept(backlog: Backlog) -> list[dict]:
    binds = [{"op": "bind", "key": k, "run_id": v} for k, v in backlog.run_ids.items()]
    return binds + [record for _, record in backlog.waiting]


def torn_path(path: Path) -> Path:
    return path.with_name(path.name + ".torn")


def compact(path: Path, backlog: Backlog, warn) -> Backlog:
    """Set the torn lines of `path` aside (appended to `torn_path`, named in a warning) and
    rewrite it with what waits only, when there is anything to drop; returns the backlog as
    the file now holds it. The rewrite is whole: a temporary file renamed over it."""
    if not backlog.torn and not backlog.done:
        return backlog
    if backlog.torn:
        from pipeline.fsutil import open_for_write

        aside = torn_path(path)
        with open_for_write(aside, "tracking backlog", append=True, private=True, text=True) as f:
            f.write("".join(line + "\n" for line in backlog.torn))
        warn(
            f"{len(backlog.torn)} line(s) of {path} are not tracking records (torn by a kill "
            f"during a write, or edited); set aside in {aside}"
        )
    from pipeline.fsutil import atomic_write_bytes

    # a temporary of its own (`atomic_write_bytes`), never a fixed name that a second
    # compaction would truncate or a stopped one leave behind
    kept = "".join(json.dumps(r) + "\n" for r in _kept(backlog))
    atomic_write_bytes(path, kept.encode(), private=True)
    return read_backlog(path)


class Marks:
    """Marks written into a backlog file as a replay goes: each line whole, appended, and
    handed to the kernel before the next request (a kill -9 loses none already written)."""

    def __init__(self, path: Path):
        self.path = path
        self._file: IO[str] | None = None

    def __enter__(self):
        from pipeline.fsutil import open_for_write

        starts_a_line = _ends_a_line(self.path)
        self._file = open_for_write(
            self.path, "tracking backlog", append=True, private=True, text=True
        )
        if not starts_a_line:
            self._write("")  # a torn last line stays alone
        return self

    def __exit__(self, *exc):
        assert self._file is not None
        self._file.close()

    def bound(self, key: str, run_id: str) -> None:
        self._write(json.dumps({"op": "bind", "key": key, "run_id": run_id}))

    def sent(self, line: int) -> None:
        self._write(json.dumps({"op": "sent", "line": line}))

    def _write(self, line: str) -> None:
        assert self._file is not None
        self._file.write(line + "\n")
        self._file.flush()
