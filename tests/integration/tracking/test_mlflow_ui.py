"""What MLflow's users look for in the store: experiments marked as model training (the
`mlflow.experimentKind` tag MLflow's UI reads), and `export --register` making a model
registry version, with its config and numbers, from a real small pipeline run (a tiny
all-attention network on the built-in corpus, tracked in the default sqlite store)."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from pipeline.commands.cli import main
from pipeline.spec import load_spec
from pipeline.tracking.sender import EXPERIMENT_KIND, Delivery
from pipeline.tracking.tracker import tracking_uri

KIND, TRAINING = EXPERIMENT_KIND


def test_the_kind_is_the_tag_and_value_mlflows_ui_reads():
    """The strings are MLflow's own (its UI's ExperimentKind), not ours to vary."""
    assert EXPERIMENT_KIND == ("mlflow.experimentKind", "custom_model_development")


def client_of(cfg):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri(load_spec(cfg, [])))


def write_config(tmp, name="tiny", stages="[download, preprocess, train, evaluate]", tracking="{}"):
    cfg = tmp / f"{name}.yaml"
    cfg.write_text(f"""\
name: {name}
dataset: python_docs
model: {{kind: allattn, d_model: 32, n_layers: 1, n_heads: 2, n_persistent: 4, max_span: 32}}
train: {{steps: 20, batch_size: 4, seq_len: 32, log_every: 10, checkpoint_every: 10,
        eval_every: 10, eval_batches: 1,
        optimizer: {{type: adam, lr: 0.01, warmup_steps: 4, clip: global, clip_norm: 1.0}}}}
evaluate: {{splits: [valid], batch_size: 8}}
tracking: {tracking}
workspace: {{root: {tmp / "runs"}}}
stages: {stages}
""")
    return cfg


@pytest.fixture(scope="module")
def tracked(tmp_path_factory):
    """A pipeline run with tracking on, in the default store (sqlite in the workspace root)."""
    cfg = write_config(tmp_path_factory.mktemp("tracked"))
    result = CliRunner().invoke(main, ["run", str(cfg)])
    assert result.exit_code == 0, result.output
    return cfg


def test_a_pipeline_runs_experiment_is_marked_model_training(tracked):
    client = client_of(tracked)
    experiment = client.get_experiment_by_name("tiny")
    assert experiment.tags[KIND] == TRAINING
    assert client.search_runs([experiment.experiment_id])  # the runs are in it


def create_record(experiment):
    return {
        "op": "create",
        "key": "k",
        "experiment": experiment,
        "artifact_location": None,
        "tags": {"mlflow.runName": "r"},
        "parent": None,
        "time": 1,
    }


def test_an_existing_experiment_gets_the_kind_and_a_users_own_kind_stays(tmp_path):
    """Logging into an experiment made elsewhere (by hand, by an older version) marks it;
    a kind someone chose in the UI is theirs."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    bare = client.create_experiment("bare")
    chosen = client.create_experiment("chosen", tags={KIND: "genai_development"})
    Delivery(client).send(create_record("bare"))
    Delivery(client).send(create_record("chosen"))
    Delivery(client).send(create_record("new"))
    assert client.get_experiment(bare).tags[KIND] == TRAINING
    assert client.get_experiment(chosen).tags[KIND] == "genai_development"
    assert client.get_experiment_by_name("new").tags[KIND] == TRAINING


def test_a_sweeps_experiment_is_marked_too(tmp_path):
    from pipeline.tracking.sweep_run import SweepRun

    spec = load_spec(write_config(tmp_path, "swept"), [])
    SweepRun(spec, "id1", "a=1,2", warn=pytest.fail)
    assert client_of(spec.source).get_experiment_by_name("swept").tags[KIND] == TRAINING


def register(cfg, out, name, *args):
    return CliRunner().invoke(
        main, ["export", str(cfg), "--out", str(out), "--register", name, *map(str, args)]
    )


def test_register_makes_a_version_from_the_run_with_config_and_metrics(tracked, tmp_path):
    import mlflow

    from pipeline.commands.export import load_exported

    result = register(tracked, tmp_path / "export", "tiny-allattn")
    assert result.exit_code == 0, result.output
    assert "registered as model 'tiny-allattn' version 1" in result.output
    client = client_of(tracked)
    version = client.get_model_version("tiny-allattn", "1")
    spec = load_spec(tracked, [])
    results = json.loads((spec.workspace_dir / "evaluate" / "results.json").read_text())
    # the headline numbers, as tags of the version
    assert float(version.tags["valid_bpc"]) == pytest.approx(results["valid"]["bpc"], rel=1e-5)
    assert float(version.tags["valid_ppl"]) == pytest.approx(results["valid"]["ppl"], rel=1e-5)
    assert version.tags["checkpoint"].endswith(results["checkpoint"].replace("/", "/checkpoints/"))
    assert version.tags["model.kind"] == "allattn"
    # the run it comes from: under the pipeline run, with the config and every number
    run = client.get_run(version.run_id)
    parent = client.get_run(run.data.tags["mlflow.parentRunId"])
    assert parent.data.tags["workspace"] == str(spec.workspace_dir.resolve())
    assert run.info.status == "FINISHED"
    assert run.data.metrics["valid_bpc"] == pytest.approx(results["valid"]["bpc"])
    assert run.data.params["model.d_model"] == "32"
    assert version.source == f"{run.info.artifact_uri}/model"
    files = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert files == {"model", "spec.resolved.yaml", "results.json"}
    mlflow.set_tracking_uri(tracking_uri(spec))
    try:
        fetched = mlflow.artifacts.download_artifacts(
            "models:/tiny-allattn/1", dst_path=str(tmp_path / "fetched")
        )
        resolved = mlflow.artifacts.download_artifacts(
            run_id=run.info.run_id,
            artifact_path="spec.resolved.yaml",
            dst_path=str(tmp_path / "spec"),
        )
    finally:
        mlflow.set_tracking_uri(None)
    assert "d_model: 32" in open(resolved).read()
    # the registered files load with the export loader, into the exported model
    model, _ = load_exported(fetched)
    exported, _ = load_exported(tmp_path / "export")
    tokens = torch.arange(32).view(1, 32) % 50
    with torch.no_grad():
        assert torch.equal(model(tokens).logits, exported(tokens).logits)
    # a second registration is the next version of the same model
    again = register(tracked, tmp_path / "export", "tiny-allattn")
    assert again.exit_code == 0, again.output
    assert client.get_model_version("tiny-allattn", "2").run_id != version.run_id


def test_numbers_of_another_checkpoint_are_not_attached(tracked, tmp_path):
    """evaluate scored the latest checkpoint: an export of an earlier one gets no metrics,
    and the command says why."""
    ws = load_spec(tracked, []).workspace_dir
    earlier = sorted((ws / "train" / "checkpoints").glob("step-*"))[0]
    result = register(tracked, tmp_path / "export", "tiny-early", "--checkpoint", earlier)
    assert result.exit_code == 0, result.output
    assert "not the checkpoint exported: registered without metrics" in result.output
    version = client_of(tracked).get_model_version("tiny-early", "1")
    assert not any(k.endswith("_bpc") for k in version.tags)
    assert version.tags["checkpoint"] == str(earlier)


@pytest.mark.parametrize(
    "name, error",
    [
        ("", "--register '': not a registered model's name, it is empty"),
        (
            "a/b",
            "--register 'a/b': not a registered model's name, it holds '/', ':', '?' or "
            "'#', which a models:/NAME/VERSION URI cannot carry",
        ),
        (
            "a?b",
            "--register 'a?b': not a registered model's name, it holds '/', ':', '?' or "
            "'#', which a models:/NAME/VERSION URI cannot carry",
        ),
        ("x\ny", "--register 'x\\ny': not a registered model's name, it holds a control character"),
        (
            "..",
            "--register '..': not a registered model's name, it reads as another path "
            "(MLflow may store a name as a file name)",
        ),
        (
            "m" * 257,
            f"--register '{'m' * 257}': not a registered model's name, it is longer "
            f"than MLflow's 256 characters",
        ),
    ],
)
def test_a_bad_name_is_one_line_before_anything_is_written(tmp_path, name, error):
    cfg = write_config(tmp_path)
    result = register(cfg, tmp_path / "out", name)
    assert result.exit_code == 2, result.output
    assert result.output == f"error: {error}\n"
    assert not (tmp_path / "out").exists()


def test_register_with_tracking_off_is_one_line_saying_why(tmp_path):
    cfg = write_config(tmp_path, tracking="{enabled: false}")
    result = register(cfg, tmp_path / "out", "m")
    assert result.exit_code == 2, result.output
    assert result.output == (
        f"error: --register: tracking is off in {cfg} (tracking.enabled "
        f"is false), and the model registry is MLflow's; turn it on "
        f"(--set tracking.enabled=true) to register in its store\n"
    )
    assert not (tmp_path / "out").exists()


def test_a_store_that_cannot_hold_a_registry_is_one_line(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    monkeypatch.setenv("MLFLOW_REGISTRY_URI", (tmp_path / "registry").as_uri())
    result = register(write_config(tmp_path), tmp_path / "out", "m")
    assert result.exit_code == 2, result.output
    assert result.output == (
        f"error: --register: {(tmp_path / 'registry').as_uri()} is a file store, which MLflow "
        f"refuses as a model registry unless MLFLOW_ALLOW_FILE_STORE=true; use a database "
        f"store (the default, sqlite:///<workspace root>/mlflow.db) or a tracking server\n"
    )
