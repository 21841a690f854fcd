"""The one interface every stage kind implements: a `Stage` and the `StageContext` it runs in.

A stage reads the outputs of the stages it names in `inputs`, writes its own outputs into
`ctx.out_dir`, and returns a small JSON-able summary. The runner does the rest: ordering,
fingerprints, skipping, atomic publication of `out_dir`, tracking.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.redact import mask
from pipeline.training.settings import with_values

if TYPE_CHECKING:
    from pipeline.training.plan import TrainingPlan


@dataclass(frozen=True)
class Stage:
    name: str
    summary: str  # one line, for `allattn-pipe stages`
    # Stages whose outputs this one reads. A tuple entry means "the last of these that the
    # pipeline runs" (evaluate reads finetune's checkpoint if there is one, else train's).
    inputs: tuple[str | tuple[str, ...], ...]
    section_key: str | None  # the spec section it requires, if any
    config: Callable[[Any], dict]  # the resolved config the stage runs with
    run: Callable[[StageContext], dict]
    # Runs on every rank of a multi-process launch; the others run on rank 0 alone.
    distributed: bool = False
    # Dotted key paths of `config` that change how the stage runs but not its result, each
    # with the reason. The fingerprint leaves them out: editing them resumes an interrupted
    # run and keeps a finished one.
    runtime_only: Mapping[str, str] = field(default_factory=dict)
    # Dotted key paths `config` gained after runs of the stage already existed, each with the
    # value that does what the stage did before the key existed. At that value a key is left
    # out of the fingerprint: upgrading neither re-runs a finished stage nor refuses to
    # resume an interrupted one. Any other value is a different result and counts.
    added_keys: Mapping[str, object] = field(default_factory=dict)
    # The spec section `config` is (finetune, evaluate), or None where config's keys are
    # spec paths themselves (train.*, model.*): how the spec's inert keys are found in it.
    config_section: str | None = None
    # A stage that trains: how, read off the spec (pipeline.training.plan.TrainingPlan); its
    # `run` hands it to stages.training, and `show --estimate` counts and times it
    plan: Callable[[Any], TrainingPlan] | None = None
    # What a `run` that finds the stage up to date prints of its record (each line after
    # "[name] "): (spec, the summary `run` returned, as stage.json keeps it: keys sorted) ->
    # lines. None, or no lines: nothing. Where they are evaluate's scores of weights it would
    # not score now, one stale line is printed instead (pipeline.workspace.scores).
    result_lines: Callable[[Any, dict], list[str]] | None = None
    # What a stage costs beyond a plan's tokens, as lines of `show --estimate` read off the
    # spec (evaluate's tokens per split); None: nothing to say
    estimate_lines: Callable[[Any], list[str]] | None = None

    def fingerprinted(self, spec) -> dict:
        """The config less its runtime-only keys, and less the added keys that hold their
        earlier value, with every key that takes no effect under the others (Spec.inert_keys)
        at its default, as a Trainer reads it (pipeline.training.settings.as_trained): what
        decides whether outputs are reusable."""
        # credentials masked: the config is recorded in the workspace, and a rotated token
        # (a new pre-signed URL) fetches the same data, which dataset.sha256 pins
        config = mask(self.config(spec))
        at_old_value = [
            path for path, value in self.added_keys.items() if _lookup(config, path) == value
        ]
        config = without(config, [*self.runtime_only, *at_old_value])
        prefix = f"{self.config_section}." if self.config_section else ""
        return with_values(
            config,
            {
                path[len(prefix) :]: value
                for path, value in spec.inert_defaults().items()
                if path.startswith(prefix)
            },
        )


def _lookup(config: dict, path: str):
    """The value at a dotted key path of `config`, or a sentinel nothing equals if absent."""
    node = config
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return _ABSENT
        node = node[part]
    return node


_ABSENT = object()


class NullStageTracker:
    """What a stage may call on `ctx.tracker` (`pipeline.tracking.tracker.StageTracker` logs
    it to MLflow), doing nothing: tracking off, ranks other than 0, and tests."""

    run_id = None

    def log_params(self, params: dict) -> None: ...
    def log_metrics(self, metrics: dict, step: int) -> None: ...
    def log_artifact(self, path, artifact_path: str | None = None) -> None: ...
    def set_tags(self, tags: dict) -> None: ...
    def make_durable(self) -> None: ...


@dataclass
class StageContext:
    spec: Any  # pipeline.spec.Spec
    out_dir: Path  # where outputs go; published atomically on success
    inputs: dict[str, Path]  # input stage name -> its published output directory
    tracker: Any  # a StageTracker, or NullStageTracker
    log: Callable[[str], None] = print
    info: dict = field(default_factory=dict)  # free-form notes a stage leaves for the runner


def without(config: dict, paths) -> dict:
    """A copy of `config` without the dotted key paths `paths` (absent ones are ignored)."""
    out = dict(config)
    nested: dict[str, list[str]] = {}
    for path in paths:
        head, _, rest = path.partition(".")
        if rest:
            nested.setdefault(head, []).append(rest)
        else:
            out.pop(head, None)
    for head, rests in nested.items():
        if isinstance(out.get(head), dict):
            out[head] = without(out[head], rests)
    return out


def resolve_inputs(stage: Stage, order: list[str]) -> list[str]:
    """The concrete input stage names for `stage` in a pipeline that runs `order`."""
    before = order[: order.index(stage.name)]
    names = []
    for needed in stage.inputs:
        options = needed if isinstance(needed, tuple) else (needed,)
        present = [o for o in options if o in before]
        if present and (name := max(present, key=before.index)) not in names:
            names.append(name)
    return names
