"""A preemption's second SIGTERM during the runner's bookkeeping after the checkpoint: the
run still stops as preempted, saying which checkpoint it saved (issue 44 item 2).

The Slurm time-limit test (tests/system/cluster/test_cluster.py) now and then lost its
"checkpoint ... saved" line. After the training loop has saved its checkpoint and raised
`Preempted`, rank 0 ends the stage's MLflow run and the pipeline's (`MlflowTracker.stage`'s
end and `Runner.run`'s `tracker.finish`: each waits for the records to be durable). A SIGTERM
that reaches it then, from Slurm again, or from the step's end once the other rank has exited
143, used to replace the stop with `Interrupted`: "stopped by SIGTERM", once the training
loop's handler was gone (fixed by 5b1a17d: the loop hands the signal it took back), and
"stopped at once by a second signal ... nothing more was saved" when the bookkeeping had
run past `DUPLICATE_WINDOW_S` after the first signal, as it does under load. The line users
read to know where the re-run resumes was gone either way.

Here the second SIGTERM is sent at those moments, with the clock of the duplicate window
moved on where the case needs it: no re-running until the timing happens to line up."""

from __future__ import annotations

import dataclasses
import os
import signal
import types
from contextlib import contextmanager

import pytest

import stages
from pipeline.cluster import signals
from pipeline.cluster.signals import DUPLICATE_WINDOW_S, StopSignal
from pipeline.errors import Interrupted, Preempted
from pipeline.spec import load_spec
from pipeline.tracking.tracker import NullTracker
from pipeline.workspace.runner import Runner
from stages.base import NullStageTracker


def preempted_train(ctx):
    """What `Trainer.fit` does on a SIGTERM: the loop's handler takes it, the update ends,
    a checkpoint is saved, and `Preempted` names it."""
    with StopSignal() as stop:
        os.kill(os.getpid(), signal.SIGTERM)  # the preemption, during update 4
        checkpoints = ctx.out_dir / "checkpoints"
        (checkpoints / "step-00000004").mkdir(parents=True)
        (checkpoints / "latest").write_text("step-00000004\n")
        raise Preempted(
            f"{stop.received} at step 4: checkpoint {checkpoints / 'step-00000004'} saved; "
            f"run the pipeline again to resume from it"
        )


class Bookkeeping(NullTracker):
    """A tracker whose stage end or finish (`at`) is where the second SIGTERM arrives,
    `after` seconds after the first on the duplicate window's clock."""

    def __init__(self, at: str, after: float, clock: list[float]):
        self.at, self.after, self.clock = at, after, clock
        self.sent = False

    def _second_sigterm(self) -> None:
        self.clock[0] += self.after
        self.sent = True
        os.kill(os.getpid(), signal.SIGTERM)

    @contextmanager
    def stage(self, name, config, series=None, resumed=False):
        try:
            yield NullStageTracker()
        except Preempted:
            if self.at == "stage end":
                self._second_sigterm()
            raise

    def finish(self, status: str) -> None:
        if self.at == "finish":
            assert status == "KILLED"
            self._second_sigterm()


@pytest.mark.parametrize("at", ["stage end", "finish"])
@pytest.mark.parametrize(
    "after",
    [0.0, DUPLICATE_WINDOW_S + 1],
    ids=["within the duplicate window", "past it, under load"],
)
def test_a_second_sigterm_during_the_bookkeeping_keeps_the_checkpointed_stop(
    cfg, calls, monkeypatch, at, after
):
    monkeypatch.setitem(
        stages.STAGES, "train", dataclasses.replace(stages.STAGES["train"], run=preempted_train)
    )
    clock = [0.0]
    monkeypatch.setattr(signals, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
    tracker = Bookkeeping(at, after, clock)
    spec = load_spec(cfg, [])
    # without a handler, a SIGTERM would end pytest itself
    previous = signal.signal(signal.SIGTERM, lambda *a: pytest.fail("SIGTERM not handled"))
    try:
        with pytest.raises(Preempted) as stopped:
            Runner(spec, log=lambda m: None).run(tracker)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert tracker.sent
    assert not isinstance(stopped.value, Interrupted), stopped.value
    assert stopped.value.exit_code == 143
    checkpoint = spec.workspace_dir / "train.partial" / "checkpoints" / "step-00000004"
    # the line the Slurm test reads, as the CLI prints it
    assert str(stopped.value).startswith(f"SIGTERM at step 4: checkpoint {checkpoint} saved;")
    # and the stage is left to resume from it
    train = next(s for s in Runner(spec).plan() if s.stage == "train")
    assert (train.action, train.forced, train.checkpoint) == ("run", False, 4)
