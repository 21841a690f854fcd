"""A completed stage's outputs carry checksums in its record: a damaged one is rebuilt (or,
where a rebuild would cost checkpoints, refused in one line), never trusted as up to date.

The stand-in stages of tests/integration/workspace/test_runner.py show the runner's decisions in
milliseconds; the curriculum pipeline (curriculum -> evaluate, a toy model in one process) shows
them on real outputs: evaluate's results.json, the curriculum's checkpoints and curriculum.json."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest

import pipeline.workspace.layout
from pipeline.errors import PipelineError
from pipeline.spec import load_spec
from pipeline.tracking.tracker import NullTracker
from pipeline.workspace.runner import Runner
from stages import STAGES
from tests.fixtures.curriculum import task_spec
from tests.fixtures.stand_in_stages import ORDER, run


def workspace(cfg) -> Path:
    return Path(load_spec(cfg).workspace_dir)


def build(ws: Path, stage: str) -> str:
    return json.loads((ws / stage / "stage.json").read_text())["build"]


def plan(cfg, **options) -> dict[str, tuple[str, str]]:
    return {s.stage: (s.action, s.reason) for s in Runner(load_spec(cfg), **options).plan()}


def edit_in_place(path: Path, keep_mtime: bool = False) -> None:
    """Change one byte of `path`, keeping its size (and, `keep_mtime`, its mtime)."""
    stat = path.stat()
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))
    if keep_mtime:
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def files(root: Path) -> dict[str, bytes]:
    """Every file under `root` but the lock, by relative path: what a refusal must not touch."""
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != ".lock"
    }


# ---------------------------------------------------------------- the runner's decisions


def test_a_damaged_output_is_rebuilt_and_what_reads_it_stays_up_to_date(cfg, calls):
    run(cfg)
    ws = workspace(cfg)
    before = build(ws, "preprocess")
    edit_in_place(ws / "preprocess" / "output.txt")
    action, reason = plan(cfg)["preprocess"]
    assert action == "run" and reason == (
        "output.txt does not match its checksum (damaged since it was published); rebuilding it"
    )
    assert plan(cfg)["train"][0] == "skip"
    calls.clear()
    run(cfg)
    assert calls == ["preprocess"]
    assert (ws / "preprocess" / "output.txt").read_text() == "preprocess"
    # the rebuild reproduced the recorded file: the build train was made from is kept
    assert build(ws, "preprocess") == before
    calls.clear()
    run(cfg)
    assert calls == []


@pytest.mark.parametrize("damage", ["truncated", "deleted"])
def test_a_truncated_or_deleted_last_output_reruns_only_its_stage(cfg, calls, damage):
    run(cfg)
    ws = workspace(cfg)
    output = ws / "evaluate" / "output.txt"
    if damage == "truncated":
        output.write_text("eval")
    else:
        output.unlink()
    calls.clear()
    run(cfg)
    assert calls == ["evaluate"]
    assert output.read_text() == "evaluate"


def test_a_rebuild_that_differs_stops_before_replacing_what_later_stages_were_built_from(
    cfg, calls, monkeypatch
):
    run(cfg)
    ws = workspace(cfg)
    (ws / "preprocess" / "output.txt").write_text("damaged")
    damaged = files(ws / "preprocess")
    records = {s: (ws / s / "stage.json").read_text() for s in ORDER}

    def another_output(ctx):
        (ctx.out_dir / "output.txt").write_text("another preprocess")
        calls.append("preprocess")
        return {}

    monkeypatch.setitem(
        STAGES, "preprocess", dataclasses.replace(STAGES["preprocess"], run=another_output)
    )
    calls.clear()
    with pytest.raises(PipelineError) as e:
        run(cfg)
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith(
        f"preprocess: rebuilt in {ws / 'preprocess.partial'}, but its "
        f"output.txt differs from the one train, finetune, evaluate were "
        f"built from, so the damaged output was left as it was"
    ), message
    assert "--force preprocess" in message
    assert calls == ["preprocess"]
    assert files(ws / "preprocess") == damaged  # left as it was, not published
    assert {s: (ws / s / "stage.json").read_text() for s in ORDER} == records
    calls.clear()
    run(cfg, force=["preprocess"])  # the user's choice: a new build
    assert calls == ["preprocess", "train", "finetune", "evaluate"]


def test_a_record_written_before_outputs_had_checksums_is_trusted_as_before(cfg, calls):
    run(cfg)
    ws = workspace(cfg)
    for stage in ORDER:  # a record as allattn-pipe wrote it until now
        record = json.loads((ws / stage / "stage.json").read_text())
        assert "outputs" in record
        del record["outputs"]
        (ws / stage / "stage.json").write_text(json.dumps(record))
    (ws / "evaluate" / "output.txt").write_text("eval")
    calls.clear()
    run(cfg)
    assert calls == []


def test_an_output_whose_publish_was_interrupted_is_verified_where_it_is(cfg, calls):
    run(cfg)
    ws = workspace(cfg)
    os.rename(ws / "evaluate", ws / "evaluate.partial")  # committed, not yet moved
    assert plan(cfg)["evaluate"][0] == "skip"
    (ws / "evaluate.partial" / "output.txt").write_text("eval")
    assert plan(cfg)["evaluate"][0] == "run"


def test_only_refuses_a_damaged_input_it_does_not_rebuild(cfg, calls):
    run(cfg)
    ws = workspace(cfg)
    edit_in_place(ws / "preprocess" / "output.txt")
    assert plan(cfg, only=["preprocess"])["preprocess"][0] == "run"
    with pytest.raises(
        PipelineError,
        match=r"stage 'train' needs the output of 'preprocess', "
        r"which is damaged \(output.txt does not match its checksum in ",
    ):
        run(cfg, only=["train"], force=["train"])
    calls.clear()
    run(cfg, only=["preprocess"])
    assert calls == ["preprocess"]


def test_a_large_output_is_read_only_when_its_size_or_mtime_changed(cfg, calls, monkeypatch):
    monkeypatch.setattr(pipeline.workspace.layout, "READ_AT_EVERY_PLAN", 0)  # every file is large
    run(cfg)
    output = workspace(cfg) / "preprocess" / "output.txt"
    edit_in_place(output, keep_mtime=True)
    assert plan(cfg)["preprocess"][0] == "skip"  # the trade-off, on purpose
    published = output.stat()
    output.write_text("Preprocess")  # same size, a new mtime
    os.utime(output, ns=(published.st_atime_ns, published.st_mtime_ns + 10**9))
    assert plan(cfg)["preprocess"][0] == "run"
    output.write_text("pre")
    assert "output.txt has 3 bytes, 10 were written" in plan(cfg)["preprocess"][1]


# ---------------------------------------------------------------- real outputs


@pytest.fixture
def task(tmp_path):
    """A finished curriculum pipeline: its config, workspace and the log of a run."""
    cfg, spec = task_spec(tmp_path)
    overrides = [
        "dataset.generator.algorithmic.curriculum={epochs: 2, steps_per_epoch: 5, check_cases: 8}"
    ]
    log: list[str] = []

    def run_task():
        log.clear()
        Runner(load_spec(cfg, overrides), log=log.append).run(NullTracker())
        return log

    run_task()
    return run_task, spec.workspace_dir


def test_a_truncated_evaluate_result_is_rebuilt_whole_and_the_checkpoints_kept(task):
    run_task, ws = task
    results = ws / "evaluate" / "results.json"
    whole = results.read_bytes()
    checkpoints = files(ws / "curriculum")
    results.write_bytes(whole[: len(whole) // 2])
    log = run_task()
    assert [line for line in log if "running" in line] == [
        f"[evaluate] running: results.json has {len(whole) // 2:,} bytes, {len(whole):,} were "
        f"written (damaged since it was published); rebuilding it"
    ]
    assert any(line.startswith("[curriculum] skipped: up to date") for line in log)
    assert json.loads(results.read_bytes()) == json.loads(whole)
    assert files(ws / "curriculum") == checkpoints
    assert not any(line for line in run_task() if "running" in line)


def test_a_damaged_output_beside_checkpoints_is_refused_and_left_as_it_was(task):
    run_task, ws = task
    result = ws / "curriculum" / "curriculum.json"
    result.write_text(result.read_text().replace('"score": ', '"score": 1'))
    before = files(ws)
    with pytest.raises(PipelineError) as e:
        run_task()
    message = str(e.value)
    assert message == (
        f"curriculum: curriculum.json has {result.stat().st_size:,} bytes, "
        f"{result.stat().st_size - 1:,} were written in {ws / 'curriculum'} (damaged since it "
        f"was published); rebuilding it would train it again and replace its checkpoints, so "
        f"nothing was changed: restore the file, or re-run with --force curriculum"
    )
    assert files(ws) == before
