"""The `nan` part of `make gpu-check` (issue 43, item 3): why the fast path (attention impl
triton, bf16, CUDA graphs) stopped on a non-finite loss or gradient at update 11 of the
learning check, found in one call. Three sections, each markdown, then one line `cause: ...`.

    .venv/bin/python -m gpu.nan_check [--budget 115] [--updates 25] [--graph-updates 15]
        [--dry-run]

**(a) every tile against the reference.** At the learning check's shapes (enwik8_small's
model as the spec builds it, at gpu/learning_check.py's batch x seq_len; L' of the first
update's plan), each tile of `TILES` forced (`forced_tile`) in bf16: the output and the
seven gradients of `attend_triton` (q, k, v, pos, persistent_k, persistent_v, and the
spans through the span mask) against `attend_reference` in float64 on the same inputs
(rounded to bf16 first), dropout 0 (the two draw different masks): max |error| over the
reference's largest entry (absolute where that is below 1), or NaN / inf. The
cases: spans spread over L'; z = 0 (initialisation); z = 0 with one key 25, 50 and 100 nats
above the rest at the ramp's edge (distance R + 1: the mask exactly 0, its gradient still
flowing); the window fully masked (z = -R) with N = 0 and with N > 0.

**(b) training in plain torch.** The same model trained --updates updates as the trainer
does under DeepSpeed bf16, but by hand: bf16 weights, float32 masters the config's
optimizer steps (its clip included), the span fractions float32 in the model
(`AdaptiveSpan`) and clamped on the masters (`bounded_parameters()`), L' planned as the
trainer plans it (`planned_update` / `request_plan`), the config's dropout; no DeepSpeed, no
CUDA graphs. Once with attention impl triton, once with reference, from the same weights and
batches (the built-in corpus, as the learning check). Per update: the loss, the spans, L',
the largest |grad| per kind of parameter; the first non-finite value and its kind.

**(c) CUDA-graph recordings.** In a child process (so that its compile is cut at the budget
without losing the rest): the triton run with the layers compiled as `train.compile: graphs`
compiles them (`compile_for_training(graphs=True)`), --graph-updates updates with the span
fractions copied into the model in place, then half as many re-pointing them at a new buffer
twice an update, as `Float32Masters.copy_to_params` did when issue 43 was filed. Per update:
the graphs recorded (torch's cudagraph trees' `record_function` calls) and dynamo's compiles.
The rule: at most one update records graphs per span plan (the layers' L' buckets); the
others replay.

**The cause** (`cause`), in this order, every one that holds:

1. a tile: in (a), some tile gives a non-finite value or an error over the tolerance on a
   case where another tile is within it;
2. the kernel against the reference: in (b), the triton run turns non-finite and the
   reference run does not, or a kind of gradient of the triton run is 100x the reference's
   at the same update;
3. the graphs: in (c), the rule broken, or a non-finite value in graphs where (b)'s triton
   run stayed finite;

and with them the cases (a) finds wrong at every tile. When none holds: both (b) runs
non-finite (bf16 training itself, either op), else the cases (a) finds wrong at every tile
(the kernel's maths, not reached by (b)'s updates), else "not reproduced": what is left is
DeepSpeed's engine, which (b) does by hand.

Without CUDA, or with --dry-run: the same code at the package's smoke shrink of the model
(`load_spec(..., smoke=True)`) made smaller still (1 x 16 tokens, d 32, max span 32: the
interpreter takes seconds a call), in float32 (Triton's interpreter has no bfloat16) on random
tokens, 3 updates in (b) and 2 in (c), which runs eagerly (no graphs without CUDA): a test
proves it runs end to end (tests/system/cluster/test_gpu_nan.py). Exit status 0 once the report is
printed, whatever it finds.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

import pipeline.ops  # noqa: F401  (first: without CUDA it turns Triton's interpreter on)
from gpu import check as gpu_check
from gpu import learning_check
from pipeline.data.corpus import python_docs
from pipeline.data.stream import StreamBatches
from pipeline.data.vocab import Vocab
from pipeline.models.allattn.layers import AllAttention, planned_span_len
from pipeline.ops import adaptive_span_mask, get_attention_impl
from pipeline.ops.triton_attention import TILES, forced_tile, tiles_in_use
from pipeline.spec import load_spec
from pipeline.training.optim import build_optimizer
from pipeline.training.tasks import objective
from stages import STAGES

ROOT = Path(__file__).resolve().parent.parent
IMPLS = ("triton", "reference")
QUANTITIES = ("out", "q", "k", "v", "pos", "persistent_k", "persistent_v", "spans")
# the CUDA tests' bound for bf16 (the kernels measured within 0.0077 there); float32: the
# interpreter tests' with the reference's +1e-8 left in, as here
TOLERANCE = {torch.bfloat16: 3e-2, torch.float32: 5e-5}
GAPS = (25, 50, 100)  # nats; the kernel's masked keys carry -69 (log 1e-30)
HUGE = 100.0  # a gradient this many times the reference's points at the kernel
KINDS = (  # the columns of (b)'s table, in this order; other kinds follow
    "attention projections",
    "persistent vectors",
    "span fractions",
    "position table",
    "embeddings",
    "output layer",
    "layer norms",
)
MODULE_KINDS = {
    nn.Embedding: "embeddings",
    nn.LayerNorm: "layer norms",
    nn.Linear: "output layer",  # the Linear layers outside attention (attention's: below)
    AllAttention: "persistent vectors",  # the attention module's own tensors
}
RESULT = "graphs result: "  # the child's last line, JSON after it


def tile_name(tile: dict) -> str:
    extra = [
        f"{tile[k]} {k.removeprefix('num_')}" for k in ("num_warps", "num_stages") if k in tile
    ]
    return ", ".join([f"T {tile['T']}", *extra])


def number(x: float) -> str:
    if math.isnan(x):
        return "NaN"
    return "inf" if math.isinf(x) else f"{x:.2g}" if abs(x) < 1e4 else f"{x:.1e}"


# ---------------------------------------------------------------- the spec and the data


def learning_spec(impl: str, tiny: bool):
    """enwik8_small as gpu/learning_check.py trains it (its batch, seq_len, warm-up and seed
    A), attention impl ``impl``; tiny: the package's smoke shrink of it."""
    check = learning_check.parse_args([])
    sets = [f"model.attention.impl={impl}", f"train.seed={check.seeds[0]}"]
    if tiny:  # smaller still: Triton's interpreter takes seconds a call
        sets += ["train.batch_size=1", "train.seq_len=16", "model.max_span=32", "model.d_model=32"]
    else:
        sets += [
            f"train.batch_size={check.batch}",
            f"train.micro_batch_size={check.batch}",
            f"train.seq_len={check.seq_len}",
            f"train.optimizer.warmup_steps={check.warmup}",
        ]
    return load_spec(ROOT / check.config, sets, smoke=tiny)


def training_tokens(spec, tiny: bool) -> tuple[np.ndarray, int]:
    """(token ids, vocabulary size): the built-in corpus as bytes, as the learning check
    reads it; tiny: random tokens (the corpus takes ~8 s to assemble)."""
    if tiny:
        rng = np.random.default_rng(spec.train.seed)
        return rng.integers(0, 64, 64 * spec.train.batch_size * spec.train.seq_len), 64
    text = python_docs()
    vocab = Vocab.build("byte", text)
    return vocab.encode(text).astype(np.int64), len(vocab)


# ---------------------------------------------------------------- (a) each tile


@dataclass(frozen=True)
class Shapes:
    """The op's shapes in the learning check's first updates."""

    batch: int
    heads: int
    head_dim: int
    persistent: int
    span_len: int  # L' of the first update's plan
    block: int  # M: train.seq_len
    ramp: int

    @classmethod
    def of(cls, spec) -> Shapes:
        model = spec.model_params
        span_len = planned_span_len(model.span_init, model.max_span, model.span_ramp)
        return cls(
            spec.train.batch_size,
            model.n_heads,
            model.head_dim,
            model.n_persistent,
            span_len,
            spec.train.seq_len,
            model.span_ramp,
        )


@dataclass
class Case:
    name: str
    inputs: list  # q, k, v, pos, persistent_k, persistent_v (None for N = 0), float64
    spans: torch.Tensor  # z per head, in tokens, float64


def tile_cases(s: Shapes, dtype: torch.dtype) -> list[Case]:
    """(a)'s cases, their inputs rounded to ``dtype`` (the reference then sees exactly what
    the kernel sees)."""
    g = torch.Generator().manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    b, h, m, ell, d, n = s.batch, s.heads, s.block, s.span_len, s.head_dim, s.persistent
    inputs = [randn(b, h, m, d), randn(b, h, ell + m, d), randn(b, h, ell + m, d)]
    inputs += [randn(d, ell), randn(h, n, d), randn(h, n, d)]
    zero = torch.zeros(h, dtype=torch.float64)
    masked = torch.full((h,), -float(s.ramp), dtype=torch.float64)  # m = 0 everywhere
    cases = [
        Case("spans spread over L'", inputs, torch.linspace(0.5, ell - 0.5, h).double()),
        Case("z = 0 (initialisation)", inputs, zero),
        *(gap_case(gap, inputs, s, g) for gap in GAPS),
        Case("window masked, N = 0", [*inputs[:4], None, None], masked),
        Case("window masked, N > 0", inputs, masked),
    ]
    for case in cases:
        case.inputs = [None if x is None else x.to(dtype).double() for x in case.inputs]
        case.spans = case.spans.float().double()  # the model's spans are float32
    return cases


def gap_case(gap: int, inputs: list, s: Shapes, g: torch.Generator) -> Case:
    """z = 0, and for every query one key ``gap`` nats above the rest: the key at distance
    R + 1, the ramp's edge, through its position term; the other scores near 0."""
    q, k, v, pos, pk, pv = inputs
    q0 = torch.randn(s.head_dim, generator=g, dtype=torch.float64)
    pos = 0.1 * pos
    pos[:, s.span_len - s.ramp - 1] = gap * math.sqrt(s.head_dim) * q0 / q0.dot(q0)
    spans = torch.zeros(s.heads, dtype=torch.float64)
    name = f"z = 0, one key {gap} nats above the rest at the ramp's edge"
    return Case(name, [q0 + 0.1 * q, 0.1 * k, v, pos, 0.1 * pk, pv], spans)


def op_and_grads(fn, case: Case, device, dtype, ramp: int) -> list:
    """[out, then the gradients of sum(out * w) for a fixed random w (rounded to ``dtype``)
    with respect to q, k, v, pos, persistent_k, persistent_v and the spans]."""
    leaves = [
        None if x is None else x.to(device, dtype, copy=True).requires_grad_() for x in case.inputs
    ]
    span_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    spans = case.spans.to(device, span_dtype, copy=True).requires_grad_()
    q, k, v, pos, pk, pv = leaves
    mask = adaptive_span_mask(spans, ramp, case.inputs[3].shape[1])
    out = fn(q, k, v, pos, persistent_k=pk, persistent_v=pv, span_mask=mask)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    (out.double() * w.to(dtype).double().to(device)).sum().backward()
    return [out.detach()] + [None if x is None else x.grad for x in [*leaves, spans]]


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| over want's largest |entry|, or over 1 where that is smaller (as the
    kernel tests measure: an output of 1e-33, a masked row's, is 0 to any use, and the GPU's
    exp flushes such values to 0); NaN or inf where got has such a value."""
    got = got.double().to(want.device)
    if not torch.isfinite(got).all():
        return math.nan if got.isnan().any() else math.inf
    return (got - want).abs().max().item() / max(1.0, want.abs().max().item())


@dataclass
class TileResults:
    tiles: list[dict]
    tolerance: float
    cases: list[str] = field(default_factory=list)
    errors: dict = field(default_factory=dict)  # (case, tile index) -> {quantity: error}
    failed: dict = field(default_factory=dict)  # (case, tile index) -> why it did not run
    unrun: list[str] = field(default_factory=list)  # cases the budget did not reach

    def bad(self, case: str, i: int) -> list[str]:
        """The quantities tile i got wrong on ``case`` (all, where it did not run)."""
        if (case, i) in self.failed:
            return list(QUANTITIES)
        errors = self.errors.get((case, i), {})
        return [q for q, e in errors.items() if not e <= self.tolerance]  # NaN too

    def tile_specific(self) -> list[tuple[int, str, list[str]]]:
        """(tile index, case, quantities) wherever a tile is wrong and another right."""
        found = []
        for case in self.cases:
            wrong = {i: self.bad(case, i) for i in range(len(self.tiles))}
            if any(not q for q in wrong.values()):
                found += [(i, case, q) for i, q in wrong.items() if q]
        return found

    def every_tile(self) -> dict[str, list[str]]:
        """case -> the quantities every tile gets wrong."""
        found = {}
        for case in self.cases:
            common = set(QUANTITIES)
            for i in range(len(self.tiles)):
                common &= set(self.bad(case, i))
            if common:
                found[case] = [q for q in QUANTITIES if q in common]
        return found


def compare_tiles(shapes: Shapes, device, dtype, deadline: float) -> TileResults:
    """(a): every case at every tile of TILES, against the reference in float64."""
    triton, reference = get_attention_impl("triton"), get_attention_impl("reference")
    results = TileResults(list(TILES), TOLERANCE[dtype])
    for case in tile_cases(shapes, dtype):
        if time.monotonic() > deadline:
            results.unrun.append(case.name)
            continue
        results.cases.append(case.name)
        want = op_and_grads(reference, case, device, torch.float64, shapes.ramp)
        for i, tile in enumerate(TILES):
            try:
                with forced_tile(tile):
                    got = op_and_grads(triton, case, device, dtype, shapes.ramp)
            except Exception as error:  # a tile that does not fit or crashes is a finding
                said = " ".join(str(error).split()).replace("|", "/")  # one table cell
                results.failed[(case.name, i)] = f"{type(error).__name__}: {said}"[:160]
                continue
            results.errors[(case.name, i)] = {
                q: relative_error(a, b)
                for q, a, b in zip(QUANTITIES, got, want, strict=True)
                if b is not None
            }
    return results


def tile_report(r: TileResults) -> str:
    head = "| case | tile | " + " | ".join(QUANTITIES) + " |"
    lines = [head, "|---|---|" + "---:|" * len(QUANTITIES)]
    for case in r.cases:
        for i, tile in enumerate(r.tiles):
            if (case, i) in r.failed:
                lines.append(f"| {case} | {tile_name(tile)} | {r.failed[(case, i)]} |")
                continue
            errors = r.errors[(case, i)]
            cells = [
                "-"
                if q not in errors
                else number(errors[q])
                if errors[q] <= r.tolerance
                else f"**{number(errors[q])}**"
                for q in QUANTITIES
            ]
            lines.append(f"| {case} | {tile_name(tile)} | " + " | ".join(cells) + " |")
    notes = [
        f"max |error| over the reference's largest |entry| (over 1 where that is smaller); "
        f"**bold**: over {r.tolerance:g} or not finite; -: no such input"
    ]
    if r.unrun:
        notes.append(f"not run (the part's budget was spent): {'; '.join(r.unrun)}")
    return "\n".join(lines) + "\n\n" + "\n".join(notes)


# ---------------------------------------------------------------- (b) training by hand


def parameter_kinds(model: nn.Module) -> dict[str, list[nn.Parameter]]:
    """The trainable parameters by kind: the span fractions from the model's
    `bounded_parameters()`, the others by the module that holds them (MODULE_KINDS; the
    Linear layers inside an attention module are its projections, the model's own tensor its
    position table)."""
    bounded = {id(p) for p, _, _ in model.bounded_parameters()}  # type: ignore[operator]
    projections = {
        id(p)
        for attention in model.modules()
        if isinstance(attention, AllAttention)
        for layer in attention.children()
        if isinstance(layer, nn.Linear)
        for p in layer.parameters()
    }
    kinds: dict[str, list[nn.Parameter]] = {}
    seen: set[int] = set()
    for module in model.modules():
        for p in module.parameters(recurse=False):
            if id(p) in seen or not p.requires_grad:
                continue
            seen.add(id(p))
            kind = (
                "span fractions"
                if id(p) in bounded
                else "attention projections"
                if id(p) in projections
                else "position table"
                if module is model
                else MODULE_KINDS.get(type(module), type(module).__name__)
            )
            kinds.setdefault(kind, []).append(p)
    order = {kind: i for i, kind in enumerate(KINDS)}
    return dict(sorted(kinds.items(), key=lambda item: order.get(item[0], len(order))))


def largest(tensors: Iterable[torch.Tensor | None]) -> float:
    """The largest |entry| of the tensors (NaN if one has a NaN); 0 where there are none."""
    peaks = [t.detach().abs().amax().float() for t in tensors if t is not None]
    return torch.stack(peaks).amax().item() if peaks else 0.0


@dataclass
class Update:
    """What (b) and (c) print of one update."""

    update: int
    lr: float
    loss: float
    span_lens: list[int]  # L' per layer, as planned for this update
    grads: dict[str, float]  # kind -> largest |grad|
    spans: list[list[float]] = field(default_factory=list)  # per layer, z after the step


class HandTraining:
    """One model trained as the trainer trains it under DeepSpeed bf16, by hand: ``dtype``
    weights; float32 masters stepped by the config's optimizer (ClippedAdagrad clips per
    tensor inside its step, clip: global is applied here before it); the bounded parameters
    (span fractions, float32 in the model) clamped on the masters; the masters copied into
    the model before each update and after each step, where Float32Masters.copy_to_params
    runs: in place, or with ``move_spans`` the span fractions re-pointed at a new buffer each
    time, as copy_to_params did when issue 43 was filed. L' planned as the trainer plans it."""

    def __init__(self, spec, tokens: np.ndarray, vocab: int, device, dtype) -> None:
        train = spec.train
        torch.manual_seed(train.seed)  # the same initial weights for every attention impl
        self.model = spec.build_model(vocab, "gpu.nan_check").to(device, dtype)
        self.model.train()
        self.kinds = parameter_kinds(self.model)
        self.params = [p for ps in self.kinds.values() for p in ps]
        self.masters = [p.detach().float().clone().requires_grad_() for p in self.params]
        self.optimizer = build_optimizer(self.masters, train.optimizer)
        bounds = {id(p): (low, high) for p, low, high in self.model.bounded_parameters()}
        self.bounded = [  # (master, low, high): clamped after every step
            (m, *bounds[id(p)])
            for p, m in zip(self.params, self.masters, strict=True)
            if id(p) in bounds
        ]
        self.batches = StreamBatches(tokens, train.batch_size, train.seq_len, seed=train.seed)
        self.state = self.model.init_state(train.batch_size, device=device)
        self.spec, self.device, self.move_spans, self.done = spec, device, False, 0
        self.lr_at = STAGES["train"].plan(spec).lr  # the run's schedule, as its trainer sets it

    @torch.no_grad()
    def copy_to_params(self) -> None:
        moving = {id(m) for m, _, _ in self.bounded} if self.move_spans else set()
        for p, master in zip(self.params, self.masters, strict=True):
            if id(master) in moving:
                p.data = master.detach().clone()  # a new address, as copy_to_params' new buffer
            else:
                p.copy_(master)

    def update(self) -> Update:
        """One update: forward, backward, and, if everything came out finite, the step."""
        model = self.model
        k = self.done = self.done + 1
        lr = self.lr_at(k)
        x, y = (t.to(self.device) for t in self.batches.batch(k - 1))
        self.copy_to_params()
        with model.planned_update():
            out = model(x, y, self.state)
            nll, minimised = objective(out.nll, model.aux_loss())  # the trainer's
            minimised.backward()
            span_lens = list(model.span_lens())
        self.state = out.state
        grads = {kind: largest(p.grad for p in ps) for kind, ps in self.kinds.items()}
        row = Update(k, lr, nll.item(), span_lens, grads)
        if all(math.isfinite(value) for value in (row.loss, *grads.values())):
            self.step(lr)
            row.spans = model.spans()
        return row

    def step(self, lr: float) -> None:
        opt = self.spec.train.optimizer
        for p, master in zip(self.params, self.masters, strict=True):
            master.grad = None if p.grad is None else p.grad.float()
            p.grad = None
        if opt.clip == "global":
            torch.nn.utils.clip_grad_norm_(self.masters, opt.clip_norm)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        with torch.no_grad():
            for master, low, high in self.bounded:
                master.clamp_(low, high)
        self.copy_to_params()
        self.model.after_step()
        self.model.request_plan()

    def nonfinite_weights(self) -> list[str]:
        """The kinds whose masters hold a non-finite value."""
        masters = dict(zip(map(id, self.params), self.masters, strict=True))
        return [
            kind
            for kind, ps in self.kinds.items()
            if not math.isfinite(largest(masters[id(p)] for p in ps))
        ]


@dataclass
class Run:
    """One of (b)'s trainings."""

    impl: str
    updates: list[Update] = field(default_factory=list)
    nonfinite: str | None = None  # "update 11: the gradient of the span fractions"
    error: str | None = None  # it crashed
    stopped: str | None = None  # the budget ran out first
    tiles: str = ""

    def failed(self) -> bool:
        return self.nonfinite is not None or self.error is not None


def first_nonfinite(row: Update, loop: HandTraining) -> str | None:
    """What of ``row`` is not finite, in the order the trainer's guard would meet it."""
    if not math.isfinite(row.loss):
        return "the loss"
    bad = [kind for kind, g in row.grads.items() if not math.isfinite(g)]
    if bad:
        return f"the gradient of the {', '.join(bad)}"
    bad = loop.nonfinite_weights()
    return f"the {', '.join(bad)} after the step" if bad else None


def tiles_used() -> str:
    kept = {key[0]: tile_name(tile) for key, tile in tiles_in_use().items()}
    if not kept:
        return "the interpreter's tile (T 16)"
    return "; ".join(f"{kernel}: {tile}" for kernel, tile in kept.items())


def train_by_hand(spec, tokens, vocab: int, device, dtype, updates: int, deadline: float) -> Run:
    """(b): one run of ``updates`` updates, stopped at the first non-finite value."""
    run = Run(spec.model_params.attention.impl)
    try:
        loop = HandTraining(spec, tokens, vocab, device, dtype)
        for _ in range(updates):
            if time.monotonic() > deadline:
                run.stopped = f"stopped after update {loop.done}: the part's budget was spent"
                break
            row = loop.update()
            run.updates.append(row)
            why = first_nonfinite(row, loop)
            if why is not None:
                run.nonfinite = f"update {row.update}: {why}"
                break
    except Exception as error:  # reported, and the other run still runs
        run.error = f"{type(error).__name__}: {error}"[:400]
    if run.impl == "triton":
        run.tiles = tiles_used()
    return run


def span_text(spans: list[float]) -> str:
    if not spans:
        return "-"
    return f"{min(spans):.3g} / {sum(spans) / len(spans):.3g} / {max(spans):.3g}"


def run_report(run: Run, kinds: list[str]) -> str:
    """(b)'s table for one run, its spans per layer, and what stopped it."""
    head = "| update | lr | loss | span min / mean / max | L' | " + " | ".join(kinds) + " |"
    lines = [f"#### attention impl {run.impl}", "", head, "|" + "---:|" * (5 + len(kinds))]
    for u in run.updates:
        lens = sorted(set(u.span_lens))
        cells = [
            str(u.update),
            f"{u.lr:.3g}",
            number(u.loss),
            span_text([z for layer in u.spans for z in layer]),
            str(lens[0]) if len(lens) == 1 else f"{lens[0]}-{lens[-1]}",
            *(number(u.grads.get(kind, math.nan)) for kind in kinds),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", layer_spans(run)]
    if run.tiles:
        lines.append(f"tiles in use: {run.tiles}")
    for label, text in (("first non-finite", run.nonfinite), ("crashed", run.error)):
        if text:
            lines.append(f"**{label}: {text}**")
    if run.stopped:
        lines.append(run.stopped)
    if not run.failed():
        lines.append(f"finite through update {len(run.updates)}")
    return "\n".join(lines) + "\n"


def layer_spans(run: Run) -> str:
    """Each layer's span min / mean / max (tokens) after every 5th update and the last."""
    stepped = [u for u in run.updates if u.spans]
    shown = [u for u in stepped if u.update % 5 == 0 or u is stepped[-1]] if stepped else []
    if not shown:
        return "(no update stepped)"
    lines = [
        "| layer | " + " | ".join(f"after update {u.update}" for u in shown) + " |",
        "|---:|" + "---|" * len(shown),
    ]
    for layer in range(len(shown[0].spans)):
        lines.append(f"| {layer} | " + " | ".join(span_text(u.spans[layer]) for u in shown) + " |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- (c) CUDA graphs


@contextlib.contextmanager
def counting_recordings():
    """Counts CUDA graphs recorded by torch's cudagraph trees (reduce-overhead mode): every
    call of the tree manager's `record_function`, first recordings and re-recordings alike.
    Yields a one-element list holding the count."""
    from torch._inductor import cudagraph_trees

    manager = cudagraph_trees.CUDAGraphTreeManager
    record = manager.record_function
    count = [0]

    def counted(self, *args, **kwargs):
        count[0] += 1
        return record(self, *args, **kwargs)

    manager.record_function = counted  # type: ignore[method-assign]
    try:
        yield count
    finally:
        manager.record_function = record  # type: ignore[method-assign]


def dynamo_count(group: str, name: str) -> int:
    from torch._dynamo.utils import counters

    return int(counters[group][name])


def graph_variant(loop: HandTraining, updates: int, recorded: list, deadline: float) -> dict:
    """``updates`` updates of ``loop``, counting per update the graphs recorded and dynamo's
    compiles; prints its table; returns its verdict under the rule."""
    loop.state = loop.model.init_state(loop.spec.train.batch_size, device=loop.device)
    print(
        "| update | L' plan | graphs recorded | dynamo compiles | loss |\n|---:|---|---:|---:|---:|"
    )
    updates_by_plan: dict[str, int] = {}
    rows, nonfinite = 0, None
    for _ in range(updates):
        if time.monotonic() > deadline:
            print(f"\nstopped after {rows} updates: the part's budget was spent")
            break
        before = recorded[0], dynamo_count("stats", "unique_graphs")
        row = loop.update()
        graphs = recorded[0] - before[0]
        compiles = dynamo_count("stats", "unique_graphs") - before[1]
        lens = sorted(set(row.span_lens))
        plan = str(lens[0]) if len(lens) == 1 else ",".join(map(str, row.span_lens))
        print(f"| {row.update} | {plan} | {graphs} | {compiles} | {number(row.loss)} |", flush=True)
        rows += 1
        updates_by_plan[plan] = updates_by_plan.get(plan, 0) + (graphs > 0)
        if first_nonfinite(row, loop) is not None:
            nonfinite = row.update
            break
    return {
        "held": all(n <= 1 for n in updates_by_plan.values()),
        "updates": rows,
        "updates_recording": sum(updates_by_plan.values()),
        "plans": len(updates_by_plan),
        "nonfinite": nonfinite,
    }


def graphs_child(args, tiny: bool, device, dtype, deadline: float) -> int:
    """(c), run as its own process: prints its tables, then RESULT and the verdicts as JSON."""
    spec = learning_spec("triton", tiny)
    loop = HandTraining(spec, np.load(args.tokens), args.vocab, device, dtype)
    measured = device.type == "cuda"
    if measured:
        loop.model.compile_for_training(graphs=True)
    else:
        print("no CUDA here: the updates run eagerly and record nothing; the counting runs\n")
    variants = {}
    with counting_recordings() as recorded:
        for name, move, updates in (
            ("copied in place", False, args.graph_updates),
            (
                "re-pointed twice an update (Float32Masters before issue 43's fix)",
                True,
                max(1, args.graph_updates // 2),
            ),
        ):
            print(f"#### the span fractions {name}\n", flush=True)
            loop.move_spans = move
            v = variants[name] = graph_variant(loop, updates, recorded, deadline)
            verdict = ("held" if v["held"] else "BROKEN") if measured else "not measured (no CUDA)"
            print(
                f"\nrule (at most one update records graphs per span plan): {verdict}: "
                f"{v['updates_recording']} of {v['updates']} updates recorded graphs, "
                f"{v['plans']} span plan(s)\n"
            )
    skips = dynamo_count("inductor", "cudagraph_skips")
    print(f"CUDA graphs inductor skipped (cudagraph_skips): {skips}")
    print(RESULT + json.dumps({"measured": measured, "skips": skips, "variants": variants}))
    return 0


def graphs_section(args, tokens: np.ndarray, vocab: int, deadline: float) -> dict | None:
    """(c) in a child process on (b)'s tokens, cut at the part's deadline; its verdicts,
    None if it did not finish."""
    print("### (c) CUDA-graph recordings: the triton run with train.compile: graphs\n", flush=True)
    left = deadline - time.monotonic()
    if left < 20:
        print(f"skipped: {left:.0f} s of the part's budget left\n")
        return None
    with tempfile.TemporaryDirectory(prefix="nan-check-") as folder:
        saved = Path(folder) / "tokens.npy"
        np.save(saved, tokens)
        cmd = [sys.executable, "-m", "gpu.nan_check", "--section", "graphs", "--tokens", str(saved)]
        cmd += ["--vocab", str(vocab), "--graph-updates", str(args.graph_updates)]
        cmd += ["--budget", str(left - 10), *(["--dry-run"] if args.dry_run else [])]
        code, out = gpu_check.run(cmd, left)
    body, found, result = out.rpartition(RESULT)
    if code != 0 or not found:
        print(f"{out[-3000:]}\n\n(c) exit {code}: no verdict\n")
        return None
    print(body.strip() + "\n", flush=True)
    return json.loads(result.splitlines()[0])  # what follows it: torch's exit warnings


# ---------------------------------------------------------------- the cause


def gradient_ratio(fast: Run, ref: Run) -> tuple[float, str, int] | None:
    """The triton run's largest |grad| over the reference's, the largest such ratio over
    the kinds and the updates where both are finite: (ratio, kind, update)."""
    best = None
    for a, b in zip(fast.updates, ref.updates, strict=False):
        for kind, g in a.grads.items():
            r = b.grads.get(kind, math.nan)
            if (
                math.isfinite(g)
                and math.isfinite(r)
                and r > 0
                and (best is None or g / r > best[0])
            ):
                best = (g / r, kind, a.update)
    return best


def tile_finding(tiles: TileResults) -> str | None:
    """Each tile wrong where another tile is right: what it got wrong, on which cases."""
    by_tile: dict[int, tuple[set[str], list[str]]] = {}
    for i, case, quantities in tiles.tile_specific():
        wrong, cases = by_tile.setdefault(i, (set(), []))
        wrong.update(quantities)
        cases.append(case)
    return (
        "; ".join(
            f"tile {tile_name(tiles.tiles[i])} ({', '.join(q for q in QUANTITIES if q in wrong)} "
            f"wrong on {len(cases)} case(s) where another tile is right: {'; '.join(cases)})"
            for i, (wrong, cases) in by_tile.items()
        )
        or None
    )


def kernel_finding(fast: Run, ref: Run) -> str | None:
    if fast.failed() and not ref.failed():
        what = fast.nonfinite or f"crash ({fast.error})"
        return (
            f"the kernel against the reference (by hand, no graphs: triton's {what}; the "
            f"reference finite through update {len(ref.updates)})"
        )
    ratio = gradient_ratio(fast, ref)
    if ratio is not None and ratio[0] >= HUGE:
        return (
            f"the kernel against the reference (the triton run's {ratio[1]} gradient "
            f"{ratio[0]:.3g}x the reference's at update {ratio[2]})"
        )
    return None


def graphs_finding(graphs: dict | None, fast: Run) -> str | None:
    if not graphs or not graphs["measured"]:
        return None
    found = []
    for name, v in graphs["variants"].items():
        if not v["held"]:
            found.append(
                f"with the span fractions {name}, {v['updates_recording']} of {v['updates']} "
                f"updates recorded graphs for {v['plans']} span plan(s)"
            )
        if v["nonfinite"] is not None and not fast.failed():
            found.append(f"with the span fractions {name}, non-finite at update {v['nonfinite']}")
    return f"the CUDA graphs ({'; '.join(found)})" if found else None


def cause(tiles: TileResults, runs: list[Run], graphs: dict | None) -> str:
    """The report's last line: what (a)-(c) point at (the module docstring's rule)."""
    fast, ref = runs
    points = [
        found
        for found in (tile_finding(tiles), kernel_finding(fast, ref), graphs_finding(graphs, fast))
        if found
    ]
    every = tiles.every_tile()
    wrong = "; ".join(f"{', '.join(q)} on {case}" for case, q in every.items())
    if points:
        if every:
            points.append(f"(a) finds every tile wrong: {wrong}")
    elif fast.nonfinite and ref.nonfinite:
        points.append(
            f"bf16 training itself, with either op (triton: {fast.nonfinite}; reference: "
            f"{ref.nonfinite})"
        )
    elif every:
        points.append(
            f"not reproduced by training; the kernel's maths where (a) finds every tile "
            f"wrong ({wrong}), which {len(fast.updates)} updates by hand did not reach"
        )
    else:
        points.append(
            "not reproduced by (a)-(c): what is left is DeepSpeed's bf16 engine (its optimizer "
            "wrapper and flat buffers), which (b) does by hand"
        )
    return "cause: " + "; ".join(points)


# ---------------------------------------------------------------- the part


def header(shapes: Shapes, device, dtype, tiny: bool) -> str:
    where = torch.cuda.get_device_name() if device.type == "cuda" else "CPU, Triton's interpreter"
    shrunk = " (the smoke shrink: a dry run)" if tiny else ""
    return (
        f"{learning_check.CONFIG}'s model{shrunk} at the learning check's batch: "
        f"{shapes.batch} x {shapes.block} tokens, H {shapes.heads}, d_h {shapes.head_dim}, "
        f"N {shapes.persistent}, L' {shapes.span_len}, ramp {shapes.ramp}; "
        f"{str(dtype).removeprefix('torch.')}, {where}, torch {torch.__version__}\n"
    )


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget", type=float, default=115, help="seconds for all of it")
    parser.add_argument("--updates", type=int, default=None, help="(b)'s updates (25)")
    parser.add_argument("--graph-updates", type=int, default=None, help="(c)'s updates (15)")
    parser.add_argument(
        "--dry-run", action="store_true", help="the smoke-sized model in float32 (no CUDA: always)"
    )
    # (c)'s child: its section, on the parent's tokens
    parser.add_argument("--section", choices=("graphs",), help=argparse.SUPPRESS)
    parser.add_argument("--tokens", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--vocab", type=int, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    deadline = time.monotonic() + args.budget
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tiny = args.dry_run or device.type != "cuda"
    dtype = torch.float32 if tiny else torch.bfloat16
    updates = args.updates or (3 if tiny else 25)
    args.graph_updates = args.graph_updates or (2 if tiny else 15)
    if args.section == "graphs":
        return graphs_child(args, tiny, device, dtype, deadline)
    specs = {impl: learning_spec(impl, tiny) for impl in IMPLS}
    shapes = Shapes.of(specs["triton"])
    print(header(shapes, device, dtype, tiny), flush=True)
    print("### (a) each tile of TILES against the reference in float64, dropout 0\n")
    tiles = compare_tiles(shapes, device, dtype, deadline)
    print(tile_report(tiles) + "\n", flush=True)
    print(f"### (b) {updates} updates by hand: {str(dtype).removeprefix('torch.')} weights, "
          "float32 masters, no DeepSpeed, no CUDA graphs\n")  # fmt: skip
    tokens, vocab = training_tokens(specs["triton"], tiny)
    runs = [
        train_by_hand(specs[impl], tokens, vocab, device, dtype, updates, deadline)
        for impl in IMPLS
    ]
    kinds = list(dict.fromkeys(kind for run in runs for u in run.updates for kind in u.grads))
    print("largest |grad| per kind of parameter in the columns after L'; spans in tokens\n")
    for run in runs:
        print(run_report(run, kinds), flush=True)
    graphs = graphs_section(args, tokens, vocab, deadline)
    print(cause(tiles, runs, graphs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
