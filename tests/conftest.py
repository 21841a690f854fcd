"""The suite's tiers and the fixtures every test shares.

A test's tier is its folder (docs/contributing.md says which to run when):

- ``tests/unit/``: one module at a time, in process; no subprocess, no `allattn-pipe run`,
  no DeepSpeed engine. Seconds each.
- ``tests/integration/``: pipelines and engines in process (or one short child process) on
  tiny models. ``make test`` runs these two tiers and ``tests/test_architecture.py``.
- ``tests/system/``: what a user's run does end to end: Slurm, several DeepSpeed processes,
  kill -9, the fuzz campaigns, the quickstart's figures, the docs build, the plugin install,
  the paper configs, the Triton kernels at every GPU tile. ``make test-all`` adds them.

A case may name a higher tier than its folder's with a marker (the Triton kernels' tests at
the GPU's tile sizes are ``@pytest.mark.system`` cases of a unit test). Each test gets its tier
as a marker (``-m unit`` selects one) and a timeout that fails it
with every thread's stack when it hangs (pytest-timeout; a test's own
``@pytest.mark.timeout`` wins). The shared fixtures live in ``tests/fixtures/`` and load
here as plugins, so no test module imports another.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = [
    "tests.fixtures.environment",
    "tests.fixtures.download_server",
    "tests.fixtures.stand_in_stages",
    "tests.fixtures.tracked_pipeline",
    "tests.fixtures.trained",
]

TESTS = Path(__file__).resolve().parent
TIMEOUT_S = {"unit": 120, "integration": 600, "system": 1800}
"""Per test, by tier: several times the slowest test of the tier on 2 busy cores."""


def tier_of(path: Path) -> str:
    """The tier of a test file: its first folder under tests/ (the project-wide checks at
    the top, tests/test_architecture.py, read files only: unit)."""
    parts = path.resolve().relative_to(TESTS).parts
    return parts[0] if len(parts) > 1 and parts[0] in TIMEOUT_S else "unit"


def pytest_configure(config):
    for tier in TIMEOUT_S:
        config.addinivalue_line("markers", f"{tier}: set by the test's folder (tests/{tier}/)")


# The longest files (about 7, 4 and 3 minutes on CI's 2 cores) run first: with two test
# processes (make test-all), each one taken last kept one core idle for its whole length.
LONGEST_FIRST = (
    "system/cluster/test_cluster.py",
    "system/stages/test_quickstart_figures.py",
    "system/commands/test_cli_fuzz.py",
)


def pytest_collection_modifyitems(config, items):
    def rank(item) -> int:
        path = Path(item.fspath).as_posix()
        return next(
            (i for i, f in enumerate(LONGEST_FIRST) if path.endswith(f)), len(LONGEST_FIRST)
        )

    items.sort(key=rank)  # stable: the rest keep their order
    for item in items:
        marked = [tier for tier in TIMEOUT_S if item.get_closest_marker(tier)]
        tier = marked[-1] if marked else tier_of(Path(item.fspath))
        if not marked:
            item.add_marker(getattr(pytest.mark, tier))
        if item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(TIMEOUT_S[tier]))
