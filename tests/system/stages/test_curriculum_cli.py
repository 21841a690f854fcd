"""The curriculum through the CLI in a child process: run, killed, resumed to the same result."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.fixtures.curriculum import ROOT, task_spec


def cli_command(cfg: Path, *sets: str) -> list[str]:
    return [sys.executable, "-m", "pipeline.commands.cli", "run", str(cfg), *sets]


CLI_SETS = (
    "--set",
    "dataset.generator.algorithmic.curriculum={epochs: 6, steps_per_epoch: 30, check_cases: 8}",
)


def test_cli_runs_the_curriculum_and_a_killed_run_resumes_to_the_same_result(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cfg, _ = task_spec(tmp_path)
    whole = subprocess.run(
        cli_command(cfg, *CLI_SETS), env=env, text=True, capture_output=True, timeout=600
    )
    assert whole.returncode == 0, whole.stderr
    done = json.loads(
        (tmp_path / "runs" / "tiny_task" / "curriculum" / "curriculum.json").read_text()
    )
    assert (
        f"[curriculum] score {done['score']} (the longest length solved in 6 epochs)"
        in whole.stdout
    )
    assert (
        f"[evaluate] score {done['score']} (not, checkpoint curriculum/step-00000180)"
        in whole.stdout
    )
    results = json.loads(
        (tmp_path / "runs" / "tiny_task" / "evaluate" / "results.json").read_text()
    )
    assert results["score"] == done["score"] and results["final_length"] == done["final_length"]
    final = done["final_length"]
    assert (
        sorted(map(int, results["lengths"]))
        == [final, final + 2, final + 5, final + 10, 2 * final][: len(results["lengths"])]
    )

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}")
    exp = client.get_experiment_by_name("tiny_task")
    stage_run = next(
        r
        for r in client.search_runs([exp.experiment_id])
        if r.data.tags.get("stage") == "curriculum"
    )
    lengths = client.get_metric_history(stage_run.info.run_id, "length")
    assert [(m.step, m.value) for m in lengths] == [
        (h["epoch"], h["length"]) for h in done["history"]
    ]

    # the same curriculum under another name, killed after its second epoch's checkpoint
    cut = tmp_path / "cut.yaml"
    cut.write_text(cfg.read_text().replace("name: tiny_task", "name: cut"))
    partial = tmp_path / "runs" / "cut" / "curriculum.partial" / "checkpoints"
    proc = subprocess.Popen(
        cli_command(cut, *CLI_SETS),
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    deadline = time.time() + 300
    while not (partial / "step-00000060").exists() and proc.poll() is None:
        assert time.time() < deadline, "no second checkpoint within 300 s"
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (tmp_path / "runs" / "cut" / "curriculum").exists()  # killed mid-curriculum
    again = subprocess.run(
        cli_command(cut, *CLI_SETS), env=env, text=True, capture_output=True, timeout=600
    )
    assert again.returncode == 0, again.stderr
    assert "[curriculum] resuming after epoch" in again.stdout
    resumed = json.loads((tmp_path / "runs" / "cut" / "curriculum" / "curriculum.json").read_text())
    assert resumed["score"] == done["score"]
    assert [h["length"] for h in resumed["history"]] == [h["length"] for h in done["history"]]
    assert resumed["history"] == done["history"]
