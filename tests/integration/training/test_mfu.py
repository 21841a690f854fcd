"""Model FLOPs utilisation: the training FLOPs per token a model reports through the protocol
(``SequenceModel.train_flops_per_token``, the all-attention model's own count at the planned
spans), the GPU's dense peak by name (``pipeline.cluster.device.dense_peak_tflops``) and the
trainer's report, which logs ``mfu`` to the tracker and the log line where the peak is known
(on CUDA), and nothing new on the CPU. The expected counts are worked out here from the
configs, by hand."""

from __future__ import annotations

import pytest
import torch

from pipeline.cluster.device import dense_peak_tflops
from pipeline.diagnostics.host_syncs import HostSyncCounter
from pipeline.models.active_memory import ActiveMemoryConfig, ActiveMemoryModel
from pipeline.models.allattn import AllAttnLM
from tests.fixtures.runs import short_run
from tests.fixtures.tiny_models import tiny_allattn

D, LAYERS, HEADS, N, VOCAB = 16, 2, 2, 4, 50


def allattn(**kw) -> AllAttnLM:
    # the ramp and dropout are AllAttnConfig's defaults, as these counts were written with
    return tiny_allattn(
        VOCAB, d_model=D, n_layers=LAYERS, n_heads=HEADS, n_persistent=N, span_ramp=32,
        attn_dropout=0.3, **kw,
    )  # fmt: skip


def allattn_flops(span: int, adaptive: bool) -> float:
    """6 per weight outside the embedding, the position table and the persistent vectors,
    plus per layer 6 x 2 x d x N for the products with the persistent vectors (q.M_k, a.M_v)
    and 6 x 3 x d x L' for those with the context (q.k, q.u, a.v)."""
    per_layer = 4 * D * D + 2 * D + (HEADS if adaptive else 0)  # W_qkvo, LayerNorm, span
    out = D * VOCAB + VOCAB  # the output Linear, with bias
    weights = LAYERS * per_layer + out
    return 6.0 * weights + LAYERS * 6 * (2 * D * N + 3 * D * span)


def test_the_flops_at_a_span_fraction_are_planned_there_and_keep_the_plan_in_force():
    """The estimate's hook (AttentionSpans.train_flops_per_token_at): every span at the
    fraction, its L' planned as training plans it, and the plan in force left as it was."""
    model = allattn(max_span=1024, span_init=0.0)
    with model.planned_update():  # the first plan: L' 128 (as above)
        pass
    in_force = model.train_flops_per_token()
    assert model.spans_grow() and in_force == allattn_flops(128, adaptive=True)
    # 1/16 of 1024: span 64 + ramp 32 + 64 tokens of room = 160, the bucket above it 192
    # (buckets 64 x 2^i and 96 x 2^i); the full span: max_span
    assert model.train_flops_per_token_at(1 / 16) == (allattn_flops(192, adaptive=True), "L' 192")
    assert model.train_flops_per_token_at(1.0) == (allattn_flops(1024, adaptive=True), "L' 1024")
    assert model.train_flops_per_token() == in_force
    fixed = allattn(max_span=64, adaptive_span=False)
    assert not fixed.spans_grow()
    assert fixed.train_flops_per_token_at(1 / 16) == (allattn_flops(64, adaptive=False), "L' 64")


def test_a_fixed_span_counts_max_span():
    model = allattn(max_span=64, adaptive_span=False)
    assert model.train_flops_per_token() == allattn_flops(64, adaptive=False)
    with model.planned_update():
        assert model.train_flops_per_token() == allattn_flops(64, adaptive=False)


def test_an_adaptive_span_counts_the_planned_span_without_reading_the_device():
    model = allattn(max_span=1024, span_init=0.0)
    # no plan yet: max_span
    assert model.train_flops_per_token() == allattn_flops(1024, adaptive=True)
    with model.planned_update():  # the first plan reads the current spans (0 tokens)
        # span 0 + ramp 32 -> L' 64, + 64 tokens of room to grow -> the bucket 128
        assert model.span_lens() == [128, 128]
        with HostSyncCounter() as counter:
            inside = model.train_flops_per_token()
        assert counter.syncs == [], counter.syncs
    assert inside == allattn_flops(128, adaptive=True)
    # the spans grow on the device: the count stays the plan's (the L' the updates run at)
    # until a plan is made from them, and never reads them
    with torch.no_grad():
        for p, _, _ in model.bounded_parameters():
            p.fill_(1.0)
    with HostSyncCounter() as counter:
        after = model.train_flops_per_token()
    assert counter.syncs == [], counter.syncs
    assert after == inside


def test_head_split_counts_the_context_heads_and_their_persistent_vectors():
    """Half the heads see the context, the other half their N vectors: the persistent
    vectors are half the all-attn model's and the context products half as wide."""
    model = allattn(max_span=64, adaptive_span=False, persistent_mode="head_split")
    weights = LAYERS * (4 * D * D + 2 * D + 2 * (HEADS // 2) * N * (D // HEADS)) + D * VOCAB
    attn = LAYERS * 6 * 3 * (D // 2) * 64
    assert model.train_flops_per_token() == 6.0 * (weights + VOCAB) + attn


BLOCK = 16  # tokens per training block


def cached_projections(span: int, per_mac: int) -> float:
    """K and V (d x d each) of the L' cached rows, made again for every block of BLOCK
    tokens, per token and layer."""
    return per_mac * 2 * D * D * span / BLOCK


def triton_recomputation(span: int) -> float:
    """Per token and layer: the window's q.k, q.u (in the dq and the dk/dv kernels) and dO.v
    (once more than the model's backward), 5 products of d x L'; the persistent vectors' 3
    of d x N; 2 FLOPs a multiply-add."""
    return 2 * 5 * D * span + 2 * 3 * D * N


def test_hardware_flops_add_the_cache_s_projections_the_kernels_recomputation_and_checkpointing():
    model = allattn(max_span=64, adaptive_span=False)
    want = allattn_flops(64, adaptive=False)
    assert model.train_hardware_flops_per_token(BLOCK) == pytest.approx(
        want + LAYERS * cached_projections(64, 6), rel=1e-12
    )
    model.set_attention_impl("triton")
    assert model.train_hardware_flops_per_token(BLOCK) == pytest.approx(
        want + LAYERS * (cached_projections(64, 6) + triton_recomputation(64)), rel=1e-12
    )
    model.activation_checkpointing = True  # the forward again: 2 of the 6 per weight
    assert model.train_hardware_flops_per_token(BLOCK) == pytest.approx(
        want * 4 / 3 + LAYERS * (cached_projections(64, 8) + triton_recomputation(64)), rel=1e-12
    )
    assert model.train_flops_per_token() == want  # the MFU's count is what the model needs


def test_the_default_is_six_per_weight_outside_the_embeddings():
    d, layers, ff, heads, head_dim = 8, 2, 16, 2, 4
    cfg = ActiveMemoryConfig(
        mixer="self_attention",
        causal=True,
        d_model=d,
        n_layers=layers,
        ff_dim=ff,
        n_heads=heads,
        head_dim=head_dim,
    )
    model = ActiveMemoryModel(cfg, VOCAB)
    inner = heads * head_dim
    per_layer = (
        2 * d  # mixer LayerNorm
        + 4 * d * inner  # query, key, value, out: no biases
        + 2 * d  # feed-forward LayerNorm
        + (d * ff + ff)  # ff_in
        + (ff * d + d)  # ff_out
    )
    weights = layers * per_layer + 2 * d + (d * VOCAB + VOCAB)  # + final norm, output
    assert sum(p.numel() for p in model.parameters()) == weights + VOCAB * d  # + embedding
    assert model.train_flops_per_token() == 6.0 * weights
    # the hardware's count: the same, and a forward more (2 per weight) when recomputed
    assert model.train_hardware_flops_per_token(BLOCK) == 6.0 * weights
    model.activation_checkpointing = True
    assert model.train_hardware_flops_per_token(BLOCK) == pytest.approx(8.0 * weights, rel=1e-12)


# ---------------------------------------------------------------- the peak by name


@pytest.mark.parametrize(
    "name, dtype, peak",
    [
        ("NVIDIA H100 80GB HBM3", torch.bfloat16, 989.0),
        ("NVIDIA H100 80GB HBM3", torch.float16, 989.0),
        ("NVIDIA H100 80GB HBM3", torch.float32, 67.0),
        ("NVIDIA H100 PCIe", torch.bfloat16, 756.0),
        ("NVIDIA H100 PCIe", torch.float32, 51.0),
        ("NVIDIA H200", torch.bfloat16, 989.0),
        ("NVIDIA A100-SXM4-80GB", torch.bfloat16, 312.0),
        ("NVIDIA A100-PCIE-40GB", torch.float32, 19.5),
        ("NVIDIA L40S", torch.bfloat16, 362.0),
        ("NVIDIA A10", torch.bfloat16, 125.0),
        ("NVIDIA GeForce RTX 4090", torch.bfloat16, 165.2),
        ("Tesla V100-SXM2-16GB", torch.float16, 125.0),
        ("Tesla V100-SXM2-16GB", torch.bfloat16, None),  # no bfloat16 tensor cores
        ("Tesla V100-SXM2-16GB", torch.float32, 15.7),
        ("NVIDIA A10G", torch.bfloat16, None),  # not an A10, nor an A100
        ("NVIDIA H100 80GB HBM3 MIG 1g.10gb", torch.bfloat16, None),  # a slice of one
        ("NVIDIA Some Future GPU", torch.bfloat16, None),
        ("NVIDIA H100 80GB HBM3", torch.float64, None),
    ],
)
def test_the_dense_peak_by_device_name(monkeypatch, name, dtype, peak):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert dense_peak_tflops(torch.device("cuda", 0), dtype) == peak


def test_float32_under_tf32_is_the_tf32_peak(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    matmul = torch.backends.cuda.matmul  # a module object monkeypatch cannot restore
    before = matmul.allow_tf32
    matmul.allow_tf32 = True
    try:
        assert dense_peak_tflops(torch.device("cuda", 0), torch.float32) == 494.7
        monkeypatch.setattr(
            torch.cuda, "get_device_name", lambda device=None: "Tesla V100-SXM2-16GB"
        )
        assert dense_peak_tflops(torch.device("cuda", 0), torch.float32) == 15.7  # no TF32
    finally:
        matmul.allow_tf32 = before


def test_the_cpu_has_no_peak(monkeypatch):
    def no_gpu(device=None):
        raise AssertionError("asked a GPU's name for the CPU")

    monkeypatch.setattr(torch.cuda, "get_device_name", no_gpu)
    assert dense_peak_tflops(torch.device("cpu"), torch.float32) is None
    assert dense_peak_tflops(torch.device("cpu"), torch.bfloat16) is None


# ---------------------------------------------------------------- the trainer's report


def test_the_report_has_mfu_where_the_peak_is_known(tmp_path, monkeypatch):
    import pipeline.training.trainer as trainer_module

    asked = []

    def peak(device, dtype):
        asked.append((device, dtype))
        return 50.0

    monkeypatch.setattr(trainer_module, "dense_peak_tflops", peak)
    trainer, metrics, reports = short_run(tmp_path, monkeypatch, ["train.deepspeed.bf16=true"])
    assert asked == [(torch.device("cpu"), torch.bfloat16)]  # once, in the matmuls' dtype
    flops = trainer.model.train_flops_per_token()  # the plan of the last update, as reported
    assert trainer.world_size == 1
    last = metrics[-1]
    assert last["mfu"] == pytest.approx(last["tokens_per_s"] * flops / 50e12, rel=1e-12)
    assert 0 < last["mfu"] < 1
    hardware = trainer.model.train_hardware_flops_per_token(trainer.block_len)
    assert trainer.block_len == trainer.spec.train.seq_len
    assert last["hfu"] == pytest.approx(last["tokens_per_s"] * hardware / 50e12, rel=1e-12)
    assert last["hfu"] > last["mfu"]  # the cache's K and V projections, made again
    assert all("mfu" in m and "hfu" in m for m in metrics)
    assert all(
        " tok/s  mfu " in line and "  hfu " in line and "%  eta " in line for line in reports
    ), reports


def test_the_report_on_the_cpu_is_as_before(tmp_path, monkeypatch):
    trainer, metrics, reports = short_run(tmp_path, monkeypatch)
    assert trainer.peak_tflops is None
    assert not any("mfu" in m or "hfu" in m for m in metrics)
    assert not any("mfu" in line or "hfu" in line for line in reports)
    assert all(" tok/s  eta " in line for line in reports), reports
