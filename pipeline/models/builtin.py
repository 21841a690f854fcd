"""The built-in model families, as the `allattn_pipe.models` entry points in pyproject.toml
name them (registered the way a plugin's are: pipeline/plugins.py)."""

from __future__ import annotations

from pipeline.models.active_memory import ActiveMemoryConfig, ActiveMemoryModel
from pipeline.models.allattn import AllAttnConfig, AllAttnLM
from pipeline.models.infinity_former import InfinityFormerConfig, InfinityFormerLM
from pipeline.models.protocol import ModelFamily

ALLATTN = ModelFamily(AllAttnConfig, AllAttnLM)
ACTIVE_MEMORY = ModelFamily(ActiveMemoryConfig, ActiveMemoryModel)
INFINITY_FORMER = ModelFamily(InfinityFormerConfig, InfinityFormerLM)
