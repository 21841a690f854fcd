"""The stage kinds. Each module defines one `Stage` (the interface: `stages.base`); `STAGES`
maps names to them.
"""

from __future__ import annotations

from stages import curriculum, download, evaluate, finetune, preprocess, train
from stages.base import Stage, StageContext, resolve_inputs, without

STAGES: dict[str, Stage] = {
    s.STAGE.name: s.STAGE for s in (download, preprocess, train, finetune, evaluate, curriculum)
}

__all__ = ["STAGES", "Stage", "StageContext", "resolve_inputs", "without"]
