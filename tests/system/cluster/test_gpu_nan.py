"""gpu/nan_check.py, the `nan` part of `make gpu-check` (issue 43, item 3), without a GPU: its
dry run (the smoke-sized model in float32, Triton's interpreter) runs (a), (b) and (c) end to
end and ends on its cause line; a NaN injected at one tile of TILES is named as the cause;
and the decision rule names the kernel, the graphs, or nothing, from made-up results."""

from __future__ import annotations

import contextlib
import math

import pytest

from gpu import nan_check
from gpu.nan_check import QUANTITIES, Run, TileResults, Update, cause, tile_name
from pipeline.ops import ATTENTION_IMPLS
from pipeline.ops.triton_attention import TILES

CASES = 7  # spread, z = 0, three gaps, masked with N = 0 and N > 0


def section(report: str, start: str, end: str) -> str:
    return report.split(start, 1)[1].split(end, 1)[0]


def test_a_nan_at_one_tile_is_named_the_cause_in_a_report_of_every_section(monkeypatch, capsys):
    poisoned = TILES[2]
    current: list[dict] = []
    forced_tile = nan_check.forced_tile

    @contextlib.contextmanager
    def forcing(tile):
        current.append(tile)
        try:
            with forced_tile(tile):
                yield
        finally:
            current.pop()

    attend = ATTENTION_IMPLS["triton"]

    def poisoned_attend(*args, **kwargs):
        out = attend(*args, **kwargs)
        return out * math.nan if current and current[-1] == poisoned else out

    monkeypatch.setattr(nan_check, "forced_tile", forcing)
    monkeypatch.setitem(ATTENTION_IMPLS, "triton", poisoned_attend)
    assert nan_check.main(["--dry-run"]) == 0
    report = capsys.readouterr().out

    tiles = section(report, "### (a)", "### (b)")
    rows = [line for line in tiles.splitlines() if line.startswith("| ") and "| T " in line]
    assert len(rows) == CASES * len(TILES)
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")][2:]
        assert len(cells) == len(QUANTITIES), row
        if f"| {tile_name(poisoned)} |" in row:
            assert all(c in ("**NaN**", "-") for c in cells), row
        else:
            assert "NaN" not in row, row

    training = section(report, "### (b)", "### (c)")
    for impl in ("triton", "reference"):
        run = section(training + "####", f"#### attention impl {impl}", "####")
        table = run.split("| update |", 1)[1].split("\n\n", 1)[0].splitlines()[2:]
        assert [row.split("|")[1].strip() for row in table] == ["1", "2", "3"], run
        assert "finite through update 3" in run  # (b) forces no tile: nothing poisoned

    graphs = report.split("### (c)", 1)[1]
    assert "#### the span fractions copied in place" in graphs
    assert "#### the span fractions re-pointed twice an update" in graphs
    assert graphs.count("not measured (no CUDA)") == 2

    last = report.rstrip().splitlines()[-1]
    assert last.startswith(f"cause: tile {tile_name(poisoned)} (out, q, k, v, pos"), last
    assert "the kernel against the reference" not in last and "CUDA graphs" not in last


def _run(impl: str, losses: list[float], grad: float = 1.0) -> Run:
    updates = [
        Update(i + 1, 0.01, loss, [128], {"span fractions": grad, "embeddings": 1.0})
        for i, loss in enumerate(losses)
    ]
    nonfinite = next((f"update {u.update}: the loss" for u in updates if u.loss != u.loss), None)
    return Run(impl, updates, nonfinite=nonfinite)


def _tiles(wrong_everywhere: bool = False) -> TileResults:
    results = TileResults(list(TILES), 3e-2, cases=["z = 0"])
    for i in range(len(TILES)):
        error = 0.5 if wrong_everywhere else 1e-3
        results.errors[("z = 0", i)] = {q: error for q in QUANTITIES}
    return results


def _graphs(held: bool) -> dict:
    verdict = {"held": held, "updates": 6, "updates_recording": 1 if held else 6, "plans": 1}
    return {"measured": True, "skips": 0, "variants": {"re-pointed": verdict | {"nonfinite": None}}}


@pytest.mark.parametrize(
    "tiles, runs, graphs, expected",
    [
        (
            _tiles(),
            [_run("triton", [4.0, math.nan]), _run("reference", [4.0, 3.9, 3.8])],
            _graphs(True),
            "cause: the kernel against the reference (by hand, no graphs: triton's update 2: "
            "the loss; the reference finite through update 3)",
        ),
        (
            _tiles(),
            [_run("triton", [4.0, 3.9], grad=500.0), _run("reference", [4.0, 3.9])],
            None,
            "cause: the kernel against the reference (the triton run's span fractions "
            "gradient 500x the reference's at update 1)",
        ),
        (
            _tiles(),
            [_run("triton", [4.0, 3.9]), _run("reference", [4.0, 3.9])],
            _graphs(False),
            "cause: the CUDA graphs (with the span fractions re-pointed, 6 of 6 updates "
            "recorded graphs for 1 span plan(s))",
        ),
        (
            _tiles(),
            [_run("triton", [math.nan]), _run("reference", [math.nan])],
            _graphs(True),
            "cause: bf16 training itself, with either op (triton: update 1: the loss; "
            "reference: update 1: the loss)",
        ),
        (
            _tiles(wrong_everywhere=True),
            [_run("triton", [4.0]), _run("reference", [4.0])],
            None,
            "cause: not reproduced by training; the kernel's maths where (a) finds every tile "
            "wrong (out, q, k, v, pos, persistent_k, persistent_v, spans on z = 0), which 1 "
            "updates by hand did not reach",
        ),
        (
            _tiles(),
            [_run("triton", [4.0]), _run("reference", [4.0])],
            _graphs(True),
            "cause: not reproduced by (a)-(c): what is left is DeepSpeed's bf16 engine (its "
            "optimizer wrapper and flat buffers), which (b) does by hand",
        ),
    ],
    ids=["kernel-nonfinite", "kernel-huge-gradient", "graphs", "both-ops", "maths-only", "none"],
)
def test_the_cause_line_follows_the_decision_rule(tiles, runs, graphs, expected):
    assert cause(tiles, runs, graphs) == expected
