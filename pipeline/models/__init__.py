"""Model registry. Models are plain torch modules built from a config dataclass; every
family, built-in or installed, is an entry point in the group `allattn_pipe.models`
(pipeline/plugins.py)."""

from __future__ import annotations

from dataclasses import is_dataclass

import torch.nn as nn

from pipeline.models.adaptive import AdaptiveInput, AdaptiveLogSoftmax
from pipeline.models.allattn import FF_KINDS, PERSISTENT_MODES, AllAttnConfig, AllAttnLM
from pipeline.models.protocol import ModelFamily, ModelOutput, SequenceModel, State
from pipeline.plugins import MODEL_GROUP, load


def _not_a_family(kind: str, obj) -> str | None:
    if not isinstance(obj, ModelFamily):
        return (
            f"expected a pipeline.models.protocol.ModelFamily (config dataclass, model "
            f"class), found {type(obj).__name__}"
        )
    if not (isinstance(obj.config, type) and is_dataclass(obj.config)):
        return f"its config {obj.config!r} is not a dataclass"
    if not (isinstance(obj.model, type) and issubclass(obj.model, SequenceModel)):
        return f"its model {obj.model!r} is not a subclass of SequenceModel"
    return None


MODELS: dict[str, ModelFamily] = load(MODEL_GROUP, "model kind", _not_a_family)  # type: ignore[assignment]
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
    "FF_KINDS",
    "MODELS",
    "PERSISTENT_MODES",
    "AdaptiveInput",
    "AdaptiveLogSoftmax",
    "AllAttnConfig",
    "AllAttnLM",
    "ModelFamily",
    "ModelOutput",
    "SequenceModel",
    "State",
    "build_model",
    "count_parameters",
]
