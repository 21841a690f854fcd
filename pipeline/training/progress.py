"""What a training run shows while it runs: a progress bar on a terminal, and the loss and
throughput between two reports."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


class Progress:
    """A progress bar (steps, ETA, loss / lr / tokens/s) on rank 0 when stderr is a terminal;
    log lines are printed above it. In a log file it stays silent: the log lines say it all."""

    def __init__(self, start: int, total: int, enabled: bool):
        from tqdm import tqdm

        self._tqdm = tqdm
        self.bar = tqdm(
            total=total,
            initial=start,
            unit="step",
            dynamic_ncols=True,
            leave=False,
            disable=not (enabled and sys.stderr.isatty()),
        )

    def advance(self) -> None:
        self.bar.update(1)

    def show(self, text: str) -> None:
        self.bar.set_postfix_str(text, refresh=False)

    def log(self, log: Callable[[str], None], message: str) -> None:
        if self.bar.disable:
            log(message)
        else:
            with self._tqdm.external_write_mode():
                log(message)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.bar.close()


class LossWindow:
    """Loss and wall time accumulated between two progress reports."""

    def __init__(self, tokens_per_step: int):
        self.tokens_per_step = tokens_per_step
        self.loss: float | torch.Tensor = 0.0  # a tensor once a step's loss is added
        self.steps, self.start = 0, time.time()

    def add(self, loss: float | torch.Tensor) -> None:  # a tensor: summed on the device
        self.loss += loss
        self.steps += 1

    def restart_clock(self) -> None:
        """Leave validation and checkpoint time out of the throughput."""
        self.start = time.time()

    def take(self) -> tuple[float | torch.Tensor, float, float]:
        """(mean loss, seconds per step, tokens per second), and start a new window."""
        elapsed = time.time() - self.start
        out = (
            self.loss / self.steps,
            elapsed / self.steps,
            self.tokens_per_step * self.steps / elapsed,
        )
        self.loss, self.steps, self.start = 0.0, 0, time.time()
        return out
