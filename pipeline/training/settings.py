"""The settings a run trains with: the one place a `Trainer` (pipeline.training.trainer) and
the fingerprints of the stages that build one (stages.train, stages.curriculum; finetune
through train's build id) take them from, so that no key the trainer reads can be left out
of a fingerprint.

- `trains_with(spec)`: the model and the whole `train` section. A training stage fingerprints
  it less the keys it declares runtime-only (each with its reason, `Stage.runtime_only`): a
  key added to TrainSpec counts in every training stage until one says why it changes nothing.
- `as_trained(spec)`: the spec a Trainer reads, every `train.*` key that does nothing under
  the other settings (Spec.inert_keys: a curriculum's `train.deepspeed`, `clip_norm` with
  `clip: none`...) at its default, the value every fingerprint counts for it
  (`Stage.fingerprinted`). Such a key may still reach the spec from an `extends` base, where it
  is accepted; it never reaches the training.
"""

from __future__ import annotations

from collections.abc import Mapping


def trains_with(spec) -> dict:
    """What a Trainer built from `spec` trains with: the model's resolved section and the
    whole train section, as plain data (the core of a training stage's config)."""
    return {"model": spec.resolved()["model"], "train": spec.train.model_dump(mode="json")}


def as_trained(spec):
    """`spec` with each inert `train.*` key (Spec.inert_defaults) at its default; `spec`
    itself when they all are already (or it has no train section)."""
    if spec.train is None:
        return spec
    pinned = {
        path.removeprefix("train."): value
        for path, value in spec.inert_defaults().items()
        if path.startswith("train.")
    }
    current = spec.train.model_dump(mode="json")
    trained = with_values(current, pinned)
    if trained == current:
        return spec
    return spec.model_copy(update={"train": type(spec.train).model_validate(trained)})


def with_values(config: dict, values: Mapping[str, object]) -> dict:
    """A copy of `config` with the dotted key paths of `values` that it has set to theirs."""
    out = dict(config)
    for path, value in values.items():
        head, _, rest = path.partition(".")
        if head not in out:
            continue
        if not rest:
            out[head] = value
        elif isinstance(out[head], dict):
            out[head] = with_values(out[head], {rest: value})
    return out
