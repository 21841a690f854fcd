"""The update time `show --estimate` prints: the run's own update, timed here.

A real `Trainer` (pipeline.training.trainer) is built from the spec and the plan of its first
stage that trains, so the micro-batch, gradient accumulation, precision and DeepSpeed engine
are the ones the run resolves, and its `advance()` is what is timed; only the data differs:
the plan's `timing_data` (random tokens of the run's shape, as the estimate runs before
preprocess, or the curriculum's own generated cases). Timing one
micro-batch row and multiplying by the batch, as this did before, overstated a small
model's update 6 to 13 times (its fixed costs were paid once per row).

Where the run's update would not fit in this machine's memory, the estimate times fewer rows
of it (``smaller_update``: one micro-batch of that many rows) and scales the time by the
rows (pipeline/commands/estimate.py plans that from the memory plan). A timed update that
diverges stops the timing as `run` stops (``Diverged``), and a ``Heartbeat`` says what is
being timed at least every ``HEARTBEAT_S`` seconds, however long one update takes."""

from __future__ import annotations

import gc
import math
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pipeline.commands.report import vocab_size_for
from pipeline.errors import PipelineError

BUDGET_S = 60.0
TIMED = 5  # timed updates at most, after the warm-up
HEARTBEAT_S = 30.0  # the longest the estimate stays silent while it times


class Diverged(PipelineError):
    """A timed update's loss, gradients or weights were not finite (NaN or inf)."""


@dataclass(frozen=True)
class UpdateTime:
    seconds: float  # per optimizer update, the median of the timed ones
    measured: str  # how


def first_plan(spec):
    """The plan of the run's first stage that trains (pipeline.training.plan): its update is
    the one timed."""
    from stages import training_plans

    if not (plans := training_plans(spec)):
        raise PipelineError(f"{spec.source}: no stage of {', '.join(spec.stages)} trains")
    return plans[0][1]


def out_of_memory(error: BaseException) -> bool:
    """Whether `error` is the device or the host running out of memory (the CPU allocator
    raises a plain RuntimeError; the micro-batch search a PipelineError when none fits)."""
    if isinstance(error, MemoryError | torch.OutOfMemoryError):
        return True
    text = str(error).lower()
    return isinstance(error, RuntimeError | PipelineError) and any(
        k in text for k in ("out of memory", "allocate memory", "allocation", "no micro-batch fits")
    )


class UpdateTimer:
    """The run's `Trainer`, built as the run builds it, on data of the run's shape: `time(n)`
    times its next `n` updates on `clock`: wall time, or in a test the thread's CPU time,
    which other processes' load moves far less. Call `close()` when done (the engine's
    memory)."""

    def __init__(
        self,
        spec,
        log: Callable[[str], None] = lambda line: None,
        clock: Callable[[], float] = time.perf_counter,
    ):
        from pipeline.training.trainer import Trainer
        from stages.base import NullStageTracker

        self.clock = clock
        plan = first_plan(spec)
        vocab, origin = vocab_size_for(spec)
        if vocab is None:
            raise PipelineError(f"{spec.source}: the vocabulary size is unknown until preprocess")
        self.trainer = Trainer(spec, plan, plan.timing_data(vocab, origin), NullStageTracker(), log)

    def time(self, n: int) -> list[float]:
        """Seconds of each of the next `n` updates, each waited for; `Diverged` at an
        update whose loss, gradients or new weights are not finite (the next would fail on
        them, the all-attention spans' plan first)."""
        from pipeline.training.trainer import mean_nll

        device, out = self.trainer.device, []
        for _ in range(n):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = self.clock()
            # the run's update as its loop runs it: at the run's learning rate (its warm-up:
            # at a larger one the adaptive spans would grow faster than the run's, and the
            # updates with them), after the hooks that prepare it (the curriculum's cases)
            loss = float(mean_nll(self.trainer.advance()))  # waits for the update
            out.append(self.clock() - start)
            self.check_finite(loss)
        return out

    def check_finite(self, loss: float) -> None:
        """`Diverged`, in the words `run` stops with (pipeline.training.nonfinite), where the
        update just timed was not finite: its loss, what the non-finite guard counted (the
        gradients), or the weights it left."""
        from pipeline.training.nonfinite import all_finite

        t = self.trainer
        if t.guard.mode == "skip":  # the run skips such an update and goes on: so does this
            return
        counted = float(t.guard.tensors()["nonfinite_updates"])
        if not math.isfinite(loss) or counted > 0:
            raise Diverged(
                f"{t.stage}: a non-finite loss or gradient (NaN or inf) at step {t.step}: "
                f"the timing stopped there, as `run` stops training; {t.guard.hint}"
            )
        if not bool(all_finite([p.detach() for p in t.model.parameters() if p.numel()])):
            raise Diverged(
                f"{t.stage}: the weights at step {t.step} are not finite (NaN or inf): the "
                f"timing stopped there, as `run` stops training; {t.guard.hint}"
            )

    def describe(self) -> str:
        from pipeline.models.capabilities import AttentionSpans

        t = self.trainer
        bf16 = "bf16" if t.resolved["bf16"] else "float32"
        what = (
            f"{t.device.type}, {bf16}, one process: updates of {t.accum} micro-batch(es) of "
            f"{t.micro_batch} x {t.block_len} tokens ({t.micro_batch * t.accum} rows)"
        )
        if isinstance(t.model, AttentionSpans):
            what += f"; the initial spans ({t.model.describe_spans()})"
        return what

    def close(self) -> None:
        del self.trainer
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def smaller_update(spec, rows: int):
    """`spec` with an update of `rows` rows in one micro-batch (train.batch_size and
    train.micro_batch_size `rows`, no accumulation): the shape the estimate times where the
    run's update would not fit in this machine's memory. The rest of the spec is the run's."""
    train = spec.train
    deepspeed = train.deepspeed.model_copy(update={"gradient_accumulation_steps": 1})
    smaller = train.model_copy(
        update={"batch_size": rows, "micro_batch_size": rows, "deepspeed": deepspeed}
    )
    return spec.model_copy(update={"train": smaller})


class Heartbeat:
    """``with Heartbeat(progress) as beat:`` says ``beat.doing`` (what is being timed) and
    the seconds so far every `every` seconds until the block ends, from a thread: one update
    of a large model can take minutes, and a silent terminal looks hung."""

    def __init__(self, progress: Callable[[str], None] | None, every: float = HEARTBEAT_S):
        self.progress, self.every = progress, every
        self.doing = "building the run's trainer"
        self._done = threading.Event()
        self._start = time.monotonic()
        self._thread = threading.Thread(target=self._beat, daemon=True)

    def _beat(self) -> None:
        while not self._done.wait(self.every):
            if self.progress is not None:
                seconds = time.monotonic() - self._start
                self.progress(f"  ... still timing: {self.doing} ({seconds:.0f} s so far)")

    def __enter__(self) -> Heartbeat:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()


def time_updates(
    spec,
    budget_s: float = BUDGET_S,
    timed: int = TIMED,
    log: Callable[[str], None] = lambda line: None,
    progress: Callable[[str], None] | None = None,
) -> UpdateTime:
    """The run's update on its device: 1 warm-up, then up to `timed` updates while they stay
    within `budget_s`; the median. The spans are the initial ones (span_init), as a run's
    first updates have them. One process: a multi-process run's per-rank batch is smaller.
    `progress` hears what is being timed at least every HEARTBEAT_S seconds."""
    with Heartbeat(progress) as beat:
        timer = UpdateTimer(spec, log)
        try:
            beat.doing = "the warm-up update"
            [warmup] = timer.time(1)
            times: list[float] = []
            while len(times) < timed and sum(times) + (times[-1] if times else warmup) <= budget_s:
                beat.doing = f"update {len(times) + 1} of at most {timed}"
                times += timer.time(1)
            seconds = statistics.median(times) if times else warmup
            what = (
                f"median of {len(times)} timed"
                if times
                else "the warm-up alone, over the budget (with its first-call costs: high)"
            )
            return UpdateTime(
                seconds, f"{timer.describe()}: 1 warm-up + {len(times)} timed, {what}"
            )
        finally:
            timer.close()
