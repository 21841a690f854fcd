"""`show --estimate`'s memory (issue 52): the plan per GPU it prints, an update too large for
half of this machine's memory timed on fewer rows (or not at all) instead of taking the
machine, and (issue 51) a timed update that diverges said as `run` says it, in one line."""

from __future__ import annotations

import re

from click.testing import CliRunner

from pipeline.commands import memory_report, update_timing
from pipeline.commands.cli import main
from pipeline.commands.estimate import estimate_report, meta_model
from pipeline.spec import load_spec
from pipeline.training.memory_plan import planner
from tests.fixtures.runs import ROOT

QUICKSTART = str(ROOT / "configs/quickstart.yaml")
SMALL = ["train.steps=10", "finetune.steps=5", "train.optimizer.warmup_steps=2"]
GIB = 2**30


def show_estimate(tmp_path, *sets: str):
    args = [a for s in [*SMALL, *sets, f"workspace.root={tmp_path}"] for a in ("--set", s)]
    return CliRunner().invoke(main, ["show", QUICKSTART, "--estimate", *args])


def test_the_plan_per_gpu_names_each_part_and_whether_the_run_fits(tmp_path):
    spec = load_spec(QUICKSTART, [*SMALL, f"workspace.root={tmp_path}"])
    lines = estimate_report(spec, measure=False).splitlines()
    at = next(i for i, line in enumerate(lines) if "memory plan per GPU" in line)
    assert lines[at] == (
        "  memory plan per GPU (1 process, 32 rows each an update; ZeRO 0; float32) at the "
        "full span (L' 128):"
    )
    # 180,599 weights: 4 bytes each; Adam's two moments 8 bytes each; no masters at ZeRO 0
    assert lines[at + 1] == (
        "    weights 0.7 MiB (180,599 x 4 bytes (float32)); optimizer states 1.4 MiB (adam's "
        "2 float32 moment(s): 8 bytes a weight)"
    )
    h100, h200 = lines[at + 3], lines[at + 4]
    assert h100.startswith("    H100 (80 GB, 71.7 GiB to plan with): micro-batch 32 (train.")
    assert h200.startswith("    H200 (141 GB, 126.4 GiB to plan with): micro-batch 32 (train.")
    assert h100.endswith(": fits; the largest micro-batch that fits: 32 (all 32 rows)")


def test_the_paper_models_plan_says_what_auto_takes_on_each_gpu(tmp_path):
    """enwik8_large at the full span: every row's cache of 8192 states a layer is held, so
    auto splits the 64 rows; an H200 takes more of them than an H100."""
    spec = load_spec(str(ROOT / "configs/enwik8_large.yaml"), [f"workspace.root={tmp_path}"])
    text = estimate_report(spec, measure=False)
    h100 = re.search(r"H100 \(80 GB.*?micro-batch (\d+) \(auto", text)
    h200 = re.search(r"H200 \(141 GB.*?micro-batch (\d+) \(auto", text)
    assert h100 and h200 and 0 < int(h100[1]) < int(h200[1]) < 64
    assert 64 % int(h100[1]) == 0 and 64 % int(h200[1]) == 0
    assert "at span 1/16 (L' 768), where an adaptive span starts growing: peak H100" in text


def room_for(tmp_path, rows: int) -> int:
    """Bytes of available memory whose share (SHARE) holds the estimate's timed update of
    `rows` rows of quickstart's (its plan with the estimate's margins), and not of rows + 1."""
    spec = load_spec(QUICKSTART, [*SMALL, f"workspace.root={tmp_path}"])
    cpu = planner(spec, meta_model(spec), "cpu", 1, rows, uniform_tokens=True)
    need = [memory_report.needed_here(cpu.at(r, rows=r)) for r in (rows, rows + 1)]
    return int((need[0] + need[1]) / 2 / memory_report.SHARE)  # its share: between the two


def test_an_update_over_half_the_memory_is_timed_on_fewer_rows_and_scaled(tmp_path, monkeypatch):
    room = room_for(tmp_path, 5)
    monkeypatch.setattr(memory_report, "available_memory", lambda: (room, "a test's room"))
    monkeypatch.setattr(memory_report, "resident_memory", lambda: 0)
    timed = update_timing.time_updates  # one timed update is enough here
    monkeypatch.setattr(
        update_timing, "time_updates", lambda spec, **kw: timed(spec, timed=1, **kw)
    )
    result = show_estimate(tmp_path)
    assert result.exit_code == 0, result.output
    out = result.output
    assert "timing 5 of the update's 32 rows in one micro-batch and scaling the time by 32/5" in out
    assert "over 45% of the" in out and "(a test's room)" in out
    assert "updates of 1 micro-batch(es) of 5 x 64 tokens (5 rows); the initial spans" in out
    assert "5 of the update's 32 rows (the whole would not fit in half of this machine's " in out
    assert "H100 time at the full span: train" in out and "memory plan per GPU" in out


def test_an_update_over_half_the_memory_even_at_one_row_is_not_timed(tmp_path, monkeypatch):
    monkeypatch.setattr(memory_report, "available_memory", lambda: (2**20, "a test's room"))
    monkeypatch.setattr(memory_report, "resident_memory", lambda: 0)
    result = show_estimate(tmp_path)
    assert result.exit_code == 0, result.output
    out = result.output
    line = next(x for x in out.splitlines() if "time here" in x)
    assert re.fullmatch(
        r"  time here: not timed: one row of the update would take \d+(\.\d)? MiB here \(the "
        r"memory plan on the CPU, float32\), over 45% of the 1\.0 MiB this process had "
        r"\(a test's room\)",
        line,
    ), line
    assert "timing updates" not in out and "update time here" not in out
    assert "H100 time at the full span: train" in out and "H200 time at span 1/16" in out
    assert "memory plan per GPU" in out


def test_a_timed_update_that_diverges_is_one_line_in_runs_words(tmp_path):
    result = show_estimate(
        tmp_path, "train.batch_size=4", "train.seq_len=32", "train.optimizer.lr=1e30"
    )
    assert result.exit_code == 0, result.output
    out = result.output
    assert (
        "  time here: not timed: train: a non-finite loss or gradient (NaN or inf) at step 2: "
        "the timing stopped there, as `run` stops training; lower train.optimizer.lr (or "
        "clip the gradients), or set train.nonfinite: skip\n"
    ) in out
    assert "Traceback" not in out and "update time here" not in out
    assert "H100 time at the full span: train" in out and "memory plan per GPU" in out
