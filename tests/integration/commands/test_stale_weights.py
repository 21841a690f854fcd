"""Weights bound to the preprocess build they were trained on (issue 45, item 3): after
preprocess is rebuilt and train is not re-run, `export`, `sample` and `run --only evaluate`
refuse the old weights in one line saying what to re-run. They used to pair them with the new
vocabulary, exit 0: a vocabulary of the same size and other symbols loads without a complaint.

One copy of the session's trained workspace (tests/fixtures/trained.py), its preprocess rebuilt
by the runner (`--force preprocess --only preprocess`: a new build id, as any rebuild gets),
serves every case; nothing here trains."""

from __future__ import annotations

import json
import shutil

import pytest
from click.testing import CliRunner

from pipeline.commands.cli import main
from pipeline.spec import load_spec
from pipeline.tracking.tracker import NullTracker
from pipeline.workspace.runner import Runner
from tests.fixtures.environment import restored_environment


@pytest.fixture(scope="module")
def rebuilt(trained, tmp_path_factory):
    """(config, workspace, train's preprocess build, the rebuilt one): a copy of the trained
    workspace whose preprocess was re-run after train, with evaluate among its stages (not
    run yet)."""
    tmp = tmp_path_factory.mktemp("stale")
    root = load_spec(trained, []).workspace.root
    shutil.copytree(root, tmp / "runs", symlinks=True)
    cfg = tmp / "tiny.yaml"
    cfg.write_text(
        trained.read_text()
        .replace(str(root), str(tmp / "runs"))
        .replace(
            "stages: [download, preprocess, train]",
            "stages: [download, preprocess, train, evaluate]",
        )
    )
    spec = load_spec(cfg, [])
    ws = spec.workspace_dir
    old = json.loads((ws / "train" / "stage.json").read_text())["inputs"]["preprocess"]
    with restored_environment():
        Runner(spec, force=["preprocess"], only=["preprocess"], log=lambda m: None).run(
            NullTracker()
        )
    new = json.loads((ws / "preprocess" / "stage.json").read_text())["build"]
    assert new != old
    return cfg, ws, old, new


def refusal(rebuilt) -> str:
    cfg, ws, old, new = rebuilt
    finished = json.loads((ws / "preprocess" / "stage.json").read_text())["finished_at"]
    return (
        f"error: {ws / 'train'}: train was trained on preprocess build {old}, but the "
        f"workspace's preprocess is build {new} (finished {finished}), whose vocabulary "
        f"these weights never saw; nothing was read: run `allattn-pipe run {cfg}` to re-run "
        f"train and the stages after it on that build\n"
    )


@pytest.mark.parametrize("checkpoint", ["latest", "PATH"])
def test_export_refuses_weights_trained_on_another_preprocess_build(rebuilt, tmp_path, checkpoint):
    cfg, ws, _, _ = rebuilt
    which = (
        "latest"
        if checkpoint == "latest"
        else str(next((ws / "train" / "checkpoints").glob("step-*")))
    )
    out = tmp_path / "export"
    result = CliRunner().invoke(
        main, ["export", str(cfg), "--out", str(out), "--checkpoint", which]
    )
    assert (result.exit_code, result.output) == (2, refusal(rebuilt))
    assert not out.exists()


def test_sample_refuses_weights_trained_on_another_preprocess_build(rebuilt):
    cfg = rebuilt[0]
    result = CliRunner().invoke(main, ["sample", str(cfg), "--prompt", "def ", "--tokens", "5"])
    assert (result.exit_code, result.output) == (2, refusal(rebuilt))


def test_only_evaluate_refuses_to_score_weights_of_another_preprocess_build(rebuilt):
    cfg, ws, old, new = rebuilt
    finished = json.loads((ws / "preprocess" / "stage.json").read_text())["finished_at"]
    result = CliRunner().invoke(main, ["run", str(cfg), "--only", "evaluate"])
    assert (result.exit_code, result.stderr) == (
        2,
        f"error: stage 'evaluate' reads 'train' and 'preprocess', but train was built from "
        f"preprocess build {old} and preprocess is build {new}, finished {finished}: "
        f"train's output does not go with it; add train to --only to re-run it on that "
        f"build, or drop --only\n",
    )
    assert not (ws / "evaluate").exists() and not (ws / "evaluate.partial").exists()
