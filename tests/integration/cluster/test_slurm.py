"""`allattn-pipe launch slurm`: the rendered batch script, parsed and run by bash against fake
scontrol / srun / scancel commands (no Slurm needed), and the renderer's refusals. The real
Slurm runs it in test_cluster.py."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from pipeline.cluster.interpreter import python_module
from pipeline.commands.cli import main
from tests.fixtures.fake_slurm import FAKES

ROOT = Path(__file__).resolve().parents[3]
CONFIG = "configs/enwik8_large.yaml"
JOB_ID = "123456"


# A stand-in for sinfo: prints $FAKE_SINFO's lines ("PARTITION CPUS GRES", as --format=
# "%P %c %G" asks) for the --partition asked, all of them without one; no file: it fails, as
# sinfo does without a controller.
FAKE_SINFO = """\
#!/bin/bash
[ -f "$FAKE_SINFO" ] || { echo "sinfo: fatal: no controller" >&2; exit 1; }
for a in "$@"; do case "$a" in --partition=*) part="${a#--partition=}" ;; esac; done
if [ -n "${part:-}" ]; then grep -E "^$part\\*? " "$FAKE_SINFO"; else cat "$FAKE_SINFO"; fi
"""


@pytest.fixture(autouse=True)
def sinfo(tmp_path_factory, monkeypatch) -> Path:
    """The sinfo rendering asks about the nodes (what it prints: the returned file's lines),
    in place of any real one on this machine; outside tmp_path, which tests check is empty."""
    bin_dir = tmp_path_factory.mktemp("sinfo")
    (bin_dir / "sinfo").write_text(FAKE_SINFO)
    (bin_dir / "sinfo").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_SINFO", str(bin_dir / "sinfo.txt"))
    return bin_dir / "sinfo.txt"


def render(*args: str, workspace: Path | None = None):
    extra = ["--set", f"workspace.root={workspace}"] if workspace else []
    return CliRunner().invoke(main, ["launch", "slurm", *args, *extra])


@pytest.fixture
def project(monkeypatch):
    monkeypatch.chdir(ROOT)  # the config path is relative to the project, as users type it


@pytest.fixture
def cluster(tmp_path):
    """A PATH with the fake commands, a log directory they write to, and the job's env."""
    bin_dir, log = tmp_path / "bin", tmp_path / "log"
    bin_dir.mkdir()
    log.mkdir()
    for name, body in FAKES.items():
        fake = bin_dir / name
        fake.write_text("#!/bin/bash\n" + textwrap.dedent(body))
        fake.chmod(0o755)
    # as a GPU cluster's login shell has it (`make test` exports DS_ACCELERATOR=cpu here)
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    env.update(
        PATH=f"{bin_dir}:{os.environ['PATH']}",
        FAKE_LOG=str(log),
        SLURM_JOB_NODELIST="node[A-B]",
        SLURM_JOB_ID=JOB_ID,
    )
    return env, log


def acceptance_script(tmp_path: Path) -> str:
    result = render(
        CONFIG, "--nodes", "2", "--gpus-per-node", "8", "--dry-run", workspace=tmp_path / "runs"
    )
    assert result.exit_code == 0, result.output
    return result.stdout


def sbatch_options(script: str) -> dict[str, str]:
    return dict(re.findall(r"^#SBATCH --([\w-]+)(?:=(\S+))?$", script, re.MULTILINE))


def test_sbatch_directives(project, tmp_path):
    script = acceptance_script(tmp_path)
    assert script.startswith("#!/bin/bash\n")
    slurm_dir = tmp_path / "runs" / "enwik8_large" / "slurm"
    assert sbatch_options(script) == {
        "job-name": "enwik8_large",
        "nodes": "2",
        "ntasks-per-node": "8",
        "gpus-per-node": "8",
        "cpus-per-task": "1",  # sinfo does not answer here: Slurm's default
        "output": f"{slurm_dir}/logs/%x-%j.out",
        "open-mode": "append",
        "requeue": "",
        "signal": "B:USR1@300",
    }
    # Slurm stops reading directives at the first command.
    first_command = re.search(r"^[^#\n]", script, re.MULTILINE).start()
    assert script.rfind("#SBATCH") < first_command
    assert "DS_ACCELERATOR" not in script


def test_cpus_per_task_account_and_qos_become_sbatch_lines(project, tmp_path):
    flags = ["--cpus-per-task", "6", "--account", "proj_1.a-b", "--qos", "high"]
    launch = render(CONFIG, "--nodes", "2", "--gpus-per-node", "8", *flags, "--dry-run")
    assert launch.exit_code == 0, launch.output
    sweep = CliRunner().invoke(
        main,
        ["sweep", CONFIG, "--seeds", "1,2", "--set", f"workspace.root={tmp_path}"]
        + ["--slurm", "--nodes", "2", "--gpus-per-node", "8", *flags, "--dry-run"],
    )
    assert sweep.exit_code == 0, sweep.output
    for script in (launch.stdout, sweep.stdout):
        options = sbatch_options(script)
        assert options["cpus-per-task"] == "6"
        assert options["account"] == "proj_1.a-b" and options["qos"] == "high"
        # srun of Slurm 22.05-23.02 does not pass the job's --cpus-per-task on by itself
        assert "export SRUN_CPUS_PER_TASK=${SLURM_CPUS_PER_TASK:-1}\n" in script
    assert "account" not in sbatch_options(acceptance_script(tmp_path))
    assert "qos" not in sbatch_options(acceptance_script(tmp_path))


def test_cpus_per_task_comes_from_the_nodes_sinfo_reports(project, tmp_path, sinfo):
    # the default partition (*) has 8-GPU nodes of 128 CPUs, and some with more
    sinfo.write_text("gpu* 128 gpu:h100:8(S:0-1)\ngpu* 256+ gpu:8\ncpu 64 (null)\n")
    gpu = render(CONFIG, "--nodes", "2", "--gpus-per-node", "4", "--dry-run", workspace=tmp_path)
    assert gpu.exit_code == 0, gpu.output
    assert sbatch_options(gpu.stdout)["cpus-per-task"] == "16"  # 128 CPUs / 8 GPUs
    assert "# CPUs per training process: 128 CPUs / 8 GPUs per node of the default" in gpu.stdout
    cpu = render(
        CONFIG,
        *["--nodes", "2", "--gpus-per-node", "0", "--procs-per-node", "4"],
        *["--partition", "cpu", "--dry-run"],
        workspace=tmp_path,
    )
    assert cpu.exit_code == 0, cpu.output
    assert sbatch_options(cpu.stdout)["cpus-per-task"] == "16"  # 64 CPUs / 4 processes
    given = render(
        CONFIG, "--nodes", "2", "--gpus-per-node", "4", "--cpus-per-task", "3", "--dry-run"
    )
    assert sbatch_options(given.stdout)["cpus-per-task"] == "3"


def test_without_sinfo_cpus_per_task_is_slurms_default_and_says_so(project, tmp_path):
    script = acceptance_script(tmp_path)
    assert sbatch_options(script)["cpus-per-task"] == "1"
    assert "sinfo could not say what the default partition's nodes have" in script


def test_a_cpu_partition_asks_for_no_gpu(project, tmp_path):
    result = render(
        CONFIG,
        "--nodes",
        "2",
        "--gpus-per-node",
        "0",
        "--procs-per-node",
        "4",
        "--signal-lead",
        "120",
        "--time",
        "10",
        "--dry-run",
        workspace=tmp_path,
    )
    assert result.exit_code == 0, result.output
    options = sbatch_options(result.stdout)
    assert "gpus-per-node" not in options and "gpu" not in result.stdout.replace("gpus", "")
    assert options["ntasks-per-node"] == "4" and options["signal"] == "B:USR1@120"
    assert "export DS_ACCELERATOR=cpu\n" in result.stdout


def test_partition_and_time(project, tmp_path):
    result = render(
        CONFIG,
        "--nodes",
        "2",
        "--gpus-per-node",
        "8",
        "--partition",
        "gpu",
        "--time",
        "1-00:00:00",
        "--dry-run",
        workspace=tmp_path,
    )
    assert result.exit_code == 0, result.output
    options = sbatch_options(result.stdout)
    assert options["partition"] == "gpu" and options["time"] == "1-00:00:00"


def test_script_starts_every_rank_with_srun(project, tmp_path, cluster):
    env, log = cluster
    script = acceptance_script(tmp_path)
    done = subprocess.run(
        ["bash", "-c", script], env=env, capture_output=True, text=True, timeout=20, check=False
    )
    assert done.returncode == 0, done.stderr

    argv = (log / "srun.argv").read_text().splitlines()
    # the rank's module of the installed package, the job's directory off sys.path: no file
    # of a checkout is needed on the nodes
    assert argv == [
        "--kill-on-bad-exit=1",
        *python_module("pipeline.commands.launched"),
        "--ranks-from-slurm",
        "--config",
        CONFIG,
        "--set",
        f"workspace.root={tmp_path / 'runs'}",
        "--set",
        "train.launcher.nodes=2",
        "--set",
        "train.launcher.procs_per_node=8",
    ]
    port = 20000 + int(JOB_ID) % 10000
    # rank 0's address: the first node's NodeAddr
    assert (log / "srun.env").read_text() == f"10.0.0.7:{port} \n"
    assert (log / "srun.cwd").read_text().strip() == str(ROOT)


def test_spec_the_job_runs_records_its_world_size(project, tmp_path, cluster):
    from pipeline.spec import load_spec

    env, log = cluster
    script = acceptance_script(tmp_path)
    subprocess.run(["bash", "-c", script], env=env, check=True, timeout=20, capture_output=True)
    argv = (log / "srun.argv").read_text().splitlines()
    user_args = argv[argv.index("--ranks-from-slurm") + 1 :]
    config = user_args[user_args.index("--config") + 1]
    sets = [user_args[i + 1] for i, a in enumerate(user_args) if a == "--set"]
    launcher = load_spec(config, sets).train.launcher
    assert (launcher.nodes, launcher.procs_per_node, launcher.world_size) == (2, 8, 16)


@pytest.mark.parametrize("sig, requeued", [(signal.SIGTERM, False), (signal.SIGUSR1, True)])
def test_signal_reaches_the_ranks_and_their_exit_code_comes_back(
    project, tmp_path, cluster, sig, requeued
):
    """SIGTERM (scancel, preemption: Slurm signals every process of the job) or USR1 (time
    limit near: the batch script only, which passes it on with scancel): the ranks get
    SIGTERM, the script waits for their exit code 143; only USR1 requeues."""
    env, log = cluster
    script = acceptance_script(tmp_path)
    # its own process group, so that a failing test can take its fakes down with it
    job = subprocess.Popen(
        ["bash", "-c", script],
        env={**env, "FAKE_RANK": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 10
        while not (log / "rank.pid").exists():
            assert job.poll() is None and time.monotonic() < deadline, job.communicate()
            time.sleep(0.02)
        time.sleep(0.1)
        if sig == signal.SIGTERM:
            os.killpg(job.pid, sig)
        else:
            job.send_signal(sig)
        _, err = job.communicate(timeout=10)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.pid, signal.SIGKILL)
    assert job.returncode == 143, err
    assert (log / "rank").read_text() == "TERM\n"
    scancel = log / "scancel"
    assert (scancel.read_text() if scancel.exists() else "") == (
        f"scancel --signal=TERM {JOB_ID}\n" if requeued else ""
    )
    requeue = log / "scontrol"
    assert (requeue.read_text() if requeue.exists() else "") == (
        f"scontrol requeue {JOB_ID}\n" if requeued else ""
    )


def test_writes_the_script_and_says_how_to_submit(project, tmp_path):
    args = [CONFIG, "--nodes", "2", "--gpus-per-node", "8"]
    path = tmp_path / "enwik8_large" / "slurm" / "enwik8_large.sbatch"
    first = render(*args, workspace=tmp_path)
    assert first.exit_code == 0, first.output
    assert first.output == f"{path}: written\nsubmit with: sbatch {path}\n"
    assert path.read_text() == render(*args, "--dry-run", workspace=tmp_path).stdout
    assert (path.parent / "logs").is_dir()  # Slurm needs it before the job starts

    assert render(*args, workspace=tmp_path).output.startswith(f"{path}: unchanged\n")
    changed = render(*args, "--time", "2:00:00", workspace=tmp_path)
    assert changed.output.startswith(f"{path}: replaced a different earlier script\n")
    assert "#SBATCH --time=2:00:00" in path.read_text()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--nodes", "0", "--gpus-per-node", "8"], "--nodes must be at least 1, got 0"),
        (
            ["--nodes", "2", "--gpus-per-node", "-1"],
            "--gpus-per-node must be 0 (a CPU partition) or more, got -1",
        ),
        (
            ["--nodes", "2", "--gpus-per-node", "0"],
            "--gpus-per-node 0 (a CPU partition) needs --procs-per-node",
        ),
        (
            ["--nodes", "2", "--gpus-per-node", "8", "--procs-per-node", "4"],
            "--procs-per-node 4 with --gpus-per-node 8: each process trains on one GPU",
        ),
        (
            ["--nodes", "2", "--gpus-per-node", "8", "--time", "10", "--signal-lead", "600"],
            "--time 10: the job is asked to checkpoint 600 s before its time limit",
        ),
        (
            ["--nodes", "2", "--gpus-per-node", "8", "--time", "24h"],
            "--time '24h': not a Slurm time limit",
        ),
        (
            ["--nodes", "2", "--gpus-per-node", "8", "--time", "5"],
            "--time 5: the job is asked to checkpoint 300 s before its time limit",
        ),
        (
            ["--nodes", "3", "--gpus-per-node", "8"],
            (
                "train.batch_size 64 is not divisible by 3 nodes x 8 processes "
                "x 1 gradient accumulation steps = 24"
            ),
        ),
        (
            [
                "--nodes",
                "2",
                "--gpus-per-node",
                "8",
                "--set",
                "train.micro_batch_size=null",
                "--set",
                "train.deepspeed.gradient_accumulation_steps=8",
            ],
            (
                "train.batch_size 64 is not divisible by 2 nodes x 8 processes "
                "x 8 gradient accumulation steps = 128"
            ),
        ),
        (
            ["--nodes", "2", "--gpus-per-node", "8", "--set", "stages=[download,preprocess]"],
            "has no train stage",
        ),
        (
            ["--nodes", "2", "--gpus-per-node", "8", "--cpus-per-task", "0"],
            "--cpus-per-task must be at least 1, got 0",
        ),
        (
            ["--nodes", "2", "--gpus-per-node", "8", "--account", "a b"],
            "--account 'a b': not a Slurm account name; only ASCII letters, digits and _.-",
        ),
        (
            ["--nodes", "2", "--gpus-per-node", "8", "--qos", "$(touch x)"],
            "--qos '$(touch x)': not a Slurm QOS name",
        ),
        (
            ["--nodes", "2", "--gpus-per-node", "8", "--account", "a\nb"],
            "--account a\\nb: control characters (newline, tab, ...) cannot go into",
        ),
    ],
)
def test_refuses_with_a_clear_message(project, args, message):
    result = render(CONFIG, *args, "--dry-run")
    assert result.exit_code == 2
    assert result.stdout == ""
    assert message in result.stderr


def test_missing_config_fails_in_one_line(project):
    result = render("configs/nope.yaml", "--nodes", "2", "--gpus-per-node", "8", "--dry-run")
    assert result.exit_code == 2
    assert result.stderr == (
        "error: configs/nope.yaml: no such file, nor a config of the package by that name "
        "(`allattn-pipe list` names them all)\n"
    )


@pytest.mark.parametrize(
    "time_limit, seconds",
    [
        ("90", 5400),
        ("90:30", 5430),
        ("24:00:00", 86400),
        ("1-12", 129600),
        ("1-00:30", 88200),
        ("1-00:00:00", 86400),
    ],
)
def test_slurm_time_formats(time_limit, seconds):
    from pipeline.cluster.slurm import time_limit_seconds

    assert time_limit_seconds(time_limit) == seconds


def test_sweep_slurm_dry_run_is_one_array_of_the_points(project, tmp_path):
    result = CliRunner().invoke(
        main,
        [
            "sweep",
            CONFIG,
            "--grid",
            "train.optimizer.lr=0.05,0.07",
            "--seeds",
            "1,2",
            "--set",
            f"workspace.root={tmp_path}",
            "--slurm",
            "--nodes",
            "2",
            "--gpus-per-node",
            "8",
            "--max-parallel",
            "3",
            "--dry-run",
        ],
    )
    assert result.exit_code == 0, result.output
    script = result.stdout
    options = sbatch_options(script)
    assert options["array"] == "0-3%3" and options["job-name"] == "enwik8_large-sweep"
    assert options["output"].endswith("/logs/%x-%A_%a.out")
    assert (
        "    2) POINT=(--set workspace.root=" in script
        and "--set train.optimizer.lr=0.07 --set train.seed=1 --set "
        "name=enwik8_large-lr0.07-seed1 --set tracking.experiment=enwik8_large) ;;"
        in script
    )
    assert '--array-task-prepare "$SLURM_ARRAY_TASK_ID"' in script
    assert '--array-task-finish "$SLURM_ARRAY_TASK_ID"' in script
    # the job's working directory off sys.path: no module planted there is imported
    steps = [line for line in script.splitlines() if "pipeline.commands.cli sweep" in line]
    assert len(steps) == 2 and all(f"{sys.executable} -P -m pipeline" in s for s in steps)
    assert not list(tmp_path.iterdir())  # a dry run writes nothing


def test_cluster_options_without_slurm_are_refused(project):
    result = CliRunner().invoke(
        main, ["sweep", CONFIG, "--seeds", "1,2", "--nodes", "2", "--max-parallel", "2"]
    )
    assert result.exit_code == 2
    assert result.stderr == (
        "error: --nodes, --max-parallel: only with --slurm (locally, "
        "--parallel sets how many points run at once)\n"
    )
    slurm_only = ["--cpus-per-task", "4", "--account", "p", "--qos", "q"]
    result = CliRunner().invoke(main, ["sweep", CONFIG, "--seeds", "1,2", *slurm_only])
    assert result.exit_code == 2
    assert result.stderr.startswith("error: --cpus-per-task, --account, --qos: only with --slurm")


def test_ranks_from_slurm_outside_an_srun_step_is_one_line(project, monkeypatch, capsys):
    from pipeline.commands.launched import main as rank_main

    for var in (
        "SLURM_PROCID",
        "SLURM_LOCALID",
        "SLURM_NTASKS",
        "SLURM_NTASKS_PER_NODE",
        "MASTER_ADDR",
        "MASTER_PORT",
    ):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("SLURM_PROCID", "0")
    assert rank_main(["--ranks-from-slurm", "--config", CONFIG]) == 2
    assert capsys.readouterr().err == (
        "error (rank 0): --ranks-from-slurm: SLURM_LOCALID, SLURM_NTASKS, "
        "SLURM_NTASKS_PER_NODE, MASTER_ADDR, MASTER_PORT not set; this process is not a task "
        "of an srun step started by the Slurm script\n"
    )


def test_several_nodes_without_slurm_need_a_hostfile(project):
    from pipeline.cluster.launcher import launcher_command
    from pipeline.errors import PipelineError
    from pipeline.spec import load_spec

    spec = load_spec(CONFIG, ["train.launcher.nodes=2", "train.launcher.procs_per_node=8"])
    with pytest.raises(
        PipelineError,
        match="train.launcher.nodes 2: the deepspeed launcher needs train.launcher.hostfile",
    ):
        launcher_command(spec, [])
