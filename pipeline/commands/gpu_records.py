"""The GPU check's recorded training-step figures (docs/benchmarks.md#triton), as data: what
`allattn-pipe show --estimate` turns into H100 / H200 hours. A Python module, not a data
file, so that it ships in the wheel with the package that reads it. Add a row after each GPU
check; never edit a figure that was not measured.

Each row: when and where it was measured, the config and settings, milliseconds per update,
tokens/s and MFU (the model's ``train_flops_per_token()`` at the planned L' over the GPU's
dense bf16 peak, 989 TFLOP/s on an H100 SXM / HBM3)."""

from __future__ import annotations

CHECK = {
    "date": "2026-11-27",
    "machine": "one NVIDIA H100 80GB HBM3",
    "torch": "2.11.0+cu130",
    "triton": "3.6.0",
    "command": "python -m bench.train_step configs/enwik8_large.yaml --dtype bf16 "
    "--span 0.0625,1 --batch 4,max --set model.attention.impl=triton",
    "source": "docs/benchmarks.md#triton (first GPU check)",
}

H100_BF16_PEAK_TFLOPS = 989.0
"""Dense bf16 peak of an H100 SXM / HBM3 (pipeline.cluster.device's table); an H200 has the
same (its memory is larger and faster, its tensor cores the same)."""

STEPS = (
    # code, micro-batch, span fraction, L' (synchronous), ms/step, tokens/s, peak MB, MFU
    ("reference op, eager", 4, 1 / 16, 576, 141.4, 14_485, 11_210, 0.014),
    ("reference op, eager", 4, 1.0, 8192, 348.8, 5_872, 36_159, 0.020),
    ("triton, eager", 4, 1 / 16, 576, 116.8, 17_528, 2_072, 0.017),
    ("triton, eager", 4, 1.0, 8192, 135.6, 15_105, 6_237, 0.052),
    ("triton, CUDA graphs", 4, 1 / 16, 576, 52.4, 39_105, 1_868, 0.037),
    ("triton, CUDA graphs", 4, 1.0, 8192, 138.5, 14_786, 5_709, 0.051),
    ("triton, eager, largest that fits", 41, 1 / 16, 576, 205.6, 102_093, 52_202, 0.097),
    ("triton, eager, largest that fits", 41, 1.0, 8192, 1_046.5, 20_059, 52_758, 0.069),
)
"""enwik8_large's model (114,017,773 parameters), bf16, batch rows x 512 tokens."""

CONFIG = "configs/enwik8_large.yaml"


def records() -> list[dict]:
    """Every recorded step as a dict (CHECK's fields with the row's)."""
    keys = ("code", "micro_batch", "span_frac", "span_len", "ms", "tokens_s", "peak_mb", "mfu")
    return [{**CHECK, "config": CONFIG, **dict(zip(keys, row, strict=True))} for row in STEPS]


def estimate_record(span_frac: float) -> dict:
    """The row the estimate uses at a span fraction: the largest micro-batch that fits (a
    paper config's micro_batch_size is auto), eager Triton kernel, at that fraction."""
    return next(
        r
        for r in records()
        if r["code"] == "triton, eager, largest that fits" and r["span_frac"] == span_frac
    )
