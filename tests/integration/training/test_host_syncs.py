"""A training step never waits for the device (issue 26): counted with HostSyncCounter on
the DeepSpeed engine on CPU (what would wait on CUDA), a tiny all-attention model with
adaptive span, attention dropout and two micro-batches per update. In steady state a step
makes no host sync; a step that reports the loss makes exactly one (the loss and the model's
metrics read in one transfer)."""

from __future__ import annotations

import pytest

from pipeline.diagnostics.host_syncs import HostSyncCounter
from stages.base import NullStageTracker
from stages.train import plan as train_plan
from tests.fixtures.tiny_corpus import tiny_corpus

WARMUP, LOG_EVERY = 3, 3


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    from pipeline.spec import load_spec
    from pipeline.training.trainer import Trainer
    from pipeline.training.training_data import PreprocessedData

    tmp = tmp_path_factory.mktemp("syncs")
    cfg, pre = tiny_corpus(tmp)
    spec = load_spec(cfg, [f"train.log_every={LOG_EVERY}", "train.checkpoint_every=0"])
    assert spec.model["adaptive_span"] and spec.model["attn_dropout"] > 0
    data = PreprocessedData(pre, spec.train.seq_len)
    t = Trainer(spec, train_plan(spec), data, NullStageTracker(), lambda _: None)
    assert t.accum == 2
    for _ in range(WARMUP):
        t.train_step()
    return t


def test_a_steady_state_step_makes_no_host_sync(trainer):
    for _ in range(3):
        with HostSyncCounter() as counter:
            loss = trainer.train_step()
        assert counter.syncs == [], "\n".join(counter.syncs)
    assert loss.dim() == 0 and 0 < float(loss) < 10


def test_a_report_reads_the_device_once(trainer, tmp_path, monkeypatch):
    lines: list[str] = []
    monkeypatch.setattr(trainer, "save", lambda *a, **k: tmp_path)
    monkeypatch.setattr(trainer, "log", lines.append)
    start = trainer.step
    assert start % LOG_EVERY == 0
    with HostSyncCounter() as counter:
        trainer.fit(start + 2 * LOG_EVERY, tmp_path)
    assert len(counter.syncs) == 2, "\n".join(counter.syncs)  # one per report
    assert all("pipeline/training/trainer.py" in s for s in counter.syncs)
    reports = [line for line in lines if "loss" in line]
    assert len(reports) == 2 and "bpc" in reports[0]


def test_a_compiled_step_makes_no_host_sync(tmp_path, monkeypatch):
    """train.compile: true (aot_eager here: inductor takes minutes per graph on this CPU)."""
    from pipeline.models.allattn import AllAttnLM
    from pipeline.spec import load_spec
    from pipeline.training.trainer import Trainer
    from pipeline.training.training_data import PreprocessedData

    compile_for_training = AllAttnLM.compile_for_training
    monkeypatch.setattr(
        AllAttnLM,
        "compile_for_training",
        lambda self, graphs=False: compile_for_training(self, backend="aot_eager", graphs=graphs),
    )
    cfg, pre = tiny_corpus(tmp_path)
    spec = load_spec(cfg, ["train.compile=true"])
    data = PreprocessedData(pre, spec.train.seq_len)
    t = Trainer(spec, train_plan(spec), data, NullStageTracker(), lambda _: None)
    assert t.compiled and "compiled" in t.model.describe()
    for _ in range(WARMUP):
        t.train_step()
    with HostSyncCounter() as counter:
        t.train_step()
    assert counter.syncs == [], "\n".join(counter.syncs)
