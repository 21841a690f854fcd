"""Short runs of issue 35's fuzzers (quality/fuzzers/secret_fuzz.py, injection_fuzz.py,
link_fuzz.py): a canary secret in every credential place is never recorded or printed, a
canary command in every value that reaches a batch script or a remote command line never
runs, and a link or FIFO planted where a command opens a file changes nothing outside and
blocks nothing. Each test runs every case and then fails listing all the bad ones.
quality/fuzz.py --secrets / --injection / --links N prints the full figures."""

from __future__ import annotations

import pytest

from quality.fuzzers.cli_fuzz import build_world
from quality.fuzzers.injection_fuzz import fuzz_injection
from quality.fuzzers.link_fuzz import KINDS, fuzz_links
from quality.fuzzers.secret_fuzz import fuzz_secrets

SECRET_CASES = 100
INJECTION_CASES = 30
LINK_CASES = 30


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return build_world(tmp_path_factory.mktemp("fuzz-classes") / "world")


def _all_good(outcomes: list) -> None:
    bad = [o for o in outcomes if o.problem]
    assert not bad, f"{len(bad)} of {len(outcomes)} cases went wrong:\n" + "\n".join(
        f"{o.args!r}\n  {o.problem}\n  said: {o.said}" for o in bad
    )


def test_no_secret_reaches_an_output_the_store_the_workspace_or_a_log(world):
    outcomes: list = []
    fuzz_secrets(world, SECRET_CASES, outcomes.append)
    assert len(outcomes) >= SECRET_CASES
    _all_good(outcomes)
    assert any(o.exit_code == 0 for o in outcomes) and any(o.exit_code == 2 for o in outcomes)


def test_no_value_runs_as_shell_in_a_script_or_on_a_node(world):
    outcomes: list = []
    fuzz_injection(world, INJECTION_CASES, outcomes.append)
    assert len(outcomes) >= INJECTION_CASES
    _all_good(outcomes)
    # some scripts were rendered, so run under the recorders and checked
    assert any(o.exit_code == 0 and o.command != "run, 2 nodes" for o in outcomes)


def test_no_planted_link_is_followed_and_no_fifo_blocks(world):
    outcomes: list = []
    fuzz_links(world, LINK_CASES, outcomes.append)
    assert len(outcomes) >= LINK_CASES
    _all_good(outcomes)
    assert len({o.kind for o in outcomes}) >= 3 and {o.kind for o in outcomes} <= set(KINDS)
