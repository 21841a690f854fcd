"""The experiment spec: YAML in, a validated, fully resolved `Spec` out.

Resolution order: the file and its `extends` (merged in order, the file itself last), a
dataset card named by string replaced by the card's contents, then `--set` overrides
(`sources`). Every key remembers the file and line it came from, so a validation error
(`validation`) can point at it. The sections and their keys: `schema`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipeline.spec.yaml_reading import PROJECT_ROOT, SpecError, parse_override

if TYPE_CHECKING:
    from pipeline.spec.loading import ALL, inert_on_its_own, load_spec
    from pipeline.spec.schema import Spec

__all__ = ["ALL", "PROJECT_ROOT", "Spec", "SpecError", "inert_on_its_own", "load_spec"]
__all__ += ["parse_override"]

_LOADING = {"ALL", "inert_on_its_own", "load_spec"}


def __getattr__(name: str):
    # loading and schema import the models' configs, and so torch (seconds of a fresh
    # process): they come on first use, so that what reads only a config's names (quick.py,
    # run's busy-workspace check) starts without them
    if name in _LOADING:
        from pipeline.spec import loading

        return getattr(loading, name)
    if name == "Spec":
        from pipeline.spec.schema import Spec

        return Spec
    raise AttributeError(f"module 'pipeline.spec' has no attribute {name!r}")
