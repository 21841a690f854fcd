"""No value becomes shell: what `launch slurm` and `sweep --slurm` render into a batch script,
and what the deepspeed launcher sends to every node of a multi-node run, either arrives byte
for byte or is refused in one line. Each script is rendered, then run by bash with sbatch, srun,
scontrol and the interpreter replaced by recorders; the multi-node launch runs deepspeed's own
runner with pdsh and ssh replaced by a recorder that runs the remote command with bash here.
A canary command hidden in the values must never run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

from pipeline.commands.cli import main
from tests.fixtures.fake_slurm import FAKES

ROOT = Path(__file__).resolve().parents[3]
CONFIG = "configs/enwik8_large.yaml"
SLURM = ["--nodes", "1", "--gpus-per-node", "1"]


def hostile(canary: Path) -> str:
    """A one-line value holding every shell metacharacter, each trying to run the canary."""
    return (
        f"$(touch {canary}) `touch {canary}`; touch {canary} & b | c 'q' \"d\"  e\\ "
        f"&& touch {canary} > x < y * ?"
    )


def stubs(tmp: Path) -> tuple[dict[str, str], Path]:
    """PATH with recorders for the cluster's commands and an interpreter, and their log."""
    bin_dir, log = tmp / "bin", tmp / "log"
    bin_dir.mkdir()
    log.mkdir()
    bodies = {
        **FAKES,
        "sbatch": 'cp "${@: -1}" "$FAKE_LOG/submitted.sbatch"; echo 4242\n',
        "python": 'printf "%s\\n" "$@" >> "$FAKE_LOG/python.argv"\n',
    }
    for name, body in bodies.items():
        fake = bin_dir / name
        fake.write_text("#!/bin/bash\n" + textwrap.dedent(body))
        fake.chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "FAKE_LOG": str(log),
        "SLURM_JOB_NODELIST": "node[A-B]",
        "SLURM_JOB_ID": "4242",
        "SLURM_ARRAY_TASK_ID": "0",
    }
    return env, log


def cli(args: list[str], env: dict[str, str]):
    return CliRunner(env={"PATH": env["PATH"]}).invoke(main, args)


def run_script(script: str, env: dict[str, str], log: Path) -> subprocess.CompletedProcess:
    """The script as the job runs it, its interpreter (an absolute path) a recorder."""
    script = script.replace(sys.executable, str(log.parent / "bin" / "python"))
    path = log / "job.sbatch"
    path.write_text(script)
    return subprocess.run(
        ["bash", str(path)], env=env, cwd=log, capture_output=True, text=True, timeout=30
    )


CONTROL = ["\ntouch {canary} #", "\rtouch {canary}", "\x00", "\t", "\x1b[2K", "\x85", "\x7f"]


@pytest.mark.parametrize("control", CONTROL, ids=repr)
@pytest.mark.parametrize("where", ["sweep --set", "sweep --grid", "launch --set"])
def test_a_control_character_in_a_value_is_refused_and_never_runs(
    monkeypatch, tmp_path, where, control
):
    monkeypatch.chdir(ROOT)
    canary = tmp_path / "CANARY"
    env, log = stubs(tmp_path)
    value = "x" + control.format(canary=canary)
    root = ["--set", f"workspace.root={tmp_path / 'runs'}"]
    if where == "sweep --set":
        args = ["sweep", CONFIG, "--set", f"dataset.description={value}", "--seeds", "1,2"]
    elif where == "sweep --grid":
        args = ["sweep", CONFIG, "--grid", f"dataset.description=a,{value}"]
    else:
        args = ["launch", "slurm", CONFIG, "--set", f"dataset.description={value}"]
    args += [*root, *SLURM] + (["--slurm"] if where.startswith("sweep") else [])
    result = cli(args, env)
    submitted = log / "submitted.sbatch"
    rendered = list((tmp_path / "runs").glob("*/slurm/*.sbatch"))
    for script in [*rendered, *([submitted] if submitted.exists() else [])]:
        run_script(script.read_text(), env, log)
    assert not canary.exists(), "a value ran as shell"
    assert result.exit_code == 2, result.output
    assert result.stderr.count("\n") == 1
    assert "control characters (newline, tab, ...) cannot go into a Slurm script" in result.stderr
    assert not rendered and not submitted.exists()


@pytest.mark.parametrize("command", ["sweep", "launch"])
def test_metacharacters_reach_the_ranks_and_the_sweep_byte_for_byte(monkeypatch, tmp_path, command):
    monkeypatch.chdir(ROOT)
    canary = tmp_path / "CANARY"
    env, log = stubs(tmp_path)
    value = f"dataset.description={hostile(canary)}"
    root = f"workspace.root={tmp_path / 'runs'}"
    if command == "sweep":
        args = ["sweep", CONFIG, "--set", value, "--set", root, "--seeds", "1,2", "--slurm"]
    else:
        args = ["launch", "slurm", CONFIG, "--set", value, "--set", root]
    result = cli([*args, *SLURM, "--dry-run"], env)
    assert result.exit_code == 0, result.output
    done = run_script(result.stdout, env, log)
    assert done.returncode == 0, done.stderr
    assert not canary.exists(), "a value ran as shell"
    srun = (log / "srun.argv").read_text().splitlines()
    assert value in srun and root in srun
    if command == "sweep":  # the task's prepare and finish steps get the sweep's own options
        python = (log / "python.argv").read_text().splitlines()
        assert python.count(value) == 2 and python.count("--array-task-prepare") == 1


def test_the_script_says_who_rendered_it_in_one_comment_line(monkeypatch, tmp_path):
    monkeypatch.chdir(ROOT)
    canary = tmp_path / "CANARY"
    result = cli(
        ["sweep", CONFIG, "--set", f"dataset.description={hostile(canary)}", "--slurm"]
        + ["--grid", "train.seed=1,2"]
        + ["--set", f"workspace.root={tmp_path}", *SLURM, "--dry-run"],
        dict(os.environ),
    )
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[1].startswith("# allattn-pipe rendered this Slurm script")
    header = "# Slurm batch script for the pipeline enwik8_large-sweep, rendered by"
    rendered_by = lines.index(header)
    assert lines[rendered_by + 1].startswith("#   allattn-pipe sweep ")
    assert lines[rendered_by + 2].startswith("# from launch/slurm.sbatch.")


# -- what sbatch itself would refuse


def render(*args: str, tmp: Path):
    return cli(
        ["launch", "slurm", CONFIG, *SLURM, "--set", f"workspace.root={tmp}", *args],
        dict(os.environ),
    )


def test_a_signal_lead_beyond_sbatchs_limit_is_refused(monkeypatch, tmp_path):
    monkeypatch.chdir(ROOT)
    refused = render("--signal-lead", "65536", "--time", "3-00:00:00", "--dry-run", tmp=tmp_path)
    assert refused.exit_code == 2
    assert refused.stderr == (
        "error: --signal-lead 65536: sbatch's --signal takes at most 65535 seconds\n"
    )
    taken = render("--signal-lead", "65535", "--time", "3-00:00:00", "--dry-run", tmp=tmp_path)
    assert taken.exit_code == 0, taken.output
    assert "#SBATCH --signal=B:USR1@65535\n" in taken.stdout


@pytest.mark.parametrize("time_limit", ["١٢٠", "1-٠٠", "２4:00:00", "90:٣٠", "²"])
def test_a_time_in_other_scripts_digits_is_refused(monkeypatch, tmp_path, time_limit):
    monkeypatch.chdir(ROOT)
    result = render("--time", time_limit, "--dry-run", tmp=tmp_path)
    assert result.exit_code == 2
    assert result.stderr.startswith(f"error: --time {time_limit!r}: not a Slurm time limit;")
    assert result.stderr.count("\n") == 1


@pytest.mark.parametrize("seeds", ["١,٢", "²", "1,٣"])
def test_seeds_in_other_scripts_digits_are_refused(monkeypatch, tmp_path, seeds):
    monkeypatch.chdir(ROOT)
    result = cli(
        ["sweep", CONFIG, "--seeds", seeds, "--slurm", *SLURM, "--dry-run"], dict(os.environ)
    )
    assert result.exit_code == 2
    assert "expected integers separated by commas" in result.stderr
    assert result.stderr.count("\n") == 1


def test_a_non_ascii_partition_is_refused(monkeypatch, tmp_path):
    monkeypatch.chdir(ROOT)
    result = render("--partition", "gpü", "--dry-run", tmp=tmp_path)
    assert result.exit_code == 2
    assert "--partition 'gpü': not a partition name" in result.stderr


# -- launch slurm --output replaces only a script it rendered


def test_output_replaces_an_earlier_script_and_nothing_else(monkeypatch, tmp_path):
    monkeypatch.chdir(ROOT)
    config = tmp_path / "copy.yaml"
    config.write_text((ROOT / CONFIG).read_text())
    refused = render("--output", str(config), tmp=tmp_path)
    assert refused.exit_code == 2
    assert refused.stderr == (
        f"error: --output {config}: not a script allattn-pipe rendered (no "
        f"'# allattn-pipe rendered this Slurm script: re-rendering it replaces this file' "
        f"line); refusing to replace it: name a new file, or remove this one\n"
    )
    assert config.read_text() == (ROOT / CONFIG).read_text()

    script = tmp_path / "job.sbatch"
    assert render("--output", str(script), tmp=tmp_path).exit_code == 0
    again = render("--output", str(script), "--time", "2:00:00", tmp=tmp_path)
    assert again.exit_code == 0, again.output
    assert again.stdout.startswith(f"{script}: replaced a different earlier script\n")
    assert "#SBATCH --time=2:00:00\n" in script.read_text()

    link = tmp_path / "link.sbatch"
    link.symlink_to(script)
    via_link = render("--output", str(link), tmp=tmp_path)
    assert via_link.exit_code == 2
    assert via_link.stderr == (
        f"error: --output {link}: not a regular file (a link, a directory, a FIFO); "
        f"refusing to replace it with the script\n"
    )
    assert link.is_symlink()

    fifo = tmp_path / "fifo.sbatch"
    os.mkfifo(fifo)
    assert render("--output", str(fifo), tmp=tmp_path).exit_code == 2  # refused, not waited on


def test_the_default_path_is_not_replaced_unless_rendered(monkeypatch, tmp_path):
    monkeypatch.chdir(ROOT)
    path = tmp_path / "enwik8_large" / "slurm" / "enwik8_large.sbatch"
    path.parent.mkdir(parents=True)
    path.write_text("#!/bin/bash\necho my own script\n")
    result = render(tmp=tmp_path)
    assert result.exit_code == 2 and "not a script allattn-pipe rendered" in result.stderr
    assert path.read_text() == "#!/bin/bash\necho my own script\n"


# -- the deepspeed launcher across nodes: pdsh runs one command line on each


REMOTE = {
    # pdsh -S -f N -w host1,host2 WORD...: the words joined by spaces, run by each host's
    # shell with %n the host's index
    "pdsh": """\
        import os, subprocess, sys
        args = sys.argv[1:]
        hosts = []
        while args and args[0].startswith("-"):
            flag = args.pop(0)
            if flag in ("-f", "-w"):
                value = args.pop(0)
                hosts = value.split(",") if flag == "-w" else hosts
        line = " ".join(args)
        with open(os.path.join(os.environ["FAKE_LOG"], "pdsh.line"), "a") as f:
            f.write(line + "\\n")
        codes = [subprocess.call(["bash", "-c", line.replace("%n", str(i))])
                 for i, _ in enumerate(hosts)]
        sys.exit(max(codes))
        """,
    "ssh": "import sys; print('127.0.0.1')\n",  # the runner's reachability and address checks
}

RECORDER = """\
import json, os, sys
name = f"node{os.environ.get('CROSS_RANK', os.environ.get('RANK', 'x'))}.json"
with open(os.path.join(os.environ["FAKE_LOG"], name), "w") as f:
    json.dump(sys.argv[1:], f)
"""


@pytest.mark.parametrize("case", ["metacharacters", "quotes"])
def test_a_multi_node_launch_passes_every_argument_byte_for_byte(monkeypatch, tmp_path, case):
    from pipeline.cluster import launcher
    from pipeline.spec import load_spec

    monkeypatch.chdir(ROOT)
    bin_dir, log = tmp_path / "bin", tmp_path / "log"
    bin_dir.mkdir()
    log.mkdir()
    for name, body in REMOTE.items():
        (bin_dir / name).write_text(f"#!{sys.executable}\n" + textwrap.dedent(body))
        (bin_dir / name).chmod(0o755)
    modules = tmp_path / "modules"  # each node's rank: the recorder, run as deepspeed --module
    modules.mkdir()
    (modules / "rank_recorder.py").write_text(RECORDER)
    monkeypatch.setattr(launcher, "RANK_MODULE", "rank_recorder")
    hostfile = tmp_path / "hosts"
    hostfile.write_text("nodeA slots=1\nnodeB slots=1\n")
    spec = load_spec(
        CONFIG,
        ["train.launcher.nodes=2", "train.launcher.procs_per_node=1"]
        + [f"train.launcher.hostfile={hostfile}", f"workspace.root={tmp_path / 'runs'}"],
    )
    canary = tmp_path / "CANARY"
    args = ["--config", CONFIG]
    if case == "metacharacters":  # today: the canary runs on every node
        args += ["--set", f"dataset.description=$(touch {canary});touch {canary}|`touch {canary}`"]
    else:  # today: the remote shell's line is cut, or the value changed
        args += ["--set", f"dataset.description={hostile(canary)}", "--set", "x=a  b"]
        args += ["--set", "y='\"", "--set", "z=\\$HOME\\\\", "--only", ""]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW", "NCCL", "PYTHON"))}
    env.update(PATH=f"{bin_dir}:{env['PATH']}", FAKE_LOG=str(log), DS_ACCELERATOR="cpu")
    env.update(PYTHONPATH=str(modules))
    monkeypatch.setattr(os, "environ", env)  # the launch checks the env it runs in
    from pipeline.commands.launched import arguments  # what a launched rank reads

    with launcher.Launch(spec, args) as launch:
        done = subprocess.run(
            launch.cmd, env=launch.env, cwd=launch.cwd, capture_output=True, text=True, timeout=120
        )
        assert not canary.exists(), "an argument ran as shell on a node"
        assert done.returncode == 0, done.stdout + done.stderr
        received = [json.loads(p.read_text()) for p in sorted(log.glob("node*.json"))]
        assert len(received) == 2, (log / "pdsh.line").read_text()
        for argv in received:
            given = [a for a in arguments(argv)[0] if not a.startswith("--local_rank")]
            assert given == ["--workdir", str(ROOT), *args]


@pytest.mark.parametrize("name", ["MLFLOW_TRACKING_TOKEN", "NCCL_DEBUG", "PYTHONWARNINGS"])
def test_an_exported_variable_that_a_remote_shell_would_run_is_refused(monkeypatch, tmp_path, name):
    from pipeline.cluster.launcher import Launch, launcher_command, read_args_file
    from pipeline.errors import PipelineError
    from pipeline.spec import load_spec

    monkeypatch.chdir(ROOT)
    hostfile = tmp_path / "hosts"
    hostfile.write_text("nodeA slots=1\nnodeB slots=1\n")
    spec = load_spec(
        CONFIG,
        ["train.launcher.nodes=2", "train.launcher.procs_per_node=1"]
        + [f"train.launcher.hostfile={hostfile}", f"workspace.root={tmp_path}"],
    )
    hostile = f"$(touch {tmp_path / 'C'})"
    if name.startswith("MLFLOW"):  # a credential: in the arguments file, never on a line
        with Launch(spec, [], env={name: hostile}) as launch:
            assert name not in launch.env and launch.file is not None
            assert read_args_file(str(launch.file))[1] == {name: hostile}
        return
    with pytest.raises(PipelineError, match=f"^environment variable {name}: the deepspeed"):
        launcher_command(spec, [], env={name: hostile})
    assert launcher_command(spec, [], env={name: "a b:c/d=e"})  # plain values pass


def test_a_working_directory_a_remote_shell_would_split_travels_in_the_arguments_file(
    monkeypatch, tmp_path
):
    from pipeline.cluster.launcher import Launch, launch_dir, read_args_file
    from pipeline.spec import load_spec

    hostfile = tmp_path / "hosts"
    hostfile.write_text("nodeA slots=1\nnodeB slots=1\n")
    spec = load_spec(
        ROOT / CONFIG,
        ["train.launcher.nodes=2", "train.launcher.procs_per_node=1"]
        + [f"train.launcher.hostfile={hostfile}", f"workspace.root={tmp_path}"],
    )
    odd = tmp_path / "a b;$(x)"
    odd.mkdir()
    monkeypatch.chdir(odd)
    with Launch(spec, ["--config", "c.yaml"], env={}) as launch:
        assert launch.cwd == launch_dir() and str(odd) not in " ".join(launch.cmd)
        assert launch.file is not None
        assert read_args_file(str(launch.file))[0] == ["--workdir", str(odd), "--config", "c.yaml"]


@pytest.mark.parametrize(
    "args", [[], [""], ["a", ""], ["--set", "x=\udcff\xff é", "$(x)`y`'\"\\ \t\n;&|"]]
)
def test_the_arguments_file_gives_back_every_argument(tmp_path, args):
    from pipeline.cluster.launcher import read_args_file, write_args_file

    path = write_args_file(tmp_path, args, {"MLFLOW_TRACKING_TOKEN": "t"})
    assert path.stat().st_mode & 0o777 == 0o600
    assert read_args_file(str(path)) == (args, {"MLFLOW_TRACKING_TOKEN": "t"})


def test_the_launch_line_shows_the_arguments_not_their_file(monkeypatch, tmp_path):
    from pipeline.cluster import launcher
    from pipeline.spec import load_spec

    hostfile = tmp_path / "hosts"
    hostfile.write_text("nodeA slots=1\nnodeB slots=1\n")
    spec = load_spec(
        ROOT / CONFIG,
        ["train.launcher.nodes=2", "train.launcher.procs_per_node=1"]
        + [f"train.launcher.hostfile={hostfile}", f"workspace.root={tmp_path}"],
    )
    started: list[list[str]] = []

    def popen(cmd, **kw):
        started.append(cmd)
        raise KeyboardInterrupt  # stop before anything runs

    monkeypatch.setattr(launcher.subprocess, "Popen", popen)
    monkeypatch.setattr(os, "environ", {"PATH": os.environ["PATH"], "DS_ACCELERATOR": "cpu"})
    lines: list[str] = []
    with pytest.raises(KeyboardInterrupt):
        launcher.run_under_launcher(spec, ["--config", CONFIG, "--set", "a=b c"], log=lines.append)
    assert started[0][-2] == launcher.ARGS_FILE
    assert lines[0].endswith(f" --module {launcher.RANK_MODULE} --config {CONFIG} --set a=b c")
