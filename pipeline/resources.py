"""The project's files that the package reads at run time: the dataset cards (`datasets/`), the
paper configs (`configs/`) and the Slurm template (`launch/slurm.sbatch`).

They have one place, the checkout's folders. A wheel carries a copy of them in
`pipeline/_project/` (setup.py's build step puts it there), so that an installed package finds
them from any directory; an editable install, or a checkout on PYTHONPATH, reads the checkout's
folders themselves.

Plain paths rather than importlib.resources' readers: a config's `extends` names files beside
it, every spec error names a file and a line, and the DeepSpeed launcher needs a directory to
start in. pip installs a wheel unpacked, so the copies are real files.
"""

from __future__ import annotations

from pathlib import Path

SHIPPED = Path(__file__).resolve().parent / "_project"
"""Where a wheel's build puts the copies (setup.py: `SHIPPED_AS`)."""

CHECKOUT = Path(__file__).resolve().parents[1]
"""The source checkout, where the package is imported from one."""

FOLDERS = ("configs", "datasets", "launch")


def project_dir(folder: str) -> Path:
    """`configs`, `datasets` or `launch`: the wheel's copy where the package has one, else the
    checkout's folder."""
    if folder not in FOLDERS:
        raise ValueError(f"not a folder the package ships: {folder!r}")
    shipped = SHIPPED / folder
    return shipped if shipped.is_dir() else CHECKOUT / folder
