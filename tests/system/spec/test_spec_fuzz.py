"""Fuzzing `validate` and `show` with broken versions of the real configs: every input ends
either in success or in exit 2 with one located error per line, quickly; never a traceback
or a hang.

The damage (quality/fuzzers/spec_damage.py) is what a spec meets: odd scalars, YAML tags with
random text, huge and infinite numbers, deep structures, aliases, complex and merge keys, bad
bytes, odd `extends` targets, damaged dataset cards and `--set` overrides.
"""

from __future__ import annotations

import re
import signal
import tempfile
import time
from pathlib import Path

from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.commands.cli import main
from quality.fuzzers.spec_damage import ROOT, damaged_config

# A hang detector, not a speed target: a refusal or a `show` takes well under a second alone
# (the deepest --set the fuzzer made: 0.3 s over a plain validate), but a shared 2-core CI
# machine has been seen to stretch one past 5 s; an exponential expansion never finishes.
SECONDS_PER_COMMAND = 10.0
HANG_SECONDS = 20


def _hang(signum, frame):
    raise TimeoutError(f"still running after {HANG_SECONDS} s")


def run_command(args: list[str]):
    previous = signal.signal(signal.SIGALRM, _hang)
    signal.alarm(HANG_SECONDS)
    try:
        start = time.monotonic()
        result = CliRunner().invoke(main, args)
        return result, time.monotonic() - start
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def assert_clean(args: list[str], workdir: Path) -> None:
    result, seconds = run_command(args)
    assert result.exit_code in (0, 2), (
        f"{args}: exit {result.exit_code}: {result.exception!r}\n{result.output}"
    )
    assert seconds < SECONDS_PER_COMMAND, f"{args}: took {seconds:.1f} s"
    if result.exit_code == 2:
        lines = result.stderr.splitlines()
        assert lines and lines[0].startswith("error: "), result.stderr
        lines[0] = lines[0][len("error: ") :]
        # one error a line (every mistake is reported at once), each "PLACE: what", the place
        # a file (the damaged copy, or a config or card it reads) or the --set override
        assert all(
            re.match(
                rf"({re.escape(str(workdir))}|{re.escape(str(ROOT))}|--set )"
                rf"[^\n]*?: \S",
                line,
            )
            for line in lines
        ), result.stderr
        assert "Traceback" not in result.output


@settings(
    max_examples=400,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(data=st.data())
def test_validate_and_show_refuse_any_damaged_config_in_one_line(data):
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        target, overrides = damaged_config(data.draw, workdir)
        sets = [item for o in overrides for item in ("--set", o)]
        for command in ("validate", "show"):
            assert_clean([command, str(target), *sets], workdir)
