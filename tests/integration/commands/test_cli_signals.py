"""A signal ends any command as it ends a pipeline's stage: exit 128 + its number, one line
(the rule: pipeline/cluster/signals.py). Before, only `run`'s stages and `sweep` had a
handler: SIGTERM and SIGHUP killed every other command silently, by their default action.

A real signal to this process, raised while the command runs (in `load_spec`, which every
command with a CONFIG calls); SIGTERM's default would end pytest itself, so the test puts a
handler of its own in place that fails it instead."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

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


def console_script(setup: str, cwd) -> subprocess.CompletedProcess:
    """`allattn-pipe list` through the console script's `entry`, in a process of its own
    whose SIGTERM and SIGHUP are a fresh shell's child's, after `setup` (Python) ran."""
    script = "\n".join(
        [
            "import atexit, os, signal, sys, time",
            "from pipeline.commands import cli",
            "for s in (signal.SIGTERM, signal.SIGHUP):",
            "    signal.signal(s, signal.SIG_DFL)",
            textwrap.dedent(setup),
            'sys.argv = ["allattn-pipe", "list"]',
            "cli.entry()",
        ]
    )
    return subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=cwd, timeout=120
    )


# A signal while click is still reading the arguments, before any command's code runs: the
# console script handles it from its first line (it had the interpreter's default, and the
# command ended killed by the signal without a word)
SIGNAL_WHILE_PARSING = """
parse = cli.main.make_context
def signalled(*args, **kwargs):
    os.kill(os.getpid(), signal.{name})
    return parse(*args, **kwargs)
cli.main.make_context = signalled
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_signal_before_the_command_starts_is_one_line_and_128_plus_its_number(sig, tmp_path):
    done = console_script(SIGNAL_WHILE_PARSING.format(name=sig.name), tmp_path)
    assert done.returncode == 128 + sig, done.stderr
    assert done.stdout == ""
    assert done.stderr == (
        f"error: stopped by {sig.name}: the command did not finish; run it again\n"
    )


# A signal while the interpreter runs its exit handlers, after the command decided its exit:
# it changes nothing (it killed the command by the default action, exit 129 after `export`
# had said it was done, or raised KeyboardInterrupt in torch's handler: a traceback)
SIGNAL_WHILE_EXITING = """
def exiting():
    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        os.kill(os.getpid(), s)
    time.sleep(0.05)
    print("the exit handlers ran to their end")
atexit.register(exiting)
"""


def test_a_signal_after_the_command_decided_its_exit_changes_nothing(tmp_path):
    done = console_script(SIGNAL_WHILE_EXITING, tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    assert done.stdout.endswith("\nthe exit handlers ran to their end\n")
    assert "quickstart" in done.stdout
