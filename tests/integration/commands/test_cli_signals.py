"""A signal ends any command as it ends a pipeline's stage: exit 128 + its number, one line
(the rule: pipeline/cluster/signals.py). Before, only `run`'s stages and `sweep` had a
handler: SIGTERM and SIGHUP killed every other command silently, by their default action.

A real signal to this process, raised while the command runs (in `load_spec`, which every
command with a CONFIG calls); SIGTERM's default would end pytest itself, so the test puts a
handler of its own in place that fails it instead."""

from __future__ import annotations

import signal

import pytest
from click.testing import CliRunner

import pipeline.spec
from pipeline.commands.cli import main
from pipeline.spec import PROJECT_ROOT

QUICKSTART = str(PROJECT_ROOT / "configs" / "quickstart.yaml")


@pytest.fixture
def default_handlers():
    """SIGTERM and SIGHUP failing the test where their default would end pytest (under
    nohup SIGHUP would be ignored, which the commands keep); SIGINT as Python has it."""

    def unhandled(signum, frame):
        pytest.fail(f"{signal.Signals(signum).name} reached the test: no handler took it")

    taken = (signal.SIGTERM, signal.SIGHUP)
    previous = {s: signal.signal(s, unhandled) for s in taken}
    yield
    for s, handler in previous.items():
        signal.signal(s, handler)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
@pytest.mark.parametrize("command", [["validate", QUICKSTART], ["show", QUICKSTART]])
def test_a_signal_in_any_command_ends_it_with_128_plus_its_number_and_one_line(
    command, sig, monkeypatch, default_handlers
):
    def signalled(*args, **kwargs):
        signal.raise_signal(sig)
        pytest.fail("the signal did not stop the command")

    monkeypatch.setattr(pipeline.spec, "load_spec", signalled)
    result = CliRunner().invoke(main, command)
    assert result.exit_code == 128 + sig, result.output
    assert result.stdout == ""
    assert result.stderr == (
        f"error: stopped by {sig.name}: the command did not finish; run it again\n"
    )
