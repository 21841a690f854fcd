"""What `validate` accepts runs, and every key acts or is refused (issue: bounds and
cross-checks belong in the spec; settings the chosen optimizer would ignore are errors)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pipeline.spec import SpecError, load_spec
from pipeline.training.ds_config import deepspeed_config
from pipeline.training.optim import build_optimizer
from tests.fixtures.local_corpus import config as local_corpus_config
from tests.fixtures.runs import cli as run_cli

ROOT = Path(__file__).resolve().parents[3]
QUICKSTART = ROOT / "configs" / "quickstart.yaml"
ADAGRAD = [
    "train.optimizer.type=adagrad",
    "train.optimizer.clip=per_param",
    "train.optimizer.clip_norm=0.03",
]


@pytest.mark.parametrize(
    "sets, needle",
    [
        (["train.optimizer.lr=.inf"], "train.optimizer.lr"),
        (["train.optimizer.betas=[2, -1]"], "train.optimizer.betas"),
        (["train.seed=1180591620717411303424"], "train.seed"),  # 2**70
        (["train.seed=-1"], "train.seed"),
        (["workspace.root=/dev/null"], "workspace.root: /dev/null is not a directory"),
        (["workspace.root=/dev/null/runs"], "/dev/null is not a directory"),
        (["workspace.cache=/dev/null"], "workspace.cache: /dev/null is not a directory"),
        ([*ADAGRAD, "train.optimizer.betas=[0.8, 0.9]"], "adagrad has none"),
        ([*ADAGRAD, "train.optimizer.weight_decay=0.01"], "has no weight decay"),
        # counts past any machine: refused here, not overflowing or allocating inside `run`
        (["train.steps=100000000000000000000000"], "train.steps: expected less than or equal"),
        (["train.batch_size=100000000000000000000000"], "train.batch_size: expected less than"),
        (["train.seq_len=10000000000000000000000"], "train.seq_len: expected less than"),
        (["dataset.split.valid=1e300"], "dataset.split.valid: expected less than"),
        (["dataset.shards.block_tokens=100000000000000000000"], "dataset.shards.block_tokens"),
    ],
)
def test_refused_before_anything_runs(sets, needle):
    with pytest.raises(SpecError) as e:
        load_spec(QUICKSTART, sets)
    assert needle in str(e.value), str(e.value)


def test_keys_that_act_are_accepted():
    """Accepted, and each reaches what it acts on: the optimizer built from the spec and
    DeepSpeed's gradient clipping."""
    param = torch.nn.Parameter(torch.zeros(1))
    adam = load_spec(
        QUICKSTART,
        [
            "train.optimizer.weight_decay=0.01",  # adam's
            "train.optimizer.betas=[0.9, 0.98]",
        ],
    ).train
    optimizer = build_optimizer([param], adam.optimizer)
    assert type(optimizer) is torch.optim.Adam
    assert optimizer.param_groups[0]["weight_decay"] == 0.01
    assert optimizer.param_groups[0]["betas"] == (0.9, 0.98)
    adagrad = load_spec(
        QUICKSTART,
        [
            "train.optimizer.type=adagrad",
            "train.optimizer.clip=global",
            "train.optimizer.weight_decay=0.01",
        ],
    ).train
    optimizer = build_optimizer([param], adagrad.optimizer)
    assert type(optimizer) is torch.optim.Adagrad  # torch's, which has a weight decay
    assert optimizer.param_groups[0]["weight_decay"] == 0.01
    # the quickstart's clip_norm 1.0, applied by DeepSpeed to the whole gradient
    assert deepspeed_config(adagrad, 1, 1, bf16=False)["gradient_clipping"] == 1.0


def config(tmp: Path, corpus: bytes) -> Path:
    source = tmp / "corpus.txt"
    source.write_bytes(corpus)
    return local_corpus_config(
        tmp,
        source,
        "model: {d_model: 16, n_layers: 1, n_heads: 2, n_persistent: 4, max_span: 16}",
        "train: {steps: 2, batch_size: 1, seq_len: 2, log_every: 1, eval_every: 0,",
        "        optimizer: {warmup_steps: 0}}",
        "finetune: {steps: 1}",
        "evaluate: {splits: [valid], batch_size: 1}",
        name="small",
        stages="[download, preprocess, train, finetune, evaluate]",
    )


def cli(*args):
    return run_cli(*args, check=False)


def test_a_one_token_valid_split_is_refused_at_preprocess(tmp_path):
    cfg = config(tmp_path, b"abcdefghij" * 50)
    result = cli("run", cfg, "--set", "dataset.split.valid=1")
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.strip() == (
        "error: dataset 'local': the valid split has 1 token(s); "
        "it needs at least 2 to be scored: make "
        "dataset.split.valid larger"
    )
    assert "[train]" not in result.stdout


def test_a_model_that_cannot_hold_the_vocabulary_is_one_line_at_train(tmp_path):
    cfg = config(tmp_path, b"abcdefghij" * 50)
    result = cli("run", cfg, "--set", "model.adaptive_io=true", "--set", "model.d_model=64")
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert "model: adaptive_cutoffs [20000, 40000, 200000] need a vocabulary larger" in line
    assert "(vocabulary 10 from " in line and "manifest.json)" in line


def test_a_tiny_split_is_scored_with_a_warning(tmp_path):
    cfg = config(tmp_path, bytes(range(97, 123)) * 20)  # 520 bytes: 52 valid tokens
    result = cli("run", cfg)
    assert result.returncode == 0, result.stdout + result.stderr
    assert (
        "warning: the valid split has only 51 scored tokens: its bpc is a rough estimate "
        "(make dataset.split.valid larger)"
    ) in result.stdout


@pytest.mark.parametrize(
    "sets, key",
    [
        (
            ["train.optimizer.clip=none", "train.optimizer.clip_norm=2.0"],
            "train.optimizer.clip_norm",
        ),
        (["model.adaptive_span=false", "model.span_ramp=16"], "model.span_ramp"),
        (["model.adaptive_cutoffs=[10, 20]"], "model.adaptive_cutoffs"),
    ],
)
def test_a_key_written_where_it_does_nothing_is_refused(sets, key):
    with pytest.raises(SpecError) as e:
        load_spec(QUICKSTART, sets)
    assert f"--set {sets[-1]}: {key}: does nothing here (" in str(e.value)


def test_an_inherited_key_a_variant_switches_off_is_accepted_and_show_drops_it(tmp_path):
    # char.yaml (a shared base) sets the span ramp and Adagrad's clip_norm
    import yaml

    spec = load_spec(
        ROOT / "configs" / "enwik8_small.yaml",
        ["model.adaptive_span=false", "train.optimizer.clip=none"],
    )
    resolved = spec.resolved()
    assert "span_ramp" not in resolved["model"]
    assert "clip_norm" not in resolved["train"]["optimizer"]
    copy = tmp_path / "copy.yaml"
    copy.write_text(yaml.safe_dump(resolved))
    assert load_spec(copy).resolved() == resolved  # what show prints validates
