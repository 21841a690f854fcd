"""Process-group set-up for DeepSpeed, the same for one CPU process and many GPU nodes."""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prepare_environment() -> None:
    """Environment DeepSpeed reads at import time. Call before `import deepspeed`."""
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    # C++ ops DeepSpeed builds on first use: cached per interpreter prefix (virtualenv),
    # so two environments never clobber each other's builds.
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))
    # Launched by hand as a single process: give the process group what a launcher would.
    if "RANK" not in os.environ:
        os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
                           "MASTER_ADDR": "127.0.0.1",
                           "MASTER_PORT": os.environ.get("MASTER_PORT", str(_free_port()))})


def init_process_group() -> tuple[int, int]:
    """(rank, world size), the group initialised with nccl on CUDA and gloo on CPU."""
    prepare_environment()
    import deepspeed
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        deepspeed.init_distributed(dist_backend=backend, verbose=False)
    return dist.get_rank(), dist.get_world_size()


def barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
