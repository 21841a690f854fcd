"""SIGTERM / SIGINT / SIGHUP: the one rule for every command, and how it is kept.

The rule, as docs/running.md#signals states it for users:

- A first signal inside the training loop (train, finetune, curriculum) becomes a flag: the
  loop finishes the update, every rank saves a checkpoint, and the command exits 143
  (`Preempted`) whichever of the three it was; a requeued job resumes from it.
- A first signal anywhere else, in any command (a stage outside training, a tracking
  request, the replay of a backlog, `sync`, `export`, `compare`, a command's start and its
  bookkeeping), ends the command where it is: it unwinds through its failure path (MLflow runs
  marked KILLED, temporary files removed, nothing half-published) and exits 128 + the
  signal's number, SIGHUP 129, SIGINT 130, SIGTERM 143, with one line `error: stopped by
  SIGNAL: ...`. What a short section that publishes (`HoldSignals`: an export's renames) has
  begun, it finishes first.
- A second signal stops at once, with 128 + its own number (`error: stopped at once by a
  second signal ...`), no checkpoint and no cleanup beyond what is atomic anyway; except
  that a SIGTERM or SIGHUP within `DUPLICATE_WINDOW_S` of the first is the same request
  delivered twice (a preemption reaches the ranks from Slurm and, near a time limit, from
  the job script's `scancel --signal=TERM` too), not impatience, and is ignored.
- SIGHUP (a closed terminal, a dropped ssh session) is taken as SIGTERM is, unless the
  process was started with it ignored (`nohup`): then it stays ignored.
- `sweep --parallel` and a `run` under DeepSpeed's launcher pass the signal on to their
  processes (a second one as SIGINT, which stops them at once) and exit as above.
- Before a command's handler is in place (the interpreter starting, the CLI's imports: a few
  tenths of a second) and after the command returned, a signal has the system's default
  effect: SIGTERM and SIGHUP end the process by that signal (a shell's status 143 / 129),
  SIGINT is Python's KeyboardInterrupt (130).

How: the CLI (pipeline.commands.click_types.Main) runs every command under `RaiseOnSignal`,
whose first signal raises `Interrupted` (a BaseException: no `except Exception` takes it for
a failed request or a bad file); the runner nests its own for the stage wording, the training
loop `StopSignal`, a sweep and the launcher their forwarding handlers. A handler that exits
hands the signal it took to the one it restores, so the preemption's duplicate that reaches
the bookkeeping after the checkpoint is still the same request, not a new one that would
replace the `Preempted` exit with `Interrupted`. An `Interrupted` that Python drops because the
signal came while a finalizer ran (a weakref callback, a `__del__`) is raised again where the
main thread goes on (`REDELIVERY`).
"""

from __future__ import annotations

import _thread
import signal
import sys
import threading
import time
from contextlib import contextmanager

from pipeline.errors import Interrupted

DUPLICATE_WINDOW_S = 5.0
# The longest a main thread waits at once for another thread (a tracking request, the
# sender): the OS may hand a process's signal to any of its threads, and Python runs the
# handler only once the main thread wakes, so a longer wait would hold the signal back.
WAKE_S = 0.1


def _handler_of(installed) -> SignalHandler | None:
    """The SignalHandler whose method `installed` (a signal's disposition) is, if any."""
    owner = getattr(installed, "__self__", None)
    return owner if isinstance(owner, SignalHandler) else None


class SignalHandler:
    """Installs `_first` / `_again` for SIGTERM, SIGINT and SIGHUP (main thread only) and restores
    the previous handlers on exit."""

    after: str | None = None  # `Interrupted`'s words on what was left: the runner's by default

    def __init__(self, signals=(signal.SIGTERM, signal.SIGINT, signal.SIGHUP)):
        self.signals, self._previous = signals, {}
        self.received: str | None = None  # the first signal's name
        self._first_at = 0.0

    def _handle(self, signum, frame) -> None:
        if self.received is None:
            self.received, self._first_at = signal.Signals(signum).name, time.monotonic()
            self._first(signum)
        elif not (
            signum in (signal.SIGTERM, signal.SIGHUP)
            and time.monotonic() - self._first_at < DUPLICATE_WINDOW_S
        ):
            raise Interrupted(signal.Signals(signum).name, signum, at_once=True, after=self.after)

    def _first(self, signum) -> None:
        """What the first signal does beyond recording itself in `received`."""

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                if sig == signal.SIGHUP and signal.getsignal(sig) == signal.SIG_IGN:
                    continue  # nohup: the user asked for it to be ignored
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        outer = _handler_of(self._previous.get(signal.SIGTERM))
        if self.received and outer is not None and outer.received is None:
            outer.received, outer._first_at = self.received, self._first_at


class RaiseOnSignal(SignalHandler):
    """The first signal raises `Interrupted` where the program is; `after`: its words on what
    the command left and what to do now (the runner's, about a stage, by default)."""

    def __init__(self, after: str | None = None):
        super().__init__()
        self.after = after

    def _first(self, signum) -> None:
        raise Interrupted(signal.Signals(signum).name, signum, after=self.after)

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._hook = sys.unraisablehook
            sys.unraisablehook = _keep_dropped_interrupt
            self._previous[REDELIVERY] = signal.signal(REDELIVERY, _raise_dropped_interrupt)
        return super().__enter__()

    def __exit__(self, exc_type, *exc):
        global _dropped
        if hasattr(self, "_hook"):
            sys.unraisablehook = self._hook
        super().__exit__(exc_type, *exc)
        if _dropped is not None and exc_type is None:  # not yet raised again: now
            dropped, _dropped = _dropped, None
            raise dropped


def unheeded_once_decided() -> None:
    """Make SIGTERM, SIGINT and SIGHUP do nothing (unless ignored already: nohup), for a
    program whose handler, put in place next, will put this back as it ends. A signal that
    comes after the command has decided its exit code, while the interpreter runs its exit
    handlers (torch's, MLflow's: a few hundred milliseconds on a busy machine), would
    otherwise kill it by the default action (exit 129 after `export` had finished and said
    so) or raise KeyboardInterrupt inside one of them (a traceback after one error line)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        if signal.getsignal(sig) != signal.SIG_IGN:
            signal.signal(sig, _unheeded)


def _unheeded(signum, frame) -> None:
    """The exit is decided: the signal has nothing left to stop."""


@contextmanager
def stop_words(after: str):
    """Within, a signal that ends the command says `after` of what it left (`Interrupted`),
    in place of the words of the handler in place: a part of a command those do not describe
    (the runner's are about a stage; a run's start sends an earlier backlog before any stage).
    Installs no handler: where none raises, there is nothing to word."""
    handler = _handler_of(signal.getsignal(signal.SIGTERM))
    if handler is None:
        yield
        return
    before, handler.after = handler.after, after
    try:
        yield
    finally:
        handler.after = before


# Python runs a signal's handler wherever the main thread is, a finalizer included (a weakref
# callback, a `__del__`, a generator closed by the collector). An exception raised there
# cannot propagate: the interpreter prints it and carries on, and the command would end as if
# no signal had come (the signal fuzzer caught `show --estimate` exiting 0 so). While a
# `RaiseOnSignal` is in place, such an `Interrupted` is kept and raised again a moment later
# where the main thread is then, through a handler of its own for REDELIVERY: a signal that
# nothing else here uses, whose default (once the handler is gone) is to do nothing, so a
# redelivery that comes late is dropped harmlessly.
REDELIVERY = signal.SIGURG
REDELIVER_S = 0.005
_dropped: Interrupted | None = None
_in_unraisable_hook = False


def _keep_dropped_interrupt(unraisable) -> None:
    global _dropped, _in_unraisable_hook
    if not isinstance(unraisable.exc_value, Interrupted):
        sys.__unraisablehook__(unraisable)
        return
    _in_unraisable_hook = True  # what the hook itself raises is dropped as well
    try:
        _dropped = _dropped or unraisable.exc_value
        _deliver_later()
    finally:
        _in_unraisable_hook = False


def _raise_dropped_interrupt(signum, frame) -> None:
    global _dropped
    if _dropped is None:
        return  # raised already (a command's end), or a real SIGURG
    if _in_unraisable_hook:
        _deliver_later()
        return
    dropped, _dropped = _dropped, None
    raise dropped


def _deliver_later() -> None:
    """Run REDELIVERY's handler in the main thread a moment from now, once the finalizer that
    dropped the exception has returned (sent from here, it would run here, in the hook)."""

    def deliver():
        time.sleep(REDELIVER_S)
        _thread.interrupt_main(REDELIVERY)

    threading.Thread(target=deliver, name="signal-redelivery", daemon=True).start()


class HoldSignals(SignalHandler):
    """A short section that must not be cut in the middle (a few renames that publish): a
    first signal within is held and delivered to the handler outside when the section ends,
    which acts on it as it would have; a second one within stops at once, as anywhere."""

    def __enter__(self):
        outer = _handler_of(signal.getsignal(signal.SIGTERM))
        self.after = outer.after if outer is not None else None
        return super().__enter__()

    def _first(self, signum) -> None:
        self._held = signum

    def __exit__(self, exc_type, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        if self.received is not None and not (exc_type and issubclass(exc_type, Interrupted)):
            signal.raise_signal(self._held)  # unless a second one already stopped everything


class StopSignal(SignalHandler):
    """The training loop's: the first signal only sets `received`, which the loop checks
    after each update, so a preempted job stops at a step boundary with a checkpoint."""
