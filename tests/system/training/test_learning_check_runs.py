"""gpu/learning_check.py's runs for real: three tiny trainings end to end on the CPU, the dry
run of the GPU defaults, a run past its budget and a run that crashes (each a process of its
own)."""

from __future__ import annotations

import re

import pytest

from gpu import learning_check as lc

# a model small enough that a CPU trains it in seconds: the overhead is the three processes'
CPU_ARGS = [
    "--config",
    "configs/quickstart.yaml",
    "--steps",
    "20",
    "--batch",
    "4",
    "--seq-len",
    "32",
    "--log-every",
    "5",
    "--warmup",
    "5",
    *("--set", "model.d_model=32", "--set", "model.n_layers=2", "--set", "model.n_heads=2"),
    *("--set", "model.n_persistent=16", "--set", "model.max_span=64"),
    *("--set", "model.attn_dropout=0", "--set", "train.device=cpu"),
    *("--fast-set", "model.attention.impl=sdpa", "--fast-set", "train.deepspeed.bf16=false"),
    *("--fast-set", "train.compile=false"),
    *("--timeout", "120"),
]


def test_a_run_past_the_budget_exits_2(tmp_path, capsys):
    code = lc.main(["--budget", "0", "--workdir", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 2
    assert "[fast] timed out, after 1 s; its output's tail:" in out
    assert out.rstrip().endswith("(timed out after 1 s)")


def test_a_crashed_run_exits_2_with_its_tail(tmp_path, capsys):
    code = lc.main(
        [
            *("--config", "configs/quickstart.yaml", "--workdir", str(tmp_path)),
            *("--fast-set", "model.attention.impl=nonesuch"),
        ]
    )
    out = capsys.readouterr().out
    assert code == 2
    assert re.search(r"\[fast\] crashed \(exit [1-9]\d*\), after \d+ s", out)
    assert "nonesuch" in out.split("its output's tail:")[1]  # the spec error, from the run
    assert "[ref A]" not in out  # nothing trains after a crash
    assert (tmp_path / "fast.log").is_file()


def test_three_tiny_trainings_end_to_end(tmp_path, capsys):
    plot = tmp_path / "curves.png"
    code = lc.main([*CPU_ARGS, "--plot", str(plot), "--workdir", str(tmp_path / "work")])
    out = capsys.readouterr().out
    assert code == 0, out
    rows = [line for line in out.splitlines() if re.match(r"\| \d+ \|", line)]
    assert [int(r.split("|")[1]) for r in rows] == [5, 10, 15, 20]
    for row in rows:
        cells = [c.strip() for c in row.split("|")[2:-1]]
        assert len(cells) == 5 and all(c != "-" for c in cells), row
        # the same seed, initial weights and batches: sdpa is the reference up to rounding
        assert float(cells[0]) == pytest.approx(float(cells[1]), rel=1e-3)
    assert out.strip().splitlines()[-2].startswith("PASS: fast within 2.00% of ref A")
    assert plot.stat().st_size > 0
    logs = {p.name for p in (tmp_path / "work").glob("*.log")}
    assert logs == {"fast.log", "ref_A.log", "ref_B.log"}
    # one workspace: download and preprocess ran once, train three times
    assert (
        (tmp_path / "work" / "ref_B.log").read_text().startswith("[download] skipped: up to date")
    )


def test_dry_run_checks_the_gpu_defaults(capsys):
    code = lc.main(["--dry-run"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "model.attention.impl=triton train.deepspeed.bf16=true train.compile=graphs" in out
    for label in ("fast", "ref A", "ref B"):
        assert f"[{label}] --dry-run: ok" in out
    assert out.count("train       run   forced (--force)") == 3
    assert "step " not in out  # nothing trained
