"""The all-attention model family's configuration: one dataclass, the `model:` section of a
spec. Every field has a type and a default (the paper's enwik8 small model); the spec layer
validates YAML against these fields, and `__post_init__` refuses bad values naming the field.
The paper-versus-code notes and the ablations' definitions are in pipeline/models/allattn/model.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pipeline.models.adaptive import band_dims
from pipeline.models.checks import check_at_least, check_scalar_types

PERSISTENT_MODES = ("all_attn", "attn_split", "head_split", "single_head")
"""How the persistent vectors join the self-attention (the paper's section 5.3 ablations)."""

FF_KINDS = ("relu", "ff_attn", "softmax")
"""The feed-forward sublayer when ff_dim > 0: the Transformer's ReLU FF (the baseline), the
ablation's FF-attn, or eq. 9 literally."""

ATTENTION_IMPL_NAMES = ("reference", "sdpa", "flex", "triton", "auto")
"""Backends of the attention op (pipeline.ops): same numbers, different speed and memory."""


@dataclass
class AttentionConfig:
    """How the attention op is computed (the `model.attention` mapping); not the model."""

    impl: str = "reference"
    """reference = plain PyTorch (pipeline/ops/attention.py); sdpa = scaled_dot_product_attention
    with a float bias (trains; no attention dropout); flex = FlexAttention (CUDA: trains, with
    dropout from a hashed mask; CPU: forward only); triton = the Triton kernels of
    pipeline/ops/triton_kernels.py (CUDA; on a machine without CUDA, Triton's interpreter:
    exact, for tests only); auto = per call, the backend the measured
    table says is fastest for the device, dtype and attention dropout (docs/benchmarks.md;
    ``AllAttnLM.describe()``)."""

    def __post_init__(self) -> None:
        if self.impl not in ATTENTION_IMPL_NAMES:
            raise ValueError(
                f"attention.impl must be one of {', '.join(ATTENTION_IMPL_NAMES)}; "
                f"got {self.impl!r}"
            )


@dataclass
class AllAttnConfig:
    """Architecture of an all-attention LM. Defaults: the paper's enwik8 / text8 small model.

    The paper's models, by config: character level d 512, H 8, max_span 8192, ramp 32, span
    loss 1e-7; small 18 layers, N 1024, dropout 0.3; large 36 layers, N 2048, dropout 0.4.
    Word level (WikiText-103): 36 layers, N 2048, max_span 2048, span loss 5e-7, dropout 0.3,
    emb/out dropout 0.1, adaptive_io with cutoffs 20k/40k/200k and div 4, tied.
    Transformer + adaptive span baseline: n_persistent 0, ff_dim > 0, ff_kind relu.
    """

    d_model: int = 512
    """Model width d (paper: 512)."""
    n_layers: int = 18
    """Number of layers (paper, character level: 18 small, 36 large; FF-attn ablation 24)."""
    n_heads: int = 8
    """Attention heads H; head size d_h = d_model / n_heads (paper: 8)."""
    n_persistent: int = 1024
    """Persistent key/value vectors N per head and layer (per layer with single_head);
    0 = none, the N = 0 ablation when ff_dim is 0 too (paper: 1024 small, 2048 large)."""
    persistent_mode: str = "all_attn"
    """How the persistent vectors join the attention (paper section 5.3; see the module doc):
    all_attn = one softmax over context and persistent vectors (the paper's model);
    attn_split = two softmaxes, outputs summed; head_split = half the heads see only the
    context, half only persistent vectors; single_head = one set of N vectors of dimension d
    per layer, own softmax, output summed with the heads' before W_o."""
    ff_dim: int = 0
    """Feed-forward inner size: 0 = all-attention layer without feed-forward (the paper's
    model); > 0 = a Transformer layer: attention, then a feed-forward sublayer of ff_dim
    units (ff_kind), each with its AddNorm. The paper's baseline (Transformer + adaptive
    span): ff_dim 2048 with d 512 (small), 4096 with d 768 (large); FF-attn ablation: 3072."""
    ff_kind: str = "relu"
    """The feed-forward sublayer when ff_dim > 0: relu = Linear -> ReLU -> dropout -> Linear
    with biases (the Transformer baseline, the authors' FeedForwardLayer); ff_attn = the
    ablation's FF-attn: W_o' softmax(W_q' h . M_k / sqrt(d)) M_v with ff_dim persistent
    vectors of dimension d (same parameters as all-attn at 24 layers x 3072); softmax =
    eq. 9 literally, U softmax(V h) without biases."""
    max_span: int = 8192
    """L: the maximum attention span and the length of the relative position table
    (paper: 8192 character level, 2048 word level)."""
    adaptive_span: bool = True
    """Learn a span per head with the adaptive-span soft mask (paper: on). Off = every
    query attends to exactly max_span previous tokens."""
    span_ramp: int = 32
    """R: length of the soft mask's linear ramp in tokens (paper: 32)."""
    span_init: float = 0.0
    """Initial span of every head as a fraction of max_span, in [0, 1] (code: 0)."""
    span_loss_coef: float = 1e-7
    """Lambda of the L1 span penalty lambda * sum_layers mean_heads(z), z in tokens
    (paper: 1e-7 character level, 5e-7 word level; the baseline's scripts 5e-7)."""
    attn_dropout: float = 0.3
    """Dropout on attention weights (and, as in the code, on the feed-forward hidden units
    when ff_dim > 0) (paper: 0.3 small, 0.4 large, 0.3 word level)."""
    emb_dropout: float = 0.0
    """Dropout on the input embeddings (paper: 0 character level, 0.1 word level)."""
    out_dropout: float = 0.0
    """Dropout on the final representation before the output layer (paper: 0 character
    level, 0.1 word level; the code applies its emb_dropout at both places)."""
    adaptive_io: bool = False
    """Adaptive input + adaptive softmax instead of a full embedding and softmax (paper: on
    at word level). ``forward`` then returns logits None: use nll (see ModelOutput)."""
    adaptive_cutoffs: list[int] = field(default_factory=lambda: [20000, 40000, 200000])
    """Band boundaries of the frequency-ordered vocabulary: K cutoffs give K + 1 bands
    (paper: 20000, 40000, 200000, i.e. four bands 0-20k, 20k-40k, 40k-200k, 200k-V as the
    authors' code reads the paper's "3 clusters")."""
    adaptive_div: int = 4
    """Band i has vectors of dimension d_model // adaptive_div**i (paper: 4, i.e. d, d/4,
    d/16, d/64)."""
    adaptive_tied: bool = True
    """Tie the adaptive softmax's weights and projections to the adaptive input's (paper:
    tied)."""
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    """The attention op's backend (``impl``); every backend computes the same numbers."""

    def __post_init__(self) -> None:
        if isinstance(self.attention, dict):  # from YAML, or dataclasses.asdict
            self.attention = AttentionConfig(**self.attention)
        if not isinstance(self.attention, AttentionConfig):
            raise ValueError(f"attention must be a mapping, got {self.attention!r}")
        check_scalar_types(self)
        check_at_least(
            self, ("d_model", "n_layers", "n_heads", "max_span", "span_ramp", "adaptive_div"), 1
        )
        check_at_least(self, ("n_persistent", "ff_dim"), 0)
        if self.d_model % self.n_heads != 0:
            raise ValueError(
                f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})"
            )
        if not 0.0 <= self.span_init <= 1.0:
            raise ValueError(
                f"span_init must be in [0, 1] (a fraction of max_span), got {self.span_init}"
            )
        if not (self.span_loss_coef >= 0.0 and math.isfinite(self.span_loss_coef)):
            raise ValueError(f"span_loss_coef must be finite and >= 0, got {self.span_loss_coef}")
        for name in ("attn_dropout", "emb_dropout", "out_dropout"):
            p = getattr(self, name)
            if not 0.0 <= p < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {p}")
        if self.persistent_mode not in PERSISTENT_MODES:
            raise ValueError(
                f"persistent_mode must be one of {', '.join(PERSISTENT_MODES)}; "
                f"got {self.persistent_mode!r}"
            )
        if self.persistent_mode != "all_attn" and self.n_persistent == 0:
            raise ValueError(
                f"persistent_mode {self.persistent_mode} needs persistent vectors "
                "(n_persistent > 0); the N = 0 ablation is persistent_mode all_attn"
            )
        if self.persistent_mode == "head_split" and self.n_heads % 2 != 0:
            raise ValueError(
                f"persistent_mode head_split splits the heads in two halves: n_heads must be "
                f"even, got {self.n_heads}"
            )
        if self.ff_kind not in FF_KINDS:
            raise ValueError(f"ff_kind must be one of {', '.join(FF_KINDS)}; got {self.ff_kind!r}")
        if self.ff_kind != "relu" and self.ff_dim == 0:
            raise ValueError(
                f"ff_kind {self.ff_kind} is a feed-forward sublayer: it needs ff_dim > 0"
            )
        cut = self.adaptive_cutoffs
        if (
            not isinstance(cut, list)
            or not cut
            or any(isinstance(c, bool) or not isinstance(c, int) for c in cut)
        ):
            raise ValueError(f"adaptive_cutoffs must be a non-empty list of ints, got {cut!r}")
        if cut[0] <= 0 or any(b <= a for a, b in zip(cut, cut[1:], strict=False)):
            raise ValueError(f"adaptive_cutoffs must be increasing and > 0, got {cut}")
        if self.adaptive_io and min(band_dims(self.d_model, len(cut) + 1, self.adaptive_div)) < 1:
            raise ValueError(
                f"adaptive_div {self.adaptive_div}: d_model {self.d_model} // "
                f"{self.adaptive_div}**{len(cut)} leaves the last band with no dimension"
            )

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def inert_keys(self) -> list[tuple[str, str]]:
        """Fields that do nothing under the other fields' values, each with why (the spec
        refuses them where the user wrote them)."""
        out = []
        if not self.adaptive_span:
            out += [
                (k, "model.adaptive_span is false")
                for k in ("span_ramp", "span_init", "span_loss_coef")
            ]
        if not self.adaptive_io:
            out += [
                (k, "model.adaptive_io is false")
                for k in ("adaptive_cutoffs", "adaptive_div", "adaptive_tied")
            ]
        return out
