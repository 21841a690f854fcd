"""The all-attention family (`model: {kind: allattn}`): its config, layers and language model."""

from pipeline.models.allattn.config import FF_KINDS, PERSISTENT_MODES, AllAttnConfig
from pipeline.models.allattn.model import AllAttnLM

__all__ = ["FF_KINDS", "PERSISTENT_MODES", "AllAttnConfig", "AllAttnLM"]
