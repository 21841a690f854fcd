"""Non-finite numbers never pass silently (issue 35): a learning rate that makes the loss NaN
from step 2 (large but valid) stops training in one line naming the step, keeps the last
finite checkpoint, never marks a NaN validation best, and fails the run in MLflow;
`train.nonfinite: skip` skips and counts such updates up to its limit; evaluate records no
NaN score; the curriculum stage has the same guard. A tiny all-attention model on the
built-in corpus, a few steps each."""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from pipeline.commands.cli import main
from pipeline.errors import PipelineError
from pipeline.spec import load_spec
from pipeline.tracking.tracker import NullTracker, make_tracker
from pipeline.training.checkpoint_dirs import read_checkpoint_file, read_pointer, step_dirs
from pipeline.workspace.runner import Runner

MODEL = "mp_rank_00_model_states.pt"
# Adam's first step moves every weight by about lr: at 1e5 the next forward overflows float32
NAN_LR = "1.0e+5"


def config(tmp: Path, steps: int = 6) -> Path:
    path = tmp / "nonfinite.yaml"
    path.write_text(f"""\
name: nonfinite
dataset: python_docs
model: {{kind: allattn, d_model: 32, n_layers: 2, n_heads: 2, n_persistent: 8, max_span: 32,
        adaptive_span: true, span_ramp: 8}}
train: {{steps: {steps}, batch_size: 8, seq_len: 32, log_every: 1, checkpoint_every: 1,
        eval_every: 1, eval_batches: 2, keep_checkpoints: 10,
        optimizer: {{type: adam, lr: {NAN_LR}, warmup_steps: 0, clip: global, clip_norm: 1.0}}}}
evaluate: {{splits: [valid], batch_size: 8}}
workspace: {{root: {tmp / "runs"}}}
stages: [download, preprocess, train, evaluate]
""")
    return path


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    """download and preprocess, once: each test trains in a copy of this workspace root."""
    tmp = tmp_path_factory.mktemp("prepared")
    Runner(load_spec(config(tmp), []), only=["download,preprocess"], log=lambda m: None).run(
        NullTracker()
    )
    return tmp / "runs"


def copied(prepared: Path, tmp: Path, steps: int = 6) -> Path:
    """The config, its workspace root a copy of the prepared one."""
    shutil.copytree(prepared, tmp / "runs", symlinks=True)
    return config(tmp, steps)


def mlflow_runs(spec) -> dict:
    """{stage tag or 'parent': (status, nonfinite_skipped's history, the last metrics)}, each
    the latest run of its name."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{Path(spec.workspace.root) / 'mlflow.db'}")
    exp = client.get_experiment_by_name(spec.name)
    runs = client.search_runs([exp.experiment_id], order_by=["attributes.start_time DESC"])
    out = {}
    for r in runs:
        name = r.data.tags.get("stage", "parent")
        if name in out:
            continue
        skipped = [m.value for m in client.get_metric_history(r.info.run_id, "nonfinite_skipped")]
        out[name] = (r.info.status, skipped, r.data.metrics)
    return out


def weights(ckpt: Path) -> dict[str, torch.Tensor]:
    return read_checkpoint_file(ckpt / MODEL)["module"]


def all_finite(ckpt: Path) -> bool:
    return all(torch.isfinite(t).all() for t in weights(ckpt).values() if t.is_floating_point())


def test_a_nan_producing_lr_stops_in_one_line_and_keeps_the_last_finite_checkpoint(
    prepared, tmp_path
):
    """Before issue 35: training went on with a NaN loss, the NaN validation became `best`,
    evaluate recorded NaN and the pipeline exited 0, FINISHED."""
    cfg = copied(prepared, tmp_path)
    result = CliRunner().invoke(main, ["run", str(cfg)])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and re.match(
        r"^error: train: a non-finite loss or gradient \(NaN or inf\) at step 2: training "
        r"stopped; the last checkpoint saved before it is kept; ",
        errors[0],
    ), result.output
    spec = load_spec(cfg, [])
    ckpts = Path(spec.workspace_dir) / "train.partial" / "checkpoints"
    # step 1's update was finite (its validation too): the only checkpoint, latest and best
    assert [p.name for p in step_dirs(ckpts)] == ["step-00000001"]
    assert read_pointer(ckpts / "best") == read_pointer(ckpts / "latest") == "step-00000001"
    assert all_finite(ckpts / "step-00000001")
    assert not (Path(spec.workspace_dir) / "evaluate").exists()
    runs = mlflow_runs(spec)
    assert (runs["train"][0], runs["parent"][0]) == ("FAILED", "FAILED")
    assert all(math.isfinite(v) for v in runs["train"][2].values())  # no NaN recorded


def test_skip_leaves_the_weights_of_skipped_updates_unchanged_and_counts_them(prepared, tmp_path):
    cfg = copied(prepared, tmp_path, steps=4)
    spec = load_spec(cfg, ["train.nonfinite=skip", "train.nonfinite_limit=10"])
    Runner(spec, only=["download,preprocess,train"], log=lambda m: None).run(make_tracker(spec))
    train = Path(spec.workspace_dir) / "train"
    summary = json.loads((train / "stage.json").read_text())["summary"]
    assert summary["nonfinite_skipped"] == 3  # updates 2, 3 and 4: NaN from the huge weights
    ckpts = sorted(step_dirs(train / "checkpoints"))
    assert len(ckpts) == 4 and all(all_finite(c) for c in ckpts)
    first = weights(train / "checkpoints" / "step-00000001")
    for ckpt in ckpts:
        assert all(torch.equal(first[k], t) for k, t in weights(ckpt).items()), ckpt.name
    runs = mlflow_runs(spec)
    assert runs["train"][0] == "FINISHED" and runs["train"][1] == [1.0, 2.0, 3.0]


def test_skip_stops_past_its_limit_naming_the_step(prepared, tmp_path):
    spec = load_spec(
        copied(prepared, tmp_path), ["train.nonfinite=skip", "train.nonfinite_limit=1"]
    )
    with pytest.raises(PipelineError) as info:
        Runner(spec, only=["download,preprocess,train"], log=lambda m: None).run(make_tracker(spec))
    assert str(info.value).startswith(
        "train: a non-finite loss or gradient (NaN or inf) at step 3: 2 updates skipped, more "
        "than train.nonfinite_limit (1): training stopped; the last checkpoint is kept"
    )
    ckpts = Path(spec.workspace_dir) / "train.partial" / "checkpoints"
    assert [p.name for p in step_dirs(ckpts)] == ["step-00000002", "step-00000001"]
    runs = mlflow_runs(spec)
    assert (runs["train"][0], runs["parent"][0]) == ("FAILED", "FAILED")


def test_a_nonfinite_evaluation_is_an_error_not_a_result(prepared, tmp_path, monkeypatch):
    """What a checkpoint whose weights overflow in evaluation's longer segments gives: here
    the scorer made to answer NaN (training no longer saves non-finite weights)."""
    import pipeline.training.evaluation as evaluation

    spec = load_spec(
        copied(prepared, tmp_path, steps=2), ["train.optimizer.lr=0.01", "train.eval_every=0"]
    )
    Runner(spec, only=["download,preprocess,train"], log=lambda m: None).run(make_tracker(spec))
    monkeypatch.setattr(evaluation, "evaluate_nll", lambda *a, **k: (math.nan, 1000))
    with pytest.raises(PipelineError, match=r"^evaluate: the valid split's loss is not finite"):
        Runner(spec, log=lambda m: None).run(make_tracker(spec))
    assert not (Path(spec.workspace_dir) / "evaluate").exists()
    runs = mlflow_runs(spec)
    assert runs["evaluate"][0] == "FAILED" and "valid_bpc" not in runs["evaluate"][2]


def test_the_curriculum_stage_has_the_same_guard(tmp_path):
    from tests.fixtures.curriculum import history, run_stage, task_spec

    _, spec = task_spec(tmp_path, "train.optimizer.lr=1e6")
    with pytest.raises(
        PipelineError, match=r"^curriculum: a non-finite loss or gradient .* at step 2: "
    ):
        run_stage(spec, tmp_path / "stop")
    assert not (tmp_path / "stop" / "checkpoints").exists() or not step_dirs(
        tmp_path / "stop" / "checkpoints"
    )
    _, spec = task_spec(
        tmp_path, "train.optimizer.lr=1e6", "train.nonfinite=skip", "train.nonfinite_limit=100"
    )
    summary = run_stage(spec, tmp_path / "skip")
    assert summary["nonfinite_skipped"] == 39  # every update after the first (4 x 10)
    # the first update's loss; then no update ran: no loss to record
    assert [h["loss"] is None for h in history(tmp_path / "skip")] == [False, True, True, True]


def test_the_guard_decides_once_per_update_and_stop_mode_never_waits_for_the_device():
    """ZeRO 3 calls the optimizer's step once per sub-group of one update: the first call
    decides for all; in stop mode the guard reads nothing from the device."""
    from pipeline.diagnostics.host_syncs import HostSyncCounter
    from pipeline.training.nonfinite import NonfiniteGuard

    w = torch.nn.Parameter(torch.ones(3))

    def update(guard, opt, *grads):
        guard.loss(torch.tensor(1.0))
        for g in grads:  # one step() call per sub-group
            w.grad = torch.full((3,), g)
            opt.step()

    skip = NonfiniteGuard("skip", 5, "train", "cpu")
    opt = torch.optim.SGD([w], lr=0.5)
    skip.attach(opt)
    update(skip, opt, math.nan, 1.0)  # skipped whole: the second piece too
    assert torch.equal(w.detach(), torch.ones(3)) and (skip.step, skip.skipped) == (1, 1)
    with pytest.raises(PipelineError, match=r"^train: a non-finite gradient .* at step 2, found "):
        update(skip, opt, 1.0, math.inf)

    stop = NonfiniteGuard("stop", 0, "finetune", "cpu")
    opt = torch.optim.SGD([w], lr=0.5)
    stop.attach(opt)
    stop.start(10)
    with HostSyncCounter() as counter:
        update(stop, opt, 1.0, 1.0)
        update(stop, opt, 1.0, math.nan)
    assert counter.syncs == [], counter.syncs
    with pytest.raises(PipelineError, match=r"^finetune: a non-finite .* at step 12: "):
        stop.read_and_check()


HUGE = torch.full((4,), 1e20)  # finite; its float32 norm is not: 4e40 > 3.4e38


@pytest.mark.parametrize("mode", ["stop", "skip"])
def test_a_finite_gradient_whose_norm_overflows_float32_is_not_flagged(mode):
    """Issue 43 item 1: the guard tested a float32 norm of the gradients, inf for four
    finite 1e20s, and stopped (or skipped) a finite update as "NaN or inf"."""
    from pipeline.training.nonfinite import NonfiniteGuard

    assert torch.isfinite(HUGE).all() and 1e20 * 1e20 * 4 > torch.finfo(torch.float32).max
    guard = NonfiniteGuard(mode, 0, "train", "cpu")
    guard.start(0)
    guard.loss(torch.tensor(1.0))
    assert guard.before_step([HUGE, torch.ones(3)])
    assert guard.skipped == 0
    guard.read_and_check()
    # the weights' check, which read the same norm
    NonfiniteGuard(mode, 0, "train", "cpu").read_and_check([torch.ones(3), HUGE], step=1)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("mode", ["stop", "skip"])
def test_one_nonfinite_element_among_huge_ones_is_flagged(mode, bad):
    from pipeline.training.nonfinite import NonfiniteGuard

    grad = torch.cat([HUGE, torch.tensor([bad]), HUGE])
    guard = NonfiniteGuard(mode, 0, "train", "cpu")
    guard.start(0)
    guard.loss(torch.tensor(1.0))
    if mode == "skip":
        with pytest.raises(PipelineError, match=r"^train: a non-finite loss or gradient .* step 1"):
            guard.before_step([torch.ones(3), grad])
    else:
        assert guard.before_step([torch.ones(3), grad])  # stop mode reads it later
        with pytest.raises(PipelineError, match=r"^train: a non-finite loss or gradient .* step 1"):
            guard.read_and_check()
    weights = NonfiniteGuard(mode, 0, "train", "cpu")
    with pytest.raises(PipelineError, match=r"^train: the weights at step 7 are not finite"):
        weights.read_and_check([torch.ones(2), grad.bfloat16()], step=7)
