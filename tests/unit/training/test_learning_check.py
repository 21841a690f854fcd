"""gpu/learning_check.py on the CPU: the verdict on hand-made curves (within 2% of ref A at
every step and no further from it than the seed spread, else FAIL naming the worst step),
the trainer's report lines parsed, a run that crashes (exit 2, with its output's tail), the
three trainings end to end on a tiny model with backends a CPU trains (sdpa for the fast
path, float32 and uncompiled), and the dry run of the GPU defaults (triton, bf16, CUDA
graphs)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from gpu import learning_check as lc

ROOT = Path(__file__).resolve().parents[3]

STEPS = [10, 20, 30, 40]
REF_A = {10: 4.0, 20: 3.5, 30: 3.0, 40: 2.8}
REF_B = {10: 4.1, 20: 3.6, 30: 3.1, 40: 2.9}  # the seed spread: 0.1 at every step


def test_matching_curves_pass():
    fast = {s: v * 1.001 for s, v in REF_A.items()}
    ok, line = lc.verdict(fast, REF_A, REF_B)
    assert ok, line
    assert line.startswith("PASS")
    assert "over 4 steps" in line


def test_a_step_beyond_the_tolerance_fails_naming_it():
    fast = dict(REF_A) | {30: 3.0 * 1.03}  # 3% off at step 30, 1% at step 20
    fast[20] = 3.5 * 1.01
    ok, line = lc.verdict(fast, REF_A, REF_B)
    assert not ok
    assert line.startswith("FAIL at step 30: fast is 3.00% from ref A")


def test_within_the_tolerance_but_beyond_the_seed_spread_fails():
    spread = {s: v + 0.01 for s, v in REF_A.items()}  # two seeds 0.01 apart
    fast = {10: 4.04, 20: 3.55, 30: 3.03, 40: 2.828}  # 1%, 1.43%, 1%, 1%: 0.03-0.05 away
    ok, line = lc.verdict(fast, REF_A, spread)
    assert not ok
    assert line.startswith("FAIL: fast is further from ref A than the seed spread")
    assert "the worst step 20: fast 3.5500 vs ref A 3.5000 (1.43%)" in line
    # the same fast curve beside a wider spread passes
    assert lc.verdict(fast, REF_A, REF_B)[0]


def test_a_nan_loss_fails_at_its_step():
    fast = dict(REF_A) | {40: math.nan}
    ok, line = lc.verdict(fast, REF_A, REF_B)
    assert not ok
    assert line.startswith("FAIL at step 40: fast is inf from ref A")


def test_no_shared_step_fails():
    assert lc.verdict({5: 1.0}, REF_A, REF_B) == (
        False,
        "FAIL: the three curves share no logged step",
    )


def test_report_lines_are_parsed():
    text = """\
[train] 373,631 parameters, vocabulary 111, 20 steps of 4 x 64 tokens on cpu
[train] step      5/20  loss 4.8689  bpc 7.024  lr 0.00015  2,712 tok/s  eta 1s
[train] step      5/20  span mean 12.0 (a warning line: no loss)
step     10/20  loss 4.7428  bpc 6.842  lr 0.0003  3,657 tok/s  eta 1s
[train] step     10/20  loss 4.7000  bpc 6.8  lr 0.0003  3,657 tok/s  eta 1s
[train] step     15/20  loss nan  bpc nan  lr 0.00045  3,080 tok/s  eta 0s
"""
    losses = lc.parse_losses(text)
    assert list(losses) == [5, 10, 15]
    assert losses[5] == 4.8689 and losses[10] == 4.7  # a step logged again keeps the last
    assert math.isnan(losses[15])


def test_the_table_has_every_step_and_both_gaps():
    text = lc.table({10: 4.04, 20: 3.5}, {10: 4.0, 20: 3.5}, {10: 4.2, 20: 3.6})
    rows = text.splitlines()
    assert rows[0].count("|") == 11  # 7 column borders and 4 escaped bars
    assert rows[2] == "| 10 | 4.0400 | 4.0000 | 4.2000 | 1.00% | 5.00% |"
    assert rows[3] == "| 20 | 3.5000 | 3.5000 | 3.6000 | 0.00% | 2.86% |"


def test_overrides_replace_the_defaults_key_by_key():
    args = lc.parse_args(
        [
            *("--set", "model.n_layers=2", "--fast-set", "train.compile=true"),
            *("--ref-set", "train.deepspeed.bf16=auto", "--seeds", "7,8"),
        ]
    )
    fast, ref_a, ref_b = (run.sets() for run in lc.plan(args))
    assert fast == [
        "model.attention.impl=triton",
        "train.deepspeed.bf16=true",
        "train.compile=true",
        "model.n_layers=2",
        "train.seed=7",
    ]
    assert ref_a == [
        "model.attention.impl=reference",
        "train.deepspeed.bf16=auto",
        "train.compile=false",
        "model.n_layers=2",
        "train.seed=7",
    ]
    assert ref_b == ref_a[:-1] + ["train.seed=8"]
    with pytest.raises(SystemExit) as e:
        lc.parse_args(["--fast-set", "oops"])
    assert e.value.code == 2


def fake_trainer(monkeypatch, curves: dict[str, dict[int, float]], crash: str | None = None):
    """lc.start writing the trainer's report lines of ``curves[label]`` instead of training
    (its "process" is the exit code lc.finish returns); the run ``crash`` stops after its
    first line with a traceback (exit 1). Returns the commands started, in order, and
    each one's place among the start and finish calls."""
    events: list[tuple[str, list[str]]] = []

    def start(cmd, log):
        label = log.name.removesuffix(".log").replace("_", " ")
        events.append(("start", cmd))
        lines = [
            f"[train] step {s:>6}/20  loss {v:.4f}  bpc 1.000  lr 0.001  1,000 tok/s  eta 1s"
            for s, v in curves[label].items()
        ]
        if label == crash:
            log.write_text(lines[0] + "\nTraceback (most recent call last):\nRuntimeError: boom\n")
            return 1
        log.write_text("\n".join(lines) + "\n")
        return 0

    def finish(code, log, timeout):
        events.append(("finish", []))
        return code

    monkeypatch.setattr(lc, "start", start)
    monkeypatch.setattr(lc, "finish", finish)
    return events


FAKE = {"fast": {5: 4.8, 10: 4.5, 15: 4.2, 20: 3.9}, "ref A": {5: 4.8, 10: 4.5, 15: 4.2, 20: 3.9}}
FAKE["ref B"] = {s: v + 0.1 for s, v in FAKE["ref A"].items()}
FAKE_ARGS = ["--steps", "20", "--log-every", "5"]


def test_main_fails_naming_the_perturbed_step(tmp_path, monkeypatch, capsys):
    fake_trainer(monkeypatch, FAKE | {"fast": FAKE["fast"] | {15: 4.2 * 1.05}})
    plot = tmp_path / "curves.png"
    assert lc.main([*FAKE_ARGS, "--plot", str(plot)]) == 1
    out = capsys.readouterr().out
    assert "| 15 | 4.4100 | 4.2000 | 4.3000 | 5.00% | 2.38% |" in out
    assert "FAIL at step 15: fast is 5.00% from ref A, more than 2.00%" in out
    assert plot.is_file()  # drawn on FAIL too
    fake_trainer(monkeypatch, FAKE)
    assert lc.main(FAKE_ARGS) == 0
    assert "PASS: fast within 2.00% of ref A" in capsys.readouterr().out


def test_three_jobs_start_together_each_in_a_workspace_of_its_own(tmp_path, monkeypatch):
    events = fake_trainer(monkeypatch, FAKE)
    assert lc.main([*FAKE_ARGS, "--jobs", "3", "--workdir", str(tmp_path)]) == 0
    assert [kind for kind, _ in events] == ["start"] * 3 + ["finish"] * 3
    roots = [next(a for a in cmd if a.startswith("workspace.root=")) for kind, cmd in events if cmd]
    assert roots == [
        f"workspace.root={tmp_path / 'runs' / label}" for label in ("fast", "ref_A", "ref_B")
    ]
    events.clear()
    assert lc.main(FAKE_ARGS) == 0  # one at a time: one workspace, the config's
    assert [kind for kind, _ in events] == ["start", "finish"] * 3
    assert not any(a.startswith("workspace.root=") for _, cmd in events for a in cmd)


def test_a_crash_after_complete_runs_shows_their_curves(monkeypatch, capsys):
    fake_trainer(monkeypatch, FAKE, crash="ref B")
    assert lc.main(FAKE_ARGS) == 2
    out = capsys.readouterr().out
    assert "| 20 | 3.9000 | 3.9000 | - | 0.00% | - |" in out
    assert "[ref B] crashed (exit 1), after 0 s; its output's tail:" in out
    assert out.rstrip().endswith("RuntimeError: boom")
    assert "PASS" not in out and "FAIL" not in out
