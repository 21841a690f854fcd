"""Short runs of issue 51's fuzzers on one tracked world (a tiny pipeline and two sweep
points tracked to a real MLflow server; quality/fuzzers/tracked_world.py), the commands run
as real processes by a fork server:

- the stateful fuzzer (quality/fuzzers/state_fuzz.py): sequences of `run` (--only, --force,
  --set, --point), evaluate, `compare`, `export --register` and `sync`, with signals and
  server outages; after every step each score shown is the true score of the weights shown
  (or reads `stale`), no tracking record is lost or created twice, every signal ended its
  command with its exit code and one line;
- the signal fuzzer (quality/fuzzers/signal_fuzz.py): SIGTERM, SIGHUP or SIGINT at a random
  moment in a command; its exit, its one line, nothing half-done, nothing sent twice.

Each test runs every case and fails listing all the bad ones, with the line that replays
each. `quality/fuzz.py --stateful N --signals N` prints the full figures. The drawn sequences
are two of seed 51 that show a score beside other weights on the code of issue 51 (compare
after a train re-run, a re-run's reprint), with the issue's own two examples as a sequence;
the signal cases are seed 51's first ten and two early signals in `sync` (signals in export,
sync, a backlog's replay).
"""

from __future__ import annotations

import pytest

from quality.fuzzers.signal_fuzz import fuzz_signals
from quality.fuzzers.state_fuzz import Sequence, Step, fuzz_state, run_sequence
from quality.fuzzers.tracked_world import NAME, build_world
from quality.fuzzers.true_scores import Scorer

SEED = 51
SEQUENCES = (0, 19)  # of 8 drawn steps each
# the first ten, and two `sync` cases whose signal lands early in it on any machine
SIGNAL_CASES = (*range(10), 25, 40)
# issue 51's examples: compare after `run --only train` with more steps; export --register
# after train re-ran with another learning rate (the same steps), evaluate not re-run
CONFIG = "{config}"
ISSUE_EXAMPLES = Sequence(
    -1,
    "clean",
    [
        Step("run", ["run", CONFIG, "--only", "train", "--set", "train.steps=6"], NAME),
        Step("compare", ["compare", CONFIG, "--format", "table"], NAME),
        Step("run", ["run", CONFIG, "--only", "train", "--set", "train.optimizer.lr=0.02"], NAME),
        Step(
            "export",
            [
                "export",
                CONFIG,
                "--out",
                "{exports}/e0",
                "--register",
                "fuzz-model",
                "--set",
                "train.optimizer.lr=0.02",
            ],
            NAME,
            out="e0",
        ),
    ],
)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    built = build_world(tmp_path_factory.mktemp("tracked") / "world", log=lambda m: None)
    yield built
    built.close()


def test_every_score_shown_is_its_weights_and_no_record_is_lost_or_doubled(world):
    scorer = Scorer(world.config, world.templates["clean"] / "runs" / NAME / "preprocess")
    outcomes: list = [run_sequence(world, scorer, ISSUE_EXAMPLES)]
    fuzz_state(world, scorer, SEED, SEQUENCES, 8, outcomes.append)
    bad = [o for o in outcomes if o.problems]
    assert not bad, "\n".join(
        (
            "issue 51's examples (ISSUE_EXAMPLES):"
            if o.index < 0
            else f"sequence {o.index} (python -m quality.fuzz --stateful 1 --first {o.index} "
            f"--seed {SEED} -j 1):"
        )
        + "".join(f"\n  {s.text}" + "".join(f"\n      {p}" for p in s.problems) for s in o.steps)
        for o in bad
    )
    steps = [s for o in outcomes for s in o.steps]
    assert len(steps) >= 8 * len(SEQUENCES)
    assert sum(s.scores_checked for s in steps) > 0  # the oracle had scores to judge


def test_a_signal_ends_every_command_with_its_exit_code_and_leaves_nothing_half_done(world):
    outcomes: list = []
    fuzz_signals(world, SEED, SIGNAL_CASES, outcomes.append)
    bad = [o for o in outcomes if o.problems]
    assert not bad, "\n".join(
        f"case {o.index}: {o.text} (exit {o.exit_code}; python -m quality.fuzz --signals 1 "
        f"--first {o.index} --seed {SEED} -j 1)\n" + "".join(f"    {p}\n" for p in o.problems)
        for o in bad
    )
    assert any(not o.late for o in outcomes)  # signals did reach running commands
