"""SIGTERM / SIGINT / SIGHUP: what the pipeline does on the first one and on a second.

SIGHUP (the terminal closed, an ssh session dropped) is taken as SIGTERM is, unless the
process was started with it ignored (`nohup`): then it stays ignored.

- Inside the training loop (`StopSignal`) the first signal becomes a flag: the loop finishes
  the update, every rank saves a checkpoint, and the run exits 143 (`Preempted`).
- Outside it (`RaiseOnSignal`: download, preprocess, evaluate, bookkeeping) the first signal
  raises `Interrupted` where the program is, so the stage and the pipeline unwind through their
  normal failure path (MLflow runs marked KILLED) and the command exits 143 / 130 with one line.
  The training loop installs its handler while it runs and restores this one after.
- A second signal stops at once (no checkpoint, no cleanup), as the README promises, with
  one exception: a SIGTERM within `DUPLICATE_WINDOW_S` of the first is the same request
  delivered twice (a preemption reaches the ranks from Slurm and, near a time limit, from the
  job script's `scancel --signal=TERM` too), not impatience. A launcher that is asked twice
  escalates to SIGINT.
- A signal the training loop took is handed to the handler it restores: the preemption's
  duplicate that reaches the bookkeeping after the checkpoint is still the same request, not
  a new one that would replace the `Preempted` exit with `Interrupted`.
"""

from __future__ import annotations

import signal
import threading
import time

from pipeline.errors import Interrupted

DUPLICATE_WINDOW_S = 5.0


class SignalHandler:
    """Installs `_first` / `_again` for SIGTERM, SIGINT and SIGHUP (main thread only) and restores
    the previous handlers on exit."""

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
            raise Interrupted(signal.Signals(signum).name, signum, at_once=True)

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
        outer = getattr(self._previous.get(signal.SIGTERM), "__self__", None)
        if self.received and isinstance(outer, SignalHandler) and outer.received is None:
            outer.received, outer._first_at = self.received, self._first_at


class RaiseOnSignal(SignalHandler):
    def _first(self, signum) -> None:
        raise Interrupted(signal.Signals(signum).name, signum)


class StopSignal(SignalHandler):
    """The training loop's: the first signal only sets `received`, which the loop checks
    after each update, so a preempted job stops at a step boundary with a checkpoint."""
