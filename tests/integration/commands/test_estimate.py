"""`allattn-pipe show --estimate`: tokens per stage by hand, the H100 hours consistent with the
recorded step, and what the command prints (a real step timed on this machine)."""

from __future__ import annotations

import dataclasses

import pytest
from click.testing import CliRunner

from pipeline.commands import gpu_records
from pipeline.commands.cli import main
from pipeline.commands.estimate import estimate_report, gpu_estimates, stage_lines, training_tokens
from pipeline.spec import PROJECT_ROOT, load_spec
from stages import STAGES

CONFIGS = PROJECT_ROOT / "configs"
SMALL = [
    "train.steps=10",
    "train.batch_size=4",
    "train.seq_len=32",
    "finetune.steps=5",
    "train.optimizer.warmup_steps=2",
    "train.eval_every=0",
    "train.checkpoint_every=0",
]


def test_tokens_per_stage_are_updates_times_sequences_times_tokens(tmp_path):
    spec = load_spec(CONFIGS / "quickstart.yaml", [*SMALL, f"workspace.root={tmp_path}"])
    got = {s.stage: (s.updates, s.tokens, s.at_least) for s in training_tokens(spec)}
    assert got == {"train": (10, 10 * 4 * 32, False), "finetune": (5, 5 * 4 * 32, False)}


def test_a_curriculum_counts_cases_at_its_start_length_as_a_lower_bound():
    spec = load_spec(
        CONFIGS / "active_memory" / "add.yaml",
        [
            "dataset.generator.algorithmic.curriculum.epochs=3",
            "dataset.generator.algorithmic.curriculum.steps_per_epoch=2",
        ],
    )
    (stage,) = training_tokens(spec)
    # 3 epochs x 2 updates x 32 cases x 5 tokens (start_length), at least
    assert (stage.stage, stage.updates, stage.tokens, stage.at_least) == (
        "curriculum",
        6,
        960,
        True,
    )


def test_an_update_of_the_sorting_task_reads_whole_documents():
    # sort_16k: 20,000 updates x 8 documents of 16,000 tokens, the separator and 20 sorted
    # symbols (its segments of 1,024 are how a document is read, not what an update costs)
    [train] = training_tokens(load_spec(CONFIGS / "infinity_former" / "sort_16k.yaml"))
    assert train.tokens == 20_000 * 8 * (16_000 + 1 + 20)
    assert "whole document" in train.how


@pytest.mark.parametrize("frac", [1.0, 1 / 16])
def test_h100_hours_of_the_measured_config_give_back_its_recorded_tokens_per_second(frac):
    """enwik8_large is the model the GPU check timed: its estimate must reproduce the
    recorded tokens/s at each span (the FLOP count and L' plan the MFU was computed with)."""
    spec = load_spec(CONFIGS / "enwik8_large.yaml", [])
    stages = training_tokens(spec)
    est = next(e for e in gpu_estimates(spec, stages) if e.record["span_frac"] == frac)
    tokens_s = stages[0].tokens / (est.hours["train"] * 3600)
    recorded = gpu_records.estimate_record(frac)["tokens_s"]
    assert tokens_s == pytest.approx(recorded, rel=0.01)


def test_evaluate_tokens_come_from_the_card_or_are_unknown_until_preprocess(tmp_path):
    where = f"workspace.root={tmp_path}"
    enwik8 = load_spec(CONFIGS / "enwik8_small.yaml", [where])
    assert stage_lines(enwik8) == [
        "evaluate: valid 5,000,000 tokens, test 5,000,000 tokens (dataset card 'enwik8': "
        "split sizes in bytes, one token each)"
    ]
    wt103 = load_spec(CONFIGS / "wt103.yaml", [where])
    assert "unknown until preprocess" in stage_lines(wt103)[0]


def test_a_plugins_stages_say_what_they_cost_with_no_edit_to_the_estimate(tmp_path, monkeypatch):
    """A training stage the estimate has never heard of is costed by its plan: its tokens and
    GPU time; a stage that does not train prints its own lines (Stage.estimate_lines), and
    one that says nothing costs nothing."""
    distil = dataclasses.replace(STAGES["train"], name="distil")
    monkeypatch.setitem(STAGES, "distil", distil)
    lines = ["corpus_stats: reads the preprocessed splits once"]
    stats = dataclasses.replace(
        STAGES["download"], name="corpus_stats", estimate_lines=lambda spec: lines
    )
    monkeypatch.setitem(STAGES, "corpus_stats", stats)
    monkeypatch.setitem(STAGES, "silent", dataclasses.replace(STAGES["download"], name="silent"))
    spec = load_spec(
        CONFIGS / "quickstart.yaml",
        [
            *SMALL,
            f"workspace.root={tmp_path}",
            "stages=[download, preprocess, silent, distil, corpus_stats]",
        ],
    )
    out = estimate_report(spec).splitlines()
    assert (
        "    distil     1,280 tokens = 10 updates (train.steps) x 4 sequences (train.batch_size, "
        "all processes) x 32 tokens (train.seq_len)"
    ) in out
    assert "  corpus_stats: reads the preprocessed splits once" in out
    assert not [line for line in out if "silent" in line or "not estimated" in line]
    # its update timed here (the Trainer built from its plan) and its GPU time
    assert any(line.startswith("  update time here: ") for line in out)
    assert any(line.startswith("  time here: distil ") for line in out)
    assert any(line.startswith("  H100 time at the full span: distil ") for line in out)


def test_a_lower_bound_is_marked_as_one_whichever_stage_counts_it(tmp_path, monkeypatch):
    """A plugin stage whose rows grow as it runs counts its tokens at least: the report marks
    them ">=" and its footnote names no curriculum (the stage's own count says how)."""
    from pipeline.training.plan import Tokens

    def grow_plan(spec):
        plan = STAGES["train"].plan(spec)
        tokens = Tokens(10, 640, "10 updates x 4 rows x at least 16 tokens (rows grow)", True)
        return dataclasses.replace(plan, name="grow", tokens=tokens)

    grow = dataclasses.replace(STAGES["train"], name="grow", plan=grow_plan)
    monkeypatch.setitem(STAGES, "grow", grow)
    spec = load_spec(
        CONFIGS / "quickstart.yaml",
        [*SMALL, f"workspace.root={tmp_path}", "stages=[download, preprocess, grow]"],
    )
    out = estimate_report(spec, measure=False).splitlines()
    count = "10 updates x 4 rows x at least 16 tokens (rows grow)"
    assert f"    grow       >= 640 tokens = {count}" in out
    assert out[-1] == "  (>=: a lower bound: the stage's rows grow as it runs; its count says how)"
    assert not [line for line in out if "curriculum" in line]


def test_show_estimate_without_a_training_stage_says_so(tmp_path):
    result = CliRunner().invoke(
        main,
        [
            "show",
            str(CONFIGS / "quickstart.yaml"),
            "--estimate",
            "--set",
            "stages=[download, preprocess]",
            "--set",
            f"workspace.root={tmp_path}",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "no stage trains (stages: download, preprocess)" in result.output
    assert "H100 hours" not in result.output


def test_show_estimate_prints_tokens_a_measured_step_and_gpu_hours_with_sources(tmp_path):
    args = [a for s in [*SMALL, f"workspace.root={tmp_path}"] for a in ("--set", s)]
    result = CliRunner().invoke(
        main, ["show", str(CONFIGS / "quickstart.yaml"), "--estimate", *args]
    )
    assert result.exit_code == 0, result.output
    out = result.output
    assert "train      1,280 tokens = 10 updates (train.steps) x 4 sequences" in out
    assert "finetune   640 tokens = 5 updates (finetune.steps)" in out
    # the run's own update: train.batch_size 4 in one micro-batch on a CPU
    assert "update time here:" in out and "updates of 1 micro-batch(es) of 4 x 32 tokens" in out
    assert "1 warm-up + 5 timed" in out
    assert "time here: train" in out
    assert "H100 time at the full span: train" in out
    assert "MFU 6.9% x 989 TFLOP/s" in out
    assert "MFU 6.9% measured for enwik8_large, not this config" in out
    assert "docs/benchmarks.md#triton" in out
    assert "H200: not measured; H100's MFU assumed" in out
