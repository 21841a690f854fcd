"""A stage's fingerprint counts what takes effect: a key that does nothing under the other
settings (Spec.inert_keys: `clip_norm` with `clip: none`, ...), inherited from an `extends`
base, neither re-runs a finished stage nor refuses to resume an interrupted one when edited.
Every other config hashes exactly as before, so workspaces already written stay valid."""

from __future__ import annotations

from pathlib import Path

import pytest

import stages.base
from pipeline.errors import Preempted
from pipeline.spec import load_spec
from pipeline.workspace.layout import fingerprint
from stages import without
from tests.fixtures.stand_in_stages import ORDER, SEEN, run

ROOT = Path(__file__).resolve().parents[3]


def fingerprinted_before(stage, spec) -> dict:
    """Stage.fingerprinted as it was before inert keys were pinned: what today's workspaces
    hold in their stage.json and partial.json."""
    config = stage.config(spec)
    at_old_value = [
        path
        for path, value in stage.added_keys.items()
        if stages.base._lookup(config, path) == value
    ]
    return without(config, [*stage.runtime_only, *at_old_value])


def pipeline_configs() -> list[Path]:
    return sorted(p for p in (ROOT / "configs").rglob("*.yaml") if "base" not in p.parts)


@pytest.mark.parametrize("path", pipeline_configs(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_shipped_config_hashes_as_it_did(path):
    """Their inert keys (adagrad's betas, say) sit at their defaults: byte-identical."""
    spec = load_spec(path)
    for name in spec.stages:
        stage = stages.STAGES[name]
        assert fingerprint(stage.fingerprinted(spec), {}) == fingerprint(
            fingerprinted_before(stage, spec), {}
        ), name


def write_pair(tmp_path: Path, clip_norm: float) -> Path:
    """A base whose optimizer has clip: none and a clip_norm, and a variant extending it."""
    (tmp_path / "base.yaml").write_text(f"""\
train: {{steps: 2, batch_size: 2, seq_len: 8,
        optimizer: {{type: adam, lr: 1.0e-3, clip: none, clip_norm: {clip_norm},
                     betas: [0.8, 0.99]}}}}
""")
    path = tmp_path / "pipe.yaml"
    path.write_text(f"""\
extends: [base.yaml]
name: pipe
dataset: python_docs
model: {{kind: allattn, d_model: 32, n_layers: 1, n_heads: 2, n_persistent: 4, max_span: 64}}
finetune: {{steps: 1}}
workspace: {{root: {tmp_path / "runs"}}}
stages: [{", ".join(ORDER)}]
""")
    return path


def test_an_inherited_inert_key_edited_re_runs_nothing(tmp_path, calls):
    run(write_pair(tmp_path, 0.5))
    assert calls == ORDER
    calls.clear()
    run(write_pair(tmp_path, 0.7))
    assert calls == []
    # a key that acts still counts
    run(write_pair(tmp_path, 0.7), "train.optimizer.betas=[0.7, 0.99]")
    assert calls == ["train", "finetune", "evaluate"]


def test_an_interrupted_run_resumes_after_an_inherited_inert_key_is_edited(
    tmp_path, calls, monkeypatch
):
    monkeypatch.setenv("PREEMPT_STAGE", "train")
    with pytest.raises(Preempted):
        run(write_pair(tmp_path, 0.5))
    monkeypatch.delenv("PREEMPT_STAGE")
    calls.clear()
    run(write_pair(tmp_path, 0.7))
    assert calls == ["train", "finetune", "evaluate"]
    assert "checkpoints" in SEEN["train"]  # resumed, not started over


@pytest.mark.parametrize("interrupted", [False, True], ids=["finished", "interrupted"])
def test_a_workspace_written_by_the_old_rule_is_still_valid(
    tmp_path, calls, monkeypatch, interrupted
):
    """Written with the fingerprints of before this change (clip: none, clip_norm unset):
    a finished one is up to date, an interrupted one resumes."""
    cfg = write_pair(tmp_path, 0.03)  # clip_norm's default: as if unset
    with monkeypatch.context() as m:
        m.setattr(stages.Stage, "fingerprinted", fingerprinted_before)
        if interrupted:
            m.setenv("PREEMPT_STAGE", "train")
            with pytest.raises(Preempted):
                run(cfg)
        else:
            run(cfg)
    calls.clear()
    run(cfg)
    assert calls == (["train", "finetune", "evaluate"] if interrupted else [])
    if interrupted:
        assert "checkpoints" in SEEN["train"]
