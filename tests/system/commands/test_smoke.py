"""`--smoke`: every paper config, shrunk, runs each of its stages end to end through the CLI
on the built-in corpus; the shrink keeps the model's family and structure and the config's
workspace apart."""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import pytest
from click.testing import CliRunner

from pipeline.commands.cli import main
from pipeline.data import corpus
from pipeline.spec import PROJECT_ROOT, load_spec
from pipeline.workspace.layout import Workspace

CONFIGS = PROJECT_ROOT / "configs"
# the all-attention paper's own configs: configs/*.yaml less the quickstart
PAPER_CONFIGS = sorted(p for p in CONFIGS.glob("*.yaml") if p.name != "quickstart.yaml")
# every paper config: those, the baselines and ablations, and the other two papers'
# (configs/base/ holds bases for `extends`, which run nothing of their own)
EVERY_PAPER_CONFIG = PAPER_CONFIGS + sorted(
    p
    for folder in ("baselines", "ablations", "active_memory", "infinity_former")
    for p in (CONFIGS / folder).glob("*.yaml")
)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """One workspace root for the module, and the built-in corpus assembled once: walking
    the standard library's sources is most of a smoke's download time."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(corpus.BUILTIN, "python-docs", functools.cache(corpus.python_docs))
        yield tmp_path_factory.mktemp("smoke")


def smoke_run(config: Path, root: Path, *sets: str):
    args = ["run", str(config), "--smoke", "--set", f"workspace.root={root}"]
    args += ["--set", "tracking.enabled=false", *(x for s in sets for x in ("--set", s))]
    return CliRunner().invoke(main, args, catch_exceptions=False)


def test_the_paper_configs_are_found():
    assert {p.stem for p in PAPER_CONFIGS} >= {"enwik8_large", "text8_small", "wt103"}
    assert len(EVERY_PAPER_CONFIG) >= 37


def numbers(node):
    """Every number in a results.json, however nested."""
    if isinstance(node, dict):
        return [x for v in node.values() for x in numbers(v)]
    if isinstance(node, list):
        return [x for v in node for x in numbers(v)]
    return [node] if isinstance(node, (int, float)) and not isinstance(node, bool) else []


@pytest.mark.parametrize("config", EVERY_PAPER_CONFIG, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_smoke_runs_every_stage_of_a_paper_config(config, root):
    result = smoke_run(config, root)
    assert result.exit_code == 0, result.output
    spec = load_spec(config, [f"workspace.root={root}"], smoke=True)
    real = load_spec(config)
    assert spec.name == f"{real.name}-smoke"
    workspace = Workspace(spec.workspace_dir)
    assert [s for s in spec.stages if workspace.record(s) is None] == []
    results = json.loads((spec.workspace_dir / "evaluate" / "results.json").read_text())
    assert numbers(results) and all(math.isfinite(x) for x in numbers(results))
    if real.dataset.generator is None:
        for split in spec.evaluate.splits:  # a downloaded corpus, scored token by token
            assert results[split]["tokens"] > 0
        assert "replaced by the built-in corpus" in result.output
        assert f"--set dataset={real.dataset.name}" in result.output


def test_sweep_takes_smoke(root):
    """`sweep --smoke`: every point is the shrunk config, named after NAME-smoke, and run
    as `run --smoke` runs it; the real config's workspace is not touched."""
    config = str(CONFIGS / "text8_small.yaml")
    common = ["--set", f"workspace.root={root}", "--set", "tracking.enabled=false"]
    dry = CliRunner().invoke(
        main,
        ["sweep", config, "--smoke", "--grid", "train.optimizer.lr=0.01,0.02", "--dry-run"]
        + common,
        catch_exceptions=False,
    )
    assert dry.exit_code == 0, dry.output
    assert "text8_small-smoke-lr0.01" in dry.output and "text8_small-smoke-lr0.02" in dry.output
    assert "replaced by the built-in corpus" in dry.output
    refused = CliRunner().invoke(
        main, ["sweep", config, "--smoke", "--seeds", "1,2", "--slurm", "--dry-run"] + common
    )
    assert refused.exit_code == 2
    assert "--smoke with --slurm" in refused.output
    from pipeline.commands.sweep import plan_sweep, point_command

    pts, _, _ = plan_sweep(config, common[1::2], [], "1,2", smoke=True)
    assert [p.spec.name for p in pts] == ["text8_small-smoke-seed1", "text8_small-smoke-seed2"]
    assert all(p.spec.train.steps == load_spec(config, smoke=True).train.steps for p in pts)
    assert "--smoke" in point_command(config, pts[0])


@pytest.mark.parametrize("config", PAPER_CONFIGS, ids=lambda p: p.stem)
def test_smoke_keeps_the_model_family_and_structure_and_shrinks_sizes(config):
    real, smoke = load_spec(config), load_spec(config, smoke=True)
    assert smoke.model_kind == real.model_kind
    for key in ("persistent_mode", "adaptive_span", "adaptive_io", "ff_kind"):
        assert getattr(smoke.model_params, key) == getattr(real.model_params, key)
    assert (smoke.model_params.n_persistent > 0) == (real.model_params.n_persistent > 0)
    assert (smoke.model_params.ff_dim > 0) == (real.model_params.ff_dim > 0)
    assert smoke.model_params.d_model < real.model_params.d_model
    assert smoke.model_params.n_layers < real.model_params.n_layers
    assert smoke.train.steps < 100 and smoke.train.launcher.procs_per_node == 1
    assert smoke.train.optimizer.type == real.train.optimizer.type
    assert smoke.train.optimizer.warmup_steps < smoke.train.steps
    assert smoke.stages == real.stages
    assert smoke.dataset.url == "builtin://python-docs"
    assert smoke.dataset.tokenizer.kind == (
        real.dataset.tokenizer.kind
        if real.dataset.tokenizer.kind in ("byte", "char")
        else "sentencepiece"
    )
    if real.model_params.adaptive_io:  # as many bands, inside the smoke vocabulary
        cutoffs = smoke.model_params.adaptive_cutoffs
        assert len(cutoffs) == len(real.model_params.adaptive_cutoffs)
        assert cutoffs[-1] < smoke.dataset.vocab_size


def test_smoke_has_its_own_workspace_and_experiment(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text(
        f"extends: [{CONFIGS / 'text8_small.yaml'}]\ntracking: {{experiment: mine}}\n"
    )
    smoke = load_spec(config, smoke=True)
    assert smoke.name == "text8_small-smoke"
    assert smoke.tracking.experiment == "mine-smoke"


def test_set_wins_over_smoke_and_a_named_dataset_is_kept():
    smoke = load_spec(
        CONFIGS / "enwik8_small.yaml", ["train.steps=3", "dataset=enwik8"], smoke=True
    )
    assert smoke.train.steps == 3
    assert smoke.dataset.name == "enwik8"


def test_smoke_shrinks_a_generated_dataset_and_a_curriculum():
    sort = load_spec(CONFIGS / "infinity_former" / "sort_4k.yaml", smoke=True)
    assert sort.dataset.generator.frequency_sort.sequences.train <= 32
    assert sort.model_kind == "infinity_former" and sort.model_params.ltm
    task = load_spec(CONFIGS / "active_memory" / "add.yaml", smoke=True)
    assert task.dataset.generator.algorithmic.curriculum.epochs <= 2
    assert (
        task.model_params.mixer
        == load_spec(CONFIGS / "active_memory" / "add.yaml").model_params.mixer
    )


def test_show_and_validate_take_smoke():
    config = str(CONFIGS / "wt103.yaml")
    shown = CliRunner().invoke(main, ["show", config, "--smoke"], catch_exceptions=False)
    assert shown.exit_code == 0, shown.output
    assert "name: wt103-smoke" in shown.output
    valid = CliRunner().invoke(main, ["validate", config, "--smoke"], catch_exceptions=False)
    assert "valid (wt103-smoke:" in valid.output
