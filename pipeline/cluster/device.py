"""The device a training or evaluation process runs on, and the memory it has used."""

from __future__ import annotations

import os
import resource

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
