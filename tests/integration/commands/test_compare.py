"""`allattn-pipe compare` on runs the tests make: stand-in stages (as in test_tracking.py) that
log what the real ones log, into an MLflow file store, so each pipeline takes well under a
second; the table's values are checked against what the stand-ins logged."""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import statistics
import time

import pytest
from click.testing import CliRunner

import stages
from pipeline.commands.cli import main
from pipeline.spec import load_spec
from pipeline.tracking.tracker import MlflowTracker, tracking_uri
from pipeline.workspace.runner import Runner
from tests.fixtures.tracked_pipeline import pipeline

ORDER = ["download", "preprocess", "train", "finetune", "evaluate"]


@pytest.fixture
def cfg(tracked_cfg):
    return tracked_cfg


def logged_test_bpc(seed: int, lr: float) -> float:
    """What the stand-in evaluate logs as test_bpc for a run (valid_bpc is this - 0.1)."""
    return round(1.0 + lr * 100 + seed / 100, 6)


def weights(spec, stage: str) -> str:
    """The id a stand-in training stage tags its weights with, and its evaluate the weights it
    scored with (finetune's, the last stage that trains)."""
    return f"{stage}-{spec.train.seed}-{spec.train.optimizer.lr}-{spec.train.steps}"


@pytest.fixture
def stand_ins(monkeypatch):
    """train logs its loss at steps 1..train.steps and `parameters`, finetune continues the
    steps; each names the weights it ended with (`weights`, and train its best's) as the real
    ones do, and leaves their id in its output. evaluate, as the real one, scores what its
    input holds (finetune's last, or train's best): it names those weights and logs valid/test
    bpc computed from the seed and the lr that trained them. A stage named in `fail` raises
    (RuntimeError, or KeyboardInterrupt for 'kill'); 'evaluate:test', evaluate between its
    valid and test splits."""
    fail: dict[str, BaseException] = {}
    trained_with: dict[str, tuple[int, float]] = {}  # weights id -> (seed, lr) behind them

    def make(name):
        def run(ctx):
            spec = ctx.spec
            if name in fail:
                raise fail[name]
            if name in ("train", "finetune"):
                made = {"weights": weights(spec, name)}
                if name == "train":  # finetune never beats train's best here
                    made["weights.best"] = weights(spec, "train-best")
                ctx.tracker.set_tags(made)
                for file, value in made.items():
                    (ctx.out_dir / file).write_text(value)
                    trained_with[value] = (spec.train.seed, spec.train.optimizer.lr)
            if name == "evaluate":  # the weights it scores: finetune's last, or train's best
                best = spec.evaluate.checkpoint == "best"
                source = ctx.inputs["train"] / "weights.best" if best else ctx.inputs["finetune"]
                scored = (source if best else source / "weights").read_text()
                ctx.tracker.set_tags({"weights": scored})
            if name == "train":
                ctx.tracker.log_params({"parameters": 12345})
                for step in range(1, spec.train.steps + 1):
                    ctx.tracker.log_metrics({"loss": 2.0 / step}, step=step)
                    if step % 3 == 0:
                        ctx.tracker.log_metrics({"valid_bpc": 3.0 / step}, step=step)
            if name == "finetune":
                first = spec.train.steps + 1
                for step in range(first, first + spec.finetune.steps):
                    ctx.tracker.log_metrics({"loss": 0.5}, step=step)
            if name == "evaluate":
                bpc = logged_test_bpc(*trained_with[scored])
                ctx.tracker.log_metrics({"valid_bpc": bpc - 0.1}, step=0)
                if "evaluate:test" in fail:  # stopped between the splits
                    raise fail["evaluate:test"]
                ctx.tracker.log_metrics({"test_bpc": bpc}, step=0)
            return {}

        return run

    for name in ORDER:
        monkeypatch.setitem(
            stages.STAGES, name, dataclasses.replace(stages.STAGES[name], run=make(name))
        )
    return fail


def compare(cfg_or_args, *args, code=0):
    result = CliRunner().invoke(main, [*cfg_or_args, *args])
    assert result.exit_code == code, result.output
    return result.output


@pytest.fixture
def three_seeds_two_lrs(cfg, stand_ins):
    for lr in ("0.001", "0.002"):
        for seed in ("1", "2", "3"):
            pipeline(cfg, f"train.seed={seed}", f"train.optimizer.lr={lr}")
    return cfg


def test_json_rows_values_and_groups(three_seeds_two_lrs, tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "store").as_uri())
    groups = json.loads(compare(["compare", "--format", "json"]))
    assert [(g["params"]["train.optimizer.lr"], g["n"], g["status"]) for g in groups] == [
        ("0.001", 3, "finished"),
        ("0.002", 3, "finished"),
    ]
    for g in groups:
        lr = float(g["params"]["train.optimizer.lr"])
        values = [logged_test_bpc(s, lr) for s in (1, 2, 3)]
        assert g["metrics"]["test_bpc"] == {
            "mean": pytest.approx(statistics.fmean(values)),
            "std": pytest.approx(statistics.stdev(values)),
            "n": 3,
        }
        assert sorted(r["seed"] for r in g["runs"]) == ["1", "2", "3"]
        assert {r["steps"] for r in g["runs"]} == {8}  # 6 train + 2 finetune
        assert {r["tokens"] for r in g["runs"]} == {8 * 2 * 8}
        assert {r["parameters"] for r in g["runs"]} == {12345}
        assert g["paper"]["results"] == {"test_bpc": 1.05}
        assert g["paper"]["difference"]["test_bpc"] == pytest.approx(
            statistics.fmean(values) - 1.05
        )


def test_table_folds_equal_columns_and_prints_the_paper_row(
    three_seeds_two_lrs, tmp_path, monkeypatch
):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "store").as_uri())
    out = compare(["compare", "--metric", "test_bpc"])
    print(out)
    # the wall time of these sub-second runs may or may not be equal: leave it out
    lines = [
        line.replace("; wall: 0s", "").replace("wall", "").replace(" 0s ", " ")
        for line in out.splitlines()
    ]
    assert lines[0].startswith(
        "equal in every row: status: finished; n: 3; seeds: 1,2,3; "
        "model: allattn; parameters: 12,345; steps: 8; tokens: 128"
    )
    header = lines[1].split()
    assert header == ["name", "train.optimizer.lr", "test_bpc"]
    mean = statistics.fmean(logged_test_bpc(s, 0.002) for s in (1, 2, 3))
    std = statistics.stdev(logged_test_bpc(s, 0.002) for s in (1, 2, 3))
    row = lines[4].split()
    assert row[:2] == ["pipe-lr0.002", "0.002"]
    assert row[2:] == [f"{mean:.4g}", "±", f"{std:.2g}"]
    assert lines[5].split()[:7] == [
        "published:",
        "a",
        "paper,",
        "table",
        "9,",
        "12,000",
        "parameters",
    ]
    assert lines[5].split()[-2:] == ["1.05", f"({mean - 1.05:+.3g})"]


def test_plot_draws_each_runs_curves_by_step_tokens_and_time(
    three_seeds_two_lrs, tmp_path, monkeypatch
):
    from pipeline.commands.compare import collect
    from pipeline.commands.plots import curves
    from pipeline.tracking.store import open_existing_store

    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "store").as_uri())
    png = tmp_path / "curves.png"
    compare(["compare", "--filter", "params.`train.seed` = '1'", "--plot", str(png)])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    client = open_existing_store((tmp_path / "store").as_uri())
    row = collect(client, filter_string="params.`train.seed` = '1'")[0]
    data = curves(client, row)
    assert [(p["step"], p["tokens"], p["value"]) for p in data["loss"]] == (
        [(s, s * 16, 2.0 / s) for s in range(1, 7)] + [(7, 112, 0.5), (8, 128, 0.5)]
    )
    assert [(p["step"], p["value"]) for p in data["valid_bpc"]] == [(3, 1.0), (6, 0.5)]
    minutes = [p["minutes"] for p in data["loss"]]
    assert minutes[0] == 0 and minutes == sorted(minutes)


def test_plot_to_a_place_it_cannot_write_is_one_line_and_leaves_nothing(
    cfg, stand_ins, tmp_path, monkeypatch
):
    pipeline(cfg, "train.seed=1")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "store").as_uri())
    (tmp_path / "a_file").write_text("mine")
    unwritable = tmp_path / "a_file" / "curves.png"
    result = CliRunner().invoke(main, ["compare", "--plot", str(unwritable)])
    assert result.exit_code == 2, result.output
    assert result.stderr == (
        f"error: --plot {unwritable}: cannot write the picture: File "
        f"exists ({tmp_path / 'a_file'})\n"
    )
    assert (tmp_path / "a_file").read_text() == "mine"
    no_format = tmp_path / "curves.xyz"
    result = CliRunner().invoke(main, ["compare", "--plot", str(no_format)])
    assert result.exit_code == 2, result.output
    assert result.output.startswith(
        f"error: --plot {no_format}: no image format is called "
        f".xyz; name a .png, .svg or .pdf file (or .avif, "
    )
    assert len(result.output.splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file", "pipe.yaml", "runs", "store"]


def test_plot_without_an_extension_is_a_png_at_that_name(cfg, stand_ins, tmp_path, monkeypatch):
    pipeline(cfg, "train.seed=1")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "store").as_uri())
    compare(["compare", "--plot", str(tmp_path / "curves")])
    assert (tmp_path / "curves").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_filter_mlflow_refuses_is_one_escaped_line(cfg, stand_ins, tmp_path, monkeypatch):
    # MLflow's message quotes the filter raw: a carriage return in it broke the one line
    pipeline(cfg, "train.seed=1")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "store").as_uri())
    out = compare(["compare", "--filter", "0\rA"], code=2)
    assert out.startswith("error: --filter '0\\rA': ") and "\r" not in out
    assert len(out.strip().splitlines()) == 1


def test_csv_keeps_every_column_and_filter_uses_mlflow_syntax(
    three_seeds_two_lrs, tmp_path, monkeypatch
):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "store").as_uri())
    out = compare(["compare", "--format", "csv", "--filter", "params.`train.seed` = '2'"])
    rows = list(csv.DictReader(io.StringIO(out)))
    runs = [r for r in rows if r["status"] != "published"]
    assert [(r["train.optimizer.lr"], r["seeds"], r["n"], r["test_bpc"]) for r in runs] == [
        ("0.001", "2", "1", f"{logged_test_bpc(2, 0.001):.4g}"),
        ("0.002", "2", "1", f"{logged_test_bpc(2, 0.002):.4g}"),
    ]


def test_failed_and_killed_runs_show_as_such(cfg, stand_ins, tmp_path, monkeypatch):
    pipeline(cfg, "train.seed=1")
    stand_ins["evaluate"] = RuntimeError("evaluate broke")
    with pytest.raises(RuntimeError):
        pipeline(cfg, "train.seed=2")
    stand_ins["train"] = KeyboardInterrupt()
    with pytest.raises(KeyboardInterrupt):
        pipeline(cfg, "train.seed=3")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "store").as_uri())
    groups = json.loads(compare(["compare", "--format", "json"]))
    assert [
        (g["name"], g["status"], g["metrics"].get("test_bpc", {}).get("mean")) for g in groups
    ] == [
        ("pipe-seed1-lr0.001", "finished", logged_test_bpc(1, 0.001)),
        ("pipe-seed2-lr0.001", "failed", None),
        ("pipe-seed3-lr0.001", "killed", None),
    ]
    # the killed one resumed: one row for its workspace, both pipeline runs behind it
    stand_ins.clear()
    pipeline(cfg, "train.seed=3")
    groups = json.loads(
        compare(["compare", "--format", "json", "--filter", "params.`train.seed` = '3'"])
    )
    assert [
        (g["status"], len(g["runs"][0]["run_ids"]), g["metrics"]["test_bpc"]["mean"])
        for g in groups
    ] == [("finished", 2, logged_test_bpc(3, 0.001))]


BEST = ("evaluate.checkpoint=best", "train.eval_every=3")


def test_scores_of_other_weights_read_stale_and_are_never_averaged_in(
    cfg, stand_ins, tmp_path, monkeypatch
):
    """A row whose evaluate scored other weights than its latest training run ended with (a
    train re-run killed; an evaluate run of an older allattn-pipe, which named none) reads
    `stale` in its score cells, apart from the rows that are not, with a line below the
    table; with evaluate.checkpoint best, the best of train is the weights evaluate scores."""
    from mlflow.tracking import MlflowClient

    for seed in (1, 2, 3):
        pipeline(cfg, f"train.seed={seed}", *BEST)
    stand_ins["train"] = KeyboardInterrupt()
    with pytest.raises(KeyboardInterrupt):  # seed 2's train again, killed: no weights named
        pipeline(cfg, "train.seed=2", *BEST, "train.steps=9")
    stand_ins.clear()
    client = MlflowClient((tmp_path / "store").as_uri())
    experiment = client.get_experiment_by_name("pipe").experiment_id
    [older] = [
        r
        for r in client.search_runs([experiment], "tags.stage = 'evaluate'")
        if client.get_run(r.data.tags["mlflow.parentRunId"]).data.params["train.seed"] == "3"
    ]
    client.delete_tag(older.info.run_id, "weights")  # as an older allattn-pipe left it
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "store").as_uri())
    groups = json.loads(compare(["compare", "--format", "json"]))
    assert [(g["name"], g["status"], g["metrics"], g.get("stale")) for g in groups] == [
        (
            "pipe-seed1-lr0.001",
            "finished",
            {
                m: dict(mean=pytest.approx(v), std=None, n=1)
                for m, v in (
                    ("test_bpc", logged_test_bpc(1, 0.001)),
                    ("valid_bpc", logged_test_bpc(1, 0.001) - 0.1),
                )
            },
            None,
        ),
        (
            "pipe-seed2-lr0.001",
            "killed",
            {},
            "train's latest run does not name the weights it ended with (it was killed or "
            "failed, or an older allattn-pipe ran it); re-run evaluate (`allattn-pipe run` "
            "its config with --force evaluate)",
        ),
        (
            "pipe-seed3-lr0.001",
            "finished",
            {},
            "evaluate's run does not name the weights it scored (an older allattn-pipe ran "
            "it); re-run evaluate (`allattn-pipe run` its config with --force evaluate)",
        ),
    ]
    table = compare(["compare", "--metric", "test_bpc"]).splitlines()
    # each row's score cell, the paper's row beneath it comparing ours only where it is not
    assert [line.rsplit("  ", 1)[-1].strip() for line in table[2:8]] == [
        f"{logged_test_bpc(1, 0.001):.4g}",
        f"1.05 ({logged_test_bpc(1, 0.001) - 1.05:+.3g})",
        "stale",
        "1.05",
        "stale",
        "1.05",
    ]
    assert table[8:] == [f"stale: {g['name']}: {g['stale']}" for g in groups[1:]]


def _selected(cfg, *overrides, only, force=()):
    """`allattn-pipe run CFG --only ONLY --force FORCE --set ...` on the workspace that
    `pipeline(cfg, *overrides)` runs in."""
    spec = load_spec(cfg, [*overrides, f"name=pipe-seed{_seed(overrides)}-lr0.001"])
    tracker = MlflowTracker(spec.tracking.uri, flush_s=5.0, warn=lambda m: None)
    Runner(spec, only=list(only), force=list(force), log=lambda m: None).run(tracker)


def _seed(overrides) -> str:
    return next((o.split("=")[1] for o in overrides if o.startswith("train.seed=")), "1")


def test_a_row_describes_the_weights_it_shows_not_the_largest_of_its_history(
    cfg, stand_ins, tmp_path, monkeypatch
):
    """A model trained again with fewer steps (`run --set train.steps=3 --only train`): the
    row's steps, tokens, spec and wall time are of the 3-step model its stale scores sit
    beside, not of the 6 + 2-step one before; finetune and evaluate run on it then: steps
    3 + 2, the wall time of the runs since it began. Evaluate run alone under another lr
    (`--only evaluate --force evaluate --set train.optimizer.lr=0.005`) scores the weights
    trained with 0.001: the row says 0.001 beside their scores."""
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "store").as_uri())
    client = MlflowClient((tmp_path / "store").as_uri())

    def row(seed: int) -> dict:
        [group] = [
            g
            for g in json.loads(compare(["compare", "--format", "json"]))
            if g["runs"][0]["seed"] == str(seed)
        ]
        return group["runs"][0] | {"params": group["params"], "stale": group.get("stale")}

    def wall(run_ids) -> float:  # the pipeline runs' own durations, as MLflow has them
        runs = [client.get_run(r).info for r in run_ids]
        return sum((r.end_time - r.start_time) / 1000 for r in runs)

    pipeline(cfg, "train.seed=1")
    first = row(1)
    assert (first["steps"], first["tokens"], first["stale"]) == (8, 8 * 2 * 8, None)
    _selected(cfg, "train.seed=1", "train.steps=3", only=["train"])
    retrained = row(1)
    assert len(retrained["run_ids"]) == 2 and wall(retrained["run_ids"][:1]) > 0
    assert (
        retrained["steps"],
        retrained["tokens"],
        retrained["params"]["train.steps"],
        retrained["parameters"],
        retrained["metrics"],
    ) == (3, 3 * 2 * 8, "3", 12345, {})
    assert retrained["stale"].startswith("evaluate scored other weights than train's latest")
    assert retrained["wall_s"] == pytest.approx(wall(retrained["run_ids"][1:]), abs=1e-6)
    pipeline(cfg, "train.seed=1", "train.steps=3")  # finetune and evaluate on the new train
    again = row(1)
    assert (again["steps"], again["stale"], again["metrics"]["test_bpc"]) == (
        5,
        None,
        logged_test_bpc(1, 0.001),
    )
    assert again["wall_s"] == pytest.approx(wall(again["run_ids"][1:]), abs=1e-6)

    pipeline(cfg, "train.seed=2")
    _selected(
        cfg, "train.seed=2", "train.optimizer.lr=0.005", only=["evaluate"], force=["evaluate"]
    )
    scored = row(2)
    assert (
        scored["params"]["train.optimizer.lr"],
        scored["steps"],
        scored["stale"],
        scored["metrics"]["test_bpc"],
    ) == ("0.001", 8, None, logged_test_bpc(2, 0.001))
    assert scored["wall_s"] == pytest.approx(wall(scored["run_ids"]), abs=1e-6)
    # evaluate again, stopped after the valid split: the row keeps the numbers of the one
    # that finished (its results are the workspace's), not the half the killed one logged
    stand_ins["evaluate:test"] = KeyboardInterrupt()
    with pytest.raises(KeyboardInterrupt):
        _selected(cfg, "train.seed=2", only=["evaluate"], force=["evaluate"])
    killed = row(2)
    assert (killed["metrics"], killed["stale"]) == (scored["metrics"], None)
    assert set(scored["metrics"]) == {"valid_bpc", "test_bpc"}


def test_a_config_names_its_runs_and_a_missing_store_is_one_line(cfg, stand_ins, tmp_path):
    spec = load_spec(cfg, [])
    Runner(spec, log=lambda m: None).run(MlflowTracker(spec.tracking.uri, warn=print))
    Runner(load_spec(cfg, ["train.seed=5"]), log=lambda m: None).run(
        MlflowTracker(spec.tracking.uri, warn=print)
    )
    out = json.loads(compare(["compare", str(cfg), "--set", "train.seed=5", "--format", "json"]))
    assert [(g["name"], g["runs"][0]["seed"]) for g in out] == [("pipe", "5")]
    missing = tmp_path / "none" / "mlflow.db"
    err = compare(["compare", str(cfg), "--set", f"tracking.uri=sqlite:///{missing}"], code=2)
    assert err == (
        f"error: no tracking store at {missing}: no pipeline has run with it "
        f"(name a CONFIG, or set MLFLOW_TRACKING_URI)\n"
    )
    assert not missing.parent.exists()


def test_show_prints_the_paper_row(cfg):
    out = compare(["show", str(cfg)])
    assert out.splitlines()[-1] == (
        "published: test_bpc 1.05 with 0.012M parameters (a paper, table 9)"
    )


PUBLISHED = {  # docs/papers.md#all-attention-results: the all-attention paper's tables 1-3
    "enwik8_small.yaml": {"test_bpc": 1.01},
    "enwik8_large.yaml": {"test_bpc": 0.98},
    "text8_small.yaml": {"valid_bpc": 1.05, "test_bpc": 1.11},
    "text8_large.yaml": {"valid_bpc": 1.02, "test_bpc": 1.08},
    "wt103.yaml": {"valid_ppl": 19.7, "test_ppl": 20.6},
    "baselines/enwik8_transformer_small.yaml": {"test_bpc": 1.02},
    "baselines/enwik8_transformer_large.yaml": {"test_bpc": 0.98},
    "baselines/text8_transformer_small.yaml": {"valid_bpc": 1.05, "test_bpc": 1.11},
    "baselines/text8_transformer_large.yaml": {"valid_bpc": 1.01, "test_bpc": 1.07},
} | {  # the active-memory paper's table 1: test loss per token (its padded mean)
    f"active_memory/wt103_{mixer}.yaml": {"test_paper_loss": loss}
    for mixer, loss in (
        ("cgru", 1.6834),
        ("conv", 1.5358),
        ("persistent_conv", 1.5341),
        ("highway_conv", 1.5327),
        ("self_attention", 1.5189),
        ("sa_conv", 1.4912),
        ("sa_persistent_conv", 1.4905),
        ("sa_highway_conv", 1.4869),
    )
}


def test_every_paper_config_carries_its_published_row_and_the_ablations_none():
    from pipeline.spec import PROJECT_ROOT

    configs = PROJECT_ROOT / "configs"
    for path in sorted(configs.glob("**/*.yaml")):
        rel = str(path.relative_to(configs))
        if rel.startswith("base/"):
            continue
        paper = load_spec(path, []).paper
        assert (paper.results if paper else None) == PUBLISHED.get(rel), rel


def test_a_run_killed_without_a_word_shows_killed_and_its_resumption_marks_it(
    cfg, stand_ins, tmp_path, monkeypatch
):
    """kill -9 leaves MLflow's runs RUNNING: compare, finding the workspace's lock free,
    shows the attempt killed with the wall time it had; the next run marks it KILLED."""
    from mlflow.tracking import MlflowClient

    from pipeline.tracking.tracker import StageTracker

    with monkeypatch.context() as m:  # no run hears of its end, as under kill -9
        m.setattr(StageTracker, "end", lambda self, status: None)
        stand_ins["finetune"] = KeyboardInterrupt()
        with pytest.raises(KeyboardInterrupt):
            pipeline(cfg)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "store").as_uri())
    client = MlflowClient((tmp_path / "store").as_uri())
    assert {
        r.info.status
        for r in client.search_runs([client.get_experiment_by_name("pipe").experiment_id])
    } == {"RUNNING"}
    first = json.loads(compare(["compare", "--format", "json"]))
    time.sleep(1.5)
    again = json.loads(compare(["compare", "--format", "json"]))
    assert [g["status"] for g in first] == ["killed"]
    assert again[0]["runs"][0]["wall_s"] == first[0]["runs"][0]["wall_s"] < 60
    stand_ins.clear()
    pipeline(cfg)
    runs = client.search_runs(
        [client.get_experiment_by_name("pipe").experiment_id],
        order_by=["attributes.start_time ASC"],
    )
    # the dead attempt: its parent and 4 stage runs; the resumption: parent, finetune, evaluate
    assert sorted(r.info.status for r in runs) == ["FINISHED"] * 3 + ["KILLED"] * 5


@pytest.mark.parametrize("damage", ["truncated", "not a database", "empty"])
def test_a_damaged_store_is_one_line_and_left_as_it_was(cfg, stand_ins, tmp_path, damage):
    spec = load_spec(cfg, ["tracking.uri=null"])
    Runner(spec, log=lambda m: None).run(MlflowTracker(tracking_uri(spec), warn=print))
    db = tmp_path / "runs" / "mlflow.db"
    data = db.read_bytes()
    db.write_bytes(
        {"truncated": data[: len(data) // 3], "not a database": b"hello " * 100, "empty": b""}[
            damage
        ]
    )
    before = db.read_bytes()
    err = compare(["compare", str(cfg), "--set", "tracking.uri=null"], code=2)
    assert err.startswith(f"error: {db}: ") and err.count("\n") == 1, err
    assert db.read_bytes() == before


def _no_nan(name: str):
    raise ValueError(f"{name} in compare's JSON")


def test_json_is_strict_json_with_null_for_a_nan_metric(cfg, stand_ins, tmp_path, monkeypatch):
    """A run whose evaluate logged NaN (what evaluate did before issue 35) and one that
    logged nothing: the JSON parses without NaN or Infinity, the values null."""
    pipeline(cfg, "train.seed=1")
    finite = logged_test_bpc(1, 0.001)
    monkeypatch.setitem(globals(), "logged_test_bpc", lambda seed, lr: float("nan"))
    pipeline(cfg, "train.seed=2")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "store").as_uri())
    text = compare(["compare", "--format", "json"])
    (group,) = json.loads(text, parse_constant=_no_nan)  # the seeds of one setting
    assert group["metrics"]["test_bpc"] == {"mean": None, "std": None, "n": 2}
    by_seed = {r["seed"]: r["metrics"] for r in group["runs"]}
    assert by_seed["1"]["test_bpc"] == finite and by_seed["2"]["test_bpc"] is None
    assert "nan" in compare(["compare"])  # the table shows it as it is
