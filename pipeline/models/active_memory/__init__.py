"""The active-memory family (`model: {kind: active_memory}`): convolutional token mixers in
place of, or added to, self-attention."""

from pipeline.models.active_memory.model import (
    CONV_ACTIVATIONS,
    GATES,
    MIXERS,
    ActiveMemoryConfig,
    ActiveMemoryModel,
)

__all__ = ["CONV_ACTIVATIONS", "GATES", "MIXERS", "ActiveMemoryConfig", "ActiveMemoryModel"]
