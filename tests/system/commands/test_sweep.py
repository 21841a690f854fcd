"""`allattn-pipe sweep`: a 2 x 2 grid with 2 seeds is 8 runs and one preprocess; a second
sweep runs nothing; an interrupted sweep's re-run finishes only what was missing, also after
kill -9. Stand-in stages (tests/fixtures/workers/sweep_worker.py) record each call in a file, so
the whole sweep takes seconds."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.fixtures.runs import five_stage_config

ROOT = Path(__file__).resolve().parents[3]

GRID = [
    "--grid",
    "train.optimizer.lr=0.001,0.002",
    "--grid",
    "model.n_layers=1,2",
    "--seeds",
    "1,2",
]
NAMES = [
    f"pipe-lr{lr}-n_layers{n}-seed{s}" for lr in ("0.001", "0.002") for n in (1, 2) for s in (1, 2)
]


@pytest.fixture
def cfg(tmp_path):
    return five_stage_config(tmp_path, steps=4, tracking=True)


def sweep(cfg, *args, env=None):
    """The sweep in its own process (stand-in stages), as a user runs it."""
    return subprocess.Popen(
        [
            sys.executable,
            str(ROOT / "tests" / "fixtures" / "workers" / "sweep_worker.py"),
            "sweep",
            str(cfg),
            *GRID,
            *args,
        ],
        env={
            **os.environ,
            "MLFLOW_ALLOW_FILE_STORE": "true",
            "DS_ACCELERATOR": "cpu",
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
            **(env or {}),
        },
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def calls_of(path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def finish(proc) -> str:
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, out
    return out


def test_grid_of_8_preprocesses_once_then_skips_all_and_resumes_after_kill_9(
    cfg, tmp_path, monkeypatch
):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    calls = tmp_path / "calls.jsonl"
    env = {"SWEEP_CALLS": str(calls), "SWEEP_HANG_AT": f"{NAMES[5]}:train"}
    proc = sweep(cfg, env=env)
    hang = tmp_path / "runs" / NAMES[5] / "train.partial" / "hanging"
    deadline = time.time() + 240
    while not hang.exists():
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[0]
        time.sleep(0.2)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    first = calls_of(calls)
    assert [c for c in first if c["stage"] in ("download", "preprocess")] == [
        {"stage": "download", "point": NAMES[0], "resumed": False},
        {"stage": "preprocess", "point": NAMES[0], "resumed": False},
    ]
    assert [c["point"] for c in first if c["stage"] == "evaluate"] == NAMES[:5]

    calls.unlink()
    out = finish(sweep(cfg, env={"SWEEP_CALLS": str(calls)}))
    again = calls_of(calls)
    # only what was missing: the killed point resumes its train, the last two run whole
    assert [(c["stage"], c["point"], c["resumed"]) for c in again] == [
        ("train", NAMES[5], True),
        ("finetune", NAMES[5], False),
        ("evaluate", NAMES[5], False),
    ] + [(stage, name, False) for name in NAMES[6:] for stage in ("train", "finetune", "evaluate")]
    assert "8 of 8 points done" in out

    calls.unlink()
    out = finish(sweep(cfg, env={"SWEEP_CALLS": str(calls)}))
    assert not calls.exists()
    assert [line for line in out.splitlines() if line.endswith("] done")] == [
        f"[{name}] done" for name in NAMES
    ]

    from mlflow.tracking import MlflowClient

    client = MlflowClient((tmp_path / "store").as_uri())
    exp = client.get_experiment_by_name("pipe")
    sweeps = client.search_runs([exp.experiment_id], "tags.`sweep.id` != ''")
    assert len(sweeps) == 1 and sweeps[0].info.status == "FINISHED"
    pipelines = [r for r in client.search_runs([exp.experiment_id]) if "spec" in r.data.tags]
    assert {r.data.tags["mlflow.parentRunId"] for r in pipelines} == {sweeps[0].info.run_id}

    # compare on the sweep's run: the four grid points, two seeds each
    from click.testing import CliRunner

    from pipeline.commands.cli import main

    result = CliRunner(
        env={
            "MLFLOW_ALLOW_FILE_STORE": "true",
            "MLFLOW_TRACKING_URI": (tmp_path / "store").as_uri(),
        }
    ).invoke(main, ["compare", sweeps[0].info.run_id, "--format", "json"])
    assert result.exit_code == 0, result.output
    groups = json.loads(result.output)
    assert [(g["name"], g["n"], g["metrics"]["test_bpc"]["n"]) for g in groups] == [
        (f"pipe-lr{lr}-n_layers{n}", 2, 2) for lr in ("0.001", "0.002") for n in (1, 2)
    ]
    # and on the config the sweep was made from, with --set picking points
    result = CliRunner().invoke(
        main, ["compare", str(cfg), "--set", "model.n_layers=2", "--format", "json"]
    )
    assert [g["name"] for g in json.loads(result.output)] == [
        "pipe-lr0.001-n_layers2",
        "pipe-lr0.002-n_layers2",
    ]


def test_dry_run_names_the_points_and_runs_nothing(cfg, tmp_path):
    out = finish(sweep(cfg, "--dry-run", env={"SWEEP_CALLS": str(tmp_path / "calls")}))
    lines = out.splitlines()
    assert lines[0] == "8 points; run once and reused by every point: download, preprocess"
    assert [line.split()[0] for line in lines[1:]] == NAMES
    assert lines[1].split()[1:] == [
        "run",
        "download,preprocess,train,finetune,evaluate",
        "--set",
        "train.optimizer.lr=0.001",
        "--set",
        "model.n_layers=1",
        "--set",
        "train.seed=1",
    ]
    assert not (tmp_path / "calls").exists() and not (tmp_path / "runs").exists()


def test_grid_mistakes_are_one_line(cfg):
    from click.testing import CliRunner

    from pipeline.commands.cli import main

    result = CliRunner().invoke(main, ["sweep", str(cfg), "--grid", "train.optimizer.lr"])
    assert result.exit_code == 2
    assert result.output == (
        "error: --grid train.optimizer.lr: expected KEY=V1,V2,... "
        "(e.g. --grid train.optimizer.lr=1e-3,3e-3)\n"
    )
    result = CliRunner().invoke(main, ["sweep", str(cfg), "--grid", "model.n_layer=1,2"])
    assert result.exit_code == 2
    assert result.output.startswith("error: sweep point pipe-n_layer1: ")
    assert "model.n_layer" in result.output and "n_layers" in result.output


@pytest.mark.parametrize(
    "args, error",
    [
        (
            ["--grid", "train.seed=1,2", "--seeds", "3,4"],
            "--grid train.seed and --seeds both set train.seed: each point would run under two "
            "names; give the seeds once",
        ),
        (["--grid", "name=a,b"], "--grid name=a,b: the sweep sets name itself, one per point"),
        (
            ["--grid", "tracking.experiment=a,b"],
            "--grid tracking.experiment=a,b: the sweep sets tracking.experiment itself, one per "
            "point",
        ),
    ],
)
def test_a_grid_that_would_name_points_wrongly_is_refused(cfg, tmp_path, args, error):
    from click.testing import CliRunner

    from pipeline.commands.cli import main

    result = CliRunner().invoke(main, ["sweep", str(cfg), "--dry-run", *args])
    assert result.exit_code == 2, result.output
    assert result.output == f"error: {error}\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pipe.yaml"]


def test_a_set_that_the_grid_replaces_is_named(cfg):
    from click.testing import CliRunner

    from pipeline.commands.cli import main

    result = CliRunner().invoke(
        main,
        [
            "sweep",
            str(cfg),
            "--dry-run",
            "--set",
            "train.optimizer.lr=0.5",
            "--set",
            "train.seed=7",
            "--set",
            "model.d_model=32",
            "--grid",
            "train.optimizer.lr=0.01,0.02",
            "--seeds",
            "1",
        ],
    )
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[:2] == [
        "--set train.optimizer.lr=0.5: replaced at every point by --grid train.optimizer.lr",
        "--set train.seed=7: replaced at every point by --seeds",
    ]
    assert "model.d_model" not in result.output


def test_parallel_runs_each_point_as_its_own_process_and_compare_shows_both(
    cfg, tmp_path, monkeypatch
):
    """The real stages (a point's process is a plain `allattn-pipe run`) on a small corpus."""
    from click.testing import CliRunner

    from pipeline.cluster import distributed
    from pipeline.commands.cli import main

    corpus = tmp_path / "corpus.txt"  # small: download, preprocess, evaluate in seconds
    corpus.write_bytes(b"".join(b"line %d of a small corpus.\n" % i for i in range(2000)))
    # the points' processes (python -m pipeline.commands.cli run) import this checkout
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    # As after a run in this process (a single process exports what a launcher would): the
    # points must not inherit it, or both rendezvous at one port ("address already in use").
    for name, value in {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(distributed.free_port()),
    }.items():
        monkeypatch.setenv(name, value)
    monkeypatch.chdir(ROOT)
    result = CliRunner().invoke(
        main,
        [
            "sweep",
            str(cfg),
            "--seeds",
            "1,2",
            "--parallel",
            "2",
            "--set",
            f"dataset.url=file://{corpus}",
            "--set",
            "train.steps=2",
            "--set",
            "evaluate.seq_len=64",
            "--set",
            "evaluate.splits=[valid]",
            "--set",
            "stages=[download,preprocess,train,evaluate]",
        ],
    )
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    names = ["pipe-seed1", "pipe-seed2"]
    started = [
        next(i for i, line in enumerate(lines) if line.startswith(f"[{n}] started")) for n in names
    ]
    finished = [lines.index(f"[{n}] finished") for n in names]
    assert max(started) < min(finished), result.output  # both ran at the same time
    assert lines[-1] == "2 of 2 points done"
    for name in names:
        log = (tmp_path / "runs" / name / "sweep.log").read_text()  # its own process's output
        assert "[train] running" in log and "[evaluate] done" in log, log
        assert "[preprocess] running" not in log  # the sweep's, reused

    result = CliRunner(env={"MLFLOW_TRACKING_URI": (tmp_path / "store").as_uri()}).invoke(
        main, ["compare", "--format", "json"]
    )
    assert result.exit_code == 0, result.output
    groups = json.loads(result.output)
    assert [(g["name"], g["n"], g["status"], g["metrics"]["valid_bpc"]["n"]) for g in groups] == [
        ("pipe", 2, "finished", 2)
    ]
    assert sorted(r["seed"] for r in groups[0]["runs"]) == ["1", "2"]


def test_a_signal_to_a_parallel_sweep_reaches_its_points_and_marks_its_run_killed(
    cfg, tmp_path, monkeypatch
):
    # before: SIGTERM killed the sweep at once; its points trained on as orphans and its
    # MLflow run stayed RUNNING
    import psutil
    from mlflow.tracking import MlflowClient

    calls = tmp_path / "calls.jsonl"
    proc = subprocess.Popen(
        [
            sys.executable,
            str(ROOT / "tests" / "fixtures" / "workers" / "sweep_worker.py"),
            "sweep",
            str(cfg),
            "--seeds",
            "1,2",
            "--parallel",
            "2",
        ],
        env={
            **os.environ,
            "MLFLOW_ALLOW_FILE_STORE": "true",
            "DS_ACCELERATOR": "cpu",
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
            "SWEEP_CALLS": str(calls),
            "SWEEP_HANG_AT": "*:train",
        },
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 180
    while sum(c["stage"] == "train" for c in (calls_of(calls) if calls.exists() else [])) < 2:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
        time.sleep(0.2)
    points = psutil.Process(proc.pid).children(recursive=True)
    assert len(points) >= 2
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 143, out
    assert out.splitlines()[-1].startswith("error: sweep stopped by SIGTERM: "), out
    assert "Traceback" not in out, out
    for point in points:  # no orphans: each stopped on the signal
        assert not point.is_running() or point.status() == psutil.STATUS_ZOMBIE
    for seed in (1, 2):
        assert (
            "stopped by SIGTERM"
            in (tmp_path / "runs" / f"pipe-seed{seed}" / "sweep.log").read_text()
        )
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient((tmp_path / "store").as_uri())
    exp = client.get_experiment_by_name("pipe")
    sweeps = client.search_runs([exp.experiment_id], "tags.`sweep.id` != ''")
    assert [r.info.status for r in sweeps] == ["KILLED"]
