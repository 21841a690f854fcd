"""The names `--smoke` gives a run and its experiment, apart from the rest of smoke.py so that
what reads only a config's names (spec/quick.py) need not import the models (and torch)."""

from __future__ import annotations

import hashlib

SUFFIX = "-smoke"
NAME_LIMIT = 100  # Spec.name's max_length


def smoke_name(name: str) -> str:
    """`name` with SUFFIX, inside NAME_LIMIT (the rule of `name` and tracking.experiment);
    a name too long for it is cut and keeps a hash of the whole, so two long names that
    differ only past the cut still get different workspaces and experiments."""
    if len(name) + len(SUFFIX) <= NAME_LIMIT:
        return name + SUFFIX
    digest = hashlib.sha256(name.encode()).hexdigest()[:8]
    return f"{name[: NAME_LIMIT - len(SUFFIX) - len(digest) - 1]}-{digest}{SUFFIX}"
