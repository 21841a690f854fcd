"""kill -9 a tiny training with tracking on at random moments, resuming after each, and
print what MLflow's training-loss history holds against an uninterrupted run: kills, steps
checked, steps lost, steps doubled, values that differ (tests/system/tracking/test_kill9_tracking.py
asserts the same with 4 kills). About 20-40 s a kill on 2 busy cores.

    DS_ACCELERATOR=cpu .venv/bin/python -m quality.kill9_tracking [--kills 20] [--seed 20]
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import tempfile
import time
from collections import Counter
from pathlib import Path

from quality.tiny_training import ADAM, cli, tiny_config

EXPERIMENT = "procs1-zero0-span1"


def config(tmp: Path, steps: int) -> Path:
    tmp.mkdir(parents=True, exist_ok=True)
    return tiny_config(tmp, procs=1, zero=0, optimizer=ADAM, steps=steps)  # a checkpoint every 4


def loss_records(root: Path) -> tuple[list[tuple[int, float]], list[str]]:
    """Every (step, loss) over all train runs of the experiment, and the runs' statuses,
    oldest first."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")
    exp = client.get_experiment_by_name(EXPERIMENT)
    runs = client.search_runs(
        [exp.experiment_id], "tags.stage = 'train'", order_by=["attributes.start_time ASC"]
    )
    return (
        [
            (m.step, m.value)
            for run in runs
            for m in client.get_metric_history(run.info.run_id, "loss")
        ],
        [run.info.status for run in runs],
    )


def kill_and_resume(tmp: Path, kills: int, seed: int, steps: int) -> dict:
    """Run `steps` steps, kill -9 at `kills` random moments (resuming after each), finish;
    compare the losses in MLflow with those of an uninterrupted run. Returns the figure."""
    rng = random.Random(seed)
    whole = config(tmp / "whole", steps)
    cli("run", whole)
    reference = dict(loss_records(tmp / "whole" / "runs")[0])
    cfg = config(tmp / "killed", steps)
    latest = tmp / "killed" / "runs" / "dist" / "train.partial" / "checkpoints" / "latest"
    done = 0
    while done < kills:
        before = latest.read_text() if latest.exists() else None
        proc = cli("run", cfg, start_new_session=True)
        # the next checkpoint published, then a random moment within a few steps of it
        while proc.poll() is None and (not latest.exists() or latest.read_text() == before):
            time.sleep(0.002)
        time.sleep(rng.uniform(0, 0.15))
        if proc.poll() is not None:
            break  # finished before the kill: enough steps?
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
        done += 1
    cli("run", cfg)
    records, statuses = loss_records(tmp / "killed" / "runs")
    counts = Counter(step for step, _ in records)
    return {
        "kills": done,
        "steps": steps,
        "lost": sum(1 for s in range(1, steps + 1) if s not in counts),
        "doubled": sum(1 for c in counts.values() if c > 1),
        "wrong": sum(1 for s, v in records if v != reference.get(s)),
        "killed_runs": statuses[:-1].count("KILLED"),
        "runs": len(statuses),
        "last": statuses[-1],
    }


def render(figure: dict) -> str:
    return (
        f"kills {figure['kills']}  steps checked {figure['steps']}  lost {figure['lost']}  "
        f"doubled {figure['doubled']}  wrong values {figure['wrong']}  "
        f"killed attempts marked KILLED {figure['killed_runs']}/{figure['runs'] - 1}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--seed", type=int, default=20)
    args = parser.parse_args()
    steps = 4 * (args.kills + 3)  # a checkpoint every 4 steps, one per kill or more
    with tempfile.TemporaryDirectory() as tmp:
        figure = kill_and_resume(Path(tmp), args.kills, args.seed, steps)
    print(render(figure))


if __name__ == "__main__":
    main()
