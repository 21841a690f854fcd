"""A score names the weights it scored (issue 51, item 1): evaluate records the checkpoint it
scored by content (`weights`), and `compare`, `export --register`, a re-run's reprint and the
Hugging Face model card show its numbers only beside those weights; otherwise they say
`stale` and to re-run evaluate. They used to match by path, or not at all: after train was
re-run without evaluate, compare showed the old model's score beside the new one's steps, and
`export --register` tagged the new weights with the old weights' test bpc.

Real stages on a tiny model (2 steps of train, evaluate on the valid split), tracked in a file
store of the test's own; download and preprocess are done once for the module and copied."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from pipeline.commands.cli import main
from pipeline.spec import load_spec
from pipeline.tracking.tracker import NullTracker
from pipeline.workspace.runner import Runner
from tests.fixtures.environment import restored_environment

CONFIG = """\
name: bound
dataset: {{name: python_docs, url: "builtin://python-docs",
          split: {{kind: tail, valid: 0.002, test: 0.002}}}}
model: {{kind: allattn, d_model: 16, n_layers: 1, n_heads: 2, n_persistent: 4, max_span: 16}}
train: {{steps: 2, batch_size: 2, seq_len: 16, seed: 1, checkpoint_every: 0,
        optimizer: {{type: adam, lr: 0.01, warmup_steps: 0, clip: global, clip_norm: 1.0}}}}
evaluate: {{splits: [valid], batch_size: 16, seq_len: 64}}
tracking: {{uri: "{store}", experiment: bound}}
workspace: {{root: {root}}}
stages: [download, preprocess, train, evaluate]
"""
OTHER_LR = ("--set", "train.optimizer.lr=0.003")


def write_config(tmp) -> Path:
    path = tmp / "bound.yaml"
    path.write_text(CONFIG.format(store=(tmp / "store").as_uri(), root=tmp / "runs"))
    return path


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """A workspace root whose `bound` workspace has download and preprocess done."""
    tmp = tmp_path_factory.mktemp("prepared")
    spec = load_spec(write_config(tmp), ["tracking.enabled=false"])
    with restored_environment():
        Runner(spec, only=["download", "preprocess"], log=lambda m: None).run(NullTracker())
    return tmp / "runs"


def copy_of(prepared, tmp) -> Path:
    """The config, in a workspace of its own under `tmp` (download and preprocess done),
    tracked to a file store of its own."""
    shutil.copytree(prepared, tmp / "runs", symlinks=True)
    return write_config(tmp)


def allow_file_registry(monkeypatch, tmp) -> None:
    """A file store may hold the registry; in `tmp`, where MLflow's file-store registry
    makes its stray `mlflow.db` (it opens the default store, in the working directory)."""
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.chdir(tmp)


@pytest.fixture
def cfg(prepared, tmp_path, monkeypatch):
    allow_file_registry(monkeypatch, tmp_path)
    return copy_of(prepared, tmp_path)


@pytest.fixture(scope="module")
def retrained(prepared, tmp_path_factory):
    """(config, the results evaluate wrote): a pipeline run, then train run again with
    another learning rate and the same steps, without evaluate: other weights at the path
    evaluate scored, train/checkpoints/step-00000002. The tests that read it change nothing
    in its workspace."""
    with restored_environment():
        os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
        cfg = copy_of(prepared, tmp_path_factory.mktemp("retrained"))
        cli("run", cfg)
        scored = results(cfg)
        cli("run", cfg, *OTHER_LR, "--only", "train")
    return cfg, scored


@pytest.fixture
def retrained_cfg(retrained, monkeypatch, tmp_path):
    """`retrained`, and its file store's registry allowed to this test."""
    allow_file_registry(monkeypatch, tmp_path)
    return retrained


def cli(*args) -> str:
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    return result.output


def results(cfg) -> dict:
    return json.loads((load_spec(cfg, []).workspace_dir / "evaluate" / "results.json").read_text())


def checkpoint(cfg, tag: str = "step-00000002") -> Path:
    return load_spec(cfg, []).workspace_dir / "train" / "checkpoints" / tag


def stale_reason(cfg, now: str) -> str:
    return (
        f"evaluate scored the weights train/step-00000002 held then, not those of {now}; "
        f"re-run evaluate (allattn-pipe run {cfg} --force evaluate)"
    )


def cells(table: str) -> dict[str, str]:
    """A one-row table's cells by column (the columns are split at two spaces or more)."""
    header, row = (re.split(r"\s{2,}", line.strip()) for line in table.splitlines()[:2])
    return dict(zip(header, row, strict=True))


def version_tags(cfg, name: str, version: str) -> dict:
    from mlflow.tracking import MlflowClient

    from pipeline.tracking.tracker import tracking_uri

    return MlflowClient(tracking_uri(load_spec(cfg, []))).get_model_version(name, version).tags


def test_compare_shows_stale_not_the_old_models_score_beside_the_new_training(cfg):
    """The issue's case: evaluate scored a 2-step model, train re-run for more steps alone."""
    cli("run", cfg)
    scored = results(cfg)["valid"]["bpc"]
    [row] = json.loads(cli("compare", cfg, "--format", "json"))
    assert (row["runs"][0]["steps"], row["metrics"]["valid_bpc"]["mean"]) == (
        2,
        pytest.approx(scored),
    )
    cli("run", cfg, "--set", "train.steps=6", "--only", "train")
    table = cli("compare", cfg)
    assert {k: cells(table)[k] for k in ("status", "steps", "valid_bpc", "valid_ppl")} == {
        "status": "finished",
        "steps": "6",
        "valid_bpc": "stale",
        "valid_ppl": "stale",
    }
    assert table.splitlines()[2:] == [
        "stale: bound: evaluate scored other weights than train's latest run ended with; "
        "re-run evaluate (`allattn-pipe run` its config with --force evaluate)"
    ]
    [row] = json.loads(cli("compare", cfg, "--format", "json"))
    assert row["metrics"] == {} and row["runs"][0]["metrics"] == {}
    assert row["stale"].startswith("evaluate scored other weights than train's latest run")
    # evaluate run on the new weights: their score, beside them
    cli("run", cfg, "--set", "train.steps=6")
    assert results(cfg)["checkpoint"] == "train/step-00000006"
    [row] = json.loads(cli("compare", cfg, "--format", "json"))
    assert (row["runs"][0]["steps"], row["metrics"]["valid_bpc"]["mean"]) == (
        6,
        pytest.approx(results(cfg)["valid"]["bpc"]),
    )
    assert "stale" not in row and row["runs"][0]["stale"] is None
    assert cells(cli("compare", cfg))["valid_bpc"] == f"{results(cfg)['valid']['bpc']:.4g}"


def test_compare_says_stale_while_a_training_run_waits_in_the_workspaces_backlog(cfg):
    """The stateful fuzzer's case: train and evaluate re-run while the tracking server was
    away, their runs kept in the workspace's backlog; the store still has the older weights'
    training and scores, which are no longer the workspace's."""
    from pipeline.tracking.backlog import append_records
    from pipeline.tracking.tracker import BACKLOG

    cli("run", cfg)
    backlog = load_spec(cfg, []).workspace_dir / BACKLOG
    create = {"op": "create", "key": "k", "experiment": "bound", "parent": None, "time": 1}
    append_records(backlog, [{**create, "tags": {"stage": "download"}}])
    assert "stale" not in json.loads(cli("compare", cfg, "--format", "json"))[0]
    append_records(backlog, [{**create, "key": "t", "tags": {"stage": "train"}}])
    table = cli("compare", cfg)
    assert cells(table)["valid_bpc"] == "stale"
    assert table.splitlines()[2:] == [
        f"stale: bound: train ran since with the tracking server away: their runs wait in "
        f"{backlog}, not yet in this store; send them with `allattn-pipe sync` its config"
    ]
    [row] = json.loads(cli("compare", cfg, "--format", "json"))
    assert row["metrics"] == {} and row["stale"].startswith("train ran since")


def test_register_attaches_no_score_of_other_weights_at_the_same_checkpoint_path(
    retrained_cfg, tmp_path
):
    cfg, scored = retrained_cfg
    out = cli("export", cfg, *OTHER_LR, "--out", tmp_path / "export", "--register", "m")
    assert out.splitlines()[-1].endswith(
        f"; evaluate's numbers are stale (evaluate scored the weights train/step-00000002 held "
        f"then, not those of {checkpoint(cfg)}): registered without score tags; re-run "
        f"evaluate (allattn-pipe run {cfg} --force evaluate) and register again"
    )
    assert not any(key.startswith("valid_") for key in version_tags(cfg, "m", "1"))


def test_a_rerun_with_nothing_to_do_says_stale_instead_of_reprinting_other_weights_scores(
    retrained,
):
    cfg, scored = retrained
    out = cli("run", cfg, *OTHER_LR, "--only", "train")
    assert "nothing to run: the stages selected are up to date" in out
    assert f"[evaluate] stale: {stale_reason(cfg, 'train/step-00000002')}\n" in out
    assert "bpc" not in out.partition("recorded results of evaluate")[2]


def test_an_exports_model_card_says_stale_instead_of_other_weights_scores(retrained, tmp_path):
    from pipeline.commands.export import export

    cfg, scored = retrained
    export(load_spec(cfg, [OTHER_LR[1]]), tmp_path / "hf", fmt="hf", log=lambda m: None)
    card = (tmp_path / "hf" / "README.md").read_text()
    assert card.endswith(
        f"\n## Scores\n\nstale: evaluate scored the weights train/step-00000002 held then, not "
        f"those of {checkpoint(cfg)}, so none are given here; re-run evaluate (allattn-pipe "
        f"run {cfg} --force evaluate) and export again.\n"
    )
    assert f"{scored['valid']['bpc']:.3f}" not in card


def test_scores_of_the_weights_shown_are_shown_reprinted_carded_and_registered(cfg, tmp_path):
    from pipeline.commands.export import export

    cli("run", cfg)
    scored = results(cfg)
    valid = scored["valid"]
    lines = [
        f"checkpoint train/step-00000002; unigram entropy of the train split "
        f"{scored['unigram_entropy_bits']:.3f} bits",
        f"valid bpc {valid['bpc']:.3f}   ppl {valid['ppl']:.2f}   ({valid['tokens']:,} tokens)",
    ]
    again = cli("run", cfg)
    assert "".join(f"[evaluate] {line}\n" for line in lines) in again
    export(load_spec(cfg, []), tmp_path / "hf", fmt="hf", log=lambda m: None)
    assert (
        (tmp_path / "hf" / "README.md")
        .read_text()
        .endswith(
            "\n## Scores\n\nallattn-pipe's evaluate scored these weights:\n\n```\n"
            + "\n".join(lines)
            + "\n```\n"
        )
    )
    out = cli("export", cfg, "--out", tmp_path / "export", "--register", "m")
    assert out.splitlines()[-1].endswith("; evaluate's numbers of train/step-00000002 attached")
    assert float(version_tags(cfg, "m", "1")["valid_bpc"]) == pytest.approx(valid["bpc"], rel=1e-5)


def test_results_of_an_older_version_are_kept_and_read_as_stale(cfg):
    """Results that name no weights (written before evaluate named them): the stages are
    still up to date (nothing re-runs after an upgrade: the fingerprints are as they were),
    and what shows the results says stale."""
    from pipeline.workspace.layout import RECORD

    off = ("--set", "tracking.enabled=false")
    cli("run", cfg, *off)
    record = load_spec(cfg, []).workspace_dir / "evaluate" / RECORD
    before = json.loads(record.read_text())
    assert before["summary"]["weights"] == results(cfg)["weights"]
    old = dict(before, summary={k: v for k, v in before["summary"].items() if k != "weights"})
    record.write_text(json.dumps(old))
    spec = load_spec(cfg, [off[1]])
    assert [(s.stage, s.action) for s in Runner(spec, log=lambda m: None).plan()] == [
        (name, "skip") for name in spec.stages
    ]
    out = cli("run", cfg, *off)
    assert (
        "[evaluate] stale: evaluate's results of train/step-00000002 do not name the weights "
        f"they scored (an older allattn-pipe wrote them); re-run evaluate (allattn-pipe run "
        f"{cfg} --force evaluate)\n"
    ) in out
    assert json.loads(record.read_text()) == old  # nothing re-ran


def test_an_algorithmic_tasks_scores_are_bound_to_the_curriculums_weights(tmp_path, monkeypatch):
    """The curriculum pipeline's evaluate (stages.curriculum.evaluate_task) names the weights
    too: the curriculum trained again alone makes its scores stale, in the reprint and in
    compare (whose row reads them from the curriculum's run and evaluate's)."""
    from tests.fixtures.curriculum import task_spec

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    sets = ["train.device=cpu", f"tracking.uri={(tmp_path / 'store').as_uri()}"]
    cfg, spec = task_spec(tmp_path, *sets)
    tiny = (
        "dataset.generator.algorithmic.curriculum={epochs: 2, steps_per_epoch: 5, check_cases: 8}"
    )
    args = ["--set", tiny, *(a for s in sets for a in ("--set", s))]
    cli("run", cfg, *args)
    scored = json.loads((spec.workspace_dir / "evaluate" / "results.json").read_text())
    label = scored["checkpoint"]
    assert label == "curriculum/step-00000010"
    assert f"[evaluate] score {scored['score']} (not, checkpoint {label})\n" in cli(
        "run", cfg, *args
    )
    assert cells(cli("compare", cfg, *args))["score"] == str(scored["score"])
    again = [*args, "--set", "train.seed=7", "--only", "curriculum"]
    cli("run", cfg, *again)
    assert cells(cli("compare", cfg, *args))["score"] == "stale"
    out = cli("run", cfg, *again)
    assert (
        f"[evaluate] stale: evaluate scored the weights {label} held then, not those of {label}; "
        f"re-run evaluate (allattn-pipe run {cfg} --force evaluate)\n"
    ) in out
    assert "[evaluate] score" not in out
