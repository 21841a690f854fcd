"""The runner's decisions (run / skip / re-run), atomic publication and the workspace lock.

The stages here are stand-ins that record their calls, so every case runs in milliseconds;
tests/test_quickstart.py runs the real stages.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
from pathlib import Path

import pytest

import stages
from pipeline.errors import PipelineError
from pipeline.runner import Runner, WorkspaceLock
from pipeline.spec import load_spec
from pipeline.tracking import NullTracker

ORDER = ["download", "preprocess", "train", "finetune", "evaluate"]
SEEN: dict[str, list[str]] = {}   # stage -> files already in its out_dir when it started


@pytest.fixture
def calls(monkeypatch):
    """Replace each stage's work with a stub that writes a file and records the call."""
    ran: list[str] = []
    SEEN.clear()

    def make(name):
        def run(ctx):
            SEEN[name] = sorted(p.name for p in ctx.out_dir.iterdir())
            if os.environ.get("FAIL_STAGE") == name:
                (ctx.out_dir / "half-written").write_text("x")
                raise RuntimeError(f"{name} failed")
            for i in ctx.inputs.values():
                assert (i / "stage.json").exists(), "inputs are published outputs"
            (ctx.out_dir / "output.txt").write_text(name)
            ran.append(name)
            return {"ok": name}
        return run

    for name in ORDER:
        monkeypatch.setitem(stages.STAGES, name,
                            dataclasses.replace(stages.STAGES[name], run=make(name)))
    return ran


@pytest.fixture
def cfg(tmp_path):
    path = tmp_path / "pipe.yaml"
    path.write_text(f"""\
name: pipe
dataset: python_docs
model: {{kind: allattn, d_model: 32, n_layers: 1, n_heads: 2, n_persistent: 4, max_span: 64}}
train: {{steps: 2, batch_size: 2, seq_len: 8,
        optimizer: {{type: adam, lr: 1.0e-3, clip: global, clip_norm: 1.0}}}}
finetune: {{steps: 1}}
workspace: {{root: {tmp_path / 'runs'}}}
stages: [download, preprocess, train, finetune, evaluate]
""")
    return path


def run(cfg, *overrides, **options):
    spec = load_spec(cfg, list(overrides))
    return Runner(spec, log=lambda m: None, **options).run(NullTracker())


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
    run(cfg)                       # back to the original lr: a change again
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
    assert calls == []                       # up to date: --only does not force
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
    assert (ws / "train" / "stage.json").exists()            # train completed: published
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
        "download": "skip", "preprocess": "skip", "train": "run", "finetune": "run",
        "evaluate": "run"}
    assert calls == ORDER            # planning ran nothing


def test_second_concurrent_run_is_refused_naming_the_holder(cfg, calls):
    ws = load_spec(cfg).workspace_dir
    with WorkspaceLock(ws):
        with pytest.raises(PipelineError) as info:
            run(cfg)
    msg = str(info.value)
    assert "in use by another run" in msg
    assert f"pid {os.getpid()}" in msg and socket.gethostname() in msg
    assert calls == []
    run(cfg)                                     # released: runs
    assert calls == ORDER


def test_rerun_after_failure_resumes_in_the_partial_but_force_starts_clean(cfg, calls,
                                                                           monkeypatch):
    run(cfg, only=["download"])
    monkeypatch.setenv("FAIL_STAGE", "preprocess")
    for _ in range(2):
        with pytest.raises(RuntimeError):
            run(cfg)
    monkeypatch.delenv("FAIL_STAGE")
    run(cfg, only=["preprocess"])                   # same config: the partial is kept
    assert "half-written" in SEEN["preprocess"]
    run(cfg, only=["preprocess"], force=["preprocess"])
    assert "half-written" not in SEEN["preprocess"] and "output.txt" not in SEEN["preprocess"]
    monkeypatch.setenv("FAIL_STAGE", "preprocess")
    with pytest.raises(RuntimeError):
        run(cfg, force=["preprocess"])
    monkeypatch.delenv("FAIL_STAGE")
    run(cfg, "dataset.split.test=0.1", only=["preprocess"])   # other config: emptied
    assert "half-written" not in SEEN["preprocess"]
