"""A run's directory: where each stage's outputs, records and checkpoints live, and the
operations that change it safely (begin, publish, invalidate). The runner decides what to
run; this module is how every command reads and writes a workspace.

Layout (one per run name, `<workspace.root>/<name>/`):

    .lock                       held (flock) while a `run` is active; names its holder
    .lock.soft                  held instead where the file system has no flock (lock.py)
    <stage>/                    a completed stage's outputs
    <stage>/stage.json          its record: fingerprint, config, build id, summary, timings,
                                and the sha256 and size of each output file (`outputs`)
    <stage>.partial/            a stage in progress (or interrupted: train resumes from it)
    <stage>.partial/partial.json  the fingerprint, config and input builds it was started with
    <stage>.old/                the outputs a publish is replacing, deleted once it is done

A stage's fingerprint hashes its resolved config section, less the keys that do not change
its result (`Stage.runtime_only`), and the build ids of its inputs. A build id is new every
time a stage completes, so re-running a stage (even with the same config, as `--force` does)
re-runs everything downstream of it.

Publishing commits by writing `stage.json` into the partial directory; the renames that move
it into place are finished by the next run if the process dies between them
(`Workspace.finish_publish`). A completed stage is trusted only while its outputs match the
checksums its record holds (`Workspace.output_damage`).

Workspaces under one root can share builds: `Workspace.built_elsewhere` finds a sibling's
completed stage with a given fingerprint, where no other user can have written it, and
`Workspace.link_build` hard-links it in (a sweep's points share their common stages this way).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path

from pipeline.errors import PipelineError, shown
from pipeline.fsutil import (
    atomic_write_json,
    file_checksum,
    file_mismatch,
    not_ours,
    read_json,
    read_text,
    refuse_link,
)
from pipeline.training.checkpoint_dirs import CHECKPOINTS, CHECKSUMS, step_dirs, step_of

RECORD = "stage.json"
PARTIAL_RECORD = "partial.json"
READ_AT_EVERY_PLAN = 16 << 20  # bytes: output files up to this size are hashed at every plan


def fingerprint(config: dict, input_builds: dict[str, str | None]) -> str:
    blob = json.dumps({"config": config, "inputs": input_builds}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _dotted(data, prefix: str = "") -> dict[str, object]:
    if isinstance(data, dict) and data:
        return {
            k: v
            for key, value in data.items()
            for k, v in _dotted(value, f"{prefix}{key}.").items()
        }
    return {prefix[:-1]: data}


def config_changes(old: dict, new: dict) -> list[str]:
    """What differs between two stage configs, as 'dotted.key old -> new' (sorted)."""
    old, new = _dotted(old), _dotted(new)
    show = lambda d, k: json.dumps(d[k]) if k in d else "(absent)"  # noqa: E731
    return [
        f"{k} {show(old, k)} -> {show(new, k)}"
        for k in sorted(old.keys() | new.keys())
        if old.get(k, ...) != new.get(k, ...)
    ]


class Workspace:
    def __init__(self, path: Path):
        self.path = Path(path)

    def done_dir(self, stage: str) -> Path:
        return self.path / stage

    def partial_dir(self, stage: str) -> Path:
        return self.path / f"{stage}.partial"

    def old_dir(self, stage: str) -> Path:
        return self.path / f"{stage}.old"

    def committed_dir(self, stage: str) -> Path:
        """Where the stage's committed output is: the partial directory while a publish has
        not moved it into place (`finish_publish`), else `<stage>/`."""
        partial = self.partial_dir(stage)
        return partial if (partial / RECORD).exists() else self.done_dir(stage)

    def record(self, stage: str) -> dict | None:
        """The stage's committed record: a partial directory holding one is the output of a
        publish not yet moved into place (`finish_publish`)."""
        for path in (self.partial_dir(stage) / RECORD, self.done_dir(stage) / RECORD):
            try:
                return read_json(path)
            except FileNotFoundError:
                continue
            except (OSError, json.JSONDecodeError) as e:
                raise PipelineError(
                    f"{path}: unreadable stage record ({e}); delete "
                    f"{path.parent} to re-run '{stage}'"
                ) from None
        return None

    def output_damage(self, stage: str, record: dict) -> str | None:
        """Why the completed `stage`'s outputs are not the files its `record` lists, or None
        when they are (or when the record predates output checksums: nothing to check).

        Every file's size is checked. Its content is hashed when the file is small (results,
        manifests, vocabularies, plots: milliseconds) or when its mtime differs from the one
        recorded at publish. A large file with its size and mtime (data shards, downloads:
        gigabytes, minutes to hash at every `run`) is taken as unchanged: editing or
        truncating it in place changes them, and its readers verify its content when they
        read it (shards against the manifest, downloads against download.json)."""
        where = self.committed_dir(stage)
        for name, expected in record.get("outputs", {}).items():
            path = where / name
            unchanged = (
                expected["bytes"] > READ_AT_EVERY_PLAN
                and path.is_file()
                and path.stat().st_mtime_ns == expected.get("mtime_ns")
            )
            if why := file_mismatch(path, name, expected, read=not unchanged):
                return why
        return None

    def holds_checkpoints(self, stage: str) -> bool:
        return bool(step_dirs(self.committed_dir(stage) / CHECKPOINTS))

    def partial_marker(self, stage: str) -> dict | None:
        """What the partial directory was started with ({} when unreadable); None if none."""
        partial = self.partial_dir(stage)
        if not partial.exists():
            return None
        try:
            return read_json(partial / PARTIAL_RECORD)
        except (OSError, ValueError):
            return {}

    def partial_checkpoint(self, stage: str) -> int | None:
        """The step of the newest checkpoint directory in the partial directory, if any.
        Not `latest`: a damaged pointer must not make days of checkpoints look absent (and
        so deletable); whether each one is intact is the training stage's to check."""
        dirs = step_dirs(self.partial_dir(stage) / CHECKPOINTS)
        return step_of(dirs[0].name) if dirs else None

    def begin(self, stage: str, marker: dict, fresh: bool = False) -> Path:
        """A partial directory for `stage`: kept if `marker` (fingerprint, config, inputs)
        has its fingerprint (an interrupted run to resume) unless `fresh`, emptied otherwise.
        The caller has refused to empty one holding checkpoints (`Runner._check_partial`)."""
        partial = self.partial_dir(stage)
        # a link planted at the partial directory's name would take the stage's files (and
        # its emptying) to the directory it names
        refuse_link(partial, "stage directory", directory=True)
        kept = self.partial_marker(stage)
        if kept is not None and (fresh or kept.get("fingerprint") != marker["fingerprint"]):
            shutil.rmtree(partial)
            kept = None
        # the series: one id for this output's first attempt and the runs that resume it
        marker = {
            **marker,
            "series": (kept or {}).get("series") or uuid.uuid4().hex[:12],
            "attempt": (kept or {}).get("attempt", 1) + (kept is not None),
        }
        partial.mkdir(parents=True, exist_ok=True)
        atomic_write_json(partial / PARTIAL_RECORD, marker)
        return partial

    def publish(self, stage: str, record: dict) -> None:
        """Make the partial directory the stage's output. Writing its record is the commit:
        from then on `record()` finds it, nothing treats the directory as an interrupted run,
        and `finish_publish` (here, or on the next run after a crash) moves it into place."""
        atomic_write_json(self.partial_dir(stage) / RECORD, record)
        self.finish_publish(stage)

    def finish_publish(self, stage: str) -> None:
        """Move a committed partial directory to `<stage>/`, the output it replaces aside to
        `<stage>.old/` and then deleted. Every step can be interrupted and done again: a
        rename cannot replace a non-empty directory, hence the aside."""
        partial, done, old = self.partial_dir(stage), self.done_dir(stage), self.old_dir(stage)
        if (partial / RECORD).exists():
            if done.exists():
                if old.exists():  # an earlier, superseded output
                    shutil.rmtree(old)
                os.rename(done, old)
            os.rename(partial, done)
        if (done / RECORD).exists():
            (done / PARTIAL_RECORD).unlink(missing_ok=True)
            if old.exists():
                shutil.rmtree(old)

    def invalidate(self, stage: str) -> None:
        """Forget a completed stage that --force / --from is re-running: if that run is
        interrupted, the next plain run resumes it instead of keeping the old output."""
        (self.done_dir(stage) / RECORD).unlink(missing_ok=True)

    def built_elsewhere(
        self, stage: str, fp: str, passed_over: Callable[[str], None] | None = None
    ) -> Path | None:
        """A completed `stage` with fingerprint `fp` in another workspace under the same root,
        where only this user (or root) can have written it: a root may be shared, and a build
        planted there with the fingerprint would become this workspace's data or weights.
        `passed_over(why)` is told of each build with the fingerprint that is not (`_foreign`)."""
        for record_path in sorted(self.path.parent.glob(f"*/{stage}/{RECORD}")):
            if record_path.parent.parent == self.path:
                continue
            try:
                if json.loads(read_text(record_path, "stage record")).get("fingerprint") != fp:
                    continue
                why = _foreign(record_path.parent)
            except (OSError, ValueError, PipelineError):  # a FIFO, an edit: not a build
                continue
            if why is None:
                return record_path.parent
            if passed_over is not None:
                passed_over(why)
        return None

    def link_build(self, stage: str, source: Path) -> bool:
        """Make a hard-linked copy of another workspace's completed `stage` (at `source`) this
        one's, renamed into place when complete (copied where links cannot be made). False
        when the source changed under us."""
        dest = self.done_dir(stage)
        tmp = dest.with_name(f".{dest.name}.reuse-{uuid.uuid4().hex[:8]}")

        def link(src, dst):
            try:
                os.link(src, dst)
            except OSError:
                shutil.copy2(src, dst)

        try:
            shutil.copytree(source, tmp, copy_function=link, symlinks=True)
            os.rename(tmp, dest)
            return True
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
            return False


def _foreign(build: Path) -> str | None:
    """Why another user could have written the build `build` (a stage's output directory):
    its workspace, or a directory or file in it, is not this user's (or root's) or is
    writable by others (fsutil.not_ours), or is a link, which no stage makes; in words that
    name it. None where no one else can have written any of it."""
    paths = [build.parent, build]
    for top, dirs, files in os.walk(build):
        paths += [Path(top, name) for name in (*dirs, *files)]
    for path in paths:
        if path.is_symlink():
            return f"{shown(str(path))} is a symbolic link"
        if why := not_ours(path):
            return f"{shown(str(path))} is {why}"
    return None


def output_checksums(out_dir: Path) -> dict[str, dict]:
    """The sha256, size and mtime of each file a stage's record vouches for: its output
    directory less the records and any directory with its own CHECKSUMS (a checkpoint: its
    files are verified whenever it is loaded; hashing gigabytes of them a second time at
    publish would double the cost of saving)."""
    checksummed = {p.parent for p in out_dir.rglob(CHECKSUMS)}
    files = sorted(
        f
        for f in out_dir.rglob("*")
        if f.is_file()
        and f not in (out_dir / RECORD, out_dir / PARTIAL_RECORD)
        and checksummed.isdisjoint(f.parents)
    )
    return {
        f.relative_to(out_dir).as_posix(): file_checksum(f) | {"mtime_ns": f.stat().st_mtime_ns}
        for f in files
    }
