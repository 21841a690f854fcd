"""Issue 26, item 2: `train.micro_batch_size: auto` is searched once, at the start, and
recorded; an interrupted run resumes at the recorded micro-batch and precision (on any
device), and finetune continues at train's, without searching again.

End to end through the real stages and the CLI in this process, as
tests/system/workspace/test_resume_edits.py. No GPU here: the first run's search is made to run on
the CPU with a step that runs out of memory above 4 rows (what a GPU with little memory
does), so that the record differs from what `auto` resolves to on a CPU (the whole batch).
"""

from __future__ import annotations

import json

from click.testing import CliRunner

from pipeline.commands.cli import main
from tests.fixtures.quickstart import tiny_config
from tests.fixtures.runs import preempted_at_first_checkpoint

SETS = [
    "train.steps=8",
    "train.checkpoint_every=4",
    "train.eval_every=0",
    "tracking.enabled=false",
    "train.micro_batch_size=auto",
    "train.deepspeed.bf16=auto",
    "finetune.steps=2",
]


def run(cfg, only: str):
    argv = ["run", str(cfg), "--only", only]
    for item in SETS:
        argv += ["--set", item]
    return CliRunner().invoke(main, argv)


def test_auto_micro_batch_is_searched_once_and_recorded(tmp_path, monkeypatch):
    import torch

    from pipeline.training import micro_batch

    tried = []

    def small_gpu(model, vocab_size, seq_len, device, bf16, documents):
        def try_step(size):
            tried.append(size)
            if size > 4:
                raise torch.cuda.OutOfMemoryError(f"CUDA out of memory ({size} rows)")

        return try_step, lambda: None

    cfg = tiny_config(tmp_path)
    partial = tmp_path / "runs" / "tiny" / "train.partial"
    with monkeypatch.context() as m, preempted_at_first_checkpoint(monkeypatch):
        m.setattr(micro_batch, "can_search", lambda device: True)
        m.setattr(micro_batch, "probe", small_gpu)
        first = run(cfg, "download,preprocess,train")
    assert first.exit_code == 143, first.output
    assert tried == [8, 4]  # batch 8, one process: 8, then 4
    assert "[train] micro-batch 8: out of memory, trying a smaller one\n" in first.output
    assert (
        "[train] train.micro_batch_size auto: 4 of 8 rows per process fit (2 "
        "accumulation step(s) per update)\n"
    ) in first.output
    assert json.loads((partial / "resolved.json").read_text()) == {
        "micro_batch_size": 4,
        "bf16": False,
        "device": "cpu",
    }
    ds = json.loads((partial / "deepspeed_config.json").read_text())
    assert (ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]) == (4, 2)
    assert ds["bf16"] == {"enabled": False}  # auto on a CPU: float32

    # resumed where `auto` would give 8 (the CPU's whole batch): the record's 4, no search
    resumed = run(cfg, "download,preprocess,train")
    assert resumed.exit_code == 0, resumed.output
    assert "[train] resuming from step 4\n" in resumed.output
    assert "micro_batch_size auto" not in resumed.output and tried == [8, 4]
    record = json.loads((partial.parent / "train" / "stage.json").read_text())
    assert record["summary"]["step"] == 8
    assert {
        k: record["summary"][k]
        for k in ("micro_batch_size", "gradient_accumulation_steps", "precision")
    } == {"micro_batch_size": 4, "gradient_accumulation_steps": 2, "precision": "float32"}
    # the fingerprinted config says what the spec says; what ran is in the summary
    assert record["config"]["train"]["micro_batch_size"] == "auto"

    finetuned = run(cfg, "download,preprocess,train,finetune")
    assert finetuned.exit_code == 0, finetuned.output
    assert "micro_batch_size auto" not in finetuned.output and tried == [8, 4]
    ft = json.loads((partial.parent / "finetune" / "stage.json").read_text())["summary"]
    assert (ft["micro_batch_size"], ft["gradient_accumulation_steps"], ft["step"]) == (4, 2, 10)

    # an explicit micro-batch other than the record changes the fingerprint: a finished
    # train is re-run (here it is done, so the plan says so rather than resuming)
    plan = (
        CliRunner()
        .invoke(
            main,
            [
                "run",
                str(cfg),
                "--only",
                "download,preprocess,train",
                "--dry-run",
                *sum((["--set", s] for s in SETS[:-3]), []),
                "--set",
                "train.micro_batch_size=4",
                "--set",
                "train.deepspeed.bf16=auto",
            ],
        )
        .output
    )
    assert "  train       run" in plan, plan
