"""`show --estimate`'s update time against the run's, on this machine: the config really run
for its first `--updates` updates in process and, in turns with it under the same load, the
update the estimate times (pipeline.commands.update_timing.UpdateTimer); and, taken just
before, the figure `show --estimate` itself prints (time_updates: 1 warm-up, the median of up
to 5), which the load of that moment moves.

    python -m bench.estimate_vs_run configs/quickstart.yaml --updates 24
    python -m bench.estimate_vs_run configs/active_memory/sort.yaml --updates 24

Prints: config, show --estimate's s/update, predicted s/update (in turns), measured
s/update, their ratio, and the load average. The spans start at span_init in both; a full
run's spans grow, and its updates with them. The workspace is a temporary directory;
tracking is off."""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable

TURN = 4


def overrides(spec, updates: int) -> list[str]:
    """The config cut to its first training stage's first `updates` updates."""
    if "curriculum" in spec.stages:
        return [
            "dataset.generator.algorithmic.curriculum.epochs=1",
            f"dataset.generator.algorithmic.curriculum.steps_per_epoch={updates}",
            "stages=[curriculum]",
        ]
    before = [s for s in spec.stages if s in ("download", "preprocess")]
    warmup = min(spec.train.optimizer.warmup_steps, updates - 1)
    return [
        f"train.steps={updates}",
        f"train.optimizer.warmup_steps={warmup}",
        "train.eval_every=0",
        "train.checkpoint_every=0",
        f"stages=[{', '.join([*before, 'train'])}]",
    ]


def in_turns(
    spec, turn: int = TURN, clock: Callable[[], float] = time.perf_counter
) -> tuple[float, float]:
    """(predicted, measured) seconds per update: the estimate's (UpdateTimer, the update
    `show --estimate` times) and the run's (each update its loop calls, the stage's own
    Trainer on the stage's data), taken in turns under the same load: after every `turn` of
    the run's updates, `turn` of the estimate's. Each's first turn (first calls) is dropped;
    then each is the median over the turns of its mean update. Both are timed on `clock`."""
    from pipeline.commands.update_timing import UpdateTimer
    from pipeline.tracking.tracker import NullTracker
    from pipeline.training.trainer import Trainer
    from pipeline.workspace.runner import Runner

    timer: list[UpdateTimer] = []  # built after the run's first turn: its data exists by then
    run: list[float] = []
    turns: list[float] = []
    update = Trainer.update

    def timed_update(self):
        if timer and self is timer[0].trainer:
            return update(self)
        start = clock()
        out = update(self)
        run.append(clock() - start)
        if len(run) % turn == 0:
            if not timer:
                timer.append(UpdateTimer(spec, clock=clock))
            turns.append(statistics.mean(timer[0].time(turn)))
        return out

    Trainer.update = timed_update  # type: ignore[method-assign]
    try:
        Runner(spec, log=lambda m: None).run(NullTracker())
    finally:
        Trainer.update = update  # type: ignore[method-assign]
        for t in timer:
            t.close()
    windows = [statistics.mean(run[i : i + turn]) for i in range(turn, len(run) - turn + 1, turn)]
    return statistics.median(turns[1:]), statistics.median(windows)


def main() -> None:
    from pipeline.commands.update_timing import time_updates
    from pipeline.spec import load_spec

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config")
    parser.add_argument("--updates", type=int, default=24)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        where = [f"workspace.root={tmp}", "tracking.enabled=false"]
        spec = load_spec(
            args.config, [*where, *overrides(load_spec(args.config, where), args.updates)]
        )
        shown = time_updates(spec)
        predicted, measured = in_turns(spec)
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"estimate: {shown.measured}")
    print(
        f"| {args.config} | {shown.seconds:.3f} | {predicted:.3f} | {measured:.3f} | "
        f"{predicted / measured:.2f} | {load} |"
    )


if __name__ == "__main__":
    main()
