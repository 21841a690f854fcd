"""The checkpoint directory's conventions, readable without a DeepSpeed engine.

    <root>/step-N/       one complete checkpoint (DeepSpeed's files + trainer-rank<r>.pt)
    <root>/tmp-step-N/   one being written; renamed to step-N when every rank is done
    <root>/latest        names the newest complete checkpoint
    <root>/best          names the one with the best validation so far
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import torch

from pipeline.errors import PipelineError


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
             "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def read_pointer(pointer: Path) -> str | None:
    """The checkpoint tag a pointer file (`latest`, `best`) names, if that checkpoint exists."""
    if not pointer.exists():
        return None
    tag = pointer.read_text().strip()
    return tag if (pointer.parent / tag).is_dir() else None


def latest_checkpoint(root: Path) -> str | None:
    return read_pointer(Path(root) / "latest")


def require_latest(root: Path) -> str:
    """The tag of the latest complete checkpoint under `root`; an error if there is none."""
    tag = latest_checkpoint(root)
    if tag is None:
        raise PipelineError(f"no complete checkpoint under {root}")
    return tag


def checkpoint_step(root: Path) -> int:
    """The step of the latest complete checkpoint under `root`."""
    return int(require_latest(root).removeprefix("step-"))


def load_model_weights(model: torch.nn.Module, root: Path) -> str:
    """Load the module weights of the latest checkpoint under `root` (no engine needed)."""
    tag = require_latest(root)
    path = Path(root) / tag / "mp_rank_00_model_states.pt"
    if path.exists():
        model.load_state_dict(torch.load(path, map_location="cpu", weights_only=False)["module"])
    else:   # ZeRO 3 saves each rank's shard only: assemble the fp32 weights from the shards
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        model.load_state_dict(get_fp32_state_dict_from_zero_checkpoint(str(root), tag=tag))
    return tag

