"""Value checks shared by the model families' config dataclasses: YAML and `--set` hand them
plain values, and a wrong type or range must fail naming the field, not deep in a forward."""

from __future__ import annotations

import math
from dataclasses import fields


def check_scalar_types(cfg) -> None:
    """Refuse a field declared int, bool, float or str whose value is not one (a bool is no
    int; a float must be finite)."""
    for f in fields(cfg):
        value, kind = getattr(cfg, f.name), f.type if isinstance(f.type, str) else f.type.__name__
        if kind == "int" and (isinstance(value, bool) or not isinstance(value, int)):
            raise ValueError(f"{f.name} must be an int, got {value!r}")
        if kind == "bool" and not isinstance(value, bool):
            raise ValueError(f"{f.name} must be a bool, got {value!r}")
        if kind == "float" and (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not math.isfinite(value)
        ):
            raise ValueError(f"{f.name} must be a finite number, got {value!r}")
        if kind == "str" and not isinstance(value, str):
            raise ValueError(f"{f.name} must be a string, got {value!r}")


def check_at_least(cfg, names, low: int) -> None:
    """Refuse any of the fields `names` below `low`."""
    for name in names:
        if getattr(cfg, name) < low:
            raise ValueError(f"{name} must be >= {low}, got {getattr(cfg, name)}")
