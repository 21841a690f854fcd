"""The runner's decisions (run / skip / re-run), atomic publication and the workspace lock.

The stages here are stand-ins that record their calls, so every case runs in milliseconds;
tests/system/stages/test_quickstart.py runs the real stages.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import socket
from pathlib import Path

import pytest

from pipeline.errors import PipelineError, Preempted
from pipeline.spec import load_spec
from pipeline.workspace.layout import Workspace
from pipeline.workspace.lock import WorkspaceLock
from pipeline.workspace.runner import Runner
from tests.fixtures.stand_in_stages import ORDER, SEEN, run


def test_first_run_runs_everything_second_skips_everything(cfg, calls):
    run(cfg)
    assert calls == ORDER
    calls.clear()
    records = run(cfg)
    assert calls == []
    assert set(records) == set(ORDER) and all(records[s]["summary"] for s in ORDER)


def test_force_train_reruns_train_and_what_reads_it(cfg, calls):
    run(cfg)
    calls.clear()
    run(cfg, force=["train"])
    assert calls == ["train", "finetune", "evaluate"]


def test_changing_train_config_reruns_from_train(cfg, calls):
    run(cfg)
    calls.clear()
    run(cfg, "train.optimizer.lr=0.05")
    assert calls == ["train", "finetune", "evaluate"]
    calls.clear()
    run(cfg, "train.optimizer.lr=0.05")
    assert calls == []
    run(cfg)  # back to the original lr: a change again
    assert calls == ["train", "finetune", "evaluate"]


def test_changing_evaluate_config_reruns_only_evaluate(cfg, calls):
    run(cfg)
    calls.clear()
    run(cfg, "evaluate.batch_size=4")
    assert calls == ["evaluate"]


def test_changing_the_dataset_reruns_everything(cfg, calls):
    run(cfg)
    calls.clear()
    run(cfg, "dataset.split.valid=0.1")
    assert calls == ["preprocess", "train", "finetune", "evaluate"]
    calls.clear()
    run(cfg, "dataset.split.valid=0.1", "dataset.url=builtin://other")
    assert calls == ORDER


def test_from_and_only(cfg, calls):
    run(cfg)
    calls.clear()
    run(cfg, start_from="finetune")
    assert calls == ["finetune", "evaluate"]
    calls.clear()
    run(cfg, only=["evaluate"])
    assert calls == []  # up to date: --only does not force
    run(cfg, only=["evaluate"], force=["evaluate"])
    assert calls == ["evaluate"]


def test_only_runs_a_prefix_on_a_fresh_workspace(cfg, calls):
    run(cfg, only=["download,preprocess"])
    assert calls == ["download", "preprocess"]
    calls.clear()
    run(cfg)
    assert calls == ["train", "finetune", "evaluate"]


def test_only_refuses_a_stage_whose_inputs_never_ran(cfg, calls):
    with pytest.raises(PipelineError, match="needs the output of 'preprocess'"):
        run(cfg, only=["train"])
    assert calls == []


def test_unknown_stage_in_options(cfg, calls):
    with pytest.raises(PipelineError, match="--force trian: no such stage kind"):
        run(cfg, force=["trian"])


def test_failed_stage_publishes_nothing_and_keeps_earlier_outputs(cfg, calls, monkeypatch):
    run(cfg)
    calls.clear()
    ws = Path(load_spec(cfg).workspace_dir)
    before = json.loads((ws / "evaluate" / "stage.json").read_text())
    finetune_before = json.loads((ws / "finetune" / "stage.json").read_text())
    monkeypatch.setenv("FAIL_STAGE", "finetune")
    with pytest.raises(RuntimeError, match="finetune failed"):
        run(cfg, force=["train"])
    assert calls == ["train"]
    assert (ws / "train" / "stage.json").exists()  # train completed: published
    # finetune's previous output stays until a new one is complete (its record names the
    # old train build, so the next run re-runs it)
    assert json.loads((ws / "finetune" / "stage.json").read_text()) == finetune_before
    assert (ws / "finetune.partial" / "half-written").exists()
    assert not (ws / "finetune" / "half-written").exists()
    assert json.loads((ws / "evaluate" / "stage.json").read_text()) == before
    monkeypatch.delenv("FAIL_STAGE")
    calls.clear()
    run(cfg)
    assert calls == ["finetune", "evaluate"]
    assert not (ws / "finetune.partial").exists()
    assert (ws / "finetune" / "output.txt").read_text() == "finetune"


def test_dry_run_plan_says_why(cfg, calls):
    spec = load_spec(cfg)
    plan = Runner(spec).plan()
    assert [(s.stage, s.action, s.reason) for s in plan][0] == ("download", "run", "not done yet")
    run(cfg)
    plan = Runner(load_spec(cfg, ["train.steps=3"])).plan()
    assert {s.stage: s.action for s in plan} == {
        "download": "skip",
        "preprocess": "skip",
        "train": "run",
        "finetune": "run",
        "evaluate": "run",
    }
    assert calls == ORDER  # planning ran nothing


def test_second_concurrent_run_is_refused_naming_the_holder(cfg, calls):
    ws = load_spec(cfg).workspace_dir
    with WorkspaceLock(ws):
        with pytest.raises(PipelineError) as info:
            run(cfg)
    msg = str(info.value)
    assert "in use by another run" in msg
    assert f"pid {os.getpid()}" in msg and socket.gethostname() in msg
    assert calls == []
    run(cfg)  # released: runs
    assert calls == ORDER


def test_rerun_after_failure_resumes_in_the_partial_but_force_starts_clean(cfg, calls, monkeypatch):
    run(cfg, only=["download"])
    monkeypatch.setenv("FAIL_STAGE", "preprocess")
    for _ in range(2):
        with pytest.raises(RuntimeError):
            run(cfg)
    monkeypatch.delenv("FAIL_STAGE")
    run(cfg, only=["preprocess"])  # same config: the partial is kept
    assert "half-written" in SEEN["preprocess"]
    run(cfg, only=["preprocess"], force=["preprocess"])
    assert "half-written" not in SEEN["preprocess"] and "output.txt" not in SEEN["preprocess"]
    monkeypatch.setenv("FAIL_STAGE", "preprocess")
    with pytest.raises(RuntimeError):
        run(cfg, force=["preprocess"])
    monkeypatch.delenv("FAIL_STAGE")
    run(cfg, "dataset.split.test=0.1", only=["preprocess"])  # other config: emptied
    assert "half-written" not in SEEN["preprocess"]


# ------------------------------------------------ edits after an interruption, crash-safe publish


def interrupt(cfg, monkeypatch, stage, *overrides):
    """Run until `stage` has saved a checkpoint (step 4) and been preempted."""
    monkeypatch.setenv("PREEMPT_STAGE", stage)
    with pytest.raises(Preempted):
        run(cfg, *overrides)
    monkeypatch.delenv("PREEMPT_STAGE")


def train_step(plan) -> str:
    return next(s.describe() for s in plan if s.stage == "train")


RUNTIME_EDITS = [
    "train.log_every=3",
    "train.eval_every=5",
    "train.eval_batches=3",
    "train.checkpoint_every=2",
    "train.keep_checkpoints=5",
    "model.attention.impl=flex",
    "train.launcher.procs_per_node=2",
]


def test_runtime_only_edits_resume_an_interrupted_train_and_keep_a_finished_one(
    cfg, calls, monkeypatch
):
    interrupt(cfg, monkeypatch, "train")
    assert (
        train_step(Runner(load_spec(cfg, RUNTIME_EDITS)).plan())
        == "not done yet; resume from step 4"
    )
    calls.clear()
    run(cfg, *RUNTIME_EDITS)
    assert calls == ["train", "finetune", "evaluate"]
    assert SEEN["train"] == ["checkpoints", "partial.json"]  # resumed in its partial
    run(cfg)  # finished: the edits undone change nothing
    run(cfg, "train.log_every=7", "train.eval_every=3", "model.attention.impl=auto")
    assert calls == ["train", "finetune", "evaluate"]


def test_a_result_edit_is_refused_naming_the_keys_and_deletes_nothing(cfg, calls, monkeypatch):
    interrupt(cfg, monkeypatch, "train")
    partial = Path(load_spec(cfg).workspace_dir) / "train.partial"
    files = sorted(p.relative_to(partial) for p in partial.rglob("*"))
    calls.clear()
    with pytest.raises(PipelineError) as info:
        run(cfg, "train.optimizer.lr=0.05", "train.log_every=3")
    assert str(info.value) == (
        f"train: {partial} holds an interrupted run with checkpoints up to step 4, started "
        f"with other settings that change its result: train.optimizer.lr 0.001 -> 0.05. Set "
        f"them back to resume it, or re-run with --force train to discard its checkpoints "
        f"and start over (nothing was deleted)"
    )
    with pytest.raises(
        PipelineError,
        match=r"step 4, started with other settings that "
        r"change its result: input preprocess will be "
        r"re-run\. Set them back",
    ):
        run(cfg, "dataset.split.valid=0.1")
    assert calls == []
    assert sorted(p.relative_to(partial) for p in partial.rglob("*")) == files
    forced = Runner(load_spec(cfg, ["train.optimizer.lr=0.05"]), force=["train"]).plan()
    assert train_step(forced) == "forced (--force); would discard checkpoints up to step 4"
    run(cfg, "train.optimizer.lr=0.05", force=["train"])
    assert calls == ["train", "finetune", "evaluate"]
    assert SEEN["train"] == ["partial.json"]  # started over


def test_a_partial_from_an_older_version_is_refused_without_keys(cfg, calls, monkeypatch):
    interrupt(cfg, monkeypatch, "train")
    partial = Path(load_spec(cfg).workspace_dir) / "train.partial"
    (partial / "partial.json").write_text('{"fingerprint": "0123456789abcdef"}')
    with pytest.raises(PipelineError) as info:
        run(cfg)
    assert str(info.value) == (
        f"train: {partial} holds an interrupted run with checkpoints up to step 4, started "
        f"with other settings that its partial.json does not record (missing, or written by "
        f"an older allattn-pipe); run it with the config that started it to resume, or re-run "
        f"with --force train to discard its checkpoints and start over (nothing was deleted)"
    )
    assert (partial / "checkpoints" / "step-00000004").is_dir()


def test_a_changed_config_keeps_the_finished_output_until_the_new_one_is_complete(
    cfg, calls, monkeypatch
):
    run(cfg)
    ws = Path(load_spec(cfg).workspace_dir)
    record = (ws / "train" / "stage.json").read_text()
    plan = Runner(load_spec(cfg, ["train.optimizer.lr=0.05"])).plan()
    assert train_step(plan) == "changed: train.optimizer.lr 0.001 -> 0.05"
    monkeypatch.setenv("FAIL_STAGE", "train")
    with pytest.raises(RuntimeError, match="train failed"):
        run(cfg, "train.optimizer.lr=0.05")
    monkeypatch.delenv("FAIL_STAGE")
    assert (ws / "train" / "stage.json").read_text() == record
    calls.clear()
    run(cfg)  # the edit undone: the finished output is still good
    assert calls == []


@pytest.mark.parametrize("earlier", [False, True], ids=["first-publish", "re-publish"])
def test_publish_interrupted_at_any_operation_loses_nothing(cfg, calls, monkeypatch, earlier):
    """Fail the k-th filesystem operation of train's publish, for every k (over an earlier
    output of train or not); the next run finds train either published or resumable."""
    import pipeline.workspace.layout

    ws = Path(load_spec(cfg).workspace_dir)
    overrides = ["train.optimizer.lr=0.05"] if earlier else []
    real_publish = Workspace.publish
    ops = [
        (pipeline.workspace.layout, "atomic_write_json"),
        (os, "rename"),
        (shutil, "rmtree"),
        (Path, "unlink"),
    ]
    for k in itertools.count(1):
        shutil.rmtree(ws, ignore_errors=True)
        if earlier:
            run(cfg)
        done = 0

        def failing(real, k=k):  # this attempt's k, bound where op is made
            def op(*args, **kwargs):
                nonlocal done
                done += 1
                if done == k:
                    raise OSError(f"injected failure at operation {k}")
                return real(*args, **kwargs)

            return op

        def publish(self, stage, record):
            with monkeypatch.context() as m:
                if stage == "train":
                    for owner, name in ops:
                        m.setattr(owner, name, failing(getattr(owner, name)))
                real_publish(self, stage, record)

        with monkeypatch.context() as m:
            m.setattr(Workspace, "publish", publish)
            try:
                run(cfg, *overrides)
            except OSError:
                pass
            else:
                break  # k is past publish's last operation
        calls.clear()
        run(cfg, *overrides)
        # the record is the commit: written (k > 1), train is published by the next run;
        # not written, the next run resumes train in its partial directory
        assert ("train" in calls) == (k == 1), k
        if k == 1:
            assert "output.txt" in SEEN["train"]
        assert sorted(p.name for p in ws.iterdir() if p.name.startswith("train")) == ["train"]
        assert (ws / "train" / "output.txt").read_text() == "train"
        assert [s.action for s in Runner(load_spec(cfg, overrides)).plan()] == ["skip"] * 5
    # the record, [the earlier output aside,] the rename, the marker[, the earlier output]
    assert k - 1 == (5 if earlier else 3)


def test_a_broken_latest_pointer_does_not_make_checkpoints_deletable(cfg, calls, monkeypatch):
    # `latest` names a step that is gone: the step directories beside it still count
    interrupt(cfg, monkeypatch, "train")
    partial = Path(load_spec(cfg).workspace_dir) / "train.partial"
    (partial / "checkpoints" / "latest").write_text("step-00000099\n")
    with pytest.raises(PipelineError, match="checkpoints up to step 4"):
        run(cfg, "train.optimizer.lr=0.05")
    assert (partial / "checkpoints" / "step-00000004").is_dir()


UNWRITABLE = Path("/sys/allattn-test")
"""A directory no process may create, root included (sysfs refuses new entries)."""


def test_a_workspace_that_cannot_be_written_is_one_line_before_anything_runs(cfg):
    from click.testing import CliRunner

    from pipeline.commands.cli import main

    result = CliRunner().invoke(main, ["run", str(cfg), "--set", f"workspace.root={UNWRITABLE}"])
    assert result.exit_code == 2, result.output
    assert re.fullmatch(
        rf"error: workspace {UNWRITABLE / 'pipe'}: cannot write there: "
        rf"(Operation not permitted|Permission denied)\n",
        result.output,
    )
    assert not UNWRITABLE.exists()
