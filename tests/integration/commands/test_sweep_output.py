"""What a sweep prints: the stages its points share are built once with --only, which is the
sweep's own and no user's, so it does not report the later stages as "held: not selected by
--only"; and a self-attention point is described without a convolution's kernel."""

from __future__ import annotations

from click.testing import CliRunner

from pipeline.commands.cli import main
from tests.fixtures.environment import restored_environment
from tests.fixtures.runs import own_mixer_config


def test_a_smoke_sweep_says_nothing_of_only_and_no_kernel_for_self_attention(tmp_path):
    cfg = own_mixer_config(tmp_path, tracking=False)
    with restored_environment():
        result = CliRunner().invoke(
            main,
            [
                "sweep", str(cfg), "--smoke", "--grid", "model.mixer=conv,self_attention",
                "--set", "train.steps=2", "--set", "stages=[download,preprocess,train]",
            ],
        )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "2 of 2 points done" in result.output, result.output
    assert "running what every point shares: download, preprocess" in result.output
    assert "--only" not in result.output and "held" not in result.output, result.output
    described = [line for line in result.output.splitlines() if "active memory: " in line]
    assert any("active memory: conv, causal, kernel " in line for line in described), described
    attention = [line for line in described if "active memory: self_attention" in line]
    assert attention and not any("kernel" in line for line in attention), described
