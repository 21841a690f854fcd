"""The estimate's heartbeat (pipeline/commands/update_timing.py): while an update is timed,
however long it takes, a line says what is being timed at least every HEARTBEAT_S seconds,
under a minute (issue 52: no minute passes without a line), and none after it is done."""

from __future__ import annotations

import re
import time

from pipeline.commands.update_timing import HEARTBEAT_S, Heartbeat


def test_a_long_timing_says_what_it_times_at_every_interval_and_stops_when_done():
    lines: list[str] = []
    with Heartbeat(lines.append, every=0.05) as beat:
        beat.doing = "the warm-up update"
        deadline = time.monotonic() + 10
        while len(lines) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
    assert len(lines) >= 2
    for line in lines:
        assert re.fullmatch(r"  \.\.\. still timing: the warm-up update \(\d+ s so far\)", line)
    done = len(lines)
    time.sleep(0.2)
    assert len(lines) == done


def test_no_minute_passes_without_a_line():
    assert HEARTBEAT_S < 60
