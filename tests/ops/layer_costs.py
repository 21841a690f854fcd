"""What one all-attention layer costs, counted without a GPU: the bytes autograd keeps for
backward (on the meta device, so any shape is free) and the aten ops of a forward + backward
(CPU, a tiny shape). Used by tests/ops/test_layer_costs.py; run as a script to print ours and,
with ``--reference-code DIR`` (a checkout of facebookresearch/adaptive-span, never copied
here), the authors' layer at the same shape:

    DS_ACCELERATOR=cpu .venv/bin/python -m tests.ops.layer_costs --reference-code DIR
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections import Counter

import torch

from pipeline.diagnostics.step_audit import OpCounter, SavedBytes
from pipeline.models.allattn.config import AllAttnConfig
from pipeline.models.allattn.layers import AllAttnLayer
from pipeline.ops import get_attention_impl

GIB = 2**30

ENWIK8_LARGE = dict(b=4, d=512, h=8, m=512, span=8192, n=2048, ramp=32, p=0.4)
"""enwik8_large's layer at full span: micro-batch 4 x 512, d 512, 8 heads, N 2048."""

TINY = dict(b=2, d=16, h=2, m=8, span=32, n=4, ramp=4, p=0.3)


def saved_bytes(run) -> int:
    """Bytes of the distinct storages autograd saves for backward while ``run()`` records
    (``SavedBytes``: each storage once, parameters left out)."""
    with SavedBytes() as saved:
        run()
    return saved.bytes


def aten_ops(step) -> Counter:
    """aten ops dispatched by ``step()`` (forward and backward), by ``aten.<name>``
    (pipeline/diagnostics/step_audit.py's OpCounter)."""
    with OpCounter() as counter:
        step()
    return Counter({name if "." in name else f"aten.{name}": n for name, n in counter.ops.items()})


# --------------------------------------------------------------------------------------
# our layer
# --------------------------------------------------------------------------------------


def our_layer(shape: dict, device="cpu", impl="reference"):
    cfg = AllAttnConfig(
        d_model=shape["d"],
        n_heads=shape["h"],
        n_persistent=shape["n"],
        max_span=shape["span"],
        span_ramp=shape["ramp"],
        span_init=1.0,
        attn_dropout=shape["p"],
        ff_dim=0,
    )
    with torch.device(device):
        layer = AllAttnLayer(cfg)
    layer.attn.attend = get_attention_impl(impl)
    layer.train()
    b, d, m, span = shape["b"], shape["d"], shape["m"], shape["span"]
    with torch.device(device):
        x = torch.randn(b, m, d, requires_grad=True)
        context = torch.randn(b, span, d)
        pos = torch.randn(d // shape["h"], span, requires_grad=True)

    def forward():
        return layer(x, context, pos, span)

    return layer, forward


# --------------------------------------------------------------------------------------
# the authors' layer (their code, imported from the user's checkout)
# --------------------------------------------------------------------------------------


def authors_layer(code_dir: str, shape: dict, device="cpu"):
    sys.path.insert(0, code_dir)
    try:
        models = importlib.import_module("models")
        adaptive_span = importlib.import_module("adaptive_span")
    finally:
        sys.path.remove(code_dir)
    # full span (their trim reads the span with .item(), which the meta device cannot)
    adaptive_span.AdaptiveMask.get_current_max_size = lambda self, include_ramp=True: self._max_size
    b, d, h, m, span = shape["b"], shape["d"], shape["h"], shape["m"], shape["span"]
    with torch.device(device):
        layer = models.TransformerSeqLayer(
            hidden_size=d,
            nb_heads=h,
            attn_span=span,
            dropout=shape["p"],
            inner_hidden_size=4 * d,
            adapt_span_params=dict(
                adapt_span_enabled=True,
                adapt_span_loss=0.0,
                adapt_span_ramp=shape["ramp"],
                adapt_span_init=1.0,
                adapt_span_cache=True,
            ),
            pers_mem_params=dict(pers_mem_size=shape["n"]),
        )
        x = torch.randn(b, m, d, requires_grad=True)
        cache = torch.randn(b, span, d)
        key_pe = torch.randn(1, d // h, span, requires_grad=True)
    layer.train()

    def forward():
        return layer(x, cache, key_pe)

    return layer, forward


def step_ops(forward) -> Counter:
    def step():
        forward().sum().backward()

    return aten_ops(step)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reference-code", help="a checkout of facebookresearch/adaptive-span")
    args = ap.parse_args(argv)
    rows = [("ours", lambda s, dev: our_layer(s, dev))]
    if args.reference_code:
        rows.append(("authors", lambda s, dev: authors_layer(args.reference_code, s, dev)))
    for name, make in rows:
        torch.manual_seed(0)
        _, fwd = make(ENWIK8_LARGE, "meta")
        kept = saved_bytes(fwd)
        torch.manual_seed(0)
        _, fwd = make(TINY, "cpu")
        ops = step_ops(fwd)
        print(
            f"{name:8s} saved for backward per layer (enwik8_large, full span, fp32, meta): "
            f"{kept / GIB:.3f} GiB; aten ops per layer forward+backward (tiny shape, CPU): "
            f"{sum(ops.values())}"
        )
        print("   ", ", ".join(f"{k.replace('aten.', '')} {v}" for k, v in ops.most_common()))


if __name__ == "__main__":
    main()
