"""The command-line fuzzer (tests/helpers/cli_fuzz.py) over every command: 2,000 cases, each
ending in exit 0 or a located one-line `error: ...` with exit 2, none a traceback or a hang,
none changing what a refused or read-only command found. bench/fuzz.py prints the figure."""

from __future__ import annotations

import pytest
from tests.helpers.cli_fuzz import build_world, fuzz

pytestmark = pytest.mark.fuzz

CASES = 2000


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return build_world(tmp_path_factory.mktemp("fuzz") / "world")


def test_every_command_refuses_bad_input_in_one_line_and_leaves_files_alone(world):
    outcomes = []

    def check(outcome):
        outcomes.append(outcome)
        assert outcome.problem is None, f"{outcome.args}: {outcome.problem}"

    fuzz(world, CASES, check)
    assert len(outcomes) >= CASES
    # every command was exercised, and some of each command's cases got through
    commands = {o.command for o in outcomes}
    assert commands >= {"validate", "show", "run", "run --dry-run", "sweep", "compare",
                        "sample", "export", "sync", "launch slurm", "stages", "junk"}
    assert {o.command for o in outcomes if o.exit_code == 0} >= {
        "validate", "show", "run", "run --dry-run", "sweep", "compare", "sample", "export"}
