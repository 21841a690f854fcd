"""The memory plan against torch's measured peak (issue 52): the update `show --estimate`
times for the quickstart, planned, then built and run in a fresh process whose resident set
follows torch's tensors (bench/memory_plan.py: glibc's mmap threshold at 64 KiB, the
high-water mark reset after the libraries are loaded). Within 20%. Cost: one subprocess,
about 20 s on 2 idle cores."""

from __future__ import annotations

import sys

import pytest

from bench.memory_plan import MMAP, measure


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self/status and clear_refs")
def test_the_plan_of_the_quickstarts_update_is_within_20_percent_of_its_peak():
    got = measure("configs/quickstart.yaml", [], MMAP)
    ratio = got["planned"] / got["measured"]
    print(f"planned {got['planned'] / 2**20:.1f} MiB, measured {got['measured'] / 2**20:.1f} MiB")
    assert 0.8 <= ratio <= 1.2, got
