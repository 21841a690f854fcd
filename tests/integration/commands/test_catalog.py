"""The configs and dataset cards that ship with the package, from any directory (issue 52 item
2): a config runs by its name (`enwik8_large`, `ablations/text8_n0`) as well as by its path, a
file here wins over a name and one line says so where both exist, an unknown name is one line
with the near ones; `list` names every card and runnable config with one line each; `copy`
writes a config out as one file that loads to the same spec, and never replaces a file.

The installed layout (the wheel's copy in pipeline/_project/, no checkout) is imitated by
pointing `pipeline.resources` at a copy of the folders; tests/system/test_installed_package.py
builds and installs the real wheel.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from pipeline import resources
from pipeline.commands.cli import main

ROOT = Path(__file__).resolve().parents[3]
CONFIGS, DATASETS = ROOT / "configs", ROOT / "datasets"


def cli(*args: str):
    return CliRunner().invoke(main, list(args))


@pytest.fixture
def elsewhere(tmp_path, monkeypatch) -> Path:
    """An empty working directory outside the checkout, as a cluster's scratch space."""
    here = tmp_path / "scratch"
    here.mkdir()
    monkeypatch.chdir(here)
    return here


@pytest.fixture
def installed(tmp_path, monkeypatch) -> Path:
    """The package as a wheel installs it: the project's folders copied into the package's
    pipeline/_project/, and no checkout beside it."""
    shipped = tmp_path / "site-packages" / "pipeline" / "_project"
    shutil.copytree(CONFIGS, shipped / "configs")
    shutil.copytree(DATASETS, shipped / "datasets")
    shutil.copytree(ROOT / "launch", shipped / "launch")
    monkeypatch.setattr(resources, "SHIPPED", shipped)
    monkeypatch.setattr(resources, "CHECKOUT", tmp_path / "no-checkout")
    return shipped


# ---------------------------------------------------------------- by name, from anywhere


def test_a_config_runs_by_its_name_from_any_directory(elsewhere):
    result = cli("validate", "enwik8_large")
    assert result.exit_code == 0, result.output
    assert result.stdout == (
        f"{CONFIGS / 'enwik8_large.yaml'}: valid (enwik8_large: download, preprocess, train, "
        f"finetune, evaluate)\n"
    )
    assert result.stderr == ""
    nested = cli("validate", "ablations/text8_n0")
    assert nested.exit_code == 0, nested.output
    assert nested.stdout.startswith(f"{CONFIGS / 'ablations' / 'text8_n0.yaml'}: valid ")


def test_an_installed_package_finds_its_configs_bases_and_cards(installed, elsewhere):
    # enwik8_small extends base/char_small.yaml, which extends base/char.yaml, and names the
    # card enwik8: all three found in the installed copy
    result = cli("validate", "enwik8_small")
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith(f"{installed / 'configs' / 'enwik8_small.yaml'}: valid ")
    # a user's own config names a card: the reported failure was "known cards: none"
    (elsewhere / "my.yaml").write_text(
        "name: mine\ndataset: python_docs\nmodel: {kind: allattn, d_model: 16, n_layers: 1,\n"
        "  n_heads: 2, n_persistent: 4, max_span: 16}\ntrain: {steps: 1, batch_size: 2, "
        "seq_len: 8}\nstages: [download, preprocess, train]\n"
    )
    shown = cli("show", "my.yaml")
    assert shown.exit_code == 0, shown.output
    card = yaml.safe_load((DATASETS / "python_docs.yaml").read_text())
    assert yaml.safe_load(shown.stdout.split("\n\n")[0])["dataset"]["url"] == card["url"]
    # and the Slurm script's template
    from pipeline.cluster.slurm import template_path

    assert template_path() == installed / "launch" / "slurm.sbatch"


def test_a_file_here_wins_over_a_name_and_one_line_says_so(elsewhere):
    (elsewhere / "quickstart").write_text("name: mine\n")
    result = cli("validate", "quickstart")
    assert result.exit_code == 2  # the file here was read: it has no stages
    assert result.stderr.splitlines()[0] == (
        f"note: quickstart: the file here, not the package's config of that name "
        f"({CONFIGS / 'quickstart.yaml'})"
    )
    assert "quickstart: the package's" not in result.stderr


def test_a_name_with_a_yaml_file_of_that_name_here_says_which_was_taken(elsewhere):
    (elsewhere / "quickstart.yaml").write_text("name: mine\n")
    result = cli("validate", "quickstart")
    assert result.exit_code == 0, result.output
    assert result.stderr == (
        f"note: quickstart: the package's config ({CONFIGS / 'quickstart.yaml'}), not "
        f"quickstart.yaml here (give ./quickstart.yaml to use that one)\n"
    )
    assert result.stdout.startswith(f"{CONFIGS / 'quickstart.yaml'}: valid (quickstart: ")
    # a directory of that name is no config: the name, and nothing to say
    (elsewhere / "quickstart.yaml").unlink()
    (elsewhere / "quickstart").mkdir()
    result = cli("validate", "quickstart")
    assert result.exit_code == 0 and result.stderr == "", result.output


@pytest.mark.parametrize(
    "given, near",
    [
        ("enwik8_lage", "; near it: enwik8_large, enwik8_small, text8_large"),
        ("configs/enwik8_large.yaml", "; near it: enwik8_large, text8_large, enwik8_small"),
        ("text8_n0", "; near it: ablations/text8_n0, text8_small, text8_large"),
        ("nope", ""),
    ],
)
def test_a_name_not_found_is_one_line_with_the_near_ones(elsewhere, given, near):
    result = cli("run", given, "--dry-run")
    assert result.exit_code == 2
    assert result.stderr == (
        f"error: {given}: no such file, nor a config of the package by that name{near} "
        f"(`allattn-pipe list` names them all)\n"
    )
    assert list(elsewhere.iterdir()) == []


# ---------------------------------------------------------------- list


def test_list_names_every_card_and_runnable_config_with_its_line(elsewhere):
    result = cli("list")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    cards = sorted(DATASETS.glob("*.yaml"))
    runnable = [
        p
        for p in sorted(CONFIGS.rglob("*.yaml"))
        if "name" in (yaml.safe_load(p.read_text()) or {})
    ]
    assert lines[0] == f"dataset cards (a config's `dataset: NAME`), in {DATASETS}:"
    listed_cards = [line.split(maxsplit=1) for line in lines[1 : 1 + len(cards)]]
    assert listed_cards == [[p.stem, yaml.safe_load(p.read_text())["description"]] for p in cards]
    assert lines[1 + len(cards)] == ""
    assert lines[2 + len(cards)].startswith("configs (`allattn-pipe run NAME`;")
    listed = dict(line.split(maxsplit=1) for line in lines[3 + len(cards) :])
    names = [p.relative_to(CONFIGS).with_suffix("").as_posix() for p in runnable]
    assert list(listed) == names  # sorted by path; the bases (no name) left out
    assert "base/char" not in listed and len(names) == 38
    # a config's line is the first sentence of the comment above its first key
    assert listed["enwik8_large"] == (
        "All-attention network, large, on enwik8 (Sukhbaatar et al. 2019, table 1)"
    )
    assert listed["quickstart"] == (
        "The quickstart: every stage kind end to end on the built-in corpus, offline, on a laptop"
    )
    assert all(0 < len(line) <= 90 for line in listed.values())


# ---------------------------------------------------------------- copy


def _resolved_without_inert(path) -> dict:
    """A config's resolved spec less the keys that do nothing in it (which a copy may leave
    out, as the loader refuses them written in the config's own file)."""
    from pipeline.spec import load_spec

    spec = load_spec(path)
    inert = {key for key, _ in spec.inert_keys()}

    def strip(node: dict, prefix: tuple = ()) -> dict:
        return {
            k: strip(v, prefix + (k,)) if isinstance(v, dict) else v
            for k, v in node.items()
            if prefix + (k,) not in inert
        }

    return strip(spec.resolved())


@pytest.mark.parametrize(
    "name, merged, left_out",
    [
        ("enwik8_small", "(base/char_small.yaml, base/char.yaml)", []),
        ("active_memory/add", "(../base/active_memory_task.yaml)", ["attn_double_scale"]),
        ("quickstart", None, []),
    ],
)
def test_copy_writes_one_file_that_loads_to_the_same_spec(elsewhere, name, merged, left_out):
    result = cli("copy", name)
    assert result.exit_code == 0, result.output
    written = elsewhere / f"{name.rpartition('/')[2]}.yaml"
    assert result.stdout == f"wrote {written.name}; run it with: allattn-pipe run {written.name}\n"
    text = written.read_text()
    data = yaml.safe_load(text)
    assert "extends" not in data and list(data)[:2] == ["name", "dataset"]
    assert isinstance(data["dataset"], str)  # a card stays a name
    header = " ".join(line.lstrip("# ") for line in text.splitlines()[:8])
    assert f"from the package's config {name}" in header
    if merged:
        assert f"with its extends {merged} merged in" in header
    assert [k for k in left_out if k in data["model"]] == []
    assert _resolved_without_inert(written) == _resolved_without_inert(CONFIGS / f"{name}.yaml")
    # the config's own comment comes along, whole
    own = [line for line in (CONFIGS / f"{name}.yaml").read_text().splitlines()]
    own = own[: next(i for i, line in enumerate(own) if not line.startswith("#"))]
    assert "\n".join(own) in text


def test_copy_never_replaces_a_file(elsewhere):
    (elsewhere / "enwik8_large.yaml").write_text("mine\n")
    result = cli("copy", "enwik8_large")
    assert result.exit_code == 2
    assert result.stderr.splitlines()[-1] == (
        "error: enwik8_large.yaml: already exists; copy never replaces a file: give another "
        "destination, or remove that one"
    )
    assert (elsewhere / "enwik8_large.yaml").read_text() == "mine\n"
    link = elsewhere / "link.yaml"
    link.symlink_to(elsewhere / "absent.yaml")  # a dangling link: nothing written through it
    assert cli("copy", "enwik8_large", "link.yaml").exit_code == 2
    assert not (elsewhere / "absent.yaml").exists()


def test_copy_into_a_directory_and_the_refusals(elsewhere):
    (elsewhere / "mine").mkdir()
    assert cli("copy", "ablations/text8_n0", "mine").exit_code == 0
    assert yaml.safe_load((elsewhere / "mine" / "text8_n0.yaml").read_text())["name"] == (
        "text8_ablation_n0"
    )
    missing = cli("copy", "quickstart", "absent/")
    assert missing.exit_code == 2 and missing.stderr == "error: absent/: no such directory\n"
    base = cli("copy", "base/char")
    assert base.exit_code == 2
    assert base.stderr.startswith(
        f"error: {CONFIGS / 'base' / 'char.yaml'}: a base for `extends` (no name of its own)"
    )
    assert sorted(p.name for p in elsewhere.iterdir()) == ["mine"]
