"""Active-memory Transformers ("Active memory versus self-attention"; docs/papers.md#active-memory):
a pre-norm Transformer whose token mixer is self-attention, a convolution, a
persistent-convolution, a highway-convolution, a CGRU, or the sum of self-attention and one of
the convolutions.

Where the paper is silent, this module does what the authors' code does
(Anon-111/Active-Memory, Utils/Active_Memory_Transformer.py and util_code.py):
- blocks are pre-norm, ``x += drop(Op(LN(x)))``, ``x += drop(FFN(LN(x)))``, with a final
  LayerNorm (eps 1e-6); the FFN is Linear -> ReLU -> dropout -> Linear with biases;
- the embedding (N(0, 1)) is scaled by sqrt(d); the sinusoidal timing signal (tensor2tensor:
  sin of every timescale, then cos) is added before the stack and again at the start of
  every layer, so layer 1 sees it twice; dropout after the first addition;
- one dropout rate (the paper's keep-probability 0.9) on the embeddings, the attention
  weights, the FFN hidden units and both residual branches;
- self-attention: n_heads heads of head_dim each, independent of d (the code: 8 x 64), no
  biases; queries, keys, values ~ N(0, 0.1), W_o ~ N(0, 1) as the code's ``dense``;
- convolutions have a bias, are Glorot-uniform initialised (TensorFlow's default, biases
  included), and pad with zeros, except the persistent-convolution's trainable padding;
- the highway carry term uses the operator's input, i.e. the normalised x;
- the output layer is its own Linear(d, V) with bias, not tied to the embedding.

Divergences between paper and code are options whose default is the code's:
``conv_activation`` (code GELU, tanh approximation; paper ReLU) and ``cgru_gate`` (code hard
sigmoid; paper sigmoid). The code scales attention logits twice (q * d_h^-0.5 in
multihead_attention, then / d_h in dot_product_attention, i.e. d_h^-1.5): ``attn_double_scale:
true`` does so, and the algorithmic tasks' base config (configs/base/active_memory_task.yaml)
sets it, since with d_h^-0.5 and Adam at lr 0.01 their attention goes one-hot within ten steps
and self-attention learns nothing on add. The dataclass default, which the language model
keeps, is the standard d_h^-0.5 (the paper names no scale).

Modes: ``causal: true`` is the language model (convolutions padded k-1 on the left,
self-attention masked to the past); ``causal: false`` the algorithmic tasks (encoder only,
position-wise targets, "same" padding: (k-1)//2 left, the rest right; attention sees all).
The model sees one block at a time and carries no state between blocks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from pipeline.models.capabilities import ActivationMemory, MemoryCounts
from pipeline.models.checks import check_at_least, check_scalar_types
from pipeline.models.protocol import ModelOutput, SequenceModel, State

MIXERS = (
    "self_attention",
    "conv",
    "persistent_conv",
    "highway_conv",
    "cgru",
    "sa+conv",
    "sa+persistent_conv",
    "sa+highway_conv",
)
"""The layer's token mixer; ``sa+X`` = X(y) + self_attention(y) on the same normalised y."""

CONV_ACTIVATIONS = ("gelu", "relu")
GATES = ("hard_sigmoid", "sigmoid")

LN_EPS = 1e-6  # the code's layer_norm epsilon


@dataclass
class ActiveMemoryConfig:
    """Architecture of an active-memory Transformer. Defaults: the paper's algorithmic-task
    model (4 layers, hidden 128, filter 512, kernel 20, bidirectional). Its language model:
    causal true, 8 layers, d_model 256, ff_dim 1024, kernel 20, BPE vocabulary 32k."""

    mixer: str = "conv"
    """The token mixer of every layer: self_attention, conv, persistent_conv, highway_conv,
    cgru, or sa+conv, sa+persistent_conv, sa+highway_conv (operator output plus
    self-attention output on the same normalised input, one dropout, one residual)."""
    causal: bool = False
    """true: language modelling (left padding k-1, attention to the past only); false: the
    algorithmic tasks (same padding, attention to every position)."""
    d_model: int = 128
    """Hidden size d (paper: 128 for the tasks, 256 for language modelling)."""
    n_layers: int = 4
    """Number of layers (paper: 4 for the tasks, 8 for language modelling)."""
    ff_dim: int = 512
    """Filter size: the feed-forward sublayer's inner width (paper: 512 tasks, 1024 LM)."""
    kernel_size: int = 20
    """Convolution kernel width k (paper: 20)."""
    n_heads: int = 8
    """Self-attention heads (the code: 8)."""
    head_dim: int = 64
    """Size of each head's queries, keys and values, independent of d_model (the code: 64)."""
    dropout: float = 0.1
    """Drop probability everywhere dropout applies (paper: keep-probability 0.9)."""
    conv_activation: str = "gelu"
    """Activation after conv and persistent_conv: gelu (the code, tanh approximation) or relu
    (the paper)."""
    cgru_gate: str = "hard_sigmoid"
    """The CGRU's update and reset gates: hard_sigmoid = clip(1.2 sigmoid(x) - 0.1, 0, 1)
    (the code) or sigmoid (the paper). The highway gate is the hard sigmoid in both."""
    attn_double_scale: bool = False
    """true: attention logits scaled by d_h^-1.5 as in the authors' code (q * d_h^-0.5, then
    / d_h), the algorithmic tasks' setting (configs/base/active_memory_task.yaml: with
    d_h^-0.5 and Adam at lr 0.01 self-attention learns nothing on add); false: the standard
    d_h^-0.5 (the language model's). Every sa+X mixer's attention branch takes the same."""

    def __post_init__(self) -> None:
        check_scalar_types(self)
        check_at_least(
            self, ("d_model", "n_layers", "ff_dim", "kernel_size", "n_heads", "head_dim"), 1
        )
        for name, choices in (
            ("mixer", MIXERS),
            ("conv_activation", CONV_ACTIVATIONS),
            ("cgru_gate", GATES),
        ):
            if getattr(self, name) not in choices:
                raise ValueError(
                    f"{name} must be one of {', '.join(choices)}; got {getattr(self, name)!r}"
                )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")

    def inert_keys(self) -> list[tuple[str, str]]:
        """Fields that do nothing under this mixer, each with why (the spec refuses them
        where the user wrote them)."""
        out = []
        if self.operator is None:
            out += [
                (k, f"mixer {self.mixer} has no convolution")
                for k in ("kernel_size", "conv_activation", "cgru_gate")
            ]
        elif self.operator not in ("conv", "persistent_conv"):
            out.append(
                (
                    "conv_activation",
                    f"only conv and persistent_conv have an activation (mixer {self.mixer})",
                )
            )
        if self.operator is not None and self.operator != "cgru":
            out.append(("cgru_gate", f"mixer {self.mixer} has no CGRU"))
        if not self.uses_attention:
            out += [
                (k, f"mixer {self.mixer} has no self-attention")
                for k in ("n_heads", "head_dim", "attn_double_scale")
            ]
        return out

    @property
    def operator(self) -> str | None:
        """The active-memory operator of the mixer (None: self-attention alone)."""
        op = self.mixer.removeprefix("sa+")
        return None if op == "self_attention" else op

    @property
    def uses_attention(self) -> bool:
        return self.mixer == "self_attention" or self.mixer.startswith("sa+")

    @property
    def padding(self) -> tuple[int, int]:
        """Rows added (left, right) before a convolution so that it keeps the length."""
        k = self.kernel_size
        return (k - 1, 0) if self.causal else ((k - 1) // 2, k - 1 - (k - 1) // 2)


def hard_sigmoid(x: Tensor) -> Tensor:
    return torch.clamp(1.2 * torch.sigmoid(x) - 0.1, 0.0, 1.0)


def timing_signal(length: int, channels: int, dtype, device) -> Tensor:
    """[length, channels]: tensor2tensor's sinusoids, sin for every timescale then cos (an odd
    channel count gets a zero last column), timescales 1 .. 1e4."""
    n = channels // 2
    increment = math.log(1.0e4) / max(n - 1, 1)
    inv = torch.exp(torch.arange(n, dtype=torch.float64, device=device) * -increment)
    t = torch.arange(length, dtype=torch.float64, device=device)[:, None] * inv[None, :]
    signal = torch.cat([torch.sin(t), torch.cos(t)], dim=1)
    return F.pad(signal, (0, channels % 2)).to(dtype)


def _glorot_uniform_(t: Tensor, fan_in: int, fan_out: int) -> None:
    """TensorFlow's default initializer (the code's convolutions, biases, output layer)."""
    limit = math.sqrt(6.0 / (fan_in + fan_out))
    nn.init.uniform_(t, -limit, limit)


class Conv(nn.Module):
    """A length-preserving 1-D convolution d -> d; the caller gives the padding rows."""

    def __init__(self, d: int, k: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(d, d, k))  # [out, in, tap]
        self.bias = nn.Parameter(torch.empty(d))
        _glorot_uniform_(self.weight, k * d, k * d)  # TF fans of a [k, in, out] kernel
        _glorot_uniform_(self.bias, d, d)

    def forward(self, x: Tensor, left: Tensor, right: Tensor) -> Tensor:
        """x [B, M, d]; left [L, d], right [R, d] with L + R = k - 1 -> [B, M, d]."""
        b = x.shape[0]
        padded = torch.cat([left.expand(b, -1, -1), x, right.expand(b, -1, -1)], dim=1)
        return F.conv1d(padded.transpose(1, 2), self.weight, self.bias).transpose(1, 2)


class ConvOperator(nn.Module):
    """conv / persistent_conv: act(W * [left, x, right] + b); which padding is the caller's."""

    def __init__(self, cfg: ActiveMemoryConfig):
        super().__init__()
        self.conv = Conv(cfg.d_model, cfg.kernel_size)
        self.relu = cfg.conv_activation == "relu"

    def forward(self, x: Tensor, left: Tensor, right: Tensor) -> Tensor:
        y = self.conv(x, left, right)
        return F.relu(y) if self.relu else F.gelu(y, approximate="tanh")


class HighwayConv(nn.Module):
    """a = U0 * x + B0, b = hard_sigmoid(U1 * x + B1), y = a b + x (1 - b)."""

    def __init__(self, cfg: ActiveMemoryConfig):
        super().__init__()
        self.transform = Conv(cfg.d_model, cfg.kernel_size)
        self.gate = Conv(cfg.d_model, cfg.kernel_size)

    def forward(self, x: Tensor, left: Tensor, right: Tensor) -> Tensor:
        a = self.transform(x, left, right)
        b = hard_sigmoid(self.gate(x, left, right))
        return a * b + x * (1 - b)


class CGRU(nn.Module):
    """The Neural GPU's cell: u = g(U1 * x + B1), r = g(U2 * x + B2),
    y = u x + (1 - u) tanh(U0 * (r x) + B0), g the hard sigmoid (code) or sigmoid (paper)."""

    def __init__(self, cfg: ActiveMemoryConfig):
        super().__init__()
        self.update = Conv(cfg.d_model, cfg.kernel_size)
        self.reset = Conv(cfg.d_model, cfg.kernel_size)
        self.candidate = Conv(cfg.d_model, cfg.kernel_size)
        self.gate = hard_sigmoid if cfg.cgru_gate == "hard_sigmoid" else torch.sigmoid

    def forward(self, x: Tensor, left: Tensor, right: Tensor) -> Tensor:
        u = self.gate(self.update(x, left, right))
        r = self.gate(self.reset(x, left, right))
        return u * x + (1 - u) * torch.tanh(self.candidate(r * x, left, right))


class SelfAttention(nn.Module):
    """Multi-head dot-product self-attention without biases, dropout on the weights."""

    def __init__(self, cfg: ActiveMemoryConfig):
        super().__init__()
        inner = cfg.n_heads * cfg.head_dim
        self.n_heads, self.head_dim = cfg.n_heads, cfg.head_dim
        self.causal = cfg.causal
        # The code scales q by d_h^-0.5 and the logits again by 1/d_h.
        self.scale = cfg.head_dim ** (-1.5 if cfg.attn_double_scale else -0.5)
        self.query = nn.Linear(cfg.d_model, inner, bias=False)
        self.key = nn.Linear(cfg.d_model, inner, bias=False)
        self.value = nn.Linear(cfg.d_model, inner, bias=False)
        self.out = nn.Linear(inner, cfg.d_model, bias=False)
        self.dropout = nn.Dropout(cfg.dropout)
        for lin in (self.query, self.key, self.value):
            nn.init.normal_(lin.weight, std=0.1)
        nn.init.normal_(self.out.weight, std=1.0)

    def forward(self, x: Tensor) -> Tensor:
        b, m, _ = x.shape
        q, k, v = (
            lin(x).view(b, m, self.n_heads, self.head_dim).transpose(1, 2)
            for lin in (self.query, self.key, self.value)
        )
        logits = (q @ k.transpose(-1, -2)) * self.scale  # [B, H, M, M]
        if self.causal:
            future = torch.ones(m, m, dtype=torch.bool, device=x.device).triu(1)
            logits = logits.masked_fill(future, float("-inf"))
        weights = self.dropout(torch.softmax(logits, dim=-1))
        return self.out((weights @ v).transpose(1, 2).reshape(b, m, -1))


OPERATORS = {
    "conv": ConvOperator,
    "persistent_conv": ConvOperator,
    "highway_conv": HighwayConv,
    "cgru": CGRU,
}


class Layer(nn.Module):
    def __init__(self, cfg: ActiveMemoryConfig):
        super().__init__()
        self.mixer_norm = nn.LayerNorm(cfg.d_model, eps=LN_EPS)
        self.operator = OPERATORS[cfg.operator](cfg) if cfg.operator else None
        self.attention = SelfAttention(cfg) if cfg.uses_attention else None
        self.ff_norm = nn.LayerNorm(cfg.d_model, eps=LN_EPS)
        self.ff_in = nn.Linear(cfg.d_model, cfg.ff_dim)
        self.ff_out = nn.Linear(cfg.ff_dim, cfg.d_model)
        self.dropout = nn.Dropout(cfg.dropout)
        for lin in (self.ff_in, self.ff_out):  # the code's dense: N(0, 1), zero bias
            nn.init.normal_(lin.weight, std=1.0)
            nn.init.zeros_(lin.bias)

    def forward(self, x: Tensor, left: Tensor, right: Tensor) -> Tensor:
        y = self.mixer_norm(x)
        mixed = self.operator(y, left, right) if self.operator is not None else 0
        if self.attention is not None:
            mixed = mixed + self.attention(y)
        x = x + self.dropout(mixed)
        y = self.ff_out(self.dropout(F.relu(self.ff_in(self.ff_norm(x)))))
        return x + self.dropout(y)


class PersistentPadding(nn.Module):
    """The persistent-convolution's trainable padding: one block shared by every persistent
    convolution of the model (causal: k-1 rows on the left; bidirectional: (k-1)//2 rows
    left, the rest right)."""

    def __init__(self, cfg: ActiveMemoryConfig):
        super().__init__()
        n_left, n_right = cfg.padding
        self.left = nn.Parameter(torch.empty(n_left, cfg.d_model))
        self.right = nn.Parameter(torch.empty(n_right, cfg.d_model))
        for p in (self.left, self.right):  # TF fans of a [1, rows, d] variable
            _glorot_uniform_(p, p.shape[0], cfg.d_model)


class ActiveMemoryModel(SequenceModel, MemoryCounts):
    """Embedding -> n_layers pre-norm blocks -> LayerNorm -> Linear(d, V) (see module doc)."""

    def __init__(self, cfg: ActiveMemoryConfig, vocab_size: int):
        super().__init__()
        if vocab_size < 1:
            raise ValueError(f"vocabulary size must be >= 1, got {vocab_size}")
        self.cfg = cfg
        self.embedding = nn.Embedding(vocab_size, cfg.d_model)
        nn.init.normal_(self.embedding.weight, std=1.0)
        self.dropout = nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg.n_layers))
        self.persistent_padding = (
            PersistentPadding(cfg) if cfg.operator == "persistent_conv" else None
        )
        self.final_norm = nn.LayerNorm(cfg.d_model, eps=LN_EPS)
        self.output = nn.Linear(cfg.d_model, vocab_size)
        _glorot_uniform_(self.output.weight, cfg.d_model, vocab_size)
        _glorot_uniform_(self.output.bias, vocab_size, vocab_size)

    def forward(
        self, tokens: Tensor, targets: Tensor | None = None, state: State | None = None
    ) -> ModelOutput:
        m, d = tokens.shape[1], self.cfg.d_model
        x = self.embedding(tokens) * math.sqrt(d)
        timing = timing_signal(m, d, x.dtype, x.device)
        x = self.dropout(x + timing)
        if self.persistent_padding is not None:
            left, right = self.persistent_padding.left, self.persistent_padding.right
        else:
            n_left, n_right = self.cfg.padding
            left, right = x.new_zeros(n_left, d), x.new_zeros(n_right, d)
        for layer in self.layers:
            x = layer(x + timing, left, right)
        logits = self.output(self.final_norm(x))
        nll = None
        if targets is not None:
            nll = F.cross_entropy(
                logits.float().flatten(0, 1), targets.flatten(), reduction="none"
            ).view(targets.shape)
        return ModelOutput(logits, nll, [])

    def activation_memory(
        self,
        rows: int,
        block_len: int,
        dtype: torch.dtype,
        device_type: str,
        uniform_tokens: bool = False,
    ) -> ActivationMemory:
        """Per layer: the LayerNorms' inputs and float32 statistics, the mixer's (each
        convolution's padded input and its gates' activations; self-attention's copied
        heads, its [B, H, M, M] weights and their dropout), the dropouts' masks (bool on a
        GPU, the dtype on the CPU) and the feed-forward's hidden units; then the final norm,
        the output layer's input, its float32 log-softmax [tokens, V] and the logits, which
        the caller holds through the backward. No state."""
        c, e = self.cfg, torch.empty((), dtype=dtype).element_size()
        tokens, d = rows * block_len, c.d_model
        mask = (1 if device_type == "cuda" else e) if c.dropout > 0 else 0
        dropped = e if c.dropout > 0 else 0  # a dropout's output, where a product reads it
        padded = e * rows * (block_len + c.kernel_size - 1) * d  # a convolution's input
        # [B, M, d] tensors the mixer keeps, and its convolutions, by operator
        kept, convs = {
            None: (0, 0),
            "conv": (1, 1),
            "persistent_conv": (1, 1),
            "highway_conv": (6, 2),
            "cgru": (9, 3),
        }[c.operator]
        layer = e * tokens * (3 + kept) * d + convs * padded + 16 * tokens  # 3: the norms' in
        layer += 2 * mask * tokens * d + (2 * e + mask) * tokens * c.ff_dim
        working = 2 * e * tokens * max(c.ff_dim, d)
        if c.uses_attention:
            inner = c.n_heads * c.head_dim
            weights = rows * c.n_heads * block_len * block_len
            layer += e * tokens * (d + 4 * inner) + (e + mask + dropped) * weights
            working = max(working, 2 * e * weights)
        out = (4 + e) * tokens * self.output.out_features  # log-softmax; the logits returned
        saved = c.n_layers * layer + mask * tokens * d + e * tokens * 2 * d + 8 * tokens + out
        return ActivationMemory(saved, max(working, (4 + e) * tokens * self.output.out_features), 0)

    def describe(self) -> str:
        c = self.cfg
        parts = [
            f"active memory: {c.mixer}",
            "causal" if c.causal else "bidirectional",
        ]
        if c.operator is not None:  # self-attention alone has no convolution (inert_keys)
            parts.append(f"kernel {c.kernel_size}")
        if c.operator in ("conv", "persistent_conv"):
            parts.append(f"conv {c.conv_activation}")
        if c.operator == "cgru":
            parts.append(f"CGRU gates {c.cgru_gate}")
        if c.uses_attention:
            parts.append(
                "attention scale d_h^-1.5 (the code's)"
                if c.attn_double_scale
                else "attention scale d_h^-0.5"
            )
        return ", ".join(parts)

    def parameter_groups(self) -> dict[str, int]:
        def count(*modules) -> int:
            return sum(p.numel() for mod in modules if mod is not None for p in mod.parameters())

        groups = {
            "embeddings": count(self.embedding),
            "operator": count(*(layer.operator for layer in self.layers)),
            "self-attention": count(*(layer.attention for layer in self.layers)),
            "feed-forward": count(
                *(mod for layer in self.layers for mod in (layer.ff_in, layer.ff_out))
            ),
            "layer norms": count(
                self.final_norm,
                *(mod for layer in self.layers for mod in (layer.mixer_norm, layer.ff_norm)),
            ),
            "output": count(self.output),
            "persistent padding": count(self.persistent_padding),
        }
        return {role: n for role, n in groups.items() if n}
