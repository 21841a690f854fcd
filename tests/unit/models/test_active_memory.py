"""The active-memory model kind: every mixer against its definition computed with explicit
loops in float64, causality, the shared persistent padding, and parameter counts at the
paper's sizes as `show` prints them."""

from __future__ import annotations

import math

import pytest
import torch
from click.testing import CliRunner

from pipeline.commands.cli import main
from pipeline.models import build_model
from pipeline.models.active_memory import MIXERS
from tests.fixtures.tiny_models import float64_model

TINY = dict(d_model=6, n_layers=2, ff_dim=8, kernel_size=4, n_heads=2, head_dim=3)
VOCAB = 11


def tiny_model(mixer: str, causal: bool, **options):
    return float64_model("active_memory", dict(TINY, mixer=mixer, causal=causal, **options), VOCAB)


# ---- the definitions, one position at a time -------------------------------------------


def layer_norm(v, norm):
    mean = sum(v.tolist()) / len(v)
    var = sum((e - mean) ** 2 for e in v.tolist()) / len(v)
    return (v - mean) / math.sqrt(var + 1e-6) * norm.weight + norm.bias


def gelu_tanh(v):
    return 0.5 * v * (1 + torch.tanh(math.sqrt(2 / math.pi) * (v + 0.044715 * v**3)))


def hard_sigmoid(v):
    return torch.clamp(1.2 / (1 + torch.exp(-v)) - 0.1, min=0.0, max=1.0)


def timing(position: int, d: int):
    n = d // 2
    inv = [math.exp(-i * math.log(1.0e4) / (n - 1)) for i in range(n)]
    return torch.tensor(
        [math.sin(position * r) for r in inv] + [math.cos(position * r) for r in inv],
        dtype=torch.float64,
    )


def conv(module, xs, left, right):
    """y_t = b + sum_j W[:, :, j] [left, x, right]_{t+j}."""
    padded = left + xs + right
    k = module.weight.shape[2]
    return [
        module.bias + sum(module.weight[:, :, j] @ padded[t + j] for j in range(k))
        for t in range(len(xs))
    ]


def attention(module, ys, causal, scale):
    h_n, dh = module.n_heads, module.head_dim
    out = []
    for t in range(len(ys)):
        heads = []
        for h in range(h_n):
            rows = slice(h * dh, (h + 1) * dh)
            q = module.query.weight[rows] @ ys[t]
            seen = range(t + 1) if causal else range(len(ys))
            scores = [float(q @ (module.key.weight[rows] @ ys[j])) * scale for j in seen]
            top = max(scores)
            weights = [math.exp(s - top) for s in scores]
            total = sum(weights)
            heads.append(
                sum(
                    w / total * (module.value.weight[rows] @ ys[j])
                    for w, j in zip(weights, seen, strict=False)
                )
            )
        out.append(module.out.weight @ torch.cat(heads))
    return out


def operator(layer, mixer, ys, left, right, cfg):
    op, kind = layer.operator, mixer.removeprefix("sa+")
    if kind in ("conv", "persistent_conv"):
        act = gelu_tanh if cfg["conv_activation"] == "gelu" else torch.relu
        return [act(v) for v in conv(op.conv, ys, left, right)]
    if kind == "highway_conv":
        a = conv(op.transform, ys, left, right)
        b = [hard_sigmoid(v) for v in conv(op.gate, ys, left, right)]
        return [a_t * b_t + y * (1 - b_t) for a_t, b_t, y in zip(a, b, ys, strict=False)]
    gate = hard_sigmoid if cfg["cgru_gate"] == "hard_sigmoid" else torch.sigmoid
    u = [gate(v) for v in conv(op.update, ys, left, right)]
    r = [gate(v) for v in conv(op.reset, ys, left, right)]
    c = conv(op.candidate, [r_t * y for r_t, y in zip(r, ys, strict=False)], left, right)
    return [u_t * y + (1 - u_t) * torch.tanh(c_t) for u_t, y, c_t in zip(u, ys, c, strict=False)]


def reference(
    model,
    mixer,
    causal,
    tokens,
    targets,
    conv_activation="gelu",
    cgru_gate="hard_sigmoid",
    attn_double_scale=False,
):
    """logits [B, M, V] and nll [B, M] from the paper's and the code's definitions."""
    cfg = dict(conv_activation=conv_activation, cgru_gate=cgru_gate)
    d, k, dh = TINY["d_model"], TINY["kernel_size"], TINY["head_dim"]
    n_left = k - 1 if causal else (k - 1) // 2
    if mixer.endswith("persistent_conv"):  # one block for every layer
        left = list(model.persistent_padding.left)
        right = list(model.persistent_padding.right)
    else:
        left = [torch.zeros(d, dtype=torch.float64)] * n_left
        right = [torch.zeros(d, dtype=torch.float64)] * (k - 1 - n_left)
    scale = dh**-1.5 if attn_double_scale else dh**-0.5
    all_logits, all_nll = [], []
    for row, target_row in zip(tokens.tolist(), targets.tolist(), strict=False):
        xs = [
            model.embedding.weight[tok] * math.sqrt(d) + timing(t, d) for t, tok in enumerate(row)
        ]
        for layer in model.layers:
            xs = [x + timing(t, d) for t, x in enumerate(xs)]
            ys = [layer_norm(x, layer.mixer_norm) for x in xs]
            mixed = [torch.zeros(d, dtype=torch.float64) for _ in xs]
            if mixer != "self_attention":
                mixed = [
                    m + o
                    for m, o in zip(
                        mixed, operator(layer, mixer, ys, left, right, cfg), strict=False
                    )
                ]
            if mixer == "self_attention" or mixer.startswith("sa+"):
                mixed = [
                    m + a
                    for m, a in zip(
                        mixed, attention(layer.attention, ys, causal, scale), strict=False
                    )
                ]
            xs = [x + m for x, m in zip(xs, mixed, strict=False)]
            for t, x in enumerate(xs):
                hidden = torch.relu(
                    layer.ff_in.weight @ layer_norm(x, layer.ff_norm) + layer.ff_in.bias
                )
                xs[t] = x + layer.ff_out.weight @ hidden + layer.ff_out.bias
        logits = [
            model.output.weight @ layer_norm(x, model.final_norm) + model.output.bias for x in xs
        ]
        all_logits.append(torch.stack(logits))
        all_nll.append(
            torch.tensor(
                [
                    math.log(sum(math.exp(v) for v in z.tolist())) - float(z[y])
                    for z, y in zip(logits, target_row, strict=False)
                ],
                dtype=torch.float64,
            )
        )
    return torch.stack(all_logits), torch.stack(all_nll)


CASES = [(mixer, causal, {}) for mixer in MIXERS for causal in (True, False)] + [
    ("conv", True, {"conv_activation": "relu"}),
    ("sa+persistent_conv", False, {"conv_activation": "relu"}),
    ("cgru", True, {"cgru_gate": "sigmoid"}),
    # the algorithmic tasks' scale reaches the attention branch of every mixer that has one
    ("self_attention", False, {"attn_double_scale": True}),
    ("sa+conv", True, {"attn_double_scale": True}),
    ("sa+conv", False, {"attn_double_scale": True}),
    ("sa+persistent_conv", False, {"attn_double_scale": True}),
    ("sa+highway_conv", False, {"attn_double_scale": True}),
]


@pytest.mark.parametrize(
    "mixer,causal,options",
    CASES,
    ids=[f"{m}-{'causal' if c else 'bidir'}-{'-'.join(o) or 'code'}" for m, c, o in CASES],
)
def test_model_matches_its_definition_in_float64(mixer, causal, options):
    model = tiny_model(mixer, causal, **options)
    tokens = torch.tensor([[3, 1, 4, 1, 5], [9, 2, 6, 5, 3]])
    targets = torch.tensor([[1, 4, 1, 5, 9], [2, 6, 5, 3, 5]])
    with torch.no_grad():
        out = model(tokens, targets)
        logits, nll = reference(model, mixer, causal, tokens, targets, **options)
    assert out.state == []
    torch.testing.assert_close(out.logits, logits, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(out.nll.double(), nll, rtol=1e-6, atol=1e-6)  # nll in fp32


@pytest.mark.parametrize("mixer", ["highway_conv", "cgru", "sa+highway_conv"])
def test_hard_sigmoid_gates_clip_at_0_and_1_as_defined(mixer):
    # 1.2 sigmoid(x) - 0.1 leaves [0, 1] only for |x| > 2.4, which the initial weights rarely
    # reach: biases of +-6 on alternate channels put every gate in one of the two clips.
    model = tiny_model(mixer, causal=False)
    ops = [layer.operator for layer in model.layers]
    gates = (
        [op.gate for op in ops]
        if "highway" in mixer
        else [conv for op in ops for conv in (op.update, op.reset)]
    )
    pre = []
    for conv in gates:
        conv.register_forward_hook(lambda mod, args, out: pre.append(out))
        with torch.no_grad():
            conv.bias.copy_(torch.tensor([6.0, -6.0] * (TINY["d_model"] // 2)))
    tokens = torch.tensor([[3, 1, 4, 1, 5], [9, 2, 6, 5, 3]])
    targets = torch.tensor([[1, 4, 1, 5, 9], [2, 6, 5, 3, 5]])
    with torch.no_grad():
        out = model(tokens, targets)
        logits, _ = reference(model, mixer, False, tokens, targets)
    pre = torch.cat([p.flatten() for p in pre])
    assert (pre < -2.4).any() and (pre > 2.4).any()  # both clips are exercised
    torch.testing.assert_close(out.logits, logits, rtol=1e-10, atol=1e-10)


def test_double_scaling_changes_attention():
    tokens = torch.tensor([[3, 1, 4, 1, 5]])
    with torch.no_grad():
        standard = tiny_model("self_attention", True)(tokens).logits
        code = tiny_model("self_attention", True, attn_double_scale=True)(tokens).logits
    assert not torch.allclose(standard[:, 1:], code[:, 1:])


@pytest.mark.parametrize("mixer", MIXERS)
def test_causal_mode_never_reads_the_future(mixer):
    model = tiny_model(mixer, causal=True)
    tokens = torch.tensor([[3, 1, 4, 1, 5, 9, 2]])
    changed = tokens.clone()
    changed[0, 4] = 7
    with torch.no_grad():
        before, after = model(tokens).logits, model(changed).logits
    assert torch.equal(before[:, :4], after[:, :4])
    assert not torch.allclose(before[:, 4:], after[:, 4:])


@pytest.mark.parametrize("mixer", MIXERS)
def test_bidirectional_mode_reads_both_sides(mixer):
    model = tiny_model(mixer, causal=False)
    tokens = torch.tensor([[3, 1, 4, 1, 5]])
    changed = tokens.clone()
    changed[0, 2] = 7
    with torch.no_grad():
        before, after = model(tokens).logits, model(changed).logits
    for position in (0, 4):  # within two layers' reach on either side (k = 4: 1 left, 2 right)
        assert not torch.allclose(before[:, position], after[:, position]), position


@pytest.mark.parametrize("mixer", ["persistent_conv", "sa+persistent_conv"])
@pytest.mark.parametrize("causal,rows", [(True, (3, 0)), (False, (1, 2))])
def test_one_persistent_padding_serves_every_layer(mixer, causal, rows):
    model = tiny_model(mixer, causal)
    blocks = {name: tuple(p.shape) for name, p in model.named_parameters() if "persistent" in name}
    assert blocks == {
        "persistent_padding.left": (rows[0], 6),
        "persistent_padding.right": (rows[1], 6),
    }
    seen = []
    for layer in model.layers:
        layer.operator.register_forward_hook(lambda mod, args, out: seen.append((args[1], args[2])))
    with torch.no_grad():
        model(torch.tensor([[3, 1, 4, 1, 5]]))
    assert len(seen) == 2
    assert all(
        left is model.persistent_padding.left and right is model.persistent_padding.right
        for left, right in seen
    )


# ---- parameter counts at the paper's sizes ---------------------------------------------

TASK = dict(n_layers=4, d_model=128, ff_dim=512, kernel_size=20, vocab=100)  # reverse
LM = dict(n_layers=8, d_model=256, ff_dim=1024, kernel_size=20, vocab=32000)


def expected_groups(mixer: str, n_layers, d_model, ff_dim, kernel_size, vocab) -> dict:
    d, f, k, heads, dh = d_model, ff_dim, kernel_size, 8, 64
    conv = k * d * d + d
    operator = {
        "self_attention": 0,
        "conv": conv,
        "persistent_conv": conv,
        "highway_conv": 2 * conv,
        "cgru": 3 * conv,
    }[mixer.removeprefix("sa+")]
    attention = 4 * d * heads * dh if mixer == "self_attention" or "sa+" in mixer else 0
    groups = {
        "embeddings": vocab * d,
        "operator": n_layers * operator,
        "self-attention": n_layers * attention,
        "feed-forward": n_layers * (d * f + f + f * d + d),
        "layer norms": (2 * n_layers + 1) * 2 * d,
        "output": d * vocab + vocab,
        "persistent padding": (k - 1) * d if "persistent" in mixer else 0,
    }
    return {role: n for role, n in groups.items() if n}


SPEC = """\
name: am
dataset: python_docs
model:
  kind: active_memory
  mixer: {mixer}
  causal: {causal}
  n_layers: {n_layers}
  d_model: {d_model}
  ff_dim: {ff_dim}
{kernel}train:
  steps: 4
  batch_size: 2
  seq_len: 16
  optimizer: {{type: adam, lr: 1.0e-3, clip: global, clip_norm: 1.0}}
stages: [download, preprocess, train]
"""


def write_spec(tmp_path, mixer="conv", causal="false", **sizes):
    sizes = {**TASK, **sizes}
    path = tmp_path / "am.yaml"
    # self-attention alone has no kernel: the spec refuses the key there
    kernel = "" if mixer == "self_attention" else f"  kernel_size: {sizes['kernel_size']}\n"
    path.write_text(SPEC.format(mixer=mixer, causal=causal, kernel=kernel, **sizes))
    return path


@pytest.mark.parametrize("mixer", MIXERS)
@pytest.mark.parametrize("setting,sizes", [("tasks", TASK), ("lm", LM)])
def test_parameter_counts_at_the_papers_sizes(tmp_path, mixer, setting, sizes):
    expected = expected_groups(mixer, **sizes)
    with torch.device("meta"):
        model = build_model(
            "active_memory",
            dict(
                mixer=mixer,
                causal=setting == "lm",
                **{k: v for k, v in sizes.items() if k != "vocab"},
            ),
            sizes["vocab"],
        )
    assert model.parameter_groups() == expected
    cfg = write_spec(tmp_path, mixer, "true" if setting == "lm" else "false", **sizes)
    result = CliRunner().invoke(
        main, ["show", str(cfg), "--set", f"dataset.vocab_size={sizes['vocab']}"]
    )
    assert result.exit_code == 0, result.output
    line = next(ln for ln in result.output.splitlines() if ln.startswith("parameters:"))
    assert line.startswith(f"parameters: {sum(expected.values()):,} ")


def test_validate_accepts_an_active_memory_spec(tmp_path):
    cfg = write_spec(tmp_path, "sa+highway_conv", d_model=16, ff_dim=32, n_layers=2)
    result = CliRunner().invoke(main, ["validate", str(cfg)])
    assert result.exit_code == 0, result.output
    assert result.output == f"{cfg}: valid (am: download, preprocess, train)\n"


@pytest.mark.parametrize(
    "override,message",
    [
        (
            "model.mixer=convv",
            "model: mixer must be one of self_attention, conv, persistent_conv, "
            "highway_conv, cgru, sa+conv, sa+persistent_conv, sa+highway_conv; "
            "got 'convv'",
        ),
        (
            "model.cgru_gate=relu",
            "model: cgru_gate must be one of hard_sigmoid, sigmoid; got 'relu'",
        ),
        ("model.dropout=1.0", "model: dropout must be in [0, 1), got 1.0"),
        ("model.kernel_size=0", "model: kernel_size must be >= 1, got 0"),
    ],
)
def test_bad_values_are_one_line_naming_the_field(tmp_path, override, message):
    cfg = write_spec(tmp_path)
    result = CliRunner().invoke(main, ["validate", str(cfg), "--set", override])
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].endswith(message), result.output


@pytest.mark.parametrize(
    "mixer,override,why",
    [
        ("conv", "model.n_heads=4", "mixer conv has no self-attention"),
        ("self_attention", "model.conv_activation=relu", "mixer self_attention has no convolution"),
        (
            "highway_conv",
            "model.conv_activation=relu",
            "only conv and persistent_conv have an activation (mixer highway_conv)",
        ),
        ("sa+conv", "model.cgru_gate=sigmoid", "mixer sa+conv has no CGRU"),
    ],
)
def test_a_setting_the_mixer_does_not_use_is_refused(tmp_path, mixer, override, why):
    result = CliRunner().invoke(
        main, ["validate", str(write_spec(tmp_path, mixer)), "--set", override]
    )
    assert result.exit_code == 2
    key = override.split("=")[0]
    assert f"{key}: does nothing here ({why}); remove it" in result.output, result.output


@pytest.mark.parametrize("mixer", MIXERS)
def test_the_description_names_a_kernel_only_where_the_mixer_convolves(mixer):
    """The smoke self-attention point was described with "kernel 5": a convolution's
    setting, which self-attention alone does not have."""
    described = tiny_model(mixer, causal=True).describe()
    assert described.startswith(f"active memory: {mixer}, causal")
    assert ("kernel 4" in described) == (mixer != "self_attention"), described
