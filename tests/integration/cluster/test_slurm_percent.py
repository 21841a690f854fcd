"""A `%` in a path that goes into an #SBATCH directive (issue 45, item 6): sbatch reads
`--output` as a filename pattern everywhere in it, directories included, so a project under
`exp%j/` logged to `exp<jobid>/`, a directory that does not exist. The renderer doubles it.

Here the directive is read by `expand`, sbatch(1)'s "filename pattern" rules written out; the
real sbatch and slurmstepd read it in tests/system/cluster/test_cluster.py."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from pipeline.commands.cli import main

ROOT = Path(__file__).resolve().parents[3]
CONFIG = "configs/enwik8_large.yaml"
JOB = {"j": "4321", "A": "4320", "a": "2", "x": None}  # x: the job name


def expand(pattern: str, job_name: str) -> str:
    """What sbatch(1)'s filename pattern `pattern` names: `%%` is `%`; `%j` the job id, `%A`
    the array's, `%a` the task's index, `%x` the job name (a number after `%` zero-pads);
    any backslash turns every replacement off."""
    if "\\" in pattern:
        return pattern.replace("\\", "")
    values = {**JOB, "x": job_name}

    def one(match: re.Match) -> str:
        if match.group(2) == "%":
            return "%"
        return values[match.group(2)].zfill(int(match.group(1) or 0))

    return re.sub(r"%([0-9]*)([%jAax])", one, pattern)


def output_directive(script: str) -> str:
    return re.search(r"^#SBATCH --output=(\S+)$", script, re.MULTILINE).group(1)


@pytest.fixture
def root(tmp_path, monkeypatch):
    """A workspace root under `exp%j/`, with the project as the current directory."""
    monkeypatch.chdir(ROOT)
    return tmp_path / "exp%j" / "runs"


def test_launch_slurm_doubles_a_percent_in_the_log_directory(root):
    args = [CONFIG, "--nodes", "2", "--gpus-per-node", "8", "--cpus-per-task", "1"]
    sets = ["--set", f"workspace.root={root}"]
    result = CliRunner().invoke(main, ["launch", "slurm", *args, *sets])
    assert result.exit_code == 0, result.output
    logs = root / "enwik8_large" / "slurm" / "logs"
    assert logs.is_dir()  # made with the script: Slurm does not make it
    script = (logs.parent / "enwik8_large.sbatch").read_text()
    pattern = output_directive(script)
    assert pattern == f"{str(logs).replace('%', '%%')}/%x-%j.out"
    assert expand(pattern, "enwik8_large") == f"{logs}/enwik8_large-4321.out"


def test_sweep_slurm_doubles_a_percent_in_the_log_directory(root):
    result = CliRunner().invoke(
        main,
        [
            "sweep",
            CONFIG,
            *["--grid", "train.seed=1,2", "--set", f"workspace.root={root}"],
            *["--slurm", "--nodes", "2", "--gpus-per-node", "8", "--cpus-per-task", "1"],
            "--dry-run",
        ],
    )
    assert result.exit_code == 0, result.output
    logs = root / "enwik8_large" / "slurm" / "logs"
    pattern = output_directive(result.stdout)
    assert pattern == f"{str(logs).replace('%', '%%')}/%x-%A_%a.out"
    assert expand(pattern, "enwik8_large-sweep") == f"{logs}/enwik8_large-sweep-4320_2.out"
