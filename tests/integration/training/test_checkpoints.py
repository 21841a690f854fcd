"""A damaged checkpoint is detected and never trusted; a full disk says "disk full".

The stages run in this process on a tiny model. One uninterrupted train run (checkpoints at
steps 4, 8, 12) is the reference. Each fault is injected into a copy of its checkpoints cut
back to steps 4 and 8, as a run killed before step 12 leaves them; the train stage run again
must say in one line what it passed over, resume from the newest intact checkpoint and end
with the reference's weights, bit for bit.
"""

from __future__ import annotations

import errno
import re
import shutil
from pathlib import Path

import pytest
import torch

import stages
from pipeline.errors import PipelineError
from pipeline.spec import load_spec
from pipeline.tracking.tracker import NullTracker, make_tracker
from pipeline.training.checkpoint_dirs import (
    CHECKSUMS,
    damage,
    read_checkpoint_file,
    step_dirs,
    write_checksums,
)
from pipeline.workspace.runner import Runner
from stages import StageContext
from stages.base import NullStageTracker

ROOT = Path(__file__).resolve().parents[3]
STEPS, EVERY = 12, 4
MODEL = "mp_rank_00_model_states.pt"
OPTIMIZER = "zero_pp_rank_0_mp_rank_00_optim_states.pt"


def tag(step: int) -> str:
    return f"step-{step:08d}"


def tiny_spec(tmp: Path, name: str):
    corpus = tmp / "corpus.txt"
    corpus.write_bytes((ROOT / "README.md").read_bytes() * 3)
    path = tmp / f"{name}.yaml"
    path.write_text(f"""\
extends: [{ROOT / "configs" / "quickstart.yaml"}]
name: {name}
model: {{d_model: 16, n_layers: 1, n_heads: 2, n_persistent: 4, max_span: 32}}
train:
  steps: {STEPS}
  batch_size: 4
  seq_len: 16
  log_every: {STEPS}
  eval_every: 0
  checkpoint_every: {EVERY}
  keep_checkpoints: 4
  optimizer: {{lr: 0.01, warmup_steps: 2}}
  deepspeed: {{zero_stage: 1}}     # the optimizer state in a file of its own
evaluate: {{batch_size: 4, seq_len: 32, splits: [valid]}}
workspace: {{root: {tmp / "runs"}}}
stages: [download, preprocess, train, evaluate]
""")
    return load_spec(path, [f"dataset.url=file://{corpus}"])  # a small corpus


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted run: (spec, workspace)."""
    tmp = tmp_path_factory.mktemp("ckpt")
    spec = tiny_spec(tmp, "ref")
    Runner(spec, only=["download,preprocess,train"], log=lambda m: None).run(NullTracker())
    ws = Path(spec.workspace_dir)
    assert [p.name for p in step_dirs(ws / "train" / "checkpoints")] == [tag(12), tag(8), tag(4)]
    return spec, ws


def weights(ckpt: Path) -> dict:
    return read_checkpoint_file(ckpt / MODEL)["module"]


def interrupted(reference, tmp: Path) -> Path:
    """A train stage's partial output as a run killed between steps 8 and 12 leaves it."""
    _, ws = reference
    out = tmp / "train.partial"
    shutil.copytree(ws / "train" / "checkpoints", out / "checkpoints")
    shutil.rmtree(out / "checkpoints" / tag(12))
    (out / "checkpoints" / "latest").write_text(tag(8) + "\n")
    return out


def run_train(reference, out: Path) -> list[str]:
    spec, ws = reference
    lines: list[str] = []
    ctx = StageContext(
        spec=spec,
        out_dir=out,
        inputs={"preprocess": ws / "preprocess"},
        tracker=NullStageTracker(),
        log=lines.append,
    )
    stages.train.run(ctx)
    return lines


def flip_byte(path: Path, where: float) -> str:
    data = bytearray(path.read_bytes())
    data[int(len(data) * where)] ^= 0xFF
    path.write_bytes(bytes(data))
    return f"{path.name} does not match its checksum"


def truncate(path: Path) -> str:
    data = path.read_bytes()
    path.write_bytes(data[:1000])
    return f"{path.name} has 1,000 bytes, {len(data):,} were written"


def empty_newest(ckpts: Path) -> str:
    (ckpts / tag(12)).mkdir()
    (ckpts / "latest").write_text(tag(12) + "\n")
    return f"damaged checkpoint {tag(12)} (empty)"


def latest_names_a_missing_step(ckpts: Path) -> str:
    (ckpts / "latest").write_text(tag(99) + "\n")
    return f"latest names {tag(99)}, which does not exist"


# fault name -> (inject it into the checkpoints dir, returning the note expected; the step
# the run resumes from)
FAULTS = {
    "model flipped mid-file": (
        lambda c: f"damaged checkpoint {tag(8)} ({flip_byte(c / tag(8) / MODEL, 0.5)})",
        4,
    ),
    "model flipped late": (
        lambda c: f"damaged checkpoint {tag(8)} ({flip_byte(c / tag(8) / MODEL, 0.97)})",
        4,
    ),
    "model truncated": (
        lambda c: f"damaged checkpoint {tag(8)} ({truncate(c / tag(8) / MODEL)})",
        4,
    ),
    "optimizer truncated": (
        lambda c: f"damaged checkpoint {tag(8)} ({truncate(c / tag(8) / OPTIMIZER)})",
        4,
    ),
    "empty step dir": (empty_newest, 8),
    "latest names a missing step": (latest_names_a_missing_step, 8),
}


@pytest.mark.parametrize("fault", FAULTS)
def test_a_damaged_newest_checkpoint_is_passed_over_in_one_line(reference, tmp_path, fault):
    inject, resumed_from = FAULTS[fault]
    out = interrupted(reference, tmp_path)
    ckpts = out / "checkpoints"
    note = inject(ckpts)
    lines = run_train(reference, out)
    assert [line for line in lines if str(ckpts) in line] == [
        f"{ckpts}: {note}; using {tag(resumed_from)}, the newest intact checkpoint"
    ]
    assert f"resuming from step {resumed_from}" in lines
    # the damaged one was rewritten, not kept beside (or in place of) an intact one
    assert [damage(p) for p in step_dirs(ckpts)] == [None] * len(step_dirs(ckpts))
    assert (ckpts / "latest").read_text() == tag(12) + "\n"
    ref, got = weights(reference[1] / "train" / "checkpoints" / tag(12)), weights(ckpts / tag(12))
    assert ref.keys() == got.keys()
    assert all(torch.equal(ref[k], got[k]) for k in ref)


def test_no_intact_checkpoint_is_refused_naming_the_directory(reference, tmp_path):
    out = interrupted(reference, tmp_path)
    ckpts = out / "checkpoints"
    flipped = flip_byte(ckpts / tag(8) / MODEL, 0.5)
    truncated = truncate(ckpts / tag(4) / OPTIMIZER)
    with pytest.raises(PipelineError) as info:
        run_train(reference, out)
    assert str(info.value) == (
        f"no intact checkpoint under {ckpts}: damaged checkpoint {tag(8)} ({flipped}); "
        f"damaged checkpoint {tag(4)} ({truncated}); run the stage that wrote them again "
        f"with --force"
    )
    assert damage(ckpts / tag(8)) and damage(ckpts / tag(4))  # nothing deleted


def test_a_checkpoint_from_before_checksums_loads_with_a_warning(reference, tmp_path):
    out = interrupted(reference, tmp_path)
    ckpts = out / "checkpoints"
    for path in step_dirs(ckpts):
        (path / CHECKSUMS).unlink()
    lines = run_train(reference, out)
    assert (
        f"checkpoint {ckpts / tag(8)} has no {CHECKSUMS} (it was written before "
        f"checkpoints carried checksums): it cannot be verified" in lines
    )
    assert "resuming from step 8" in lines


def test_a_checkpoint_from_before_model_states_resumes_exactly(reference, tmp_path):
    """trainer-rank0.pt as written before models had a state of their own: the same tensors
    (the all-attention model's cache) under "caches". Resumed, the run ends with the
    uninterrupted run's weights, bit for bit."""
    out = interrupted(reference, tmp_path)
    ckpt = out / "checkpoints" / tag(8)
    saved = read_checkpoint_file(ckpt / "trainer-rank0.pt")
    saved["caches"] = saved.pop("states")
    torch.save(saved, ckpt / "trainer-rank0.pt")
    (ckpt / CHECKSUMS).unlink()  # recorded again, for the file as rewritten
    write_checksums(ckpt)
    lines = run_train(reference, out)
    assert "resuming from step 8" in lines
    ref = weights(reference[1] / "train" / "checkpoints" / tag(12))
    got = weights(out / "checkpoints" / tag(12))
    assert ref.keys() == got.keys()
    assert all(torch.equal(ref[k], got[k]) for k in ref)


def run_evaluate(reference, train_dir: Path) -> tuple[dict, list[str]]:
    spec, ws = reference
    lines: list[str] = []
    out = train_dir.parent / "evaluate.partial"
    out.mkdir()
    ctx = StageContext(
        spec=spec,
        out_dir=out,
        inputs={"preprocess": ws / "preprocess", "train": train_dir},
        tracker=NullStageTracker(),
        log=lines.append,
    )
    return stages.evaluate.run(ctx), lines


def test_evaluate_passes_over_a_damaged_checkpoint_and_refuses_when_none_is_intact(
    reference, tmp_path
):
    train_dir = tmp_path / "train"
    shutil.copytree(reference[1] / "train", train_dir)
    ckpts = train_dir / "checkpoints"
    flip_byte(ckpts / tag(12) / MODEL, 0.5)
    results, lines = run_evaluate(reference, train_dir)
    assert results["checkpoint"] == f"train/{tag(8)}"
    assert (
        f"{ckpts}: damaged checkpoint {tag(12)} ({MODEL} does not match its checksum); "
        f"using {tag(8)}, the newest intact checkpoint" in lines
    )
    for step in (4, 8):
        truncate(ckpts / tag(step) / MODEL)
    shutil.rmtree(tmp_path / "evaluate.partial")
    with pytest.raises(
        PipelineError,
        match=f"^no intact checkpoint under {re.escape(str(ckpts))}: damaged checkpoint {tag(12)} ",
    ):
        run_evaluate(reference, train_dir)


# ----------------------------------------------------------------- a full disk


@pytest.fixture(scope="module")
def full_disk_spec(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("full")
    spec = tiny_spec(tmp, "full")
    Runner(spec, only=["download,preprocess"], log=lambda m: None).run(NullTracker())
    return spec


def run_failing_train(spec) -> tuple[str, Path]:
    """Run train under MLflow; returns the one-line error and the checkpoints directory."""
    with pytest.raises(PipelineError) as info:
        Runner(spec, only=["train"], force=["train"], log=lambda m: None).run(make_tracker(spec))
    return str(info.value), Path(spec.workspace_dir) / "train.partial" / "checkpoints"


def assert_failed_in_mlflow(spec) -> None:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{Path(spec.workspace.root) / 'mlflow.db'}")
    exp = client.get_experiment_by_name(spec.name)
    latest = client.search_runs(
        [exp.experiment_id], order_by=["attributes.start_time DESC"], max_results=2
    )
    assert {r.data.tags.get("stage", "parent"): r.info.status for r in latest} == {
        "train": "FAILED",
        "parent": "FAILED",
    }


def disk_full_line(ckpts: Path, step: int) -> str:
    size = r"[\d.,]+ [KMG]iB"
    return (
        rf"^disk full: checkpoint {re.escape(str(ckpts / tag(step)))} needs about {size} "
        rf"but {re.escape(str(ckpts))} has {size} free; free {size} or more and run again "
        rf"to resume$"
    )


def test_a_disk_without_room_for_the_next_checkpoint_is_refused_before_writing(
    full_disk_spec, monkeypatch
):
    real = shutil.disk_usage
    ckpts = Path(full_disk_spec.workspace_dir) / "train.partial" / "checkpoints"

    def disk_usage(path):  # full once the first checkpoint is written
        usage = real(path)
        return usage._replace(free=1 << 10) if (ckpts / tag(4)).exists() else usage

    monkeypatch.setattr(shutil, "disk_usage", disk_usage)
    message, ckpts = run_failing_train(full_disk_spec)
    assert re.match(disk_full_line(ckpts, 8), message), message
    assert "has 1.0 KiB free" in message
    assert [p.name for p in step_dirs(ckpts)] == [tag(4)] and damage(ckpts / tag(4)) is None
    assert not list(ckpts.glob("tmp-*"))
    assert_failed_in_mlflow(full_disk_spec)


@pytest.mark.parametrize(
    "error",
    [
        OSError(errno.ENOSPC, "No space left on device"),
        RuntimeError("basic_ios::clear: iostream error"),
    ],
    ids=["ENOSPC", "torch-writer"],
)
def test_a_disk_that_fills_while_writing_says_disk_full(full_disk_spec, monkeypatch, error):
    """The write itself fails (the free-space check passed): the half-written checkpoint is
    removed, the previous one is intact, MLflow records the failure."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    real_save, real_usage = DeepSpeedEngine.save_checkpoint, shutil.disk_usage
    writing = []

    def save_checkpoint(self, save_dir, **kw):
        if kw["tag"] != "tmp-" + tag(8):
            return real_save(self, save_dir, **kw)
        (Path(save_dir) / kw["tag"]).mkdir()
        (Path(save_dir) / kw["tag"] / MODEL).write_bytes(b"half")
        writing.append(kw["tag"])
        raise error

    def disk_usage(path):  # torch's writer error is a full disk only if it is full
        usage = real_usage(path)
        return usage._replace(free=0) if writing else usage

    monkeypatch.setattr(DeepSpeedEngine, "save_checkpoint", save_checkpoint)
    monkeypatch.setattr(shutil, "disk_usage", disk_usage)
    message, ckpts = run_failing_train(full_disk_spec)
    assert writing == ["tmp-" + tag(8)]
    assert re.match(disk_full_line(ckpts, 8), message), message
    assert [p.name for p in step_dirs(ckpts)] == [tag(4)] and damage(ckpts / tag(4)) is None
    assert not list(ckpts.glob("tmp-*"))
    assert_failed_in_mlflow(full_disk_spec)
