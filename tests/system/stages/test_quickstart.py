"""End to end through the real stages and the real CLI: a tiny quickstart.

download (the built-in corpus) -> preprocess (webdataset shards) -> train (DeepSpeed, one
process) -> finetune (lr / 10) -> evaluate; then skip, --force and --set behaviour, what
MLflow recorded, and an interrupted training resumed to the same weights.
"""

from __future__ import annotations

import json
import os
import platform
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from pipeline.training.checkpoint_dirs import read_checkpoint_file
from tests.fixtures.quickstart import EVAL_EVERY, FT_STEPS, LOG_EVERY, LR, STEPS, tiny_config
from tests.fixtures.runs import cli

ROOT = Path(__file__).resolve().parents[3]


def ran(output: str) -> list[str]:
    return [line.split("]")[0][1:] for line in output.splitlines() if "] running:" in line]


@pytest.fixture(scope="module")
def pipeline_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("quickstart")
    cfg = tiny_config(tmp)
    first = cli("run", cfg)
    again = cli("run", cfg)
    forced = cli("run", cfg, "--force", "train")
    new_lr = cli("run", cfg, "--set", "train.optimizer.lr=0.005")
    return {
        "tmp": tmp,
        "cfg": cfg,
        "first": first,
        "again": again,
        "forced": forced,
        "new_lr": new_lr,
    }


def test_first_run_runs_every_stage_and_learns(pipeline_runs):
    out = pipeline_runs["first"].stdout
    assert ran(out) == ["download", "preprocess", "train", "finetune", "evaluate"]
    ws = pipeline_runs["tmp"] / "runs" / "tiny"
    results = json.loads((ws / "evaluate" / "results.json").read_text())
    entropy = results["unigram_entropy_bits"]
    assert 4.0 < entropy < 5.5  # English text, bytes
    # results.json is the latest run's (--set lr); the first run printed its own numbers
    latest_out = pipeline_runs["new_lr"].stdout
    for split in ("valid", "test"):
        assert results[split]["bpc"] < entropy  # 46 small steps already beat unigram
        assert f"{split:<5} bpc {results[split]['bpc']:.3f}" in latest_out
        printed = re.search(rf"\] {split}\s+bpc (\d+\.\d+)", out)
        assert printed and float(printed.group(1)) < entropy
    assert f"unigram entropy of the train split {entropy:.3f} bits" in out
    assert results["checkpoint"] == f"finetune/step-{STEPS + FT_STEPS:08d}"
    manifest = json.loads((ws / "preprocess" / "manifest.json").read_text())
    assert results["valid"]["tokens"] == manifest["splits"]["valid"]["tokens"] - 1
    assert all(
        name.endswith(".tar")
        for s in manifest["splits"].values()
        for name in (x["name"] for x in s["shards"])
    )


EXCERPT_PAGES = [ROOT / "README.md", ROOT / "docs" / "getting-started.md"]


def _shape(line: str) -> str:
    """A log line with its numbers blanked: the format, spacing included."""
    return re.sub(r"\d[\d,.]*", "N", line)


@pytest.mark.parametrize("page", EXCERPT_PAGES, ids=lambda p: p.name)
def test_the_pages_quickstart_excerpt_is_a_real_run(pipeline_runs, page):
    """The evaluate lines that README.md and docs/getting-started.md show for the full
    quickstart: the format is the one evaluate prints (this tiny pipeline's lines, the same
    stages on the same corpus), the checkpoint is quickstart.yaml's last step, ppl is 2^bpc,
    both beat the unigram entropy, and on the CPython the excerpt names (the corpus is made
    from its files) the entropy and the token counts are the tiny run's: same corpus, same
    split."""
    import yaml

    shown = [
        line.strip()
        for line in page.read_text(encoding="utf-8").splitlines()
        if line.strip().startswith("[evaluate] ")
    ]
    assert len(shown) == 3, f"{page.name}: expected the three evaluate lines, found {shown}"
    real = [
        line.strip()
        for line in pipeline_runs["first"].stdout.splitlines()
        if line.startswith("[evaluate] ")
        # the result lines, not the progress lines ("[evaluate] valid: 8,704/...")
        and re.match(r"\[evaluate\] (checkpoint|valid|test)\s", line)
    ]
    assert [_shape(line) for line in shown] == [_shape(line) for line in real]
    # the excerpt's corpus is made from the files of the CPython release it names
    named = re.search(
        r"\(2 CPU cores,\s+CPython (\d+\.\d+\.\d+),", page.read_text(encoding="utf-8")
    )
    assert named, f"{page.name}: names no CPython release for its excerpt"
    same_corpus = named.group(1) == platform.python_version()

    head = re.fullmatch(
        r"\[evaluate\] checkpoint finetune/step-(\d{8}); unigram entropy of "
        r"the train split (\d\.\d{3}) bits",
        shown[0],
    )
    quickstart = yaml.safe_load((ROOT / "configs" / "quickstart.yaml").read_text())
    assert int(head.group(1)) == quickstart["train"]["steps"] + quickstart["finetune"]["steps"]
    entropy = float(head.group(2))
    ws = pipeline_runs["tmp"] / "runs" / "tiny"
    results = json.loads((ws / "evaluate" / "results.json").read_text())
    for split, line in zip(("valid", "test"), shown[1:], strict=False):
        m = re.fullmatch(
            rf"\[evaluate\] {split}\s+bpc (\d\.\d{{3}})   ppl (\d+\.\d\d)   "
            rf"\(([\d,]+) tokens\)",
            line,
        )
        assert m, line
        bpc, ppl, tokens = float(m.group(1)), float(m.group(2)), int(m.group(3).replace(",", ""))
        assert bpc < entropy
        assert abs(ppl - 2**bpc) < 0.01  # byte tokens: perplexity = 2^bpc
        if same_corpus:
            assert tokens == results[split]["tokens"]
    if same_corpus:
        assert f"{results['unigram_entropy_bits']:.3f}" == f"{entropy:.3f}"


def test_show_counts_the_parameters_of_the_trained_model(pipeline_runs):
    # `show` builds on the meta device; the train stage counts the real model it trained
    ws = pipeline_runs["tmp"] / "runs" / "tiny"
    trained = json.loads((ws / "train" / "stage.json").read_text())["summary"]["parameters"]
    shown = re.search(r"^parameters: ([\d,]+) \(", cli("show", pipeline_runs["cfg"]).stdout, re.M)
    assert shown and int(shown.group(1).replace(",", "")) == trained


def test_second_run_skips_everything(pipeline_runs):
    out = pipeline_runs["again"].stdout
    assert ran(out) == []
    assert out.count("skipped: up to date") == 5
    # the first run's numbers, reprinted from its record
    first = re.search(r"\[evaluate\] valid bpc \d+\.\d+ .*", pipeline_runs["first"].stdout)
    assert first and first.group() in out and "no MLflow run recorded" in out


def test_force_train_reruns_train_finetune_evaluate(pipeline_runs):
    assert ran(pipeline_runs["forced"].stdout) == ["train", "finetune", "evaluate"]


def test_set_lr_reruns_from_train(pipeline_runs):
    assert ran(pipeline_runs["new_lr"].stdout) == ["train", "finetune", "evaluate"]


def test_finetune_continues_at_a_tenth_of_the_lr(pipeline_runs):
    out = pipeline_runs["first"].stdout
    assert f"from step {STEPS}: lr {LR:g} / 10 = {LR / 10:g} for {FT_STEPS} steps" in out


def test_mlflow_records_parent_and_nested_runs(pipeline_runs):
    from mlflow.tracking import MlflowClient

    tmp = pipeline_runs["tmp"]
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp / 'runs' / 'mlflow.db'}")
    exp = client.get_experiment_by_name("tiny")
    runs = client.search_runs(
        [exp.experiment_id], max_results=100, order_by=["attributes.start_time ASC"]
    )
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    assert len(parents) == 3  # one per `run` that ran something: `again` recorded none
    first = parents[0]
    assert first.info.status == "FINISHED"
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == first.info.run_id]
    assert sorted(r.data.tags["stage"] for r in children) == sorted(
        ["download", "preprocess", "train", "finetune", "evaluate"]
    )
    forced = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parents[1].info.run_id]
    assert sorted(r.data.tags["stage"] for r in forced) == ["evaluate", "finetune", "train"]
    assert parents[1].data.tags["stages.skipped"] == "download,preprocess"

    # hyperparameters as flattened params, environment as tags
    assert first.data.params["model.d_model"] == "32"
    assert first.data.params["train.optimizer.lr"] == str(LR)
    assert torch.__version__.startswith(first.data.tags["version.torch"])
    assert first.data.tags["world_size"] == "1"
    assert "spec.resolved.yaml" in [a.path for a in client.list_artifacts(first.info.run_id)]

    train = next(r for r in children if r.data.tags["stage"] == "train")
    assert train.data.params["model.n_persistent"] == "8"
    history = client.get_metric_history(train.info.run_id, "loss")
    assert [m.step for m in history] == list(range(LOG_EVERY, STEPS + 1, LOG_EVERY))
    valid = client.get_metric_history(train.info.run_id, "valid_bpc")
    assert [m.step for m in valid] == list(range(EVAL_EVERY, STEPS + 1, EVAL_EVERY))
    lr = {m.step: m.value for m in client.get_metric_history(train.info.run_id, "lr")}
    assert lr[LOG_EVERY] == pytest.approx(LR)  # warmup over 4 steps: done at step 4
    assert lr[STEPS] == pytest.approx(LR)

    finetune = next(r for r in children if r.data.tags["stage"] == "finetune")
    ft_lr = client.get_metric_history(finetune.info.run_id, "lr")
    assert [m.step for m in ft_lr] == [STEPS + LOG_EVERY, STEPS + FT_STEPS]  # steps continue
    assert all(m.value == pytest.approx(LR / 10) for m in ft_lr)

    evaluate = next(r for r in children if r.data.tags["stage"] == "evaluate")
    assert evaluate.data.metrics["test_bpc"] < evaluate.data.metrics["valid_bpc"] + 1


def _final_weights(ws: Path) -> dict:
    root = ws / "train" / "checkpoints"
    tag = (root / "latest").read_text().strip()
    return read_checkpoint_file(root / tag / "mp_rank_00_model_states.pt")["module"]


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["kill-9", "sigterm"])
def test_interrupted_training_resumes_to_the_same_weights(tmp_path, sig):
    """Stop `train` in the middle (kill -9, or SIGTERM as a Slurm preemption sends); the re-run
    resumes from the last complete checkpoint (SIGTERM: one saved at the step it stopped)
    and ends with exactly the weights of an uninterrupted run (dropout on, so RNG matters)."""
    straight = tiny_config(tmp_path, "straight", attn_dropout=0.2)
    cli("run", straight, "--only", "download,preprocess,train")

    killed = tiny_config(tmp_path, "killed", attn_dropout=0.2)
    cli("run", killed, "--only", "download,preprocess")
    env = dict(os.environ, DS_ACCELERATOR="cpu")
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipeline.commands.cli", "run", str(killed), "--only", "train"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    latest = tmp_path / "runs" / "killed" / "train.partial" / "checkpoints" / "latest"
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if latest.exists() and latest.read_text().strip() >= "step-00000016":
            break
        time.sleep(0.05)
    assert proc.poll() is None, "training finished before it could be interrupted"
    os.kill(proc.pid, sig)
    _, stderr = proc.communicate(timeout=120)
    assert not (tmp_path / "runs" / "killed" / "train" / "stage.json").exists()
    if sig == signal.SIGTERM:
        assert proc.returncode == 143, stderr
        stopped = re.search(r"SIGTERM at step (\d+): checkpoint .* saved", stderr)
        assert stopped, stderr
        assert latest.read_text().strip() == f"step-{int(stopped.group(1)):08d}"

    resumed = cli("run", killed, "--only", "train")
    step = int(re.search(r"resuming from step (\d+)", resumed.stdout).group(1))
    if sig == signal.SIGTERM:
        assert step == int(stopped.group(1))
    assert 16 <= step < STEPS
    a, b = (
        _final_weights(tmp_path / "runs" / "straight"),
        _final_weights(tmp_path / "runs" / "killed"),
    )
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="with CUDA, both train")
@pytest.mark.parametrize(
    "impl,why",
    [
        ("flex", "flex runs forward only on CPU (torch has no CPU backward for FlexAttention)"),
        (
            "triton",
            "triton runs its kernels on CUDA (on the CPU only in Triton's interpreter, for "
            "tests: minutes a step)",
        ),
    ],
)
def test_a_backend_that_cannot_train_here_stops_before_the_first_step_in_one_line(
    tmp_path, impl, why
):
    """train.device auto resolves to the CPU here, where FlexAttention has no backward and
    the Triton kernels only an interpreter: the train stage says so in one line (exit 2)
    instead of a traceback, or hours, at the first step."""
    cfg = tiny_config(tmp_path)
    result = cli("run", cfg, "--set", f"model.attention.impl={impl}", check=False)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: model.attention.impl: {why} and this run trains on the CPU: use reference, "
        "sdpa or auto"
    )
