"""Validation of the optimizer's schedule and clipping against the rest of train: a warm-up
as long as training is refused with the fix; the clip mode defaults to the optimizer's own
(per_param for the paper's Adagrad, global at norm 1 for Adam)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.spec import PROJECT_ROOT, SpecError, load_spec

QUICKSTART = PROJECT_ROOT / "configs" / "quickstart.yaml"  # warmup_steps 100


def spec_with_optimizer(tmp_path: Path, optimizer: str):
    path = tmp_path / "opt.yaml"
    path.write_text(
        f"name: opt\ndataset: python_docs\nmodel: {{kind: allattn, d_model: 32, n_layers: 1, "
        f"n_heads: 2, n_persistent: 4, max_span: 16}}\n"
        f"train: {{steps: 10, batch_size: 2, seq_len: 8, optimizer: {optimizer}}}\n"
        f"stages: [download, preprocess, train]\n"
    )
    return load_spec(path)


@pytest.mark.parametrize("steps", [100, 50])
def test_a_warmup_not_shorter_than_training_is_refused_naming_the_key_and_the_fix(steps):
    with pytest.raises(SpecError) as e:
        load_spec(QUICKSTART, [f"train.steps={steps}"])
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith(f"--set train.steps={steps}: train.optimizer.warmup_steps 100")
    assert "make warmup_steps smaller than train.steps" in message


def test_a_warmup_shorter_than_training_is_accepted():
    assert load_spec(QUICKSTART, ["train.steps=101"]).train.optimizer.warmup_steps == 100


def test_adam_without_a_clip_gets_the_global_clip_at_norm_1(tmp_path):
    opt = spec_with_optimizer(tmp_path, "{type: adam, lr: 0.001}").train.optimizer
    assert (opt.clip, opt.clip_norm) == ("global", 1.0)


def test_adam_keeps_the_clip_it_states(tmp_path):
    opt = spec_with_optimizer(tmp_path, "{type: adam, clip: global, clip_norm: 0.25}")
    assert (opt.train.optimizer.clip, opt.train.optimizer.clip_norm) == ("global", 0.25)
    assert spec_with_optimizer(tmp_path, "{type: adam, clip: none}").train.optimizer.clip == "none"


def test_adagrad_without_a_clip_keeps_the_papers_per_tensor_clip(tmp_path):
    opt = spec_with_optimizer(tmp_path, "{type: adagrad}").train.optimizer
    assert (opt.clip, opt.clip_norm) == ("per_param", 0.03)


def test_a_clip_mode_that_does_not_fit_adam_is_refused_with_the_fix(tmp_path):
    with pytest.raises(SpecError, match="with adam use clip: global or none"):
        spec_with_optimizer(tmp_path, "{type: adam, clip: per_param}")
