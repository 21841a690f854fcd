"""What only a GPU can show, marked `cuda` (gpu/check.py runs `pytest -m cuda`): the span
mask and whole training steps in bf16 on CUDA against float32 (a tiny model, and two layers of
the paper config's shape with its clipped Adagrad), and our collectives over a one-rank nccl
group. They skip here, naming why; the flex dropout test is in test_attention_fused.py. The
span-mask test's expectation (``ramp_expected``) is checked on the CPU too."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from pipeline.models import AllAttnConfig, AllAttnLM
from pipeline.ops import adaptive_span_mask

CUDA = torch.cuda.is_available()
cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")


def ramp_expected(span: float, ramp: int, span_len: int) -> list[float]:
    """The span mask of one head, written out independently of the op: column j has distance
    d = L' - j, the mask is evaluated at x = d - 1, m = clamp((R + z - x) / R, 0, 1); float64."""
    return [min(1.0, max(0.0, (ramp + span - (span_len - j - 1)) / ramp)) for j in range(span_len)]


def test_ramp_expected_has_r_minus_1_values_strictly_inside_at_an_integer_span():
    # not a CUDA test (it runs everywhere): the ramp of length R at an integer span has R - 1
    # values strictly inside (0, 1), its ends being exactly 1 (x = z) and 0 (x = z + R); a
    # span between integers has R. The op agrees in float64 on the CPU.
    for span in (0.0, 5.0, 2992.0):
        row = ramp_expected(span, 32, 3072)
        assert sum(0 < v < 1 for v in row) == 31
        op = adaptive_span_mask(torch.tensor([span], dtype=torch.float64), 32, 3072)[0]
        assert op.tolist() == pytest.approx(row, abs=1e-12)
    assert sum(0 < v < 1 for v in ramp_expected(2992.5, 32, 3072)) == 32


@pytest.mark.cuda
@cuda
def test_bf16_span_mask_on_cuda_equals_float32():
    # spans bf16 holds exactly, so the float32 and float64 masks are of the same spans
    spans = [2992.0, 3008.0, 3024.0]
    span16 = torch.tensor(spans, dtype=torch.bfloat16, device="cuda")
    m16 = adaptive_span_mask(span16, 32, 3072)
    m32 = adaptive_span_mask(span16.float(), 32, 3072)
    assert m16.dtype == torch.float32
    assert (m16 - m32).abs().max().item() < 1e-6
    expected = torch.tensor([ramp_expected(z, 32, 3072) for z in spans], dtype=torch.float64)
    assert (m16.double().cpu() - expected).abs().max().item() < 1e-6
    inside = [int(((row > 0) & (row < 1)).sum()) for row in m16]
    assert inside == [sum(0 < v < 1 for v in row) for row in expected.tolist()]  # R - 1 each


@pytest.mark.cuda
@cuda
def test_bf16_training_step_on_cuda_follows_float32():
    cfg = AllAttnConfig(
        d_model=64,
        n_layers=2,
        n_heads=4,
        n_persistent=16,
        max_span=256,
        span_ramp=16,
        span_init=0.5,
        attn_dropout=0.0,
    )
    torch.manual_seed(0)
    model = AllAttnLM(cfg, 50).cuda()
    tokens = torch.randint(0, 50, (4, 64), device="cuda")
    losses = {}
    for dtype in (torch.float32, torch.bfloat16):
        m = AllAttnLM(cfg, 50).cuda()
        m.load_state_dict(model.state_dict())
        m = m.to(dtype)
        opt = torch.optim.Adam(m.parameters(), lr=1e-3)
        for _ in range(3):
            out = m(tokens, tokens)
            loss = out.nll.float().mean() + m.aux_loss()
            opt.zero_grad()
            loss.backward()
            assert all(torch.isfinite(p.grad).all() for p in m.parameters() if p.grad is not None)
            opt.step()
        losses[dtype] = loss.item()
    assert losses[torch.bfloat16] == pytest.approx(losses[torch.float32], rel=2e-2)


def paper_shape_losses(device: str, updates: int = 3) -> dict:
    """enwik8_large's layer shape (d 512, 8 heads, N 2048, max span 8192, ramp 32) with its
    optimizer (the per-parameter clipped Adagrad, at lr 1e-3, where the warm-up is early on),
    2 layers, micro-batch 2 x 512, spans at a quarter of the maximum, attention dropout off
    (each precision would draw other masks): the loss after each update and the first
    gradients, float32 against the whole model in bfloat16."""
    pytest.importorskip("pydantic")  # the config's schema
    from pipeline.models import build_model
    from pipeline.spec import load_spec
    from pipeline.training.optim import build_optimizer

    root = Path(__file__).resolve().parents[3]
    spec = load_spec(
        str(root / "configs" / "enwik8_large.yaml"),
        ["model.n_layers=2", "model.attn_dropout=0.0", "train.optimizer.lr=0.001"],
    )
    torch.manual_seed(0)
    start = build_model(spec.model_kind, spec.model_params, 205)
    with torch.no_grad():
        for p, _, _ in start.bounded_parameters():
            p.fill_(0.25)
    tokens = torch.randint(0, 205, (2, 513), device=device)
    x, y = tokens[:, :-1], tokens[:, 1:]
    result = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = build_model(spec.model_kind, spec.model_params, 205)
        model.load_state_dict(start.state_dict())
        model = model.to(device=device, dtype=dtype)
        optimizer = build_optimizer(model.parameters(), spec.train.optimizer)
        state, losses, grads = None, [], None
        for _ in range(updates):
            out = model(x, y, state)
            loss = out.nll.float().mean() + model.aux_loss().float()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if grads is None:
                grads = {
                    n: p.grad.detach().float().flatten()
                    for n, p in model.named_parameters()
                    if p.grad is not None
                }
            assert all(torch.isfinite(g).all() for g in grads.values())
            optimizer.step()
            state = [s.detach() for s in out.state]
            losses.append(loss.item())
        result[dtype] = (losses, grads)
    return result


@pytest.mark.cuda
@cuda
def test_bf16_follows_fp32_at_the_paper_config_shape():
    result = paper_shape_losses("cuda")
    (l32, g32), (l16, g16) = result[torch.float32], result[torch.bfloat16]
    assert l16 == pytest.approx(l32, rel=2e-2)
    assert g16.keys() == g32.keys()
    for name in g32:  # each parameter's first gradient points the same way
        cos = torch.nn.functional.cosine_similarity(g16[name], g32[name], dim=0).item()
        assert cos > 0.95, (name, cos)


@pytest.mark.cuda
@cuda
def test_collectives_over_a_single_rank_nccl_group():
    import torch.distributed as dist

    from pipeline.cluster import distributed

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(distributed.free_port()))
    dist.init_process_group("nccl", rank=0, world_size=1)
    try:
        assert distributed.any_rank(True) is True and distributed.any_rank(False) is False
        assert distributed.mean_over_ranks(2.5) == 2.5
        assert distributed.broadcast_object({"a": 1}) == {"a": 1}
        t = torch.ones(3, device="cuda")
        dist.all_reduce(t)
        assert t.tolist() == [1.0, 1.0, 1.0]
    finally:
        dist.destroy_process_group()
