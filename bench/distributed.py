"""Start-up time and per-step cost of multi-process training against one process.

Runs the train stage of a quickstart-sized model through `allattn-pipe run` (so the 2-process
rows include the `deepspeed` launcher the runner starts) and reads MLflow back:

    python -m bench.distributed [--steps 30] [--procs 1 2] [--zero 0 1 2]

"start -> step 1" is wall time from starting `allattn-pipe run` (download and preprocess
already done) to the first logged step, so it includes the launcher, process-group set-up,
DeepSpeed initialisation and the first step itself. "step" is the mean wall time of steps
2..N (the first is left out: it pays one-off allocation costs).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def config(tmp: Path, steps: int, procs: int, zero: int) -> Path:
    path = tmp / f"bench-{procs}-{zero}.yaml"
    path.write_text(f"""\
extends: [{ROOT / "configs" / "quickstart.yaml"}]
name: bench
train:
  steps: {steps}
  log_every: 1
  eval_every: 0
  checkpoint_every: 0
  deepspeed: {{zero_stage: {zero}}}
  launcher: {{procs_per_node: {procs}}}
tracking: {{experiment: procs{procs}-zero{zero}}}
workspace: {{root: {tmp / "runs"}}}
stages: [download, preprocess, train]
""")
    return path


def measure(tmp: Path, steps: int, procs: int, zero: int) -> dict:
    from mlflow.tracking import MlflowClient

    cfg = config(tmp, steps, procs, zero)
    env = dict(os.environ)
    env.setdefault("DS_ACCELERATOR", "cpu")
    cmd = [sys.executable, "-m", "pipeline.commands.cli", "run", str(cfg)]
    subprocess.run(
        cmd + ["--only", "download,preprocess"], check=True, env=env, capture_output=True
    )
    started = time.time()
    subprocess.run(cmd + ["--force", "train"], check=True, env=env, capture_output=True)
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp / 'runs' / 'mlflow.db'}")
    exp = client.get_experiment_by_name(f"procs{procs}-zero{zero}")
    run = client.search_runs([exp.experiment_id], "tags.stage = 'train'")[0]
    loss = sorted(client.get_metric_history(run.info.run_id, "loss"), key=lambda m: m.step)
    stamps = [m.timestamp / 1000 for m in loss]
    step = (stamps[-1] - stamps[0]) / (len(stamps) - 1)
    return {"procs": procs, "zero": zero, "first": stamps[0] - started, "step": step}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--procs", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--zero", type=int, nargs="+", default=[0, 1, 2])
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for procs in args.procs:
            for zero in args.zero if procs > 1 else [0]:
                rows.append(measure(Path(tmp), args.steps, procs, zero))
    base = next((r["step"] for r in rows if r["procs"] == 1), None)
    print(
        f"quickstart model, batch 16 x 128 (global), {args.steps} steps, "
        f"{os.cpu_count()} CPU cores\n"
    )
    print("| processes | ZeRO | start -> step 1 (s) | step (s) | vs 1 process |")
    print("|---|---|---|---|---|")
    for r in rows:
        ratio = f"{r['step'] / base:.2f}x" if base else "-"
        print(f"| {r['procs']} | {r['zero']} | {r['first']:.1f} | {r['step']:.3f} | {ratio} |")


if __name__ == "__main__":
    main()
