"""The stage kinds. Each module defines one `Stage` (the interface: `stages.base`); `STAGES`
maps names to them. Every kind, built-in or installed, is an entry point in the group
`allattn_pipe.stages` (pipeline/plugins.py): the built-ins are this package's modules' `STAGE`.
"""

from __future__ import annotations

from pipeline.plugins import STAGE_GROUP, load
from stages.base import Stage, StageContext, resolve_inputs, without


def _not_a_stage(name: str, obj) -> str | None:
    if not isinstance(obj, Stage):
        return f"expected a stages.base.Stage, found {type(obj).__name__}"
    if obj.name != name:  # the runner, records and --only know a stage by Stage.name
        return f"its Stage.name is '{obj.name}': it must be the entry point's name"
    return None


def _in_reading_order(stages: dict[str, Stage]) -> dict[str, Stage]:
    """The stages, each after every stage it may read (ties by name): the order `allattn-pipe
    stages` and the reference list them in, a plugin's beside the built-ins it reads."""
    before = {
        name: {
            o
            for need in stage.inputs
            for o in (need if isinstance(need, tuple) else (need,))
            if o in stages
        }
        for name, stage in stages.items()
    }
    ordered: dict[str, Stage] = {}
    while len(ordered) < len(stages):
        ready = sorted(n for n in stages if n not in ordered and before[n] <= ordered.keys())
        if not ready:  # stages reading each other: no order runs them, keep them by name
            ready = sorted(n for n in stages if n not in ordered)
        ordered[ready[0]] = stages[ready[0]]
    return ordered


STAGES: dict[str, Stage] = _in_reading_order(load(STAGE_GROUP, "stage kind", _not_a_stage))  # type: ignore[arg-type]


def training_plans(spec) -> list:
    """(name, TrainingPlan) of each stage of `spec` that trains, in the spec's order: what
    the estimate counts and times."""
    return [
        (name, stage.plan(spec))
        for name in spec.stages
        if (stage := STAGES.get(name)) is not None and stage.plan is not None
    ]


__all__ = ["STAGES", "Stage", "StageContext", "resolve_inputs", "training_plans", "without"]
