"""A re-run with nothing to do: no new MLflow run, and the recorded results printed again.

The stages are stand-ins (as in test_runner.py); the tracking store is the real embedded one
that `allattn-pipe run` makes under workspace.root.
"""

from __future__ import annotations

import dataclasses

import pytest
from click.testing import CliRunner

import stages
from pipeline.commands.cli import main
from pipeline.spec import load_spec
from pipeline.tracking.tracker import NullTracker, experiment_name, tracking_uri
from pipeline.training.checkpoint_dirs import weights_id, write_checksums

ORDER = ["download", "preprocess", "train", "finetune", "evaluate"]
NOTHING_TO_RUN = "nothing to run: every stage is up to date; no MLflow run recorded"
RESULTS = {
    "checkpoint": "finetune/step-00000003",
    "unigram_entropy_bits": 4.5,
    "valid": {"tokens": 1234, "loss": 1.5, "bpc": 2.164, "ppl": 4.48},
    "test": {"tokens": 2345, "loss": 1.6, "bpc": 2.308, "ppl": 4.95},
}


@pytest.fixture
def stand_ins(monkeypatch):
    """Each stage writes a file; finetune a checkpoint too, and evaluate returns RESULTS,
    naming that checkpoint's weights as the real stage does (else they read as stale)."""

    def make(name):
        def run(ctx):
            (ctx.out_dir / "output.txt").write_text(name)
            if name == "evaluate":
                scored = ctx.inputs["finetune"] / "checkpoints" / "step-00000003"
                return RESULTS | {"weights": weights_id(scored)}
            if name == "finetune":
                checkpoint = ctx.out_dir / "checkpoints" / "step-00000003"
                checkpoint.mkdir(parents=True)
                (checkpoint / "mp_rank_00_model_states.pt").write_bytes(b"weights")
                write_checksums(checkpoint)
            if name in ("train", "finetune"):
                return {"step": 3, "checkpoint": "x", "best_valid_bpc_estimate": 2.5}
            return {"ok": name}

        return run

    for name in ORDER:
        monkeypatch.setitem(
            stages.STAGES, name, dataclasses.replace(stages.STAGES[name], run=make(name))
        )


def mlflow_runs(cfg) -> list:
    from mlflow.tracking import MlflowClient

    spec = load_spec(cfg, [])
    client = MlflowClient(tracking_uri(spec))
    experiment = client.get_experiment_by_name(experiment_name(spec))
    return client.search_runs([experiment.experiment_id])


def test_a_rerun_with_nothing_to_do_records_no_run_and_reprints_the_results(cfg, stand_ins):
    first = CliRunner().invoke(main, ["run", str(cfg)])
    assert first.exit_code == 0, first.output
    runs = {r.info.run_id for r in mlflow_runs(cfg)}
    assert len(runs) == 1 + len(ORDER)  # the parent and a run per stage

    again = CliRunner().invoke(main, ["run", str(cfg)])
    assert again.exit_code == 0, again.output
    assert {r.info.run_id for r in mlflow_runs(cfg)} == runs
    out = again.stdout
    assert "nothing to run: every stage is up to date; no MLflow run recorded" in out
    assert "recorded results of evaluate (finished " in out
    assert "[evaluate] valid bpc 2.164   ppl 4.48   (1,234 tokens)" in out
    assert "[evaluate] test  bpc 2.308   ppl 4.95   (2,345 tokens)" in out
    assert out.index("[evaluate] valid bpc") < out.index("[evaluate] test  bpc")  # as scored
    assert "[finetune] step 3, best valid bpc estimate 2.500" in out


def test_a_dry_run_is_unchanged_and_records_nothing(cfg, stand_ins):
    assert CliRunner().invoke(main, ["run", str(cfg)]).exit_code == 0
    runs = len(mlflow_runs(cfg))
    dry = CliRunner().invoke(main, ["run", str(cfg), "--dry-run"])
    assert dry.exit_code == 0, dry.output
    assert "recorded results" not in dry.stdout
    assert all(" skip " in line for line in dry.stdout.splitlines()[1:])
    assert len(mlflow_runs(cfg)) == runs


def test_a_rerun_reprints_a_plugin_stages_results_as_it_formats_them(cfg, calls, monkeypatch):
    """A stage kind from an installed plugin's entry point formats its own result lines
    (Stage.result_lines): a re-run with nothing to do reprints them, as it does train's and
    evaluate's, with no edit to the runner."""
    from pipeline.workspace.layout import Workspace
    from pipeline.workspace.runner import Runner
    from tests.fixtures.plugin_stages import register_plugin_stages

    register_plugin_stages(monkeypatch, {"tally": "tests.fixtures.plugin_stages:TALLY"})
    cfg.write_text(
        cfg.read_text().replace("[download, preprocess,", "[download, preprocess, tally,")
    )
    spec = load_spec(cfg, [])
    Runner(spec, log=lambda m: None).run(NullTracker())
    assert calls == ["download", "preprocess", "train", "finetune", "evaluate"]  # tally: real

    lines: list[str] = []
    Runner(load_spec(cfg, []), log=lines.append).run(NullTracker())
    finished = Workspace(spec.workspace_dir).record("tally")["finished_at"]
    assert lines[lines.index(NOTHING_TO_RUN) :] == [
        NOTHING_TO_RUN,
        f"recorded results of tally (finished {finished}):",
        "[tally] 2 files in preprocess's output",
        "[tally] named output.txt, stage.json (pipe)",
    ]
