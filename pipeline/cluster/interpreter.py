"""The Python processes a run starts (the deepspeed runner, sweep's points, a Slurm array
task's steps) run the installed package, never code from where the user stands: the
working directory off sys.path and out of PYTHONPATH."""

from __future__ import annotations

import os
import sys
from pathlib import Path

RANK_MODULE = "pipeline.commands.launched"
"""What each process of a multi-process run executes (as `python -m`, or deepspeed's
`--module`), from the installed package: the launcher and the Slurm script both start it."""


def python_module(module: str) -> list[str]:
    """`python -m module` with the working directory off sys.path: `-P` (3.11+); before it,
    a `-c` that drops sys.path[0] (the working directory) before importing anything."""
    if sys.version_info >= (3, 11):
        return [sys.executable, "-P", "-m", module]
    code = (
        "import sys; del sys.path[0]; import runpy; "
        f"runpy.run_module({module!r}, run_name='__main__', alter_sys=True)"
    )
    return [sys.executable, "-c", code]


def safe_environment(env: dict[str, str], cwd: Path | None = None) -> dict[str, str]:
    """`env` for a Python process we start: PYTHONSAFEPATH=1 (3.11+: no script's or working
    directory on sys.path, in it and in every process it starts), and PYTHONPATH without an
    entry that names the working directory (empty, relative, or `cwd` itself)."""
    here = os.path.realpath(cwd or os.getcwd())
    out = dict(env)
    out["PYTHONSAFEPATH"] = "1"
    entries = out.pop("PYTHONPATH", "").split(os.pathsep)
    kept = [e for e in entries if os.path.isabs(e) and os.path.realpath(e) != here]
    if kept:
        out["PYTHONPATH"] = os.pathsep.join(kept)
    return out
