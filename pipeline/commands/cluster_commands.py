"""The commands that reach a Slurm cluster: `sweep` (a grid run here, or as one job array) and
`launch slurm` (a training job's batch script), with the job options they share and the
careful writing of a script beside a user's files."""

from __future__ import annotations

import contextlib

import click

from pipeline.commands.click_types import Command, FilePath, Group
from pipeline.commands.options import CONFIG, SET, SMOKE, about_option, echo
from pipeline.errors import PipelineError, shown


def SLURM_JOB(command):
    """The options of a Slurm job that `launch slurm` and `sweep --slurm` share."""
    for option in reversed(
        [
            click.option(
                "--procs-per-node",
                type=int,
                help="Slurm: training processes per node (default: one per GPU; "
                "required with --gpus-per-node 0).",
            ),
            click.option("--partition", help="Slurm partition (default: the cluster's)."),
            click.option(
                "--time",
                "time_limit",
                metavar="TIME",
                help="Slurm time limit, e.g. 24:00:00 or 1-00:00:00; the job "
                "checkpoints and requeues itself shortly before it.",
            ),
            click.option(
                "--signal-lead",
                type=int,
                metavar="SECONDS",
                help="Slurm: how long before the time limit the job starts "
                "checkpointing (default 300).",
            ),
            click.option(
                "--cpus-per-task",
                type=int,
                metavar="N",
                help="Slurm: CPUs per training process (default: the node's CPUs per GPU, "
                "or per process on a CPU partition, as sinfo reports them; 1 without sinfo).",
            ),
            click.option("--account", help="Slurm account to charge (default: yours)."),
            click.option("--qos", help="Slurm quality of service (default: the account's)."),
        ]
    ):
        command = option(command)
    return command


@click.command(cls=Command)
@CONFIG
@SET
@click.option(
    "--grid",
    multiple=True,
    metavar="KEY=V1,V2,...",
    help="A spec key and its values; the points are every combination of the "
    "grids (x seeds). Repeatable.",
)
@click.option("--seeds", metavar="S1,S2,...", help="Run every point with each train.seed.")
@click.option(
    "--parallel",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Points run at once, each as its own process.",
)
@click.option(
    "--dry-run",
    is_flag=True,
    help="Print the points and what each would run (with --slurm: the script).",
)
@click.option(
    "--slurm", is_flag=True, help="Submit the sweep as one Slurm job array, a task per point."
)
@click.option(
    "--nodes",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="With --slurm: nodes per point.",
)
@click.option(
    "--gpus-per-node",
    type=int,
    default=1,
    show_default=True,
    help="With --slurm: GPUs per node, one process each; 0 for a CPU partition.",
)
@SLURM_JOB
@click.option(
    "--max-parallel",
    type=click.IntRange(min=1),
    help="With --slurm: at most this many points run at once.",
)
@SMOKE
@click.option("--array-task-prepare", type=int, hidden=True)
@click.option("--array-task-finish", type=int, hidden=True)
def sweep(
    config,
    overrides,
    grid,
    seeds,
    parallel,
    dry_run,
    slurm,
    nodes,
    gpus_per_node,
    procs_per_node,
    partition,
    time_limit,
    signal_lead,
    cpus_per_task,
    account,
    qos,
    max_parallel,
    smoke,
    array_task_prepare,
    array_task_finish,
):
    """Run CONFIG at every point of a grid (x seeds), each its own run name under one MLflow
    run; stages every point shares run once; a re-run skips finished points and resumes
    interrupted ones."""
    from pipeline.commands import sweep as sweeps

    if smoke and (slurm or array_task_prepare is not None or array_task_finish is not None):
        raise PipelineError(
            "--smoke with --slurm: a smoke sweep is a try-out that runs here; "
            "drop --slurm (or --smoke to submit the real sweep)"
        )
    args = (config, list(overrides), list(grid), seeds)
    if array_task_prepare is not None:
        sweeps.prepare_array_task(*args, array_task_prepare, log=echo)
        return
    if array_task_finish is not None:
        sweeps.finish_array_task(*args, array_task_finish, log=echo)
        return
    if slurm:
        _sweep_on_slurm(
            args,
            nodes,
            gpus_per_node,
            procs_per_node,
            partition,
            time_limit,
            signal_lead,
            max_parallel,
            dry_run,
            {"cpus_per_task": cpus_per_task, "account": account, "qos": qos},
        )
        return
    cluster_only = {
        "--nodes": nodes != 1,
        "--gpus-per-node": gpus_per_node != 1,
        "--procs-per-node": procs_per_node,
        "--partition": partition,
        "--time": time_limit,
        "--signal-lead": signal_lead,
        "--cpus-per-task": cpus_per_task is not None,
        "--account": account is not None,
        "--qos": qos is not None,
        "--max-parallel": max_parallel,
    }
    given = [flag for flag, value in cluster_only.items() if value]
    if given:
        raise PipelineError(
            f"{', '.join(given)}: only with --slurm (locally, --parallel "
            f"sets how many points run at once)"
        )
    failed = sweeps.run_sweep(*args, parallel, dry_run, log=echo, smoke=smoke)
    if failed:
        raise PipelineError(f"{len(failed)} sweep points failed: {', '.join(failed)}")


def _sweep_on_slurm(
    args,
    nodes,
    gpus_per_node,
    procs_per_node,
    partition,
    time_limit,
    signal_lead,
    max_parallel,
    dry_run,
    resources: dict,
) -> None:
    from pipeline.cluster.slurm import render_sweep_array, script_values, slurm_dir, submit
    from pipeline.commands import sweep as sweeps

    config, overrides, grid, seeds = args
    script_values(overrides, grid, seeds)  # before the points are planned from them
    # what each point drops, on stderr: a --dry-run's stdout is the script
    points, _, _ = sweeps.plan_sweep(
        str(config), overrides, grid, seeds, log=lambda m: echo(m, err=True)
    )
    script, base = render_sweep_array(
        config,
        overrides,
        grid,
        seeds,
        points,
        nodes,
        gpus_per_node,
        procs_per_node,
        partition=partition,
        time=time_limit,
        max_parallel=max_parallel,
        **resources,
        **({"signal_lead": signal_lead} if signal_lead is not None else {}),
    )
    if dry_run:
        click.echo(script, nl=False)
        return
    path = slurm_dir(base) / f"{base.name}-sweep.sbatch"
    _write_script(path, script, slurm_dir(base) / "logs", submit_hint=False)
    click.echo(f"submitted job array {submit(path)}")


@click.group(cls=Group)
def launch():
    """Run a pipeline's training on a cluster."""


@launch.command()
@CONFIG
@click.option("--nodes", type=int, required=True, help="Nodes to train on.")
@click.option(
    "--gpus-per-node",
    type=int,
    required=True,
    help="GPUs per node, one training process each; 0 for a CPU partition.",
)
@SLURM_JOB
@SET
@click.option("--dry-run", is_flag=True, help="Print the script instead of writing it.")
@click.option(
    "--output",
    type=FilePath(dir_okay=False),
    help="Where to write the script (default <workspace>/<name>/slurm/<name>.sbatch).",
)
def slurm(
    config,
    nodes,
    gpus_per_node,
    procs_per_node,
    partition,
    time_limit,
    signal_lead,
    cpus_per_task,
    account,
    qos,
    overrides,
    dry_run,
    output,
):
    """Render a Slurm batch script that trains CONFIG on NODES x GPUS-PER-NODE processes."""
    from pipeline.cluster.slurm import render_sbatch, slurm_dir
    from pipeline.spec import load_spec

    spec = load_spec(config, list(overrides))
    script = render_sbatch(
        config,
        spec,
        nodes,
        gpus_per_node,
        procs_per_node,
        partition=partition,
        time=time_limit,
        overrides=list(overrides),
        cpus_per_task=cpus_per_task,
        account=account,
        qos=qos,
        **({"signal_lead": signal_lead} if signal_lead is not None else {}),
    )
    if dry_run:
        click.echo(script, nl=False)
        return
    from pipeline.fsutil import user_path  # `..` resolved: nothing made on the way

    path = user_path(output) if output else slurm_dir(spec) / f"{spec.name}.sbatch"
    with about_option("--output"):
        _write_script(path, script, slurm_dir(spec) / "logs")


def _write_script(path, script: str, log_dir, submit_hint: bool = True) -> None:
    """Write a batch script (atomically) and say how to submit it. A script that cannot be
    written leaves nothing behind: the log directory made for it is taken back."""
    from pipeline.fsutil import atomic_write_text

    made: list = []
    try:
        previous = _earlier_script(path)
        # Slurm opens the job's --output file before the script runs: its directory must exist.
        _make_dirs(log_dir, made)
        if previous != script:
            atomic_write_text(path, script)
    except (OSError, UnicodeDecodeError) as e:
        for directory in reversed(made):  # innermost first; each one empty, as it was made
            with contextlib.suppress(OSError):
                directory.rmdir()
        raise PipelineError(
            f"{shown(path)}: cannot write the script: {getattr(e, 'strerror', None) or e}"
        ) from None
    if previous == script:
        click.echo(f"{path}: unchanged")
    else:
        click.echo(f"{path}: {'replaced a different earlier script' if previous else 'written'}")
    if submit_hint:
        click.echo(f"submit with: sbatch {path}")


def _make_dirs(path, made: list) -> None:
    """``path.mkdir(parents=True, exist_ok=True)`` that appends each directory it makes to
    ``made``, outermost first (so that a caller can take them back)."""
    missing = []
    for directory in [path, *path.parents]:
        if directory.is_dir():
            break
        missing.append(directory)
    for directory in reversed(missing):
        directory.mkdir()
        made.append(directory)


def _earlier_script(path) -> str | None:
    """The text of the script at `path` if one is there; only a regular file holding the
    renderer's marker line may be replaced (never the config, a link, a FIFO)."""
    import os
    import stat

    from pipeline.cluster.slurm import MARKER, is_rendered

    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(mode):
        raise PipelineError(
            f"{shown(path)}: not a regular file (a link, a directory, a FIFO); "
            f"refusing to replace it with the script"
        )
    # not through a link swapped in since, and a FIFO is refused rather than waited on
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise PipelineError(f"{shown(path)}: not a regular file")
        text = f.read().decode("utf-8", errors="replace")
    if not is_rendered(text):
        raise PipelineError(
            f"{shown(path)}: not a script allattn-pipe rendered (no {MARKER!r} line); "
            f"refusing to replace it: name a new file, or remove this one"
        )
    return text
