"""The device a training or evaluation process runs on, the memory it has used, and its
dense peak FLOP rate (for model FLOPs utilisation)."""

from __future__ import annotations

import os
import re
import resource
from typing import NamedTuple

import torch

from pipeline.errors import PipelineError


def resolve_device(name: str) -> torch.device:
    """`train.device` (auto, cpu or cuda) as this process's device: under a launcher, the
    GPU of its local rank."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise PipelineError("train.device is cuda but torch sees no CUDA device")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def peak_memory_mb(device: torch.device) -> float:
    """Peak memory so far in MiB: allocated on the GPU, else the process's resident set."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


class _Peak(NamedTuple):
    name: str  # a regular expression searched in torch.cuda.get_device_name()
    fp16: float  # dense tensor-core TFLOP/s, float16 inputs, float32 accumulation
    bf16: float | None  # the same in bfloat16 (None: no bfloat16 tensor cores)
    fp32: float  # plain FP32 (CUDA cores)
    tf32: float | None  # float32 matmuls on TF32 tensor cores (None: none)


# Dense (no 2:4 sparsity) peaks in TFLOP/s from the vendors' datasheets (NVIDIA H100, H200,
# A100, L40S, A10, V100 SXM2; the Ada GeForce whitepaper for the RTX 4090, with float32
# accumulation), whose tensor figures are quoted with sparsity, twice these. The first
# pattern that matches wins: the specific names ("H100 PCIe", "H100 NVL") before the
# family's; word boundaries keep "A10" from matching an A100 or an A10G and "H200" a GH200.
_PEAKS = (
    _Peak(r"\bH100\b.*\bNVL\b", 835.5, 835.5, 60.0, 417.5),
    _Peak(r"\bH100\b.*\bPCIe\b", 756.0, 756.0, 51.0, 378.0),
    _Peak(r"\bH100\b.*(\bHBM3|\bSXM)", 989.0, 989.0, 67.0, 494.7),
    _Peak(r"\bH200\b.*\bNVL\b", 835.5, 835.5, 60.0, 417.5),
    _Peak(r"\bH200\b", 989.0, 989.0, 67.0, 494.7),
    _Peak(r"\bA100\b", 312.0, 312.0, 19.5, 156.0),
    _Peak(r"\bL40S\b", 362.0, 362.0, 91.6, 183.0),
    _Peak(r"\bA10\b", 125.0, 125.0, 31.2, 62.5),
    _Peak(r"\bRTX 4090\b", 165.2, 165.2, 82.6, 82.6),
    _Peak(r"\bV100\b", 125.0, None, 15.7, None),
)


def dense_peak_tflops(device: torch.device, dtype: torch.dtype) -> float | None:
    """The GPU's dense peak in TFLOP/s for matmuls in `dtype` (float32: TF32's when
    ``torch.backends.cuda.matmul.allow_tf32`` is on and the GPU has it), the denominator of
    model FLOPs utilisation. None on the CPU, for a GPU not in the table, for a MIG slice
    (a share of the GPU) and for other dtypes."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    if "MIG" in name:
        return None
    for peak in _PEAKS:
        if re.search(peak.name, name, re.IGNORECASE):
            if dtype == torch.float32:
                if torch.backends.cuda.matmul.allow_tf32 and peak.tf32 is not None:
                    return peak.tf32
                return peak.fp32
            return {torch.float16: peak.fp16, torch.bfloat16: peak.bf16}.get(dtype)
    return None
