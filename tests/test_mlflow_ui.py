"""What MLflow's users look for in the store: experiments marked as model training (the
`mlflow.experimentKind` tag MLflow's UI reads), checked on a real small pipeline run (a tiny
all-attention network on the built-in corpus, tracked in the default sqlite store)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from pipeline.cli import main
from pipeline.spec import load_spec
from pipeline.tracking import tracking_uri
from pipeline.tracking_sender import EXPERIMENT_KIND, Delivery

KIND, TRAINING = EXPERIMENT_KIND


def test_the_kind_is_the_tag_and_value_mlflows_ui_reads():
    """The strings are MLflow's own (its UI's ExperimentKind), not ours to vary."""
    assert EXPERIMENT_KIND == ("mlflow.experimentKind", "custom_model_development")


def client_of(cfg):
    from mlflow.tracking import MlflowClient
    return MlflowClient(tracking_uri(load_spec(cfg, [])))


def write_config(tmp, name="tiny", stages="[download, preprocess, train, evaluate]",
                 tracking="{}"):
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
workspace: {{root: {tmp / 'runs'}}}
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


@pytest.mark.slow
def test_a_pipeline_runs_experiment_is_marked_model_training(tracked):
    client = client_of(tracked)
    experiment = client.get_experiment_by_name("tiny")
    assert experiment.tags[KIND] == TRAINING
    assert client.search_runs([experiment.experiment_id])      # the runs are in it


def create_record(experiment):
    return {"op": "create", "key": "k", "experiment": experiment, "artifact_location": None,
            "tags": {"mlflow.runName": "r"}, "parent": None, "time": 1}


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
    from pipeline.sweep import SweepRun

    spec = load_spec(write_config(tmp_path, "swept"), [])
    SweepRun(spec, "id1", "a=1,2", warn=pytest.fail)
    assert client_of(spec.source).get_experiment_by_name("swept").tags[KIND] == TRAINING
