"""Every error caused by a `--set` value names that `--set KEY=VALUE` as its origin, never a
line of the config file, including the checks across keys (a model's own, a section's) and a
`--set` of a key that the file also sets."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from pipeline.commands.cli import main
from pipeline.spec import PROJECT_ROOT

QUICKSTART = str(PROJECT_ROOT / "configs" / "quickstart.yaml")


def validate(*overrides: str) -> list[str]:
    args = ["validate", QUICKSTART]
    for text in overrides:
        args += ["--set", text]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, result.output
    return [line.removeprefix("error: ") for line in result.output.strip().splitlines()]


@pytest.mark.parametrize(
    "override, problem",
    [
        # a type, in a key the file also sets
        ("train.steps=abc", "train.steps: expected a valid integer"),
        # a range, checked by the model's own config (quickstart.yaml sets d_model: 128)
        ("model.d_model=-1", "d_model must be >= 1"),
        ("model.attn_dropout=2", "attn_dropout must be in [0, 1)"),
        # a key that only fails with another one the file sets (d_model 128)
        ("model.n_heads=3", "must be divisible by n_heads (3)"),
        # an unknown key, nested
        ("train.optimizer.lrr=0.1", "unknown key 'lrr' (did you mean 'lr'?)"),
        # a check across a section's keys (the file's optimizer is adam)
        ("train.optimizer.clip=per_param", "optimizer.clip per_param"),
        # a whole section given as a mapping
        ("train.optimizer={type: adam, lr: x}", "train.optimizer.lr: expected a valid number"),
    ],
)
def test_an_error_from_a_set_value_names_the_set(override, problem):
    lines = validate(override)
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"--set {override}: "), lines[0]
    assert problem in lines[0], lines[0]
    assert "quickstart.yaml" not in lines[0]


def test_of_two_sets_the_error_names_the_one_at_fault():
    lines = validate("train.seed=7", "model.n_heads=5")
    assert len(lines) == 1, lines
    assert lines[0].startswith("--set model.n_heads=5: "), lines[0]


def test_a_section_check_that_names_no_key_is_placed_with_the_set():
    # the message speaks of "processes", not of procs_per_node
    (line,) = validate("train.launcher.procs_per_node=3")
    assert " with --set train.launcher.procs_per_node=3: train: " in line, line


def test_a_mistake_in_the_file_is_still_placed_at_its_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(f"extends: [{QUICKSTART}]\nmodel: {{n_heads: 3}}\n")
    result = CliRunner().invoke(main, ["validate", str(bad), "--set", "train.seed=7"])
    assert result.exit_code == 2, result.output
    assert f"{bad}:2: " in result.output, result.output
    assert "--set" not in result.output, result.output
