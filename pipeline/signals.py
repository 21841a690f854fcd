"""SIGTERM / SIGINT outside the training loop (download, preprocess, evaluate, bookkeeping).

Python's default is a bare death on SIGTERM and a KeyboardInterrupt on SIGINT; either way the
MLflow runs would stay RUNNING. Here both raise `Interrupted` where the program is, so the
stage and the pipeline unwind through their normal failure path (runs marked KILLED) and the
command exits 143 / 130 with one line. The training loop installs its own handler
(`trainer.StopSignal`, which checkpoints first) while it runs and restores this one after.
"""

from __future__ import annotations

import signal
import threading

from pipeline.errors import Interrupted


class RaiseOnSignal:
    def __init__(self, signals=(signal.SIGTERM, signal.SIGINT)):
        self.signals, self.received, self._previous = signals, None, {}

    def _handle(self, signum, frame) -> None:
        if self.received is None:
            self.received = signum
            raise Interrupted(signal.Signals(signum).name, signum)
        # while the first one unwinds: a second ctrl-C means stop now, skipping the cleanup;
        # a launcher's SIGTERM after ctrl-C is the same request again
        if signum == signal.SIGINT:
            raise KeyboardInterrupt

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
