"""The paper configs (configs/*.yaml, baselines/, ablations/): built from the YAML files
through the spec layer on the meta device, their parameter counts checked against the
authors' code AND against an explicit formula, and their hyperparameters against the paper
(docs/papers.md#all-attention-hyperparameters)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from pipeline.models import build_model, count_parameters
from pipeline.spec import SpecError, load_spec

ROOT = Path(__file__).resolve().parents[3]
CONFIGS = ROOT / "configs"

VOCAB = {"enwik8": 205, "text8": 27, "wikitext103": 267_735}
"""The vocabulary sizes of the paper's datasets (enwik8 bytes, text8 a-z + space, WT103 words)."""


def load(rel: str):
    """The spec of a config file, with the dataset card it names (a missing card fails)."""
    return load_spec(CONFIGS / rel)


def dataset_of(rel: str) -> str:
    """The dataset the config names (read from the YAML chain, not from the card)."""
    import yaml

    path = CONFIGS / rel
    while True:
        data = yaml.safe_load(path.read_text())
        if "dataset" in data:
            return data["dataset"]
        path = path.parent / data["extends"][0]


_BUILT: dict[str, tuple] = {}


def built(rel: str):
    """(spec, model on meta, vocab) for a config file, built once per session."""
    if rel not in _BUILT:
        spec = load(rel)
        vocab = VOCAB[dataset_of(rel)]
        if spec.dataset.name in VOCAB and spec.dataset.vocab_size is not None:
            assert spec.dataset.vocab_size == vocab, f"{rel}: card's vocab_size"
        with torch.device("meta"):
            model = build_model(spec.model_kind, spec.model_params, vocab)
        _BUILT[rel] = (spec, model, vocab)
    return _BUILT[rel]


def formula(cfg, vocab: int) -> dict[str, int]:
    """The parameter count of a config, part by part, from the architecture's definition
    (not from the model code): per layer W_{q,k,v,o} 4 d^2; persistent vectors 2 N d (per
    head N x d_h keys and values for H heads, or one set of dimension d; head_split: half
    of them); LayerNorms 2 d per AddNorm; one span per context head; the FF sublayer; the
    shared d_h x L position table; the input and output layers."""
    d, H, N, L = cfg.d_model, cfg.n_heads, cfg.n_persistent, cfg.n_layers
    dh, f = d // H, cfg.ff_dim
    parts = {
        "attention matrices W_qkvo": L * 4 * d * d,
        "persistent vectors": L * (N * d if cfg.persistent_mode == "head_split" else 2 * N * d),
        "layer norms": L * 2 * d * (2 if f else 1),
        "adaptive spans": L
        * (H // 2 if cfg.persistent_mode == "head_split" else H)
        * cfg.adaptive_span,
        "position table d_h x L": dh * cfg.max_span,
    }
    if f:
        parts["feed-forward"] = (
            L
            * {
                "relu": 2 * d * f + f + d,  # fc1, fc2 and their biases
                "ff_attn": 2 * d * d + 2 * f * d,  # W_q', W_o' and f persistent vectors of dim d
                "softmax": 2 * d * f,  # U, V
            }[cfg.ff_kind]
        )
    if cfg.adaptive_io:
        bounds = [0, *cfg.adaptive_cutoffs, vocab]
        dims = [d // cfg.adaptive_div**i for i in range(len(bounds) - 1)]
        sizes = [hi - lo for lo, hi in zip(bounds, bounds[1:], strict=False)]
        k = len(cfg.adaptive_cutoffs)
        parts["adaptive input bands (tied)"] = sum(n * e for n, e in zip(sizes, dims, strict=False))
        parts["band projections (tied)"] = sum(d * e for e in dims)
        parts["output biases + cluster logits"] = vocab + k * d + k
    else:
        parts["embedding V x d"] = vocab * d
        parts["output d x V + bias"] = d * vocab + vocab
    return parts


def show(label: str, n: int, parts: dict[str, int], published: float | None = None) -> None:
    pub = f" (published: {published / 1e6:.1f}M)" if published else ""
    print(f"\n{label}: {n:,} parameters{pub}")
    for key, cnt in parts.items():
        print(f"  {key:34s} {cnt:>13,}")


# ======================================================================================
# the paper's five models
# ======================================================================================

PAPER = [
    ("enwik8_small.yaml", 38.5e6),
    ("enwik8_large.yaml", 114.0e6),
    ("text8_small.yaml", 38.3e6),
    ("text8_large.yaml", 114.0e6),
    ("wt103.yaml", 132.5e6),
]


@pytest.mark.parametrize("rel,published", PAPER, ids=[p[0] for p in PAPER])
def test_parameter_count_matches_the_authors_code_and_the_formula(rel, published):
    spec, model, vocab = built(rel)
    n = count_parameters(model)
    parts = formula(spec.model_params, vocab)
    show(rel, n, parts, published)
    assert n == sum(parts.values())
    assert abs(n - published) / published < 0.01
    # `allattn-pipe show` groups every parameter somewhere sensible
    groups = model.parameter_groups()
    assert "other" not in groups and sum(groups.values()) == n
    assert groups["persistent vectors"] == parts["persistent vectors"]
    assert groups["attention matrices"] == parts["attention matrices W_qkvo"]


def test_wt103_uses_four_tied_bands_at_d_d4_d16_d64():
    spec, model, vocab = built("wt103.yaml")
    assert [b.weight.shape for b in model.embed.bands] == [
        (20_000, 512),
        (20_000, 128),
        (160_000, 32),
        (vocab - 200_000, 8),
    ]
    assert all(model.out.weights[i] is model.embed.bands[i].weight for i in range(4))
    assert all(model.out.projs[i] is model.embed.projs[i] for i in range(4))
    # three bands (the paper's "3 clusters" read literally, 0-20k/20k-60k/60k-V at d, d/4,
    # d/16) would be ~4M short of the published 132.5M: the four-band reading is the one
    cfg3 = dataclasses.replace(spec.model_params, adaptive_cutoffs=[20_000, 60_000])
    n3 = sum(formula(cfg3, vocab).values())
    assert abs(n3 - 132.5e6) / 132.5e6 > 0.02


def test_paper_hyperparameters():
    small, large = load("enwik8_small.yaml"), load("text8_large.yaml")
    for spec, (layers, n, drop, steps, drop_steps) in (
        (small, (18, 1024, 0.3, 450_000, 30_000)),
        (load("text8_small.yaml"), (18, 1024, 0.3, 450_000, 30_000)),
        (large, (36, 2048, 0.4, 200_000, 10_000)),
        (load("enwik8_large.yaml"), (36, 2048, 0.4, 200_000, 10_000)),
    ):
        m, t = spec.model_params, spec.train
        assert (m.d_model, m.n_heads, m.ff_dim, m.persistent_mode) == (512, 8, 0, "all_attn")
        assert (m.n_layers, m.n_persistent, m.attn_dropout) == (layers, n, drop)
        assert (m.max_span, m.adaptive_span, m.span_ramp, m.span_loss_coef) == (
            8192,
            True,
            32,
            1e-7,
        )
        assert (m.emb_dropout, m.out_dropout, m.adaptive_io) == (0.0, 0.0, False)
        assert (t.steps, t.batch_size, t.seq_len) == (steps, 64, 512)
        o = t.optimizer
        assert (o.type, o.lr, o.warmup_steps, o.clip, o.clip_norm) == (
            "adagrad",
            0.07,
            32_000,
            "per_param",
            0.03,
        )
        assert (spec.finetune.steps, spec.finetune.lr_divisor) == (drop_steps, 10)
        assert spec.evaluate.batch_size == 8 and "finetune" in spec.stages
    wt = load("wt103.yaml")
    m, t, o = wt.model_params, wt.train, wt.train.optimizer
    assert (m.n_layers, m.n_persistent, m.max_span, m.span_loss_coef) == (36, 2048, 2048, 5e-7)
    assert (m.attn_dropout, m.emb_dropout, m.out_dropout) == (0.3, 0.1, 0.1)
    assert (m.adaptive_io, m.adaptive_tied, m.adaptive_cutoffs, m.adaptive_div) == (
        True,
        True,
        [20000, 40000, 200000],
        4,
    )
    assert (t.steps, t.batch_size, t.seq_len) == (800_000, 64, 256)
    assert (o.type, o.lr, o.warmup_steps, o.clip, o.clip_norm) == (
        "adam",
        2.5e-4,
        8000,
        "global",
        1.0,
    )
    assert (wt.finetune.steps, wt.finetune.lr_divisor, wt.evaluate.batch_size) == (50_000, 10, 8)


# ======================================================================================
# the Transformer + adaptive span baselines
# ======================================================================================

BASELINES = [
    ("baselines/enwik8_transformer_small.yaml", 39e6, 12, 512, 2048),
    ("baselines/text8_transformer_small.yaml", 39e6, 12, 512, 2048),
    ("baselines/enwik8_transformer_large.yaml", 209e6, 24, 768, 4096),
    ("baselines/text8_transformer_large.yaml", 209e6, 24, 768, 4096),
]


@pytest.mark.parametrize("rel,published,layers,d,ff", BASELINES, ids=[b[0] for b in BASELINES])
def test_transformer_baselines(rel, published, layers, d, ff):
    spec, model, vocab = built(rel)
    m = spec.model_params
    assert (m.n_layers, m.d_model, m.ff_dim, m.ff_kind, m.n_persistent) == (
        layers,
        d,
        ff,
        "relu",
        0,
    )
    assert m.adaptive_span and m.max_span == 8192
    n = count_parameters(model)
    parts = formula(m, vocab)
    show(rel, n, parts, published)
    assert n == sum(parts.values())
    assert abs(n - published) / published < 0.02  # published to the nearest million
    assert all(layer.ff is not None and layer.attn.persistent_k is None for layer in model.layers)


def test_small_all_attention_matches_the_small_baseline_in_size():
    # the paper's claim: the all-attention network replaces the FF sublayers at equal size
    _, allattn, _ = built("enwik8_small.yaml")
    _, base, _ = built("baselines/enwik8_transformer_small.yaml")
    a, b = count_parameters(allattn), count_parameters(base)
    assert abs(a - b) / b < 0.01


# ======================================================================================
# the ablations (text8, large model)
# ======================================================================================

ABLATIONS = {
    "ablations/text8_all_attn.yaml": {},
    "ablations/text8_attn_split.yaml": {"persistent_mode": "attn_split"},
    "ablations/text8_head_split.yaml": {"persistent_mode": "head_split"},
    "ablations/text8_single_head.yaml": {"persistent_mode": "single_head"},
    "ablations/text8_ff_attn.yaml": {
        "n_layers": 24,
        "n_persistent": 0,
        "ff_dim": 3072,
        "ff_kind": "ff_attn",
    },
    "ablations/text8_n0.yaml": {"n_persistent": 0},
}


@pytest.mark.parametrize("rel", list(ABLATIONS))
def test_each_ablation_changes_only_its_own_fields(rel):
    base, _, _ = built("text8_large.yaml")
    spec, model, vocab = built(rel)
    a, b = dataclasses.asdict(spec.model_params), dataclasses.asdict(base.model_params)
    assert {k: v for k, v in a.items() if b[k] != v} == ABLATIONS[rel]
    assert spec.dataset.name == base.dataset.name and spec.train == base.train
    assert spec.name != base.name
    n = count_parameters(model)
    parts = formula(spec.model_params, vocab)
    show(rel, n, parts)
    assert n == sum(parts.values())
    assert "other" not in model.parameter_groups()


def test_ablation_parameter_counts_are_the_papers():
    n = {rel: count_parameters(built(rel)[1]) for rel in ABLATIONS}
    full = n["ablations/text8_all_attn.yaml"]
    assert full == count_parameters(built("text8_large.yaml")[1])
    d, H, N, L = 512, 8, 2048, 36
    # "all those versions have the same number of parameters except head-split"
    assert n["ablations/text8_attn_split.yaml"] == full
    assert n["ablations/text8_single_head.yaml"] == full
    # head-split: half of the persistent vectors (H/2 heads x N x d_h, keys and values)
    # are gone, and the persistent-only heads have no span
    assert full - n["ablations/text8_head_split.yaml"] == L * (2 * (H // 2) * N * (d // H) + H // 2)
    # FF-attn: 24 layers with 3072 vectors "to maintain the number of parameters": the
    # attention + FF matrices equal the 36 all-attention layers' exactly
    assert 24 * (4 * d * d + 2 * d * d + 2 * 3072 * d) == L * (4 * d * d + 2 * N * d)
    ff = n["ablations/text8_ff_attn.yaml"]
    print(f"\nFF-attn {ff:,} vs all-attn {full:,} ({(ff - full) / full:+.4%})")
    assert abs(ff - full) / full < 0.01
    # N = 0: only W_{q,k,v,o} left in the layers, "38M" of them (paper)
    n0_spec, n0, vocab = built("ablations/text8_n0.yaml")
    assert all(layer.attn.persistent_k is None and layer.ff is None for layer in n0.layers)
    assert n["ablations/text8_n0.yaml"] == full - L * 2 * N * d
    assert abs(L * 4 * d * d - 38e6) / 38e6 < 0.01


def test_model_section_of_a_yaml_is_checked_strictly(tmp_path):
    good = tmp_path / "ok.yaml"
    good.write_text(
        f"extends: [{CONFIGS / 'wt103.yaml'}]\nname: t\ndataset: python_docs\n"
        "model: {adaptive_cutoffs: [10, 20], persistent_mode: single_head}\n"
    )
    spec = load_spec(good)
    assert spec.model_params.adaptive_cutoffs == [10, 20]
    assert spec.resolved()["model"]["persistent_mode"] == "single_head"
    for bad, needle in (
        ("{adaptive_cutoffs: 20000}", "adaptive_cutoffs"),
        ("{persistent_mode: jointly}", "persistent_mode"),
        ("{ff_kind: gelu, ff_dim: 8}", "ff_kind"),
        ("{persistent_mode: head_split, n_heads: 1}", "n_heads"),
    ):
        good.write_text(
            f"extends: [{CONFIGS / 'wt103.yaml'}]\nname: t\ndataset: python_docs\nmodel: {bad}\n"
        )
        with pytest.raises(SpecError, match=needle):
            load_spec(good)
