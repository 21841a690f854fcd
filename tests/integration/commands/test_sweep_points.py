"""A sweep's points afterwards: `export`, `sample`, `compare` and `run` take `--point NAME`
(the name the sweep printed, its end, or one of its --set) and load the point from the record
the sweep left in its workspace; an unknown name is one line listing the points. A point's
name spells a value as `--set` takes it (`mixersa+conv`), and a workspace named before that
(`mixersa_conv`) is still the point's."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from pipeline.commands.cli import main
from pipeline.commands.sweep import plan_sweep
from pipeline.spec import load_spec
from tests.fixtures.environment import restored_environment
from tests.fixtures.runs import own_mixer_config

NAMES = ["mine-smoke-mixerconv", "mine-smoke-mixersa+conv"]


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    """Two points (mixer conv and sa+conv) of a smoke sweep trained 2 steps, tracked to the
    embedded store: the config's path."""
    cfg = own_mixer_config(tmp_path_factory.mktemp("points"))
    # module-scoped: the in-process run's RANK, MASTER_PORT... undone here (`trained` says why)
    with restored_environment():
        result = invoke(
            "sweep", cfg, "--smoke", "--grid", "model.mixer=conv,sa+conv",
            "--set", "train.steps=2", "--set", "stages=[download,preprocess,train]",
        )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "2 of 2 points done" in result.output
    return cfg


def test_export_takes_a_point_by_the_name_the_sweep_printed(swept, tmp_path):
    result = invoke("export", swept, "--point", "mine-smoke-mixersa+conv", "--out", tmp_path / "x")
    assert result.exit_code == 0, result.output
    assert "/runs/mine-smoke-mixersa+conv/train/checkpoints/" in result.output
    assert "sa+conv" in (tmp_path / "x" / "config.json").read_text()


def point_sample(cfg: Path, name: str, tokens: int) -> str:
    """What `sample --prompt The` prints for the point `name`, its spec loaded here from the
    record the sweep left (not through --point)."""
    from pipeline.commands.sample import sample

    record = json.loads((cfg.parent / "runs" / name / "sweep-point.json").read_text())
    spec = load_spec(cfg, record["overrides"], smoke=record["smoke"])
    return "".join(sample(spec, "latest", "The", tokens, 1.0, None, 0, log=lambda m: None)) + "\n"


def test_sample_takes_a_point_by_the_end_of_its_name(swept):
    result = invoke("sample", swept, "--point", "mixerconv", "--prompt", "The", "--tokens", 8)
    assert result.exit_code == 0, result.output
    # the point's recorded --smoke applied (sample has no --smoke of its own)
    assert result.stderr.startswith("--smoke: dataset wikitext103_bpe replaced by the built-in")
    assert result.stdout == point_sample(swept, NAMES[0], 8)
    assert result.stdout != point_sample(swept, NAMES[1], 8)  # the other point's model


def test_run_takes_a_point_by_one_of_its_sets(swept):
    result = invoke("run", swept, "--point", "model.mixer=sa+conv", "--dry-run")
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert f"workspace {swept.parent / 'runs' / NAMES[1]}" in lines
    steps = [line.split() for line in lines if line.startswith("  ")]
    assert [s[:2] for s in steps] == [
        ["download", "skip"], ["preprocess", "skip"], ["train", "skip"],
    ]  # fmt: skip


def test_compare_takes_points(swept):
    # a smoke sweep's runs are in the experiment mine-smoke: `compare CONFIG` looks in mine
    both = invoke("compare", swept, "--point", "mixerconv", "--point", NAMES[1], "--format", "json")
    assert both.exit_code == 0, both.output
    assert sorted(r["name"] for r in json.loads(both.output)) == NAMES
    one = invoke("compare", swept, "--point", "mixer=conv", "--format", "json")
    assert one.exit_code == 0, one.output
    assert [r["name"] for r in json.loads(one.output)] == NAMES[:1]


def test_an_unknown_point_is_one_line_naming_the_points(swept):
    result = invoke("export", swept, "--point", "mixercgru", "--out", swept.parent / "x")
    assert result.exit_code != 0
    assert result.output == (
        f"error: --point mixercgru is not a point of its sweeps (under "
        f"{swept.parent / 'runs'}); the points: {', '.join(NAMES)}\n"
    )
    assert not (swept.parent / "x").exists()


def test_a_name_as_spelled_before_plus_was_kept_resolves(swept):
    result = invoke("run", swept, "--point", "mine-smoke-mixersa_conv", "--dry-run")
    assert result.exit_code == 0, result.output
    assert f"workspace {swept.parent / 'runs' / NAMES[1]}" in result.output


def test_a_name_spells_the_value_that_set_takes_back(swept):
    value = NAMES[1].removeprefix("mine-smoke-mixer")
    sets = [
        "train.steps=2", "stages=[download,preprocess,train]", f"model.mixer={value}",
        f"name={NAMES[1]}", "tracking.experiment=mine-smoke",
    ]  # fmt: skip
    record = json.loads((swept.parent / "runs" / NAMES[1] / "sweep-point.json").read_text())
    assert record["smoke"] is True
    point = load_spec(swept, record["overrides"], smoke=True)
    assert load_spec(swept, sets, smoke=True).resolved() == point.resolved()


def test_a_config_no_sweep_recorded_says_what_to_do(tmp_path):
    result = invoke("sample", own_mixer_config(tmp_path), "--point", "mixerconv", "--prompt", "x")
    assert result.exit_code != 0
    assert len(result.output.splitlines()) == 1, result.output
    assert "no sweep of" in result.output and "runs again" in result.output


def test_compare_takes_points_of_one_config_only(swept, tmp_path):
    other = own_mixer_config(tmp_path)
    result = invoke("compare", swept, other, "--point", "mixerconv")
    assert result.exit_code != 0
    assert "--point names a point of the sweep of one CONFIG argument; 2 given" in result.output


def test_a_sweep_goes_on_in_a_workspace_named_before_plus_was_kept(tmp_path):
    cfg = own_mixer_config(tmp_path)
    grid = ["model.mixer=conv,sa+conv"]
    pts, _, _ = plan_sweep(str(cfg), [], grid, None)
    assert [p.name for p in pts] == ["mine-mixerconv", "mine-mixersa+conv"]
    (tmp_path / "runs" / "mine-mixersa_conv").mkdir(parents=True)  # an earlier sweep's
    pts, _, _ = plan_sweep(str(cfg), [], grid, None)
    assert [p.name for p in pts] == ["mine-mixerconv", "mine-mixersa_conv"]
    assert pts[1].spec.model_params.mixer == "sa+conv"


def test_a_credential_in_a_points_set_is_not_recorded_and_is_asked_for(tmp_path):
    from pipeline.commands.sweep import record_points
    from pipeline.commands.sweep_points import point_overrides
    from pipeline.errors import PipelineError

    cfg = own_mixer_config(tmp_path)
    server = "tracking.uri=http://bob:s3cret@127.0.0.1:9"
    pts, _, _ = plan_sweep(str(cfg), [server], ["model.mixer=conv,sa+conv"], None)
    record_points(str(cfg), pts)
    assert not any(b"s3cret" in p.read_bytes() for p in (tmp_path / "runs").rglob("*.json"))
    with pytest.raises(PipelineError, match=r"--set tracking.uri held a credential, which"):
        point_overrides(str(cfg), "mixerconv", [])
    sets, _ = point_overrides(str(cfg), "mixerconv", [server])
    assert load_spec(cfg, sets).tracking.uri == server.partition("=")[2]


# ---------------------------------------------------------------- records another user wrote
#
# A workspace root may be shared: a record planted there must never name a point. Another
# user is drawn for real (chown to uid 65534, nobody), which needs root, as CI runs.

NOBODY = 65534
needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="giving a file to another user (chown) needs root"
)


def recorded_sweep(tmp_path):
    """A sweep's two points recorded (nothing trained): the config's path."""
    from pipeline.commands.sweep import record_points

    cfg = own_mixer_config(tmp_path, tracking=False)
    pts, _, _ = plan_sweep(str(cfg), [], ["model.mixer=conv,sa+conv"], None)
    record_points(str(cfg), pts)
    return cfg


def plant(cfg, folder: str, name: str) -> Path:
    """A record of the point `name` of `cfg`'s sweep, in a workspace `folder` of the root
    (sorted after the sweep's own), that sets a learning rate of its planter's choosing."""
    path = cfg.parent / "runs" / folder / "sweep-point.json"
    path.parent.mkdir(parents=True)
    sets = ["model.mixer=conv", f"name={name}", "train.optimizer.lr=0.9"]
    path.write_text(json.dumps({"config": str(cfg.resolve()), "name": name, "overrides": sets}))
    return path


def planted_lr(cfg, point: str) -> float:
    from pipeline.commands.sweep_points import point_overrides

    sets, _ = point_overrides(str(cfg), point, [])
    return load_spec(cfg, sets).train.optimizer.lr


@needs_root
def test_a_record_another_user_planted_in_a_shared_root_does_not_name_the_point(tmp_path):
    cfg = recorded_sweep(tmp_path)
    mine = planted_lr(cfg, "mine-mixerconv")
    path = plant(cfg, "zz-planted", "mine-mixerconv")
    os.chown(path.parent, NOBODY, NOBODY)
    os.chown(path, NOBODY, NOBODY)
    assert mine != 0.9 and planted_lr(cfg, "mine-mixerconv") == mine
    result = invoke("run", cfg, "--point", "mine-mixerconv", "--dry-run")
    assert result.exit_code == 0, result.output
    assert f"workspace {tmp_path / 'runs' / 'mine-mixerconv'}" in result.output.splitlines()


@needs_root
def test_a_record_another_user_owns_in_ones_own_workspace_is_not_read(tmp_path):
    cfg = recorded_sweep(tmp_path)
    path = plant(cfg, "zz-planted", "mine-mixerconv")
    os.chown(path, NOBODY, NOBODY)
    assert planted_lr(cfg, "mine-mixerconv") != 0.9


@needs_root
def test_a_workspace_another_group_can_write_holds_no_record(tmp_path):
    cfg = recorded_sweep(tmp_path)
    path = plant(cfg, "zz-planted", "mine-mixerconv")
    os.chown(path.parent, 0, NOBODY)
    path.parent.chmod(0o775)
    assert planted_lr(cfg, "mine-mixerconv") != 0.9


def test_a_workspace_every_user_can_write_holds_no_record(tmp_path):
    cfg = recorded_sweep(tmp_path)
    path = plant(cfg, "zz-planted", "mine-mixerconv")
    path.parent.chmod(0o777)
    assert planted_lr(cfg, "mine-mixerconv") != 0.9


@needs_root
def test_a_point_only_another_user_recorded_is_not_found_saying_why(tmp_path):
    cfg = own_mixer_config(tmp_path, tracking=False)
    path = plant(cfg, "mine-mixerconv", "mine-mixerconv")
    os.chown(path.parent, NOBODY, NOBODY)
    result = invoke("export", cfg, "--point", "mixerconv", "--out", tmp_path / "x")
    assert result.exit_code == 2
    assert result.output == (
        f"error: --point mixerconv: no sweep of {cfg} has recorded its points under "
        f"{tmp_path / 'runs'} (not read, as another user could have written it: "
        f"{path.parent} is owned by uid 65534 (nobody), not by this user); a sweep run "
        f"before points were recorded records them when it runs again (it skips the points "
        f"that are done)\n"
    )
    assert not (tmp_path / "x").exists()
