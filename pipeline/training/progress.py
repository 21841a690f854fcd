"""What a training run shows while it runs: a progress bar on a terminal, and the loss and
throughput between two reports; and what a re-run shows of a finished run
(`training_result_lines`)."""

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
        self.eta = EtaEstimate()  # the log line's ETA, smoothed over reports

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


def training_result_lines(spec, summary: dict) -> list[str]:
    """What a `run` that finds a training stage up to date reprints of the summary its
    record holds (Trainer.fit's): the last step and, if it validated, the best validation;
    none for a summary without a step."""
    if "step" not in summary:
        return []
    from pipeline.data.vocab import bits_name

    bits = bits_name(getattr(getattr(spec.dataset, "tokenizer", None), "kind", None))
    for key, what, digits in (
        ("best_valid_bpc_estimate", f"best valid {bits} estimate", 3),
        ("best_valid_loss", "best valid loss", 4),
    ):
        if summary.get(key) is not None:
            return [f"step {summary['step']}, {what} {summary[key]:.{digits}f}"]
    return [f"step {summary['step']}"]


def gpu_memory_text(device: torch.device) -> str:
    """The log line's peak memory on a GPU (torch.cuda.max_memory_allocated); "" elsewhere,
    where the process's resident set says little about the model."""
    if device.type != "cuda":
        return ""
    from pipeline.cluster.device import peak_memory_mb

    return f"  peak mem {peak_memory_mb(device):,.0f} MiB"


class LossWindow:
    """Loss and wall time accumulated between two progress reports. `clock`: seconds (a
    fake one in tests)."""

    def __init__(self, tokens_per_step: int, clock: Callable[[], float] = time.time):
        self.tokens_per_step = tokens_per_step
        self.clock = clock
        self.loss: float | torch.Tensor = 0.0  # a tensor once a step's loss is added
        self.steps, self.start = 0, clock()

    def add(self, loss: float | torch.Tensor) -> None:  # a tensor: summed on the device
        self.loss += loss
        self.steps += 1

    def restart_clock(self) -> None:
        """Leave validation and checkpoint time out of the throughput."""
        self.start = self.clock()

    def take(self) -> tuple[float | torch.Tensor, float, float]:
        """(mean loss, seconds per step, tokens per second), and start a new window."""
        elapsed = self.clock() - self.start
        out = (
            self.loss / self.steps,
            elapsed / self.steps,
            self.tokens_per_step * self.steps / elapsed,
        )
        self.loss, self.steps, self.start = 0.0, 0, self.clock()
        return out


class EtaEstimate:
    """Seconds per step for the ETA, smoothed over reports: an exponential moving average
    in which one report's window counts at most `SWING` times the estimate (a window slowed
    by a compile, a new span bucket or a busy machine moves the ETA by at most
    WEIGHT x (SWING - 1), a lasting change is followed within a few reports). The first
    window (start-up: allocation, the first compiles) is replaced by the second rather than
    averaged in."""

    WEIGHT = 0.3
    SWING = 2.0

    def __init__(self) -> None:
        self.seconds_per_step: float | None = None
        self.reports = 0

    def update(self, seconds_per_step: float) -> None:
        self.reports += 1
        if self.seconds_per_step is None or self.reports == 2:
            self.seconds_per_step = seconds_per_step
            return
        held = self.seconds_per_step
        sample = min(max(seconds_per_step, held / self.SWING), held * self.SWING)
        self.seconds_per_step = held + self.WEIGHT * (sample - held)

    def remaining(self, steps_left: int) -> float:
        """Seconds for `steps_left` more steps (0 before the first report)."""
        return steps_left * (self.seconds_per_step or 0.0)


class ScoringProgress:
    """What scoring a split shows: on a terminal a bar updated in place (tokens done /
    total, tokens/s, ETA); in a log file one line each time another tenth is done or
    `every_s` seconds have passed, whichever comes first. Called with the tokens scored so
    far (pipeline.training.evaluation.evaluate_nll's `progress`)."""

    def __init__(
        self,
        label: str,
        total: int,
        log: Callable[[str], None],
        every_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        terminal: bool | None = None,
    ):
        self.label, self.total, self.log, self.every_s, self.clock = (
            label,
            total,
            log,
            every_s,
            clock,
        )
        self.start = self.last_time = clock()
        self.last_tenth = 0
        self.bar = None
        if sys.stderr.isatty() if terminal is None else terminal:
            from tqdm import tqdm

            self.bar = tqdm(
                total=total,
                desc=label,
                unit="tok",
                unit_scale=True,
                dynamic_ncols=True,
                leave=False,
            )

    def __call__(self, done: int) -> None:
        if self.bar is not None:
            self.bar.update(done - self.bar.n)
            return
        now = self.clock()
        tenth = done * 10 // max(self.total, 1)
        if tenth > self.last_tenth or now - self.last_time >= self.every_s:
            self.last_tenth, self.last_time = tenth, now
            self.log(self.line(done, now - self.start))

    def line(self, done: int, elapsed: float) -> str:
        rate = done / elapsed if elapsed > 0 else 0.0
        eta = f"{(self.total - done) / rate:,.0f}s" if rate > 0 else "?"
        return (
            f"{self.label}: {done:,}/{self.total:,} tokens ({done / max(self.total, 1):.0%})  "
            f"{rate:,.0f} tok/s  eta {eta}"
        )

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.close()
