"""The experiment spec: YAML in, a validated, fully resolved `Spec` out.

Resolution order: the file and its `extends` (merged in order, the file itself last), a
dataset card named by string replaced by the card's contents, then `--set` overrides
(`sources`). Every key remembers the file and line it came from, so a validation error
(`validation`) can point at it. The sections and their keys: `schema`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from pipeline.errors import shown
from pipeline.spec.schema import Spec
from pipeline.spec.sources import (
    PROJECT_ROOT,
    SpecError,
    apply_override,
    load_with_extends,
    parse_override,
    resolve_dataset_card,
)
from pipeline.spec.validation import refuse_inert_keys, validate_spec

__all__ = ["PROJECT_ROOT", "Spec", "SpecError", "load_spec", "parse_override"]


def load_spec(path: str | Path, overrides: Sequence[str] = ()) -> Spec:
    """Read, merge, override and validate a pipeline spec; SpecError on any mistake."""
    path = Path(path)
    origin = shown(path)  # where an error without a line of its own points
    where: dict = {}
    data = load_with_extends(path, where)
    parsed = [(parse_override(text), text) for text in overrides]
    for (key, value), text in parsed:
        if key == ("dataset",):
            apply_override(data, key, value, where, text, path)
    if isinstance(data.get("dataset"), str):
        data["dataset"] = resolve_dataset_card(
            data["dataset"], path, where, where.get(("dataset",), origin)
        )
    for (key, value), text in parsed:
        if key != ("dataset",):
            apply_override(data, key, value, where, text, path)
    if isinstance(data.get("dataset"), str):  # --set dataset=NAME
        data["dataset"] = resolve_dataset_card(
            data["dataset"], path, where, where.get(("dataset",), origin)
        )
    spec = validate_spec(data, where, origin)
    spec._source = str(path)
    refuse_inert_keys(spec, where, origin)
    return spec
