"""What only a GPU can show, marked `cuda` (bench/gpu_check.py runs `pytest -m cuda`): the span
mask and a whole training step in bf16 on CUDA against float32, and our collectives over a
one-rank nccl group. They skip here, naming why; the flex dropout test is in
test_attention_fused.py."""

from __future__ import annotations

import os

import pytest
import torch

from pipeline.models import AllAttnConfig, AllAttnLM
from pipeline.ops import adaptive_span_mask

CUDA = torch.cuda.is_available()
pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")]


def test_bf16_span_mask_on_cuda_equals_float32():
    span16 = torch.tensor([2992.0, 3008.0, 3024.0], dtype=torch.bfloat16, device="cuda")
    m16 = adaptive_span_mask(span16, 32, 3072)
    m32 = adaptive_span_mask(span16.float(), 32, 3072)
    assert m16.dtype == torch.float32
    assert (m16 - m32).abs().max().item() < 1e-6
    assert [int(((row > 0) & (row < 1)).sum()) for row in m16] == [32] * 3   # the ramp


def test_bf16_training_step_on_cuda_follows_float32():
    cfg = AllAttnConfig(d_model=64, n_layers=2, n_heads=4, n_persistent=16, max_span=256,
                        span_ramp=16, span_init=0.5, attn_dropout=0.0)
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
