"""All-attention language model (Sukhbaatar et al. 2019, "Augmenting Self-attention with
Persistent Memory"), following the authors' code: the adaptive-span codebase with its
persistent-memory option. The same code builds the paper's baseline (the Transformer +
adaptive span of Sukhbaatar et al. 2019b: ``ff_dim > 0``, ``n_persistent: 0``), the ablations
of its section 5.3 (``persistent_mode``, ``ff_kind``, ``n_persistent: 0``) and the word-level
model (``adaptive_io``: tied adaptive input and adaptive softmax, ``pipeline.models.adaptive``).

Where the paper and the code differ, this module does what the code does:
- a query attends to the L' tokens *before* it, never to itself;
- relative positions are a key-side term only (the paper's eq. 13 also adds p(t, c) to the
  values; the code does not);
- the adaptive-span mask is evaluated at distance - 1 and padded with 1 for the persistent
  vectors; weights are renormalised jointly (+1e-8) and dropout comes after that;
- W_{q,k,v,o} have no bias and PyTorch's default Linear init (not U(-sqrt d, sqrt d));
- the cache holds each layer's input hidden states, detached, starting as zeros (unmasked);
- the adaptive input is scaled by sqrt(d) (character level: a plain N(0, 1) embedding).
The attention math itself lives in ``pipeline.ops.attention`` (the reference op).

The ablations (paper section 5.3, text8, large model), as implemented here
---------------------------------------------------------------------------
- all-attn (``persistent_mode: all_attn``, the default): one softmax over the L' context
  scores and the N persistent scores of each head (eq. 13).
- attn-split (``attn_split``): "the softmax in eq. 13 replaced by two separate softmax
  functions": a_ctx = softmax over the context only (span-masked and renormalised over the
  context, +1e-8, as the adaptive-span code does without persistent memory), a_pers =
  softmax over the N persistent vectors only; the head output is their SUM,
  y_t = sum_c a_ctx,tc v_c + sum_n a_pers,tn M_v[n] (eq. 13's sum over C_t^+, each half
  normalised on its own). Same parameters as all-attn.
- head-split (``head_split``): heads 0 .. H/2-1 attend only to the context (softmax, span
  mask, renormalisation over the context; they alone have spans), heads H/2 .. H-1 only to
  their N persistent vectors (softmax over those). Persistent vectors exist only for the
  persistent heads, so the layer has H/2 * N * d_h * 2 = N * d fewer parameters than
  all-attn, the paper's "fewer parameters because half of its persistent vectors are not
  used". W_{q,k,v,o} keep their d x d shape (the code's projections); the W_k / W_v rows of
  the persistent-only heads are not used (no gradient), which the paper's count ignores.
- single-head (``single_head``): as attn-split, but each layer has ONE set of N persistent
  key / value vectors of dimension d (not split into heads): a_pers = softmax_n(q_t . M_k[n]
  / sqrt(d)) with q_t = W_q x_t the full d-dimensional query (all heads' queries
  concatenated), and sum_n a_pers,tn M_v[n] (d-dimensional) is added to the concatenated
  context outputs of the heads before W_o. Reparameterised like the per-head vectors
  (k = sqrt(d) k', v = sqrt(N) v', k' ~ N(0, 1/d), v' ~ N(0, 1/N)). Same parameters as
  all-attn (2 N d per layer).
- FF-attn (``ff_kind: ff_attn`` with ``n_persistent: 0``, ``ff_dim: 3072``, 24 layers): a
  Transformer whose feed-forward ReLU is a softmax, "the same as single-head except that
  the persistent vectors are a separate sublayer after the self-attention sublayer". The
  sublayer is the single-head persistent attention on its own: q = W_q' h, ff_dim persistent
  vectors of dimension d, softmax(q . M_k / sqrt(d)), dropout, W_o' (no biases), with its
  own AddNorm. With its W_q' and W_o' a 24-layer model with ff_dim 3072 has EXACTLY the
  non-embedding parameters of the 36-layer all-attn model with N = 2048
  (24 (6 d^2 + 2 * 3072 d) = 36 (4 d^2 + 2 * 2048 d)), the paper's reason for that size.
  ``ff_kind: softmax`` is eq. 9 taken literally instead (U softmax(V x), no biases, no
  projections, no scaling; 11% fewer parameters at that size).
- N = 0 (``n_persistent: 0``, ``ff_dim: 0``): self-attention sublayers only.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from pipeline.models.adaptive import AdaptiveInput, AdaptiveLogSoftmax
from pipeline.models.config import FF_KINDS, PERSISTENT_MODES, AllAttnConfig
from pipeline.models.layers import AllAttnLayer, PersistentShareSum, attn_span_len, cache_len
from pipeline.models.protocol import ModelOutput, SequenceModel, State
from pipeline.ops import AttendFn, describe_auto, get_attention_impl

__all__ = ["AllAttnConfig", "AllAttnLM", "FF_KINDS", "PERSISTENT_MODES"]


# --------------------------------------------------------------------------------------
# language model
# --------------------------------------------------------------------------------------


class AllAttnLM(SequenceModel):
    """Embedding -> n_layers all-attention layers -> linear output over the vocabulary
    (or, with ``adaptive_io``, adaptive input -> layers -> tied adaptive softmax).

    Streams a text in blocks: its state is the Transformer-XL cache, one [B, C_l, d] tensor
    per layer holding that layer's input hidden states of the tokens before the block.

    ``activation_checkpointing = True``: in training, each layer's activations are recomputed
    in backward instead of stored (torch's RNG state is replayed, so dropout is identical).
    """

    def __init__(self, cfg: AllAttnConfig, vocab_size: int) -> None:
        super().__init__()
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        self.cfg = cfg
        self.vocab_size = vocab_size
        if cfg.adaptive_io:
            # tied adaptive input / softmax (pipeline.models.adaptive): four bands for the
            # paper's cutoffs; ``out`` shares ``embed``'s band weights and projections
            self.embed = AdaptiveInput(vocab_size, cfg.d_model, cfg.adaptive_cutoffs, cfg.adaptive_div)
        else:
            self.embed = nn.Embedding(vocab_size, cfg.d_model)  # default init N(0, 1), as the code
        # One key-side relative position table shared by all heads and layers, N(0, 1);
        # column L - x holds u_x, the embedding of distance x in [1, L].
        self.pos_table = nn.Parameter(torch.randn(cfg.head_dim, cfg.max_span))
        self.layers = nn.ModuleList(AllAttnLayer(cfg) for _ in range(cfg.n_layers))
        self.emb_dropout = nn.Dropout(cfg.emb_dropout)
        self.out_dropout = nn.Dropout(cfg.out_dropout)
        if cfg.adaptive_io:
            self.out = AdaptiveLogSoftmax(
                vocab_size, cfg.d_model, cfg.adaptive_cutoffs, cfg.adaptive_div,
                tie=self.embed if cfg.adaptive_tied else None,
            )
        else:
            self.out = nn.Linear(cfg.d_model, vocab_size)
        self.set_attention_impl(cfg.attention.impl)

    # ---- spans -------------------------------------------------------------------------

    def _span_fracs(self) -> list[list[float]] | None:
        if not self.cfg.adaptive_span:
            return None
        fracs = torch.stack([layer.attn.adaptive_span.frac.detach() for layer in self.layers])
        return fracs.cpu().tolist()  # one host sync for all layers

    def span_lens(self) -> list[int]:
        """L' per layer: how many previous tokens each layer attends to right now."""
        fracs = self._span_fracs()
        if fracs is None:
            return [self.cfg.max_span] * self.cfg.n_layers
        return [attn_span_len(max(f), self.cfg.max_span, self.cfg.span_ramp) for f in fracs]

    def cache_lens(self) -> list[int]:
        """Hidden states each layer carries to the next block."""
        return [cache_len(s, self.cfg.max_span) for s in self.span_lens()]

    def spans(self) -> list[list[float]]:
        """Current span z in tokens, per layer per head (max_span everywhere when fixed).
        With head_split only the context heads have a span (n_heads / 2 per layer)."""
        fracs = self._span_fracs()
        if fracs is None:
            return [[float(self.cfg.max_span)] * layer.attn.n_ctx_heads for layer in self.layers]
        return [[f * self.cfg.max_span for f in row] for row in fracs]

    # ---- the protocol (pipeline.models.protocol) -------------------------------------

    def aux_loss(self) -> Tensor:
        """The span loss: lambda * sum_layers mean_heads(z), z in tokens; zero when spans
        are fixed."""
        if not self.cfg.adaptive_span:
            return self.pos_table.new_zeros(())
        total = sum(layer.attn.adaptive_span.span().mean() for layer in self.layers)
        return self.cfg.span_loss_coef * total

    def bounded_parameters(self) -> list[tuple[nn.Parameter, float, float]]:
        """The span fractions, in [0, 1]."""
        if not self.cfg.adaptive_span:
            return []
        return [(layer.attn.adaptive_span.frac, 0.0, 1.0) for layer in self.layers]

    def describe(self) -> str:
        """The attention backend; for ``auto``, what it picks on the model's current device
        and dtype (call after moving the model)."""
        if self.attention_impl != "auto":
            return f"attention impl {self.attention_impl}"
        return describe_auto(self.pos_table.device.type, self.pos_table.dtype, self.cfg.attn_dropout)

    def cannot_train_on(self, device: torch.device) -> str | None:
        if self.attention_impl == "flex" and device.type == "cpu":
            return ("model.attention.impl: flex runs forward only on CPU (torch has no CPU "
                    "backward for FlexAttention) and this run trains on the CPU: use reference, "
                    "sdpa or auto")
        return None

    def metrics(self) -> dict[str, float]:
        """Mean and largest span over all heads, in tokens."""
        spans = [z for row in self.spans() for z in row]
        if not spans:
            return {}
        return {"span_mean": sum(spans) / len(spans), "span_max": max(spans)}

    def head_tables(self) -> dict[str, list[list[float]]]:
        """{"spans": ``spans()``} with adaptive span (a fixed span is max_span everywhere:
        nothing to show), else {}."""
        return {"spans": self.spans()} if self.cfg.adaptive_span else {}

    @contextmanager
    def measure_persistent_share(self):
        """The share of each head's joint softmax (eq. 13) that goes to its persistent
        vectors, from the reference op's weights (after the span mask and renormalisation,
        before dropout) whatever the backend. Only ``persistent_mode: all_attn`` shares one
        softmax between context and persistent vectors; the other modes (and N = 0) yield
        None: their split is fixed by construction."""
        if self.cfg.n_persistent == 0 or self.cfg.persistent_mode != "all_attn":
            yield None
            return
        sums = [PersistentShareSum(self.cfg.n_heads, self.pos_table.device) for _ in self.layers]
        tables: dict[str, list[list[float]]] = {}
        for layer, s in zip(self.layers, sums):
            layer.attn.persistent_share = s
        try:
            yield tables
        finally:
            for layer in self.layers:
                layer.attn.persistent_share = None
        if sums[0].rows:
            tables["persistent_share"] = [s.mean() for s in sums]

    def parameter_groups(self) -> dict[str, int]:
        """Parameter elements by role: embeddings, position table, attention matrices,
        persistent vectors (the FF-attn sublayer's too), adaptive span, layer norms,
        feed-forward, output (an adaptive softmax's own weights; tied ones are the
        embeddings')."""
        groups: dict[str, int] = {}
        for name, p in self.named_parameters():
            role = _ROLES.get(name.split(".", 1)[0]) or _layer_role(name.split(".")[2:])
            groups[role] = groups.get(role, 0) + p.numel()
        return groups

    # ---- backends ----------------------------------------------------------------------

    def set_attention_impl(self, impl: str | AttendFn) -> None:
        """Use another attention backend (a name in ``ATTENTION_IMPLS`` or a callable)."""
        fn = get_attention_impl(impl) if isinstance(impl, str) else impl
        self.attention_impl = impl if isinstance(impl, str) else getattr(fn, "__name__", "custom")
        for layer in self.layers:
            layer.attn.attend = fn

    # ---- streaming ---------------------------------------------------------------------

    def init_state(self, batch_size: int, device=None) -> State:
        """Zero hidden states, one [B, C_l, d] tensor per layer (C_l = ``cache_lens()``)."""
        ref = self.pos_table
        device = ref.device if device is None else device
        return [
            torch.zeros(batch_size, c, self.cfg.d_model, device=device, dtype=ref.dtype)
            for c in self.cache_lens()
        ]

    def forward(
        self,
        tokens: Tensor,
        targets: Tensor | None = None,
        state: State | None = None,
    ) -> ModelOutput:
        """tokens, targets: [B, M] int64; state: the previous block's ``ModelOutput.state``
        (None = zeros). Returns logits [B, M, V] (None with adaptive_io: the adaptive softmax
        never forms them; ``model.out.log_prob(h)`` does for inspection), nll [B, M] in nats
        (None without targets) and the next state."""
        bsz, m = tokens.shape
        cache = self.init_state(bsz, device=tokens.device) if state is None else state
        if len(cache) != len(self.layers):
            raise ValueError(f"state has {len(cache)} entries for {len(self.layers)} layers")
        span_lens = self.span_lens()  # fixed for the whole block
        h = self.emb_dropout(self.embed(tokens))
        new_cache: list[Tensor] = []
        for layer, past, span_len in zip(self.layers, cache, span_lens):
            keep = cache_len(span_len, self.cfg.max_span)  # = max_span for a fixed span
            past = past.to(h.dtype)
            if keep > m:
                nxt = torch.cat([past[:, max(0, past.shape[1] - (keep - m)) :], h], dim=1)
            else:
                nxt = h[:, m - keep :]
            new_cache.append(nxt.detach())
            if self.activation_checkpointing and self.training and torch.is_grad_enabled():
                h = checkpoint(layer, h, past, self.pos_table, span_len, use_reentrant=False)
            else:
                h = layer(h, past, self.pos_table, span_len)
        h = self.out_dropout(h)
        if self.cfg.adaptive_io:
            nll = self.out(h, targets) if targets is not None else None
            return ModelOutput(logits=None, nll=nll, state=new_cache)
        logits = self.out(h)
        nll = None
        if targets is not None:
            lg = logits if logits.dtype in (torch.float32, torch.float64) else logits.float()
            nll = F.cross_entropy(
                lg.reshape(-1, lg.shape[-1]), targets.reshape(-1), reduction="none"
            ).view(bsz, m)
        return ModelOutput(logits=logits, nll=nll, state=new_cache)


_ROLES = {"embed": "embeddings", "pos_table": "position table", "out": "output"}
"""Roles of the parameters outside the layers, by the attribute that holds them."""


def _layer_role(path: list[str]) -> str:
    """Role of a layer's parameter from its path below ``layers.<i>``."""
    sublayer, name = path[0], path[1]
    if name.startswith("persistent_"):
        return "persistent vectors"
    if sublayer == "attn":
        return "adaptive span" if name == "adaptive_span" else "attention matrices"
    return "feed-forward" if sublayer == "ff" else "layer norms"
