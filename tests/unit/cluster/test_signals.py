"""A second SIGTERM or ctrl-C stops at once, in training and outside it; the same
preemption delivered twice (a SIGTERM again within a few seconds) does not."""

from __future__ import annotations

import signal
import time
import weakref

import pytest

from pipeline.cluster.signals import (
    DUPLICATE_WINDOW_S,
    HoldSignals,
    RaiseOnSignal,
    StopSignal,
    stop_words,
)
from pipeline.errors import Interrupted


def later(handler) -> None:
    """Move the handler's first signal back past the duplicate window."""
    handler._first_at -= DUPLICATE_WINDOW_S + 1


def test_training_a_repeated_sigterm_within_the_window_is_the_same_request():
    with StopSignal() as stop:
        signal.raise_signal(signal.SIGTERM)
        signal.raise_signal(signal.SIGTERM)  # the job script's trap, right after Slurm
        assert stop.received == "SIGTERM"


@pytest.mark.parametrize(
    "first, second, code",
    [
        (signal.SIGTERM, signal.SIGTERM, 143),
        (signal.SIGINT, signal.SIGINT, 130),
        (signal.SIGTERM, signal.SIGINT, 130),
        (signal.SIGINT, signal.SIGTERM, 143),
    ],
)
def test_training_a_second_signal_stops_at_once(first, second, code):
    with StopSignal() as stop:
        signal.raise_signal(first)
        assert stop.received == first.name  # the first only asks for a checkpoint
        later(stop)
        with pytest.raises(Interrupted, match="stopped at once by a second signal") as e:
            signal.raise_signal(second)
    assert e.value.exit_code == code


def test_a_quick_ctrl_c_after_sigterm_stops_at_once():
    with StopSignal():
        signal.raise_signal(signal.SIGTERM)
        with pytest.raises(Interrupted, match="second signal"):
            signal.raise_signal(signal.SIGINT)  # impatience needs no waiting


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_outside_training_a_second_signal_cuts_the_cleanup_short(sig, code):
    cleaned = []
    with RaiseOnSignal() as handler:
        with pytest.raises(Interrupted) as first:
            signal.raise_signal(sig)
        assert "stopped by" in str(first.value)
        if sig == signal.SIGTERM:
            signal.raise_signal(sig)  # a duplicate: the cleanup goes on
            cleaned.append("duplicate ignored")
        later(handler)
        with pytest.raises(Interrupted, match="stopped at once") as second:
            signal.raise_signal(sig)  # while the first one unwinds
            cleaned.append("never")
    assert second.value.exit_code == code
    assert cleaned == (["duplicate ignored"] if sig == signal.SIGTERM else [])


def test_after_a_checkpointed_stop_the_duplicate_sigterm_does_not_interrupt_the_cleanup():
    # the loop took the preemption; its duplicate arrives while the runner records the stop
    with RaiseOnSignal() as outer:
        with StopSignal() as stop:
            signal.raise_signal(signal.SIGTERM)
        assert stop.received == outer.received == "SIGTERM"
        signal.raise_signal(signal.SIGTERM)  # within the window: the same request
        later(outer)
        with pytest.raises(Interrupted, match="stopped at once"):
            signal.raise_signal(signal.SIGTERM)  # a real second request still cuts it short


def test_the_handlers_are_restored():
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    with StopSignal(), RaiseOnSignal():
        pass
    assert {s: signal.getsignal(s) for s in before} == before


def test_sighup_is_taken_as_sigterm():
    # a closed terminal or a dropped ssh session: before, SIGHUP's default action killed the
    # run with no checkpoint and no message. SIGHUP at its default here, whatever the suite
    # was started under (nohup would leave it ignored: the next test)
    previous = signal.signal(signal.SIGHUP, signal.SIG_DFL)
    try:
        with StopSignal() as stop:
            signal.raise_signal(signal.SIGHUP)
            assert stop.received == "SIGHUP"  # a checkpoint, then stop
            signal.raise_signal(signal.SIGHUP)  # delivered twice: the same request
        with RaiseOnSignal():
            with pytest.raises(Interrupted, match="stopped by SIGHUP") as e:
                signal.raise_signal(signal.SIGHUP)
        assert e.value.exit_code == 129
    finally:
        signal.signal(signal.SIGHUP, previous)


def test_sighup_stays_ignored_under_nohup():
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with StopSignal() as stop:
            signal.raise_signal(signal.SIGHUP)
            assert stop.received is None
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, previous)


def test_a_signal_in_a_held_section_acts_when_the_section_ends():
    done = []
    with RaiseOnSignal(after="run it again"):
        with pytest.raises(Interrupted) as stopped:
            with HoldSignals():
                signal.raise_signal(signal.SIGTERM)
                done.append("the section went on to its end")
    assert done == ["the section went on to its end"]
    assert str(stopped.value) == "stopped by SIGTERM: run it again"
    assert stopped.value.exit_code == 143


def test_a_second_signal_in_a_held_section_stops_at_once():
    with RaiseOnSignal(after="run it again"):
        with pytest.raises(Interrupted) as stopped:
            with HoldSignals():
                signal.raise_signal(signal.SIGTERM)
                signal.raise_signal(signal.SIGINT)  # impatience: no waiting
                pytest.fail("the second signal did not stop the section")
    assert str(stopped.value) == (
        "stopped at once by a second signal (SIGINT): nothing more was saved; run it again"
    )
    assert stopped.value.exit_code == 130


def test_interrupted_is_no_exception_a_handler_of_failures_takes():
    # it arrives between any two lines: an `except Exception` around a request or a parse
    # (MLflow's own, a replay's) took it for a failed request and carried on
    assert not issubclass(Interrupted, Exception)


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGHUP, 129)])
def test_a_signal_that_lands_in_a_finalizer_still_stops_the_command(sig, code):
    """Python runs the handler wherever the main thread is, a weakref callback included, where
    a raised exception is printed and dropped: `show --estimate` exited 0 after a SIGHUP so
    (the signal fuzzer). The signal is raised again once the finalizer has returned."""

    class Held:
        pass

    start = time.monotonic()
    with pytest.raises(Interrupted) as stopped, RaiseOnSignal():
        held = Held()
        weakref.finalize(held, signal.raise_signal, sig)
        del held  # the finalizer runs here, and the handler inside it
        while time.monotonic() < start + 10:  # the command going on
            pass
    assert stopped.value.exit_code == code
    assert time.monotonic() - start < 1


def test_a_signal_dropped_by_a_finalizer_at_the_commands_end_is_raised_as_it_returns():
    class Held:
        pass

    with pytest.raises(Interrupted) as stopped, RaiseOnSignal():
        held = Held()
        weakref.finalize(held, signal.raise_signal, signal.SIGTERM)
        del held  # the last line of the command: no time for the signal to come back
    assert stopped.value.exit_code == 143


def test_a_redelivery_that_comes_after_the_command_ended_does_nothing():
    """The dropped signal was raised as the block ended; the redelivery already on its way
    reaches a process whose handlers are restored (ctrl-C's included) and must do nothing."""

    class Held:
        pass

    with pytest.raises(Interrupted), RaiseOnSignal():
        held = Held()
        weakref.finalize(held, signal.raise_signal, signal.SIGINT)
        del held
    deadline = time.monotonic() + 0.2
    while time.monotonic() < deadline:  # where a late redelivery lands
        pass


def test_a_part_of_a_command_says_what_its_stop_left_and_the_handler_words_its_own_after():
    with RaiseOnSignal(after="the stage is left unfinished") as handler:
        with pytest.raises(Interrupted) as stopped, stop_words("the backlog waits"):
            signal.raise_signal(signal.SIGTERM)
        assert str(stopped.value) == "stopped by SIGTERM: the backlog waits"
        assert handler.after == "the stage is left unfinished"


def test_words_for_a_stop_install_no_handler_where_none_raises():
    before = signal.getsignal(signal.SIGTERM)
    with stop_words("the backlog waits"):
        assert signal.getsignal(signal.SIGTERM) is before
