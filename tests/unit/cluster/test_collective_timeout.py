"""ALLATTN_DIST_TIMEOUT_MIN, how long the other ranks wait while rank 0 downloads and
preprocesses, read when a group starts: a value that is no whole number of minutes is one
line naming it (it was a ValueError traceback at import, for every command that trains)."""

from __future__ import annotations

from datetime import timedelta

import pytest

from pipeline.cluster import distributed
from pipeline.errors import PipelineError


@pytest.mark.parametrize("text, minutes", [(None, 180), ("", 180), ("60", 60), (" 5 ", 5)])
def test_the_timeout_is_the_variables_minutes(monkeypatch, text, minutes):
    if text is None:
        monkeypatch.delenv("ALLATTN_DIST_TIMEOUT_MIN", raising=False)
    else:
        monkeypatch.setenv("ALLATTN_DIST_TIMEOUT_MIN", text)
    assert distributed.collective_timeout() == timedelta(minutes=minutes)


@pytest.mark.parametrize("text", ["abc", "0", "-5", "1.5", "1e9", "99999999999", "٣"])
def test_a_value_that_is_no_number_of_minutes_is_one_line(monkeypatch, text):
    monkeypatch.setenv("ALLATTN_DIST_TIMEOUT_MIN", text)
    with pytest.raises(PipelineError) as refused:
        distributed.collective_timeout()
    assert str(refused.value) == (
        f"environment variable ALLATTN_DIST_TIMEOUT_MIN {text}: not a whole number of "
        f"minutes from 1 to 1000000 (how long the other ranks wait while rank 0 downloads "
        f"and preprocesses; default 180)"
    )
