"""Mistakes on the command line itself (what click parses) end as every other user error
does: one line `error: ...` naming the flag, argument or command, exit 2; `--help` is still
click's."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from pipeline.commands.cli import main
from pipeline.spec import PROJECT_ROOT

QUICKSTART = str(PROJECT_ROOT / "configs" / "quickstart.yaml")


@pytest.mark.parametrize(
    "args, names",
    [
        (["run"], "'CONFIG'"),
        (["run", QUICKSTART, "--bogus"], "'--bogus'"),
        (["--bogus"], "'--bogus'"),
        (["nope"], "'nope'"),
        (["launch", "slurm", QUICKSTART], "'--nodes'"),
        (["launch", "slurm", QUICKSTART, "--nodes", "x\ny", "--gpus-per-node", "1"], "'--nodes'"),
        (["sample", QUICKSTART, "--prompt", "x", "--tokens", "-1"], "'--tokens'"),
        # beyond a 64-bit seed: torch's generator raised an OverflowError (the CLI fuzzer)
        (["sample", QUICKSTART, "--prompt", "x", "--seed", str(-(2**63) - 1)], "'--seed'"),
        (["sample", QUICKSTART, "--prompt", "x", "--seed", str(2**64)], "'--seed'"),
        (["compare", "--format", "xml"], "'--format'"),
        (["sweep", QUICKSTART, "--parallel"], "'--parallel'"),
        ([], "missing command"),
        (["--"], "Missing command"),
        (["validate", ""], "'CONFIG'"),
        (["validate", "-"], "'CONFIG'"),
        (["export", QUICKSTART, "--out", "-"], "'--out'"),
        (["launch"], "missing command, one of: slurm"),
    ],
)
def test_a_command_line_mistake_is_one_error_line_naming_it(args, names):
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert names in lines[0]
    assert "Usage:" not in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize(
    "args", [["--help"], ["run", "--help"], ["launch", "-h"], ["launch", "slurm", "--help"]]
)
def test_help_is_still_clicks_usage_and_options(args):
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0
    assert result.stdout.startswith("Usage: ") and "Options:" in result.stdout


def test_debug_still_raises_a_pipeline_error_from_a_subgroups_command(tmp_path):
    result = CliRunner().invoke(
        main,
        [
            "--debug",
            "launch",
            "slurm",
            str(tmp_path / "no.yaml"),
            "--nodes",
            "1",
            "--gpus-per-node",
            "1",
        ],
    )
    assert result.exit_code == 1 and "no such file" in str(result.exception)


@pytest.mark.parametrize(
    "args, shown",
    [
        (["validate", "a\nb.yaml"], "a\\nb.yaml: no such file"),
        (["run", QUICKSTART, "--dry-run", "--only", "a\nb"], "--only a\\nb: no such stage kind"),
        (["sweep", QUICKSTART, "--dry-run", "--grid", "a\nb"], "--grid a\\nb: expected KEY="),
        (["sweep", QUICKSTART, "--dry-run", "--seeds", "1\n2"], "--seeds 1\\n2: expected"),
    ],
)
def test_a_value_holding_a_newline_is_shown_escaped_in_its_one_error_line(args, shown):
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert shown in lines[0]


@pytest.mark.parametrize(
    "args, names",
    [
        (["validate", "a\x00b"], "'CONFIG'"),
        (["validate", "x" * 5000], "'CONFIG'"),
        (["export", QUICKSTART, "--out", "a\x00b"], "'--out'"),
        (
            [
                "launch",
                "slurm",
                QUICKSTART,
                "--nodes",
                "1",
                "--gpus-per-node",
                "1",
                "--output",
                "x" * 5000,
            ],
            "'--output'",
        ),
        (
            [
                "launch",
                "slurm",
                QUICKSTART,
                "--nodes",
                "1",
                "--gpus-per-node",
                "1",
                "--output",
                "/proc/x/job.sbatch",
            ],
            "--output /proc/x/job.sbatch: cannot write",
        ),
        (["compare", "x" * 5000], "no tracking store"),  # not a file: an experiment's name
        (["validate", "/dev/zero"], "/dev/zero: not a file"),  # read forever, until OOM
    ],
)
def test_a_name_no_file_can_have_or_a_device_is_one_error_line(args, names):
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, (result.exception, result.output)
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and names in lines[0], lines


def test_a_script_that_cannot_be_written_leaves_no_log_directory_behind(tmp_path):
    """`launch slurm --output` to a place no file can be: one line, exit 2, and the workspace
    as it was: the log directory the script would need is made first and taken back (the CLI
    fuzzer drew it: `--output /proc/x` left runs/NAME/slurm/logs)."""
    (tmp_path / "runs").mkdir()
    args = ["launch", "slurm", QUICKSTART, "--nodes", "1", "--gpus-per-node", "1"]
    args += ["--set", f"workspace.root={tmp_path / 'runs'}", "--output", "/proc/x"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, (result.exception, result.output)
    assert result.stderr.startswith("error: --output /proc/x: cannot write"), result.stderr
    assert list((tmp_path / "runs").iterdir()) == []
    # written where it can be, the same command makes the log directory Slurm needs
    args[-1] = str(tmp_path / "job.sbatch")
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, (result.exception, result.output)
    assert (tmp_path / "runs" / "quickstart" / "slurm" / "logs").is_dir()


BLANK = "is only whitespace or control characters"
SLURM = ["launch", "slurm", QUICKSTART, "--nodes", "1", "--gpus-per-node", "1"]


@pytest.mark.parametrize(
    "args, flag, problem",
    [
        (["export", QUICKSTART, "--out", "\n"], "--out", f"it {BLANK} ('\\n')"),
        (["export", QUICKSTART, "--out", " "], "--out", f"it {BLANK} (' ')"),
        (["export", QUICKSTART, "--out", "exports/\t/x"], "--out", f"its part '\\t' {BLANK}"),
        (["export", QUICKSTART, "--out", "x", "--checkpoint", "\r\n"], "--checkpoint",
         f"it {BLANK} ('\\r\\n')"),
        (["sample", QUICKSTART, "--prompt", "x", "--checkpoint", "\n"], "--checkpoint",
         f"it {BLANK} ('\\n')"),
        (["export", QUICKSTART, "--out", "x", "--point", "\n"], "--point", f"it {BLANK} ('\\n')"),
        (["compare", QUICKSTART, "--point", "\x1b"], "--point", f"it {BLANK} ('\\x1b')"),
        (["compare", QUICKSTART, "--plot", "\n"], "--plot", f"it {BLANK} ('\\n')"),
        ([*SLURM, "--output", "\n"], "--output", f"it {BLANK} ('\\n')"),
        (["copy", "quickstart", "\n"], "[DEST]", f"it {BLANK} ('\\n')"),
    ],
)  # fmt: skip
def test_a_path_option_of_only_whitespace_is_refused_naming_it_and_makes_nothing(
    args, flag, problem, tmp_path, monkeypatch
):
    """Found by the CLI fuzzer: `export --out '\\n'` (a shell variable gone wrong) exited 0
    and wrote an export into a directory named by a newline in the current directory."""
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, result.output
    command = " ".join(args[:2] if args[0] == "launch" else args[:1])
    assert result.stderr == (
        f"error: Invalid value for '{flag}': {problem}, no name a file is given on purpose "
        f"(see main {command} --help)\n"  # CliRunner's program name
    )
    assert list(tmp_path.iterdir()) == []
