"""`--smoke`'s run name and experiment: each gets "-smoke" and stays inside the 100
characters that `name` and tracking.experiment are held to."""

from __future__ import annotations

import pytest

from pipeline.spec import PROJECT_ROOT, load_spec
from pipeline.spec.names import smoke_name

LIMIT = 100


@pytest.mark.parametrize("length", [LIMIT - 7, LIMIT - 6, LIMIT - 5, LIMIT])
def test_a_long_experiment_is_taken_under_smoke(tmp_path, length):
    experiment = "e" * length
    config = tmp_path / "c.yaml"
    config.write_text(
        f"extends: [{PROJECT_ROOT / 'configs' / 'text8_small.yaml'}]\n"
        f"name: {'n' * length}\ntracking: {{experiment: {experiment}}}\n"
    )
    smoke = load_spec(config, smoke=True)
    for name in (smoke.name, smoke.tracking.experiment):
        assert len(name) <= LIMIT and name.endswith("-smoke")


def test_a_short_name_only_gains_the_suffix():
    assert smoke_name("mine") == "mine-smoke"
    assert smoke_name("m" * (LIMIT - 6)) == "m" * (LIMIT - 6) + "-smoke"


def test_long_names_that_differ_past_the_cut_stay_apart_and_stable():
    a, b = "x" * 99 + "a", "x" * 99 + "b"
    assert smoke_name(a) != smoke_name(b)
    assert smoke_name(a) == smoke_name(a)
    assert smoke_name(a).startswith("x" * 80)
