"""What one all-attention layer keeps for backward and how many aten ops it runs, against
the authors' code (facebookresearch/adaptive-span) at the same shape. The authors' numbers
come from ``python -m tests.fixtures.layer_costs --reference-code DIR`` (their code is never copied
here); see tests/fixtures/layer_costs.py."""

from __future__ import annotations

import torch

from tests.fixtures.layer_costs import ENWIK8_LARGE, GIB, TINY, our_layer, saved_bytes, step_ops

AUTHORS_SAVED_GIB = 2.31
"""The authors' layer at enwik8_large's shape, full span, fp32, with their dropout masks kept
as bool (the fused dropout F.dropout runs on a GPU). On the meta device, where F.dropout keeps
float masks, the same count gives 2.78 GiB."""

AUTHORS_OPS = 267
"""aten ops of one forward + backward of the authors' layer at TINY on the CPU with the fused
dropout (native_dropout: 2 ops per dropout, as on a GPU): 273 counted on the CPU, where
F.dropout runs empty_like, bernoulli_, div_ and two muls for each of the two dropouts."""


def test_bytes_kept_for_backward_per_layer_at_enwik8_large_shape_on_meta():
    torch.manual_seed(0)
    _, forward = our_layer(ENWIK8_LARGE, "meta")
    kept = saved_bytes(forward) / GIB
    print(f"kept for backward per layer: {kept:.3f} GiB")
    assert kept <= AUTHORS_SAVED_GIB


def test_aten_ops_per_layer_no_more_than_the_authors(monkeypatch):
    """Counted as a GPU runs the layer: the fused dropout, as AUTHORS_OPS counts theirs (on the
    CPU our dropout is a cheaper draw of more, smaller ops: the next test)."""
    from pipeline.ops import attention

    monkeypatch.setattr(
        attention, "attention_dropout", lambda a, p: (torch.native_dropout(a, p, True)[0], 1.0)
    )
    torch.manual_seed(0)
    _, forward = our_layer(TINY, "cpu")
    ops = step_ops(forward)
    print(f"aten ops per layer, forward + backward: {sum(ops.values())}")
    assert sum(ops.values()) <= AUTHORS_OPS
    # the dropout is the fused op, once per part (context, persistent), and nothing else
    assert ops["aten.native_dropout"] == 2 and ops["aten.native_dropout_backward"] == 2
    assert not any("bitwise" in name or "shift" in name for name in ops)


def test_on_the_cpu_the_dropout_is_an_integer_draw_and_a_masked_fill():
    """The CPU's dropout: one uniform draw per weight from torch's generator, a comparison
    and a masked fill per part, the 1 / (1 - p) on the output; still no more ops than the
    authors' layer counted on the CPU (273), and no Bernoulli draw."""
    torch.manual_seed(0)
    _, forward = our_layer(TINY, "cpu")
    ops = step_ops(forward)
    assert sum(ops.values()) <= 273
    assert ops["aten.rand"] == 2 and ops["aten.masked_fill"] == 4  # forward, backward
    assert "aten.bernoulli_" not in ops and "aten.native_dropout" not in ops
