"""`allattn-pipe` with stand-in stages, for tests/commands/test_sweep.py: a sweep in its own
process, which the test can kill -9.

    sweep_worker.py ARGS...        (the CLI's arguments)

Each stage call appends {"stage", "point", "resumed"} to $SWEEP_CALLS ("resumed": the
stage found the marker an interrupted call left in its partial directory). The train call
of the point and stage named by $SWEEP_HANG_AT ("POINT:STAGE", "*:STAGE" for every point) leaves
that marker and then hangs until it is killed. Stages log what the real ones log for `compare`
(loss by step, the final bpc)."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

import stages
from pipeline.commands.cli import main

MARKER = "hanging"


def stand_in(name):
    def run(ctx):
        resumed = (ctx.out_dir / MARKER).exists()
        with open(os.environ["SWEEP_CALLS"], "a") as f:
            f.write(json.dumps({"stage": name, "point": ctx.spec.name, "resumed": resumed}) + "\n")
        if os.environ.get("SWEEP_HANG_AT") in (f"{ctx.spec.name}:{name}", f"*:{name}"):
            (ctx.out_dir / MARKER).write_text("")
            while True:
                time.sleep(60)
        train = ctx.spec.train
        if name == "train":
            for step in range(1, train.steps + 1):
                ctx.tracker.log_metrics({"loss": 2.0 / step}, step=step)
        if name == "evaluate":
            bpc = 1 + train.optimizer.lr * 100 + ctx.spec.model["n_layers"] / 10 + train.seed / 100
            ctx.tracker.log_metrics({"valid_bpc": bpc - 0.1, "test_bpc": bpc}, step=0)
        return {}

    return run


def point_command(config, point):
    """`sweep --parallel`'s point processes: this worker too, so they get the stand-ins."""
    return [
        sys.executable,
        os.path.abspath(__file__),
        "run",
        config,
        *(x for o in point.overrides for x in ("--set", o)),
    ]


if __name__ == "__main__":
    from pipeline.commands import sweep

    sweep.point_command = point_command
    for kind in list(stages.STAGES):
        stages.STAGES[kind] = dataclasses.replace(stages.STAGES[kind], run=stand_in(kind))
    sys.exit(main(sys.argv[1:]))
