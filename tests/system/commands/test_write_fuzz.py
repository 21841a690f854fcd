"""A short run of the write-failure fuzzer (quality/fuzzers/write_fuzz.py): EFBIG from a real
`ulimit -f` and ENOSPC from a real tmpfs shrunk to what the world uses plus a few bytes,
drawn at every write site of a run and of `export`. Every failure is one `error:` line, the
world's earlier files are intact and nothing published is partial.
`quality/fuzz.py --writes N` prints the full figures."""

from __future__ import annotations

import pytest

from quality.fuzzers.cli_fuzz import build_world
from quality.fuzzers.write_fuzz import can_fill_a_disk, fuzz_writes

CASES = 12


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return build_world(tmp_path_factory.mktemp("write-fuzz") / "world")


def test_a_write_that_does_not_fit_is_one_line_and_loses_nothing(world):
    outcomes: list = []
    fuzz_writes(world, CASES, outcomes.append)
    assert len(outcomes) >= CASES
    bad = [o for o in outcomes if o.problem]
    assert not bad, f"{len(bad)} of {len(outcomes)} cases went wrong:\n" + "\n".join(
        f"{o.command} {o.failure}\n  {o.problem}\n  said: {o.said}" for o in bad
    )
    ran = [o for o in outcomes if not o.skipped]
    assert any(o.exit_code == 2 for o in ran)  # the limits drawn did make writes fail
    if can_fill_a_disk():  # CI runs as root: the full disk is drawn, not skipped
        assert any(o.failure.startswith("ENOSPC") for o in ran)
