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
from typing import cast

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from pipeline.models.adaptive import AdaptiveInput, AdaptiveLogSoftmax
from pipeline.models.allattn.config import AllAttnConfig
from pipeline.models.allattn.layers import (
    AdaptiveSpan,
    AllAttnLayer,
    PersistentShareSum,
    attn_span_len,
    cache_len,
    planned_span_len,
)
from pipeline.models.allattn.span_planner import SpanPlanner
from pipeline.models.capabilities import (
    ActivationMemory,
    AttentionSpans,
    BoundedParameters,
    HeadReports,
    MemoryCounts,
    PlannedShapes,
    TrainingBackends,
    TrainingMetrics,
)
from pipeline.models.protocol import ModelOutput, SequenceModel, State, count_elements
from pipeline.ops import (
    AttendFn,
    backend_cannot_train_on,
    backends_that_train_on,
    describe_auto,
    get_attention_impl,
)
from pipeline.ops.memory import dtype_bytes
from pipeline.ops.triton_attention import RECOMPUTED_PRODUCTS

# --------------------------------------------------------------------------------------
# language model
# --------------------------------------------------------------------------------------


class AllAttnLM(
    SequenceModel,
    BoundedParameters,
    PlannedShapes,
    TrainingBackends,
    TrainingMetrics,
    HeadReports,
    MemoryCounts,
    AttentionSpans,
):
    """Embedding -> n_layers all-attention layers -> linear output over the vocabulary
    (or, with ``adaptive_io``, adaptive input -> layers -> tied adaptive softmax).

    Streams a text in blocks: its state is the Transformer-XL cache, one [B, C_l, d] tensor
    per layer holding that layer's input hidden states of the tokens before the block.

    ``activation_checkpointing = True``: in training, each layer's activations are recomputed
    in backward instead of stored (torch's RNG state is replayed, so dropout is identical).

    Planned span lengths (adaptive span, training): inside the trainer's
    ``planned_update()`` each layer's L' comes from ``span_planner``
    (pipeline.models.allattn.span_planner), planned from span fractions copied to the host
    after an earlier update, so that no training forward waits for the device; the model's
    planning hooks (``planned_update``, ``request_plan``, ``plan_state``,
    ``load_plan_state``) and its ``span_plan_overflows`` metric delegate to it. Forwards
    outside ``planned_update()`` (evaluation, sampling) read the current spans.

    ``compile_for_training()`` (train.compile) compiles each layer (regional compilation: the
    layers share the compiled code) for the planned forwards only: their L' are static ints
    from a few buckets, so a graph is compiled per bucket, with no graph break. Evaluation
    runs uncompiled.
    """

    def __init__(self, cfg: AllAttnConfig, vocab_size: int) -> None:
        super().__init__()
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        self.cfg = cfg
        self.vocab_size = vocab_size
        self.embed: nn.Module
        self.out: nn.Module
        if cfg.adaptive_io:
            # tied adaptive input / softmax (pipeline.models.adaptive): four bands for the
            # paper's cutoffs; ``out`` shares ``embed``'s band weights and projections
            self.embed = AdaptiveInput(
                vocab_size, cfg.d_model, cfg.adaptive_cutoffs, cfg.adaptive_div
            )
        else:
            self.embed = nn.Embedding(vocab_size, cfg.d_model)  # default init N(0, 1), as the code
        # One key-side relative position table shared by all heads and layers, N(0, 1);
        # column L - x holds u_x, the embedding of distance x in [1, L].
        self.pos_table = nn.Parameter(torch.randn(cfg.head_dim, cfg.max_span))
        # typed as what it holds: a ModuleList iterates as plain Modules
        self.layers: list[AllAttnLayer] = nn.ModuleList(  # type: ignore[assignment]
            AllAttnLayer(cfg) for _ in range(cfg.n_layers)
        )
        self.emb_dropout = nn.Dropout(cfg.emb_dropout)
        self.out_dropout = nn.Dropout(cfg.out_dropout)
        if cfg.adaptive_io:
            self.out = AdaptiveLogSoftmax(
                vocab_size,
                cfg.d_model,
                cfg.adaptive_cutoffs,
                cfg.adaptive_div,
                tie=cast(AdaptiveInput, self.embed) if cfg.adaptive_tied else None,  # adaptive_io
            )
        else:
            self.out = nn.Linear(cfg.d_model, vocab_size)
        self.set_attention_impl(cfg.attention.impl)
        self.span_planner = SpanPlanner(
            cfg.n_layers, cfg.max_span, cfg.span_ramp, adaptive=cfg.adaptive_span
        )
        self._compiled: list | None = None  # compile_for_training(): per layer
        self._graphs = False  # ... replayed as CUDA graphs

    # ---- spans -------------------------------------------------------------------------

    def _adaptive_spans(self) -> list[AdaptiveSpan]:
        """Each layer's AdaptiveSpan; every layer has one when cfg.adaptive_span."""
        return [
            layer.attn.adaptive_span
            for layer in self.layers
            if layer.attn.adaptive_span is not None
        ]

    def _span_fracs(self) -> list[list[float]] | None:
        if not self.cfg.adaptive_span:
            return None
        fracs = torch.stack([s.frac.detach() for s in self._adaptive_spans()])
        return fracs.cpu().tolist()  # one host sync for all layers

    def span_lens(self) -> list[int]:
        """L' per layer: how many previous tokens each layer attends to right now (inside
        ``planned_update()``: the planned ones)."""
        planned = self.span_planner.in_force()
        if planned is not None:
            return list(planned)
        fracs = self._span_fracs()
        if fracs is None:
            return [self.cfg.max_span] * self.cfg.n_layers
        return [attn_span_len(max(f), self.cfg.max_span, self.cfg.span_ramp) for f in fracs]

    def cache_lens(self) -> list[int]:
        """Hidden states each layer carries to the next block."""
        return [cache_len(s, self.cfg.max_span) for s in self.span_lens()]

    # ---- planned span lengths (the span planner's) ------------------------------------

    def _layer_max_fracs(self) -> Tensor:
        """[n_layers] each layer's largest span fraction, float32, on the device."""
        fracs = torch.stack([s.frac.detach() for s in self._adaptive_spans()])
        return fracs.float().amax(dim=1)

    @contextmanager
    def planned_update(self):
        with self.span_planner.update(self._layer_max_fracs, self.pos_table.device):
            if self._graphs:
                # a new update: the graphs' outputs of the last one may be overwritten now
                torch.compiler.cudagraph_mark_step_begin()
            yield

    def request_plan(self) -> None:
        self.span_planner.request(self._layer_max_fracs)

    def plan_state(self) -> dict | None:
        return self.span_planner.state()

    def load_plan_state(self, state: dict | None) -> None:
        self.span_planner.load_state(state, self.pos_table.device)

    # ---- torch.compile -----------------------------------------------------------------

    def compile_for_training(self, backend: str = "inductor", graphs: bool = False) -> bool:
        """Compile each layer for the planned (training) forwards: regional compilation (the
        layers share one compiled code), L' a static int per span bucket (``dynamic=False``).
        Without adaptive span L' is max_span: one graph. ``graphs``: torch.compile's
        reduce-overhead mode, each layer's forward and backward captured as CUDA graphs
        (one per bucket and batch shape) and replayed without launches from Python."""
        import torch._dynamo
        import torch._inductor.config

        # a graph per bucket (~2 per doubling of the span), per mode and batch shape
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        # random ops inside the graphs (the dropout seed, the FF sublayers' dropout) draw from
        # torch's generator as eager does, not inductor's own: compiled training makes the
        # eager run's dropout draws, so it resumes and compares like it
        torch._inductor.config.fallback_random = True
        options: dict = {"mode": "reduce-overhead"} if graphs else {}
        self._compiled = [
            torch.compile(layer, backend=backend, dynamic=False, **options) for layer in self.layers
        ]
        self._graphs = graphs
        return True

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
        total = cast(Tensor, sum(s.span().mean() for s in self._adaptive_spans()))  # n_layers >= 1
        return self.cfg.span_loss_coef * total

    def bounded_parameters(self) -> list[tuple[nn.Parameter, float, float]]:
        """The span fractions, in [0, 1]."""
        if not self.cfg.adaptive_span:
            return []
        return [(s.frac, 0.0, 1.0) for s in self._adaptive_spans()]

    def train_flops_per_token(self) -> float:
        """Training FLOPs per token at the L' in force, from host values only (the planned
        L', or max_span with fixed spans or before the first plan; never the device's span
        fractions): 6 per weight outside the embeddings and the position table, and per
        layer 6 x 3 x d_ctx x L' for the products q.k, q.u and a.v with the L' context
        columns (d_ctx = d_model, half of it with head_split's context heads). The persistent
        vectors count as weights: each element is one multiply-add per token in q.M_k or
        a.M_v, which makes 6 x 2 x d x N per layer for the paper's N vectors per head.
        Not counted: the K / V projections of the cached rows, recomputed every block (the
        authors' code does the same; a model that kept them would not)."""
        skip = {id(p) for p in self.embed.parameters()} | {id(self.pos_table)}
        weights = count_elements(p for p in self.parameters() if id(p) not in skip)
        spans = self.span_planner.planned or [self.cfg.max_span] * len(self.layers)
        attn = sum(
            6 * 3 * layer.attn.n_ctx_heads * layer.attn.head_dim * span
            for layer, span in zip(self.layers, spans, strict=True)
        )
        return 6.0 * weights + attn

    def train_hardware_flops_per_token(self, block_len: int) -> float:
        """``train_flops_per_token()`` plus, per layer, at the L' in force:

        - the K and V projections of the L' cached rows, made again for every block of
          ``block_len`` tokens: 6 per multiply-add (autograd computes their input's gradient
          too, then drops it), 8 with activation checkpointing: 2 x d^2 x L' / block_len
          multiply-adds a token;
        - with ``attention.impl: triton``, what its backward recomputes rather than stores
          (``RECOMPUTED_PRODUCTS``, 2 FLOPs a multiply-add): products of d_ctx x L' and, in
          the joint op, of d x N;
        - with activation checkpointing, the forward again (SequenceModel's third)."""
        flops = super().train_hardware_flops_per_token(block_len)
        spans = self.span_planner.planned or [self.cfg.max_span] * len(self.layers)
        per_mac = 8 if self.activation_checkpointing else 6
        d = self.cfg.d_model
        for layer, span in zip(self.layers, spans, strict=True):
            attn = layer.attn
            flops += per_mac * 2 * d * d * span / block_len
            if self.attention_impl == "triton":
                flops += 2 * RECOMPUTED_PRODUCTS["window"] * attn.n_ctx_heads * attn.head_dim * span
                if attn.mode == "all_attn":
                    pers = RECOMPUTED_PRODUCTS["persistent"] * attn.head_dim * attn.n_persistent
                    flops += 2 * pers * attn.n_heads
        return flops

    def hold_shapes_at(self, fraction: float | None) -> str:
        """Every layer's L' planned as the trainer plans it from span fraction ``fraction``
        (None: span_init, where training starts), for the estimate's counts; max_span with
        fixed spans."""
        planner = self.span_planner
        span = self.cfg.max_span
        if planner.adaptive:
            frac = self.cfg.span_init if fraction is None else fraction
            span = planned_span_len(frac, self.cfg.max_span, self.cfg.span_ramp)
        planner.planned = [span] * self.cfg.n_layers
        return f"L' {span}"

    # ---- attention spans (pipeline.models.capabilities.AttentionSpans) ------------------

    def spans_grow(self) -> bool:
        return self.cfg.adaptive_span

    def train_flops_per_token_at(self, fraction: float) -> tuple[float, str]:
        kept = self.span_planner.planned
        try:
            held = self.hold_shapes_at(fraction)
            return self.train_flops_per_token(), held
        finally:
            self.span_planner.planned = kept

    def describe_spans(self) -> str:
        return f"L' up to {max(self.span_lens())}"

    def activation_memory(
        self,
        rows: int,
        block_len: int,
        dtype: torch.dtype,
        device_type: str,
        uniform_tokens: bool = False,
    ) -> ActivationMemory:
        """Counted at the L' in force (``hold_shapes_at``; max_span before any plan): each
        layer's (``AllAttnLayer.activation_memory``, the attention backend's part from
        pipeline.ops.memory), the embedding and output dropouts' masks, the output layer's
        input, its float32 log-softmax [tokens, V] and the logits, which the caller holds
        through the backward (or the adaptive softmax's bands), and
        the cache: L' + 64 hidden states a layer (``cache_len``) a row."""
        e = dtype_bytes(dtype)
        tokens, d = rows * block_len, self.cfg.d_model
        spans = self.span_planner.planned or [self.cfg.max_span] * len(self.layers)
        counts = [
            layer.activation_memory(rows, block_len, span, dtype, device_type, self.attention_impl)
            for layer, span in zip(self.layers, spans, strict=True)
        ]
        mask = 1 if device_type == "cuda" else e  # torch's dropout mask (bool on a GPU)
        saved = sum(c.saved for c in counts) + e * tokens * d  # the output layer's input
        saved += mask * tokens * d * ((self.cfg.emb_dropout > 0) + (self.cfg.out_dropout > 0))
        if self.cfg.adaptive_io:
            out_saved, out_working = cast(AdaptiveLogSoftmax, self.out).activation_memory(
                tokens, dtype, uniform_tokens
            )
        else:
            # the float32 log-softmax, and the logits the caller holds (ModelOutput)
            out_saved = (4 + e) * tokens * self.vocab_size
            out_working = (4 + e) * tokens * self.vocab_size
        state = sum(rows * cache_len(span, self.cfg.max_span) * d * e for span in spans)
        return ActivationMemory(
            saved + out_saved, max([out_working, *(c.working for c in counts)]), state
        )

    def describe(self) -> str:
        """The attention backend; for ``auto``, what it picks on the model's current device
        and dtype (call after moving the model)."""
        compiled = ", layers compiled for training (torch.compile)" if self._compiled else ""
        if self._graphs:
            compiled = ", layers compiled for training and replayed as CUDA graphs"
        if self.attention_impl != "auto":
            return f"attention impl {self.attention_impl}{compiled}"
        return (
            describe_auto(self.pos_table.device.type, self.pos_table.dtype, self.cfg.attn_dropout)
            + compiled
        )

    def cannot_train_on(self, device: torch.device) -> str | None:
        why = backend_cannot_train_on(self.attention_impl, device.type)
        if why is None:
            return None
        where = "the CPU" if device.type == "cpu" else device.type
        return (
            f"model.attention.impl: {why} and this run trains on {where}: use "
            f"{backends_that_train_on(device.type)}"
        )

    def metrics(self) -> dict[str, float]:
        """Mean and largest span over all heads, in tokens."""
        spans = [z for row in self.spans() for z in row]
        if not spans:
            return {}
        return {"span_mean": sum(spans) / len(spans), "span_max": max(spans)}

    def metric_tensors(self) -> dict[str, Tensor]:
        """``metrics()`` on the device, and with adaptive span ``span_plan_overflows``: the
        planned forwards so far whose plan was too short (see the class doc)."""
        if not self.cfg.adaptive_span:
            return super().metric_tensors()
        spans = (
            torch.cat([s.frac.detach().double() for s in self._adaptive_spans()])
            * self.cfg.max_span
        )
        return {"span_mean": spans.mean(), "span_max": spans.max()} | (
            self.span_planner.metric_tensors()
        )

    def metric_warnings(self, values: dict[str, float]) -> list[str]:
        return self.span_planner.overflow_warnings(values)

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
        for layer, s in zip(self.layers, sums, strict=False):
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
        planned = self.span_planner.in_force() is not None
        span_lens = self.span_lens()  # fixed for the whole block (planned, or read now)
        if planned:
            self.span_planner.count_overflow(self._layer_max_fracs)
        layers = self._compiled if planned and self._compiled is not None else self.layers
        h = self.emb_dropout(self.embed(tokens))
        new_cache: list[Tensor] = []
        for layer, past, span_len in zip(layers, cache, span_lens, strict=False):
            keep = cache_len(span_len, self.cfg.max_span)  # = max_span for a fixed span
            past = past.to(h.dtype)
            if keep > m:
                nxt = torch.cat([past[:, max(0, past.shape[1] - (keep - m)) :], h], dim=1)
            else:
                nxt = h[:, m - keep :]
            # a graph's output is overwritten when the graph replays: the state kept for the
            # next block must not be a view of one
            new_cache.append(nxt.detach().clone() if self._graphs and keep <= m else nxt.detach())
            # the last L' cached rows (zero rows in front if fewer): [B, L', d]
            c = past.shape[1]
            if c >= span_len:
                past = past[:, c - span_len :]
                if layers is self._compiled:  # compiled code is specialised to strides too
                    past = past.contiguous()
            else:
                past = F.pad(past, (0, 0, span_len - c, 0))
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
