"""The quickstart's figures on the pages are what the code prints: the full
configs/quickstart.yaml, run in a temporary workspace, ends with exactly the three
`[evaluate]` lines that README.md and docs/getting-started.md show.

The figures hold for the machine the pages name ("2 CPU cores, CPython 3.11, torch 2.13"):
the built-in corpus is made from the running Python's own files, and torch's kernels may
round differently from one version to the next. On another CPython or torch minor the test
skips saying so; CI sets $ALLATTN_REQUIRE_QUICKSTART_FIGURES (.ci/run), which turns that skip
into a failure, so a CI that moves to another Python or torch is told to refresh the figures.
The run uses 2 threads, as on the 2 cores the pages name. It takes about 5 minutes on 2 idle
cores: the check the pages' promise needs, and the only one that can catch a change in what
training computes.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", ROOT / "docs" / "getting-started.md"]
REQUIRE = "ALLATTN_REQUIRE_QUICKSTART_FIGURES"
THREADS = 2  # the pages' "2 CPU cores"

pytestmark = pytest.mark.slow


def documented(page: Path) -> tuple[list[str], str, str]:
    """The page's `[evaluate]` lines, and the CPython and torch versions it says they are for."""
    text = page.read_text(encoding="utf-8")
    lines = [line.strip() for line in text.splitlines() if line.strip().startswith("[evaluate] ")]
    machine = re.search(r"\(2 CPU cores,\s+CPython (\d+\.\d+),\s+torch (\d+\.\d+)\)", text)
    assert machine, f"{page.name}: says no '(2 CPU cores, CPython X.Y, torch X.Y)' for its figures"
    return lines, machine.group(1), machine.group(2)


def test_both_pages_show_the_same_figures_for_the_same_machine():
    first, *others = [documented(page) for page in PAGES]
    assert len(first[0]) == 3, first[0]
    assert all(other == first for other in others), [documented(p) for p in PAGES]


@pytest.fixture(scope="module")
def printed(tmp_path_factory) -> list[str]:
    """The `[evaluate]` lines of a full quickstart run, on the machine the pages name."""
    _, python, torch_version = documented(PAGES[0])
    here = f"{sys.version_info[0]}.{sys.version_info[1]}"
    torch_here = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    if (here, torch_here) != (python, torch_version):
        why = (
            f"the pages' quickstart figures are for CPython {python}, torch {torch_version} "
            f"(the corpus is made from Python's own files); this is CPython {here}, "
            f"torch {torch_here}"
        )
        if os.environ.get(REQUIRE):
            pytest.fail(f"{why}: rerun the quickstart and update the pages ({REQUIRE} is set)")
        pytest.skip(why)
    runs = tmp_path_factory.mktemp("quickstart-figures") / "runs"
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS=str(THREADS))
    result = subprocess.run(
        [sys.executable, "-m", "pipeline.commands.cli", "run", "configs/quickstart.yaml"]
        + ["--set", f"workspace.root={runs}"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=3 * 3600,  # ~5 minutes on 2 idle cores; hours when other work shares them
    )
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    return [
        line.strip()
        for line in result.stdout.splitlines()
        if re.match(r"\[evaluate\] (checkpoint|valid|test)", line)
    ]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_the_pages_quickstart_figures_are_what_it_prints(printed, page):
    shown, _, _ = documented(page)
    assert shown == printed, (
        f"{page.relative_to(ROOT)} shows\n  " + "\n  ".join(shown) + "\nthe quickstart printed\n  "
        "" + "\n  ".join(printed)
    )
