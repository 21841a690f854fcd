"""The adaptive span under bf16 / fp16: the mask and the span fractions stay float32.

bf16 holds integers exactly only up to 256: at the paper's max_span 8192 a span near 3000
tokens and the distances around it are rounded to multiples of 16, so a mask computed in bf16
turns the 32-token ramp into a staircase and gives the span a wrong gradient.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest
import torch

from pipeline.models.allattn.layers import AdaptiveSpan
from pipeline.ops import adaptive_span_mask
from stages.base import NullStageTracker
from stages.train import plan as train_plan
from tests.fixtures.tiny_models import tiny_allattn

MAX_SPAN, RAMP = 8192, 32
SPANS = [2990.37, 3001.5, 3013.25, 2999.875]  # tokens, near 3000
SPAN_LEN = 3072  # L' covering the spans and their ramps


def _span_module() -> AdaptiveSpan:
    module = AdaptiveSpan(len(SPANS), MAX_SPAN, RAMP, init=0.0)
    with torch.no_grad():
        module.frac.copy_(torch.tensor(SPANS) / MAX_SPAN)
    return module


def _mask_and_grad(module: AdaptiveSpan, weights: torch.Tensor):
    module.frac.grad = None
    mask = module.mask(SPAN_LEN)
    (mask * weights).sum().backward()
    return mask.detach(), module.frac.grad.clone()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_module_keeps_the_span_and_its_mask_in_float32(dtype):
    f32 = _span_module()
    low = copy.deepcopy(f32).to(dtype)
    assert low.frac.dtype == torch.float32 and torch.equal(low.frac, f32.frac)
    weights = torch.randn(len(SPANS), SPAN_LEN, generator=torch.Generator().manual_seed(0))
    mask32, grad32 = _mask_and_grad(f32, weights)
    mask_low, grad_low = _mask_and_grad(low, weights)
    assert mask_low.dtype == torch.float32
    assert (mask_low - mask32).abs().max().item() < 1e-6
    assert ((grad_low - grad32).abs() / grad32.abs()).max().item() < 1e-6
    # the ramp really is there: 32 distinct values strictly between 0 and 1 per head
    inside = [(row > 0) & (row < 1) for row in mask_low]
    assert [int(k.sum()) for k in inside] == [RAMP] * len(SPANS)
    # .half() / .bfloat16() go through the same cast; the gradient stays float32 too
    low.frac.grad = torch.ones(len(SPANS))
    assert low.bfloat16().frac.dtype == torch.float32 and low.frac.grad.dtype == torch.float32


def test_mask_of_a_bf16_span_is_computed_in_float32():
    """The op itself: given spans in bf16 (exactly representable, near 3000), the mask equals
    the float32 computation from the same values, and so does the span's gradient."""
    span16 = torch.tensor([2992.0, 3008.0, 3024.0], dtype=torch.bfloat16, requires_grad=True)
    span32 = span16.detach().float().requires_grad_()
    weights = torch.randn(3, SPAN_LEN, generator=torch.Generator().manual_seed(1))
    m16 = adaptive_span_mask(span16, RAMP, SPAN_LEN)
    m32 = adaptive_span_mask(span32, RAMP, SPAN_LEN)
    assert m16.dtype == torch.float32
    assert (m16 - m32).abs().max().item() < 1e-6
    (m16 * weights).sum().backward()
    (m32 * weights).sum().backward()
    assert torch.allclose(span16.grad.float(), span32.grad, rtol=1e-2)  # bf16 grad: 8 bits
    # dm/dz = 1/R on the ramp, its ends included (torch's clamp passes the gradient at the
    # bounds): d/dz sum(m * w) = sum of the weights there / R
    x = torch.arange(SPAN_LEN - 1, -1, -1, dtype=torch.float64)
    u = (RAMP + span32.detach().double()[:, None] - x) / RAMP
    want = (weights.double() * ((u >= 0) & (u <= 1))).sum(dim=1) / RAMP
    assert torch.allclose(span32.grad.double(), want, rtol=1e-5)


def test_bf16_model_trains_with_float32_spans():
    """A whole model cast to bf16: the spans stay float32, a forward and backward run on the
    reference backend, and the span fractions get a float32 gradient."""
    model = tiny_allattn(n_persistent=4, span_init=0.3).to(torch.bfloat16)
    model.set_attention_impl("reference")
    fracs = [layer.attn.adaptive_span.frac for layer in model.layers]
    assert all(f.dtype == torch.float32 for f in fracs)
    assert model.pos_table.dtype == torch.bfloat16
    tokens = torch.randint(0, 11, (2, 8), generator=torch.Generator().manual_seed(0))
    out = model(tokens, tokens)
    assert out.nll.dtype == torch.float32 and model.aux_loss().dtype == torch.float32
    (out.nll.mean() + model.aux_loss()).backward()
    assert all(
        f.grad is not None and f.grad.dtype == torch.float32 and f.grad.abs().sum() > 0
        for f in fracs
    )


# ------------------------------------------------------------------ DeepSpeed's bf16 engine

SPAN_INIT, DS_STEPS = 0.37, 4


def _ds_worker(cfg: Path, preprocess_dir: Path, ckpt: Path, out: Path) -> None:
    """bf16 Trainers (one process) under ZeRO 0, 1 and 2: what the forward sees of the spans,
    the losses; under ZeRO 1 also a save after 2 steps and a fresh Trainer resumed from it."""
    from pipeline.spec import load_spec
    from pipeline.training.trainer import Trainer
    from pipeline.training.training_data import PreprocessedData

    def trainer(stage: int) -> Trainer:
        spec = load_spec(
            cfg,
            [
                "train.deepspeed.bf16=true",
                f"train.deepspeed.zero_stage={stage}",
                f"model.span_init={SPAN_INIT}",
                "model.span_loss_coef=0.01",
            ],
        )
        data = PreprocessedData(preprocess_dir, spec.train.seq_len)
        return Trainer(spec, train_plan(spec), data, tracker=NullStageTracker(), log=print)

    def fracs(t: Trainer) -> list[list[float]]:
        return [layer.attn.adaptive_span.frac.tolist() for layer in t.model.layers]

    def seen_by_forward(module, args) -> None:
        spans = [layer.attn.adaptive_span.frac for layer in module.layers]
        seen.append(
            {
                "dtypes": sorted({str(f.dtype) for f in spans}),
                "pos": str(module.pos_table.dtype),
                "fracs": [f.tolist() for f in spans],
            }
        )

    result = {}
    for stage in (0, 1, 2):
        t = trainer(stage)
        seen: list[dict] = []
        t.model.register_forward_pre_hook(seen_by_forward)
        losses, after = [], []
        for step in range(DS_STEPS):
            losses.append(float(t.train_step()))
            after.append(fracs(t))
            if stage == 1 and step == 1:
                t.save(ckpt, keep=1)
        result[stage] = {"seen": seen, "losses": losses, "fracs": after}
        if stage == 1:
            resumed = trainer(1)
            resumed.load(ckpt)
            result["resumed"] = {
                "losses": [float(resumed.train_step()) for _ in range(2)],
                "fracs": fracs(resumed),
            }
    out.write_text(json.dumps(result))


def test_deepspeed_bf16_trains_with_float32_spans(tmp_path):
    """DeepSpeed casts every parameter to bf16 and, under ZeRO 1/2, points them back at its
    bf16 flat buffer after every step; the forward must still see the spans in float32, the
    fp32 masters' values (not on bf16's grid), starting exactly at span_init, while the rest
    of the model stays bf16; resuming from a checkpoint continues exactly."""
    from tests.fixtures.runs import run_worker
    from tests.fixtures.tiny_corpus import tiny_corpus

    cfg, pre = tiny_corpus(tmp_path)
    got = run_worker(__file__, cfg, pre, tmp_path / "ckpt", tmp_path / "bf16.json")
    init = torch.tensor(SPAN_INIT).item()  # float32(0.37), which bf16 cannot hold
    assert torch.tensor(SPAN_INIT).bfloat16().item() != init
    for stage in ("0", "1", "2"):
        run = got[stage]
        assert len(run["seen"]) == DS_STEPS * 2  # 2 micro-batches per step
        assert all(
            s["dtypes"] == ["torch.float32"] and s["pos"] == "torch.bfloat16" for s in run["seen"]
        ), stage
        assert run["seen"][0]["fracs"] == [[init] * 2] * 2, stage
        # the spans moved, to values bf16 cannot represent, and the model learned
        last = torch.tensor(run["fracs"][-1])
        assert (last < init).all() and not torch.equal(last, last.bfloat16().float()), stage
        assert run["losses"][-1] < run["losses"][0], stage
        # what each forward sees is what the previous step left
        seen = [s["fracs"] for s in run["seen"]]
        assert seen[2::2] == run["fracs"][:-1], stage
    assert got["resumed"]["losses"] == got["1"]["losses"][2:]
    assert got["resumed"]["fracs"] == got["1"]["fracs"][-1]


if __name__ == "__main__":
    _ds_worker(*map(Path, sys.argv[1:]))
