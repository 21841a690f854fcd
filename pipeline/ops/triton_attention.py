"""``triton``: the all-attention op as Triton kernels (``pipeline.ops.triton_kernels``), forward
and backward, with the signature and numbers of ``attend_reference``.

What it computes is the reference's: the softmax over [window ; persistent vectors] of

    s_tc = (q_t . k_c + q_t . u_(t-c)) / sqrt(d_h)
    s_tn = q_t . M_k[n] / sqrt(d_h)

with the span mask m (float32) multiplying the window's weights and the joint
renormalisation 1 / (sum(a m) + sum(a_pers) + 1e-8), its guard included
(``pipeline.ops.triton_kernels`` writes it out): a key with m = 0 weighs exactly 0 and the
spans' gradient is the reference's, bounded where the mask is 0, which the log m
formulation of ``pipeline.ops.fused`` is not (it grows like e^gap of the scores there). With
attention dropout from a hash of a device seed (``pipeline.ops.dropout.flex_keep``: flex
draws the same mask). Nothing of size [B, H, M, L'] is ever in memory: the forward keeps
the output and one float32 log-denominator per query, and the backward recomputes the
weights tile by tile.

Three kernels run the backward: per query block, dq and the partial sums of u's and m's
gradients over its rows (reduced here, once); per key tile, dk and dv; per tile of
persistent vectors, their gradients over the whole batch. No atomics, so a gradient is the
same bits run to run.

With persistent vectors the op can split them out (``SPLIT_PERSISTENT``,
``persistent_split``; off by default until a GPU has run its CUDA path): the kernels run the
window alone, writing its output and log-sum-exp, and the persistent part, shared by the
whole batch with neither positions nor mask, runs as one dense attention of the
batch-folded queries [H, B·M, d_h] against [H, N, d_h] (``pipeline.ops.persistent_part``:
torch's flash or memory-efficient op on CUDA). The two are merged by log-sum-exp, the joint
denominator D = D_w + (1 + 1e-8) P (the guard's eps counts the persistent keys too), and
each part's backward runs with the joint output and log-sum-exp, so its weights are the
joint softmax's, its delta = dO . O the joint one's, and every gradient the unsplit op's.
The persistent part's dropout is its backend's (on CUDA, torch's generator: other bits than
the kernels' hash, the same law; on the CPU the hash).

Where it runs: CUDA tensors, compiled by Triton; on a machine without CUDA, CPU tensors
through Triton's interpreter (``TRITON_INTERPRET=1``, which pipeline.ops sets when it is
imported before triton): the same kernels, exact, and far too slow to train with. That is
what the tests run in CI. The interpreter has no bfloat16.

The tile: one T for the query block and the key tile alike (the position gather needs it),
chosen per kernel, device, dtype, head size, L' bucket and query-row bucket the first time
it runs there, as the fastest of
``TILES`` that fits the chip; a tile that runs out of shared memory or registers is skipped,
as flex's tiles are (``pipeline.ops.fused.FLEX_TILES``).
"""

from __future__ import annotations

import contextlib
import math
import os
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from pipeline.ops import persistent_part
from pipeline.ops.attention import RENORM_EPS, check_shapes
from pipeline.ops.dropout import draw_dropout_seed, keep_threshold

__all__ = [
    "KERNELS",
    "RECOMPUTED_PRODUCTS",
    "TILES",
    "attend_triton",
    "compile_ahead",
    "forced_tile",
    "persistent_split",
    "tiles_in_use",
]

TILES: tuple[dict, ...] = (
    {"T": 64, "num_warps": 4, "num_stages": 2},
    {"T": 64, "num_warps": 4, "num_stages": 3},
    {"T": 128, "num_warps": 8, "num_stages": 2},
    {"T": 32, "num_warps": 4, "num_stages": 2},
)
"""The tiles tried on CUDA, per kernel; the first that compiles wins where timing is not
possible (inside a CUDA graph capture)."""

RECOMPUTED_PRODUCTS = {"window": 5, "persistent": 3}
"""Matmul-shaped products per query that the backward kernels compute beyond a stored-weights
backward's (the hardware FLOPs utilisation counts them): the dq and the dk/dv kernels each
recompute the window's scores (q.k and q.u) and dO.v, which a backward needs once, so 5 of
d_ctx x L' multiply-adds; the persistent scores twice and dO.M_v once more, 3 of d x N."""

INTERPRETER_TILE = {"T": 16}
"""The tile under Triton's interpreter: the smallest tl.dot takes, so the tests' small shapes
still span several tiles."""

SPLIT_PERSISTENT = False
"""With persistent vectors, run the window in the kernels and the persistent part as a dense
attention over the batch-folded queries (``pipeline.ops.persistent_part``), merged by
log-sum-exp; False runs both in the kernels. ``persistent_split`` sets it for a block.
Off by default: the split is exact through the interpreter and torch on the CPU
(tests/unit/ops/test_attention_triton_split.py), but its CUDA path (torch's flash and
memory-efficient ops, their log-sum-exp layouts) has not yet run on a GPU: `make gpu-check`
runs its CUDA tests and `bench.attention --impls triton,triton-unsplit` times it first."""

WINDOW_ONLY = " (window only)"
"""The tile cache's name suffix of the kernels run for the split's window part: the fastest
tile without the persistent tiles need not be the fastest with them."""

_tiles: dict[tuple, dict] = {}
_kernels: Any = None
_forced: dict | None = None
_split: tuple[bool, str | None] | None = None


@contextlib.contextmanager
def persistent_split(enabled: bool = True, backend: str | None = None):
    """Inside, the op splits the persistent part out of the kernels (``enabled``) or not,
    whatever ``SPLIT_PERSISTENT`` says, the persistent part through ``backend`` (one of
    ``pipeline.ops.persistent_part.BACKENDS``; None: ``choose_backend``'s): how the tests
    reach each path and the benchmark times split against unsplit."""
    global _split
    before, _split = _split, (enabled, backend)
    try:
        yield
    finally:
        _split = before


@contextlib.contextmanager
def forced_tile(tile: dict):
    """Every kernel launched inside runs in ``tile`` (one of TILES, or the interpreter's
    {"T": t}), neither timed nor kept: how the tests and the GPU check reach each tile,
    which the timed choice alone would leave untested."""
    global _forced
    before, _forced = _forced, dict(tile)
    try:
        yield
    finally:
        _forced = before


def tiles_in_use() -> dict[tuple, dict]:
    """{(kernel, device, dtype, d_h, L' bucket, rows bucket): the tile it runs with} for the
    benchmarks' reports (``_launch``)."""
    return dict(_tiles)


def _load_kernels(device: torch.device):
    """The kernel module, built for CUDA or, on a machine without CUDA, for the interpreter."""
    global _kernels
    if device.type == "cpu" and not torch.cuda.is_available():
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError(
                "attention impl triton on the CPU runs Triton's interpreter: set "
                "TRITON_INTERPRET=1 before triton is imported (pipeline.ops sets it when it "
                "is imported first)"
            )
    elif device.type != "cuda":
        raise ValueError(
            f"attention impl triton runs on CUDA tensors (on a machine without CUDA, on the "
            f"CPU through Triton's interpreter), not on {device.type}"
        )
    if _kernels is None:
        try:
            from pipeline.ops import triton_kernels
        except ImportError as error:
            raise RuntimeError(
                f"attention impl triton needs the triton package ({error}); CUDA builds of "
                "torch bring it, elsewhere: pip install triton"
            ) from None
        _kernels = triton_kernels
    return _kernels


def _bucket(n: int) -> int:
    """n rounded up to a power of 2: the sizes that share a tile choice."""
    return 1 << max(0, n - 1).bit_length()


def _launch(name: str, q: Tensor, launch_one, span_len: int) -> dict:
    """Run ``launch_one(tile)`` in the tile kept for (name, device, dtype, d_h, L' bucket,
    rows bucket); the first time, time every tile of TILES that compiles and keep the
    fastest. Returns the tile. Per bucket of L' and of the query rows (B x H x M), both
    rounded up to a power of 2: the fastest tile at the spans of the first update (short,
    at initialisation) need not be the fastest once the spans have grown, nor at another
    micro-batch."""
    if _forced is not None:
        launch_one(_forced)
        return _forced
    if q.device.type != "cuda":
        launch_one(INTERPRETER_TILE)
        return INTERPRETER_TILE
    rows = q.shape[0] * q.shape[1] * q.shape[2]
    where = (name, str(q.device), q.dtype, q.shape[-1], _bucket(span_len), _bucket(rows))
    if where in _tiles:
        launch_one(_tiles[where])
        return _tiles[where]
    from triton.runtime.errors import OutOfResources

    capturing = torch.cuda.is_current_stream_capturing()
    best, best_ms = None, math.inf
    for tile in TILES:
        try:
            launch_one(tile)
        except OutOfResources:
            continue
        if capturing:  # no timing inside a graph capture: the first tile that fits
            best = tile
            break
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(3):
            launch_one(tile)
        end.record()
        end.synchronize()
        if start.elapsed_time(end) < best_ms:
            best, best_ms = tile, start.elapsed_time(end)
    if best is None:
        raise RuntimeError(f"attention impl triton: no tile of TILES fits {where}")
    _tiles[where] = best
    launch_one(best)  # the kept tile's outputs (each tile writes every output in full)
    return best


KERNELS = {
    "forward": "attention_fwd",
    "backward dq": "attention_bwd_dq",
    "backward dk dv": "attention_bwd_dkdv",
    "backward persistent": "attention_bwd_persistent",
}
"""The kernels by the names the tile cache and the reports use."""

_FLOAT32_POINTERS = {"lse", "delta", "du", "dmask", "mask"}
_FLOAT_ARGS = {"qk_scale2", "sm_scale", "keep_scale", "renorm_eps"}


def compile_ahead(cc: int, dtype: torch.dtype, head_dim: int = 64, tile: dict | None = None):
    """Compile every kernel for an NVIDIA GPU of compute capability ``cc`` (90: H100/H200,
    80: A100) without one, with dropout and the span mask on: {kernel name: {"shared": bytes
    of shared memory, "registers" and "spilled" bytes per thread (from cuobjdump; None where
    it is missing)}}. Needs a process whose Triton is not in interpreter mode."""
    import re
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from pipeline.ops import triton_kernels

    tile = dict(TILES[0] if tile is None else tile)
    constants = _constants(dtype, head_dim, has_mask=True, dropout=True) | {"T": tile.pop("T")}
    element = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]
    dump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    found = {}
    for name, attr in KERNELS.items():
        fn = getattr(triton_kernels, attr)
        signature = {}
        for arg, param in zip(fn.arg_names, fn.params, strict=True):
            if param.is_constexpr:
                signature[arg] = "constexpr"
            elif arg.endswith("_ptr"):
                kind = arg.removesuffix("_ptr")
                signature[arg] = (
                    "*i32"
                    if kind == "seed"
                    else "*fp32"
                    if kind in _FLOAT32_POINTERS
                    else f"*{element}"
                )
            else:
                signature[arg] = "fp32" if arg in _FLOAT_ARGS else "i32"
        wanted = {k: v for k, v in constants.items() if k in fn.arg_names}
        kernel = triton.compile(
            ASTSource(fn, signature, wanted), target=GPUTarget("cuda", cc, 32), options=tile
        )
        registers = spilled = None
        if dump.exists():
            with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
                cubin.write(kernel.asm["cubin"])
                cubin.flush()
                usage = subprocess.run(
                    [str(dump), "--dump-resource-usage", cubin.name], capture_output=True, text=True
                ).stdout
            if m := re.search(r"REG:(\d+) STACK:(\d+)", usage):
                registers, spilled = int(m.group(1)), int(m.group(2))
        found[name] = {"shared": kernel.metadata.shared, "registers": registers, "spilled": spilled}
    return found


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _rows_contiguous(x: Tensor) -> Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _operands(q, k, v, pos, pk, pv, mask, seed, dropout_p: float) -> tuple:
    """The leading arguments every kernel takes: the inputs, their strides, the sizes
    (B, H, M, L', N, d_h) and the scalars. Without persistent vectors, a mask or dropout, q
    and pos stand in for the pointers the kernels then never read."""
    b, h, m, d = q.shape
    pk_, pv_, lm = (
        (q if pk is None else pk),
        (q if pv is None else pv),
        (pos if mask is None else mask),
    )
    seed = q if seed is None else seed
    n = 0 if pk is None else pk.shape[1]
    return (
        q, k, v, pos, pk_, pv_, lm, seed,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *pos.stride(),
        pk_.stride(-3), pk_.stride(-2), pv_.stride(-3), pv_.stride(-2), lm.stride(0),
        b, h, m, pos.shape[1], n, d,
        1.4426950408889634 / math.sqrt(d), 1.0 / math.sqrt(d), 1.0 / (1.0 - dropout_p),
        keep_threshold(dropout_p), 0.0 if mask is None else RENORM_EPS,
    )  # fmt: skip


def _constants(dtype: torch.dtype, head_dim: int, has_mask: bool, dropout: bool) -> dict:
    """The kernels' compile-time arguments but the tile."""
    return dict(
        HAS_MASK=has_mask,
        DROPOUT=dropout,
        DP=max(16, 1 << (head_dim - 1).bit_length()),  # the head size padded to a power of 2
        PREC="ieee" if dtype == torch.float32 else "tf32",  # fp32 matmuls in full fp32
    )


def _kernels_forward(
    q, k, v, pos, pk, pv, mask, seed, dropout_p: float, out_dtype=None, split: bool = False
) -> tuple[Tensor, Tensor]:
    """The forward kernel: (out [B, H, M, d_h] in ``out_dtype`` (default: q's), lse
    [B, H, M] float32: log2 of each row's denominator, plus its max). ``split``: the window
    alone of the persistent split (pk None), timed as a kernel of its own."""
    kernels = _load_kernels(q.device)
    b, h, m, _ = q.shape
    out = torch.empty_like(q, dtype=out_dtype, memory_format=torch.contiguous_format)
    lse = q.new_empty(b, h, m, dtype=torch.float32)
    args = (
        *_operands(q, k, v, pos, pk, pv, mask, seed, dropout_p),
        out, lse, *out.stride()[:3],
    )  # fmt: skip
    constants = _constants(q.dtype, q.shape[-1], mask is not None, dropout_p > 0.0)
    _launch(
        "forward" + (WINDOW_ONLY if split else ""),
        q,
        lambda t: kernels.attention_fwd[(_cdiv(m, t["T"]), b * h)](*args, **constants, **t),
        pos.shape[1],
    )
    return out, lse


@torch.library.custom_op("allattn::triton_attention", mutates_args=())
def _forward_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    pos: Tensor,
    pk: Tensor | None,
    pv: Tensor | None,
    mask: Tensor | None,
    seed: Tensor | None,
    dropout_p: float,
) -> tuple[Tensor, Tensor]:
    """(out [B, H, M, d_h], lse [B, H, M] float32: log2 of each row's denominator, plus its
    max)."""
    return _kernels_forward(q, k, v, pos, pk, pv, mask, seed, dropout_p)


@_forward_op.register_fake
def _(q, k, v, pos, pk, pv, mask, seed, dropout_p):
    return (
        torch.empty_like(q, memory_format=torch.contiguous_format),
        q.new_empty(q.shape[:-1], dtype=torch.float32),
    )


@torch.library.custom_op("allattn::triton_attention_backward", mutates_args=())
def _backward_op(
    grad: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    pos: Tensor,
    pk: Tensor | None,
    pv: Tensor | None,
    mask: Tensor | None,
    seed: Tensor | None,
    out: Tensor,
    lse: Tensor,
    dropout_p: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dv, dpos, dpk, dpv, dmask); dpk, dpv and dmask are empty where there is no
    such input (a custom op returns tensors only)."""
    return _kernels_backward(grad, q, k, v, pos, pk, pv, mask, seed, out, lse, dropout_p)


def _kernels_backward(
    grad, q, k, v, pos, pk, pv, mask, seed, out, lse, dropout_p: float, split: bool = False
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The backward kernels (``_backward_op``'s result) from the op's output ``out`` and
    log-sum-exp ``lse`` (log2), the joint op's in the persistent split (``split``: pk None,
    the kernels timed as kernels of their own)."""
    kernels = _load_kernels(q.device)
    suffix = WINDOW_ONLY if split else ""
    b, h, m, d = q.shape
    span_len, n = pos.shape[1], 0 if pk is None else pk.shape[1]
    grad = _rows_contiguous(grad)
    delta = (grad.float() * out.float()).sum(-1)  # sum_c P dP per row = dO . O
    ops = _operands(q, k, v, pos, pk, pv, mask, seed, dropout_p)
    rows = (grad, lse, delta, *grad.stride()[:3])
    constants = _constants(q.dtype, q.shape[-1], mask is not None, dropout_p > 0.0)

    # per query block: dq, and partial sums per distance of u's and m's gradients
    # ([B * H, blocks, W]: each block's chunks end before W), summed here once; the kernels
    # store every gradient but those two scaled, in the input's dtype
    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    partials: dict[int, tuple[Tensor, Tensor]] = {}

    def dq_pass(tile: dict) -> None:
        t = tile["T"]
        blocks, width = _cdiv(m, t), ((span_len + t - 2) // t + 1) * t
        if t not in partials:
            partials[t] = (
                q.new_empty(b * h, blocks, width, d, dtype=torch.float32),
                q.new_empty(b * h, blocks, width, dtype=torch.float32),
            )
        du, dmask = partials[t]
        kernels.attention_bwd_dq[(blocks, b * h)](
            *ops, *rows, dq, du, dmask, width, **constants, **tile
        )

    tile = _launch("backward dq" + suffix, q, dq_pass, span_len)
    du, dmask_parts = partials[tile["T"]]
    scale = 1.0 / math.sqrt(d)
    # contiguous, as the fake kernel says: torch.compile checks the real strides against it
    dpos = (du.sum((0, 1))[:span_len] * scale).t().contiguous().to(pos.dtype)
    dmask = (
        dmask_parts.view(b, h, -1, dmask_parts.shape[-1]).sum((0, 2))[:, :span_len].contiguous()
        if mask is not None
        else lse.new_empty(0)
    )

    # per key tile: dk, dv
    dk = k.new_empty(b, h, span_len + m, d)
    dv = v.new_empty(b, h, span_len + m, d)
    _launch(
        "backward dk dv" + suffix,
        q,
        lambda t: kernels.attention_bwd_dkdv[(_cdiv(span_len + m, t["T"]), b * h)](
            *ops, *rows, dk, dv, **constants, **t
        ),
        span_len,
    )

    # per tile of persistent vectors: their gradients over the whole batch
    if pk is None:
        dpk, dpv = q.new_empty(0), q.new_empty(0)
    else:
        dpk, dpv = pk.new_empty(h, n, d), pk.new_empty(h, n, d)
        _launch(
            "backward persistent",
            q,
            lambda t: kernels.attention_bwd_persistent[(_cdiv(n, t["T"]), h)](
                *ops, *rows, dpk, dpv, **constants, **t
            ),
            span_len,
        )
    return dq, dk, dv, dpos, dpk, dpv, dmask


@_backward_op.register_fake
def _(grad, q, k, v, pos, pk, pv, mask, seed, out, lse, dropout_p):
    def like(x):
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    return (
        like(q),
        like(k),
        like(v),
        like(pos),
        q.new_empty(0) if pk is None else like(pk),
        q.new_empty(0) if pv is None else like(pv),
        lse.new_empty(0) if mask is None else like(mask),
    )


def _setup_context(ctx, inputs, output):
    q, k, v, pos, pk, pv, mask, seed, dropout_p = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, pos, pk, pv, mask, seed, out, lse)
    ctx.dropout_p = dropout_p


def _backward(ctx, grad, _grad_lse):
    q, k, v, pos, pk, pv, mask, seed, out, lse = ctx.saved_tensors
    dq, dk, dv, dpos, dpk, dpv, dmask = _backward_op(
        grad, q, k, v, pos, pk, pv, mask, seed, out, lse, ctx.dropout_p
    )
    absent = (pk is None, pv is None, mask is None)
    extra = [None if gone else g for gone, g in zip(absent, (dpk, dpv, dmask), strict=True)]
    return dq, dk, dv, dpos, *extra, None, None


_forward_op.register_autograd(_backward, setup_context=_setup_context)


# --------------------------------------------------------------------------------------
# the persistent split: the window in the kernels, the persistent part a dense attention
# --------------------------------------------------------------------------------------

_LOG2E = 1.4426950408889634


def _rows_of(x: Tensor, b: int) -> Tensor:
    """[H, B·M] (the folded rows) -> [B, H, M]."""
    return x.view(x.shape[0], b, -1).transpose(0, 1)


def _merge(out_w, lse_w, out_p, lse_p, has_mask: bool) -> tuple[Tensor, Tensor]:
    """The joint op's output (float32) and log-sum-exp (log2, float32, [B, H, M]) from the
    window's part (out_w [B, H, M, d] and lse_w, log2 of D_w = sum(e m) + eps sum(e) plus the
    max, as the kernel writes it) and the persistent part's (out_p [H, B·M, d], lse_p the
    natural log of P = sum(e_n), [H, B·M]). The joint denominator is D = D_w + (1 + eps) P
    (the guard's eps counts every key, the persistent ones included), the joint output
    (out_w D_w + out_p P) / D: each part's share exp(lse_part - lse) is at most 1, so
    nothing overflows whatever the gap between the parts."""
    b = out_w.shape[0]
    lse_p = _rows_of(lse_p, b) * _LOG2E
    shifted = lse_p + math.log2(1.0 + RENORM_EPS) if has_mask else lse_p
    lse = torch.logaddexp2(lse_w, shifted)
    out_p = out_p.view(out_p.shape[0], b, -1, out_p.shape[-1]).transpose(0, 1)
    out = out_w.float() * torch.exp2(lse_w - lse)[..., None]
    out = out + out_p.float() * torch.exp2(lse_p - lse)[..., None]
    return out, lse


@torch.library.custom_op("allattn::triton_attention_split", mutates_args=())
def _split_forward_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    pos: Tensor,
    pk: Tensor,
    pv: Tensor,
    mask: Tensor | None,
    seed: Tensor | None,
    dropout_p: float,
    backend: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The op with its persistent part split out: (out [B, H, M, d_h], lse [B, H, M]
    float32, log2 of the joint denominator plus its max, as ``_forward_op``'s; and the
    persistent part's dropout state for its backward, ``persistent_part.persistent_forward``).
    """
    m = q.shape[2]
    out_w, lse_w = _kernels_forward(
        q, k, v, pos, None, None, mask, seed, dropout_p, out_dtype=torch.float32, split=True
    )
    out_p, lse_p, rng_a, rng_b = persistent_part.persistent_forward(
        persistent_part.fold(q), pk, pv, seed, dropout_p, backend, m
    )
    out, lse = _merge(out_w, lse_w, out_p, lse_p, mask is not None)
    return out.to(q.dtype), lse.contiguous(), rng_a, rng_b


@_split_forward_op.register_fake
def _(q, k, v, pos, pk, pv, mask, seed, dropout_p, backend):
    # the persistent part's own op on the fake tensors: the shapes of its dropout state
    _, _, rng_a, rng_b = persistent_part.persistent_forward(
        persistent_part.fold(q), pk, pv, seed, dropout_p, backend, q.shape[2]
    )
    return (
        torch.empty_like(q, memory_format=torch.contiguous_format),
        q.new_empty(q.shape[:-1], dtype=torch.float32),
        rng_a,
        rng_b,
    )


@torch.library.custom_op("allattn::triton_attention_split_backward", mutates_args=())
def _split_backward_op(
    grad: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    pos: Tensor,
    pk: Tensor,
    pv: Tensor,
    mask: Tensor | None,
    seed: Tensor | None,
    out: Tensor,
    lse: Tensor,
    rng_a: Tensor,
    rng_b: Tensor,
    dropout_p: float,
    backend: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dv, dpos, dpk, dpv, dmask; dmask empty without a mask): each part's backward
    run with the joint output ``out`` and log-sum-exp ``lse``, so that its weights are the
    joint softmax's and its delta = dO . O the joint one's, and the gradients are the
    unsplit op's; dq is the sum of the two parts'."""
    b, h, m, _ = q.shape
    grad = _rows_contiguous(grad)
    dq, dk, dv, dpos, _, _, dmask = _kernels_backward(
        grad, q, k, v, pos, None, None, mask, seed, out, lse, dropout_p, split=True
    )
    fold = persistent_part.fold
    lse_f = lse.transpose(0, 1).reshape(h, b * m) * (1.0 / _LOG2E)  # natural log, folded
    dq_p, dpk, dpv = persistent_part.persistent_backward(
        fold(grad), fold(q), pk, pv, seed, fold(out), lse_f, rng_a, rng_b, dropout_p, backend, m
    )
    dq = dq + dq_p.view(h, b, m, -1).transpose(0, 1).to(dq.dtype)
    return dq, dk, dv, dpos, dpk.contiguous(), dpv.contiguous(), dmask


@_split_backward_op.register_fake
def _(grad, q, k, v, pos, pk, pv, mask, seed, out, lse, rng_a, rng_b, dropout_p, backend):
    def like(x):
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    dmask = lse.new_empty(0) if mask is None else like(mask)
    return like(q), like(k), like(v), like(pos), like(pk), like(pv), dmask


def _split_setup_context(ctx, inputs, output):
    q, k, v, pos, pk, pv, mask, seed, dropout_p, backend = inputs
    out, lse, rng_a, rng_b = output
    ctx.save_for_backward(q, k, v, pos, pk, pv, mask, seed, out, lse, rng_a, rng_b)
    ctx.dropout_p, ctx.backend = dropout_p, backend


def _split_backward(ctx, grad, *_unused):
    q, k, v, pos, pk, pv, mask, seed, out, lse, rng_a, rng_b = ctx.saved_tensors
    dq, dk, dv, dpos, dpk, dpv, dmask = _split_backward_op(
        grad, q, k, v, pos, pk, pv, mask, seed, out, lse, rng_a, rng_b, ctx.dropout_p,
        ctx.backend,
    )  # fmt: skip
    return dq, dk, dv, dpos, dpk, dpv, None if mask is None else dmask, None, None, None


_split_forward_op.register_autograd(_split_backward, setup_context=_split_setup_context)


def _split_backend(q: Tensor, dropout: bool) -> str | None:
    """The persistent part's backend when the op splits it out, else None."""
    enabled, backend = (SPLIT_PERSISTENT, None) if _split is None else _split
    if not enabled:
        return None
    if backend is None:
        backend = persistent_part.choose_backend(q.device.type, q.dtype, q.shape[-1], dropout)
    return backend


def attend_triton(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    pos: Tensor,
    *,
    persistent_k: Tensor | None = None,
    persistent_v: Tensor | None = None,
    span_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    training: bool = False,
    dropout_seed: Tensor | None = None,
) -> Tensor:
    """The all-attention op through the Triton kernels (see the module docstring).

    dropout_seed: int32 scalar tensor on q's device seeding the dropout mask (the flex
    backend's hash, so both drop the same weights for a seed); None draws one there."""
    span_len = check_shapes(q, k, pos, persistent_k, persistent_v)
    if span_mask is not None and span_mask.shape != (q.shape[1], span_len):
        raise ValueError(
            f"span_mask must be [H, L'] = {(q.shape[1], span_len)}, got {tuple(span_mask.shape)}"
        )
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"attention impl triton takes float32, float16 or bfloat16, not {q.dtype}")
    if q.device.type == "cpu" and q.dtype == torch.bfloat16:
        raise ValueError(
            "attention impl triton on the CPU runs Triton's interpreter, which has no bfloat16"
        )
    drop = dropout_p > 0.0 and training
    seed = None
    if drop:
        seed = draw_dropout_seed(q.device) if dropout_seed is None else dropout_seed
    dt = q.dtype
    backend = None if persistent_k is None else _split_backend(q, drop)
    if backend is not None and persistent_k is not None and persistent_v is not None:
        out, *_ = _split_forward_op(
            _rows_contiguous(q),
            _rows_contiguous(k),
            _rows_contiguous(v),
            pos.to(dt),
            _rows_contiguous(persistent_k.to(dt)),
            _rows_contiguous(persistent_v.to(dt)),
            None if span_mask is None else _rows_contiguous(span_mask.float()),
            seed,
            dropout_p if drop else 0.0,
            backend,
        )
        return out
    out, _ = _forward_op(
        _rows_contiguous(q),
        _rows_contiguous(k),
        _rows_contiguous(v),
        pos.to(dt),
        None if persistent_k is None else _rows_contiguous(persistent_k.to(dt)),
        None if persistent_v is None else _rows_contiguous(persistent_v.to(dt)),
        None if span_mask is None else _rows_contiguous(span_mask.float()),
        seed,
        dropout_p if drop else 0.0,
    )
    return out
