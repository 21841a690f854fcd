"""Model registry. Models are plain torch modules built from a config dataclass."""

from __future__ import annotations

import torch.nn as nn

from pipeline.models.active_memory import ActiveMemoryConfig, ActiveMemoryModel
from pipeline.models.adaptive import AdaptiveInput, AdaptiveLogSoftmax
from pipeline.models.allattn import FF_KINDS, PERSISTENT_MODES, AllAttnConfig, AllAttnLM
from pipeline.models.infinity_former import InfinityFormerConfig, InfinityFormerLM
from pipeline.models.protocol import ModelOutput, SequenceModel, State

MODELS: dict[str, tuple[type, type[nn.Module]]] = {
    "allattn": (AllAttnConfig, AllAttnLM),
    "active_memory": (ActiveMemoryConfig, ActiveMemoryModel),
    "infinity_former": (InfinityFormerConfig, InfinityFormerLM),
}
"""kind -> (config dataclass, model class taking (cfg, vocab_size))."""


def build_model(kind: str, cfg, vocab_size: int) -> SequenceModel:
    """Build a registered model. ``cfg`` is the kind's config dataclass (or a dict of its
    fields)."""
    try:
        cfg_cls, model_cls = MODELS[kind]
    except KeyError:
        raise ValueError(f"unknown model kind {kind!r}; known: {sorted(MODELS)}") from None
    if isinstance(cfg, dict):
        cfg = cfg_cls(**cfg)
    elif not isinstance(cfg, cfg_cls):
        raise ValueError(
            f"model kind {kind!r} needs a {cfg_cls.__name__}, got {type(cfg).__name__}"
        )
    return model_cls(cfg, vocab_size)


def count_parameters(model: nn.Module) -> int:
    """Number of parameter elements (shared parameters counted once; works on meta)."""
    return sum(p.numel() for p in model.parameters())


__all__ = [
    "FF_KINDS", "MODELS", "PERSISTENT_MODES", "AdaptiveInput", "AdaptiveLogSoftmax",
    "AllAttnConfig", "AllAttnLM", "ModelOutput", "SequenceModel", "State", "build_model",
    "count_parameters",
]
