"""A sweep over a structural key (model.mixer): a key the config writes that does nothing at
some points (n_heads, head_dim without self-attention) is dropped there, one line per point
says so, and the point's name, spec and fingerprints no longer depend on it. A single run
whose --set switches off a key of the file drops it the same way; a key that does nothing in
the file on its own, or that a --set itself writes, is refused (at every point of a sweep, or
in a single run), and the error names the way out."""

from __future__ import annotations

import shlex

import pytest
from click.testing import CliRunner

from pipeline.commands.cli import main
from pipeline.spec import load_spec
from pipeline.spec.yaml_reading import PROJECT_ROOT
from stages import STAGES
from tests.fixtures.docs_pages import PAGES, PLACEHOLDER, commands
from tests.fixtures.runs import own_mixer_config

WHY = "mixer conv has no self-attention"


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def test_a_mixer_sweep_drops_the_attention_keys_where_they_do_nothing(tmp_path):
    cfg = own_mixer_config(tmp_path)
    result = invoke("sweep", cfg, "--dry-run", "--grid", "model.mixer=self_attention,conv,sa+conv")
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    dropped = [line for line in lines if line.startswith("point ")]
    assert dropped == [
        f"point mine-mixerconv: dropped model.n_heads, model.head_dim ({WHY})",
    ], result.output
    conv = next(line for line in lines if line.split()[:1] == ["mine-mixerconv"])
    assert conv.split()[-6:] == [
        "--set",
        "model.mixer=conv",
        "--set",
        "~model.n_heads",
        "--set",
        "~model.head_dim",
    ]
    # what a point's own process (--parallel, a launcher, a Slurm task) loads: the same spec
    result = invoke(
        "validate", cfg, "--set", "model.mixer=conv", "--set", "~model.n_heads", "--set",
        "~model.head_dim",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert not (tmp_path / "runs").exists()


def test_a_dropped_key_changes_no_fingerprint_and_no_name(tmp_path):
    from pipeline.commands.sweep import plan_sweep

    specs = []
    for n_heads in (4, 8):
        cfg = own_mixer_config(tmp_path, n_heads=n_heads, name=f"mine{n_heads}")
        pts, _, _ = plan_sweep(str(cfg), ["name=mine"], ["model.mixer=conv,self_attention"], None)
        specs.append({p.name: p.spec for p in pts})
    assert list(specs[0]) == list(specs[1]) == ["mine-mixerconv", "mine-mixerself_attention"]
    conv = [STAGES["train"].fingerprinted(s["mine-mixerconv"]) for s in specs]
    assert conv[0] == conv[1]
    attention = [STAGES["train"].fingerprinted(s["mine-mixerself_attention"]) for s in specs]
    assert attention[0] != attention[1]  # where they act, they count


def test_a_grid_key_dropped_at_a_point_leaves_one_point_for_its_values(tmp_path):
    cfg = own_mixer_config(tmp_path)
    result = invoke(
        "sweep", cfg, "--dry-run", "--grid", "model.mixer=self_attention,conv",
        "--grid", "model.n_heads=2,4",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    names = [line.split()[0] for line in lines if line.startswith("  ")]
    assert names == [
        "mine-mixerself_attention-n_heads2",
        "mine-mixerself_attention-n_heads4",
        "mine-mixerconv",
    ], result.output
    assert any(line.startswith("3 points;") for line in lines)
    assert f"point mine-mixerconv: dropped model.n_heads, model.head_dim ({WHY})" in lines


@pytest.mark.parametrize(
    "args", [["--grid", "model.mixer=conv,cgru"], ["--set", "model.mixer=conv", "--seeds", "1,2"]]
)
def test_a_key_of_the_file_that_the_sets_switch_off_everywhere_is_dropped_everywhere(
    tmp_path, args
):
    result = invoke("sweep", own_mixer_config(tmp_path), "--dry-run", *args)
    assert result.exit_code == 0, result.output
    dropped = [line for line in result.output.splitlines() if line.startswith("point ")]
    assert len(dropped) == 2, result.output
    assert all(": dropped model.n_heads, model.head_dim (mixer c" in line for line in dropped)


@pytest.mark.parametrize(
    "args, at, mixer",
    [
        # written by --set: the user's own doing
        (
            ["--grid", "model.mixer=conv,cgru", "--set", "model.n_heads=2"],
            "--set model.n_heads=2",
            "self_attention",
        ),
        # doing nothing in the file on its own: no --set switched it off
        (["--grid", "train.seed=1,2"], "FILE:5", "conv"),
    ],
)
def test_a_key_that_does_nothing_at_every_point_is_refused(tmp_path, args, at, mixer):
    cfg = own_mixer_config(tmp_path, mixer=mixer)
    result = invoke("sweep", cfg, "--dry-run", *args)
    assert result.exit_code == 2, result.output
    at = at.replace("FILE", str(cfg))
    assert f"{at}: model.n_heads: does nothing at any point of the sweep (mixer c" in result.output


def test_a_single_run_drops_a_key_of_the_file_that_its_set_switches_off(tmp_path):
    cfg = own_mixer_config(tmp_path)
    result = invoke("validate", cfg, "--set", "model.mixer=conv")
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[:2] == [
        f"{cfg}:5: model.n_heads: dropped, it does nothing with these --set ({WHY})",
        f"{cfg}:6: model.head_dim: dropped, it does nothing with these --set ({WHY})",
    ]
    # the spec a sweep point with the same value runs
    point = load_spec(cfg, ["model.mixer=conv", "~model.n_heads", "~model.head_dim"])
    assert load_spec(cfg, ["model.mixer=conv"]).resolved() == point.resolved()


def test_a_single_run_refuses_a_key_that_does_nothing_in_the_file_itself(tmp_path):
    cfg = own_mixer_config(tmp_path, mixer="conv")
    result = invoke("validate", cfg, "--set", "train.seed=3")
    assert result.exit_code == 2, result.output
    assert f"{cfg}:5: model.n_heads: does nothing here ({WHY}); remove it" in result.output
    assert "`extends`" in result.output and "sweep" in result.output


def test_a_single_run_refuses_a_key_its_set_writes_that_does_nothing(tmp_path):
    cfg = own_mixer_config(tmp_path)
    result = invoke("validate", cfg, "--set", "model.mixer=conv", "--set", "model.n_heads=2")
    assert result.exit_code == 2, result.output
    assert f"--set model.n_heads=2: model.n_heads: does nothing here ({WHY})" in result.output
    assert "head_dim" not in result.output  # the file's: the --set switched it off


def test_a_set_that_removes_a_key_the_config_does_not_set_is_refused(tmp_path):
    cfg = own_mixer_config(tmp_path)
    with pytest.raises(Exception, match=r"~model.cgru_gate: .*not set"):
        load_spec(cfg, ["~model.cgru_gate"])


def docs_sweeps() -> list[tuple[str, str]]:
    """The `allattn-pipe sweep` commands the pages show with a real config (not `CFG`)."""
    return [
        (page.name, c)
        for page in PAGES
        for c in commands(page)
        if c.split()[1] == "sweep" and not PLACEHOLDER.search(c)
    ]


def test_the_docs_show_a_mixer_sweep():
    assert any("--grid model.mixer=" in c for _, c in docs_sweeps()), docs_sweeps()


@pytest.mark.parametrize("page, command", docs_sweeps(), ids=[c for _, c in docs_sweeps()])
def test_the_docs_sweeps_plan_as_written(page, command, monkeypatch):
    monkeypatch.chdir(PROJECT_ROOT)  # the pages' config paths are the project's
    args = shlex.split(command)[1:]
    result = invoke(*args, *([] if "--dry-run" in args else ["--dry-run"]))
    assert result.exit_code == 0, f"{page}: `{command}`:\n{result.output}"
