"""The ∞-former family (`model: {kind: infinity_former}`): a Transformer-XL with a continuous
long-term memory."""

from pipeline.models.infinity_former.model import InfinityFormerConfig, InfinityFormerLM

__all__ = ["InfinityFormerConfig", "InfinityFormerLM"]
