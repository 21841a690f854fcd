"""The `allattn-pipe` command: parse, call the engine, print."""

from __future__ import annotations

import click

from pipeline.commands.catalog_commands import copy, list_
from pipeline.commands.click_types import FilePath, Main, PathText
from pipeline.commands.cluster_commands import launch, sweep
from pipeline.commands.options import CONFIG, POINT, SET, SMOKE, about_option, echo, point_sets
from pipeline.errors import PipelineError


@click.group(cls=Main, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--debug", is_flag=True, help="Show full tracebacks for errors.")
def main(debug: bool) -> None:
    """Staged YAML pipelines for long-context attention language models:
    download -> preprocess -> train -> finetune -> evaluate, tracked in MLflow."""
    from pipeline.cluster.distributed import drop_inherited_group

    # a command is one process, never a rank of the launch its environment may describe (a
    # torchrun step, a training pod): it would wait at that launch's rendezvous for hours
    inherited = drop_inherited_group()
    size = inherited.get("WORLD_SIZE", "")
    if size.isdigit() and int(size) > 1:
        echo(
            f"note: ignoring {', '.join(sorted(inherited))} from the environment (a launch of "
            f"{int(size)} processes): allattn-pipe runs as one process and starts the ranks "
            f"that train.launcher asks for itself (`allattn-pipe launch slurm` on Slurm)",
            err=True,
        )


@main.command()
@CONFIG
@SET
@click.option(
    "--from",
    "start_from",
    metavar="STAGE",
    help="Re-run STAGE and every stage after it; earlier ones run only if needed.",
)
@click.option(
    "--only",
    multiple=True,
    metavar="STAGE[,STAGE]",
    help="Run only these stages (if out of date); the others are left as they are.",
)
@click.option(
    "--force",
    multiple=True,
    metavar="STAGE",
    help="Re-run STAGE even if up to date (and so everything reading its output), "
    "discarding the checkpoints of an interrupted run of it.",
)
@click.option("--dry-run", is_flag=True, help="Print what would run and why; run nothing.")
@SMOKE
@POINT
def run(config, overrides, start_from, only, force, dry_run, smoke, point):
    """Run the pipeline CONFIG, skipping stages whose outputs are up to date."""
    from pipeline.spec.quick import workspace_of
    from pipeline.workspace.lock import busy_message, holder

    overrides, smoke = point_sets(config, overrides, point, smoke)
    # the workspace read off the file before the spec's validation imports torch, so that a
    # second run on a busy workspace is refused within a fraction of a second of starting
    named = workspace_of(config, overrides, smoke)
    if not dry_run and named is not None and (busy := holder(named)) is not None:
        raise PipelineError(busy_message(named, busy))
    from pipeline.spec import load_spec
    from pipeline.tracking.tracker import make_tracker
    from pipeline.workspace.runner import Runner

    spec = load_spec(config, list(overrides), smoke=smoke, log=echo)
    runner = Runner(spec, force=list(force), start_from=start_from, only=list(only))
    # asked before anything slow (MLflow's store, the launcher's processes), which a run on a
    # busy workspace would only sit through to be refused by the lock
    busy = holder(spec.workspace_dir)
    if dry_run:
        click.echo(f"workspace {spec.workspace_dir}")
        if busy is not None:
            click.echo(f"  in use by another run ({busy}): a run now would be refused")
        for step in runner.plan():
            click.echo(f"  {step.stage:<11} {step.action:<5} {step.describe()}")
        return
    if busy is not None:
        raise PipelineError(busy_message(spec.workspace_dir, busy))
    from pipeline.fsutil import writable_dir

    writable_dir(spec.workspace_dir, "workspace")  # before MLflow's store is made in it
    if runner.needs_launcher():
        from pipeline.cluster.launcher import run_under_launcher

        make_tracker(spec).check(spec)  # here, not after every process has started

        args = [
            "--config",
            config,
            *(["--smoke"] if smoke else []),  # each rank loads the spec this process loaded
            *_repeat("--set", overrides),
            *_repeat("--only", only),
            *_repeat("--force", force),
            *_repeat("--from", [start_from] if start_from else []),
        ]
        run_under_launcher(spec, args)
        return
    runner.run(make_tracker(spec))


@main.command()
@CONFIG
@SET
def sync(config, overrides):
    """Send the tracking records a run kept while its MLflow server was down."""
    from pipeline.spec import load_spec
    from pipeline.tracking.tracker import sync as sync_backlog

    sync_backlog(load_spec(config, list(overrides)), log=echo)


def _is_file(name: str) -> bool:
    """Whether a compare target names a file; an experiment's name may be no possible one."""
    from pathlib import Path

    try:
        return Path(name).is_file()
    except (OSError, ValueError):  # too long, or a NUL byte
        return False


def _repeat(flag: str, values) -> list[str]:
    return [item for v in values for item in (flag, v)]


@main.command()
@CONFIG
@SET
@SMOKE
def validate(config, overrides, smoke):
    """Check CONFIG (and its extends, dataset card and overrides) without running anything."""
    from pipeline.spec import load_spec

    spec = load_spec(config, list(overrides), smoke=smoke, log=echo)
    click.echo(f"{config}: valid ({spec.name}: {', '.join(spec.stages)})")


@main.command()
@CONFIG
@SET
@SMOKE
@click.option(
    "--estimate",
    is_flag=True,
    help="Also print the cost: tokens per stage, the memory per GPU, a step timed here, "
    "H100 / H200 hours.",
)
def show(config, overrides, smoke, estimate):
    """Print the fully resolved spec and the model's parameter count."""
    import yaml

    from pipeline.commands.report import parameter_report
    from pipeline.spec import load_spec

    # the substitution's line on stderr: stdout stays the spec's YAML
    spec = load_spec(config, list(overrides), smoke=smoke, log=lambda m: echo(m, err=True))
    click.echo(yaml.safe_dump(spec.resolved(), sort_keys=False).rstrip())
    click.echo()
    click.echo(parameter_report(spec))
    if spec.paper:
        from pipeline.commands.compare import paper_line

        click.echo(paper_line(spec.paper))
    if estimate:
        from pipeline.commands.estimate import estimate_report

        click.echo(estimate_report(spec, progress=lambda m: echo(m, err=True)))


@main.command()
@click.argument("targets", nargs=-1, metavar="[CONFIG | EXPERIMENT | RUN_ID]...")
@SET
@click.option(
    "--metric",
    "metrics",
    multiple=True,
    metavar="M",
    help="Show this metric (repeatable; default: every final metric logged).",
)
@click.option(
    "--filter",
    "filter_string",
    default="",
    metavar="EXPR",
    help="MLflow search syntax, e.g. \"params.train.seed = '2'\" or "
    '"metrics.test_bpc < 1.5": a pipeline run is kept when it or one of '
    "its stage runs matches.",
)
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["table", "markdown", "csv", "json"]),
    default="table",
    show_default=True,
)
@click.option(
    "--plot",
    type=FilePath(dir_okay=False),
    metavar="FILE.png",
    help="Also draw the runs' learning curves (train loss, valid bpc by step, "
    "tokens and wall-clock) into FILE.png, and log it to their sweep's run.",
)
@click.option(
    "--point",
    "points",
    type=PathText(),
    multiple=True,
    metavar="NAME",
    help="Only this point of a sweep of the CONFIG given, named as the sweep printed it "
    "(or by the end of that name); repeatable.",
)
def compare(targets, overrides, metrics, filter_string, fmt, plot, points):
    """Pipeline runs side by side from the MLflow store: seeds grouped (mean ± std, n),
    published results beside ours, columns equal in every row folded into a header line."""
    import re

    from pipeline.commands import compare as cmp
    from pipeline.redact import mask
    from pipeline.spec import load_spec
    from pipeline.tracking.store import open_existing_store

    if plot:
        from pipeline.commands.plots import check_replaceable
        from pipeline.fsutil import user_path
        from pipeline.training.head_maps import image_format

        plot = str(user_path(plot))  # `..` resolved: nothing made beside the picture
        # a name no picture can have, or a file compare did not draw, is refused before the
        # queries (and checked again when the picture is written)
        with about_option("--plot"):
            image_format(plot)
            check_replaceable(plot)
    configs = [t for t in targets if _is_file(t)]
    if points and len(configs) != 1:
        raise PipelineError(
            f"--point names a point of the sweep of one CONFIG argument; {len(configs)} given"
        )
    specs, experiments, run_ids = [], [], []
    matched = list(overrides)  # the keys whose values a run must have: the points' too
    for target in targets:
        if _is_file(target) and points:
            for name in points:
                sets, smoke = point_sets(target, overrides, name)
                specs.append(load_spec(target, sets, smoke=smoke))
                # `~KEY` removes rather than sets; the name is matched as the run's name
                matched += [
                    o for o in sets if not o.startswith(("~", "name=")) and o not in matched
                ]
        elif _is_file(target):
            specs.append(load_spec(target, list(overrides)))
        elif re.fullmatch(r"[0-9a-f]{32}", target):
            run_ids.append(target)
        else:
            experiments.append(target)
    if overrides and not specs:
        raise PipelineError("--set applies to a CONFIG argument; none was given")
    client = open_existing_store(cmp.store_uri(specs))
    rows = cmp.collect(client, specs, experiments, run_ids, filter_string, matched)
    groups = cmp.group(rows)
    # runs recorded before URLs were masked still hold their secrets: never printed
    click.echo(mask(cmp.render(groups, cmp.metric_names(groups, metrics), fmt)))
    if plot and rows:
        from pipeline.commands.plots import curves, learning_curves

        data = {row.name: curves(client, row) for row in rows}
        with about_option("--plot"):
            learning_curves(data, plot)
        sweeps = {row.sweep for row in rows}
        if len(sweeps) == 1 and None not in sweeps:
            client.log_artifact(sweeps.pop(), plot)
        click.echo(f"learning curves: {plot}", err=True)


CHECKPOINT = click.option(
    "--checkpoint",
    type=PathText(),
    default="latest",
    show_default=True,
    metavar="latest|best|PATH",
    help="latest: finetune's last (else train's); best: the best "
    "validation's; or a checkpoint directory.",
)


@main.command()
@CONFIG
@SET
@CHECKPOINT
@click.option("--prompt", required=True, help="The text to continue.")
@click.option(
    "--tokens",
    type=click.IntRange(min=1),
    default=200,
    show_default=True,
    help="How many tokens to generate.",
)
@click.option(
    "--temperature",
    type=click.FloatRange(min=0),
    default=1.0,
    show_default=True,
    help="Softmax temperature; 0 picks the most likely token.",
)
@click.option("--top-k", type=click.IntRange(min=1), help="Draw from the K most likely only.")
@click.option(
    "--seed",
    # what torch's generator takes (a 64-bit seed, signed or not)
    type=click.IntRange(min=-(2**63), max=2**64 - 1),
    default=0,
    show_default=True,
)
@POINT
def sample(config, overrides, checkpoint, prompt, tokens, temperature, top_k, seed, point):
    """Continue PROMPT with CONFIG's trained language model (through its cache)."""
    from pipeline.commands.sample import sample as generate_text
    from pipeline.spec import load_spec

    overrides, smoke = point_sets(config, overrides, point)
    spec = load_spec(config, overrides, smoke=smoke, log=lambda m: echo(m, err=True))
    for text in generate_text(
        spec,
        checkpoint,
        prompt,
        tokens,
        temperature,
        top_k,
        seed,
        log=lambda m: echo(m, err=True),
    ):
        click.echo(text, nl=False)
    click.echo()


@main.command()
@CONFIG
@SET
@CHECKPOINT
@click.option(
    "--out",
    required=True,
    type=FilePath(file_okay=False),
    help="The directory to write (model.safetensors, config.json, vocab.json).",
)
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["native", "hf"]),
    default="native",
    show_default=True,
    help="native: this package's files (load_exported); hf: a folder Hugging Face "
    "transformers loads without this package (AutoModelForCausalLM.from_pretrained(DIR, "
    "trust_remote_code=True); writing it needs no transformers).",
)
@click.option(
    "--register",
    metavar="NAME",
    help="Also register the export as a new version of model NAME in MLflow's model "
    "registry, in the tracking store of CONFIG's runs (tracking must be on): "
    "its files are logged by an 'export' run under the pipeline's run, with "
    "the resolved config and evaluate's results; the version is tagged with "
    "the checkpoint and the headline numbers.",
)
@POINT
def export(config, overrides, checkpoint, out, fmt, register, point):
    """Write CONFIG's trained weights as safetensors, with the model config and vocabulary
    as JSON: `pipeline.commands.export.load_exported(DIR)` loads them into the plain torch model."""
    from pipeline.commands.export import export as write_export
    from pipeline.spec import load_spec

    overrides, smoke = point_sets(config, overrides, point)
    spec = load_spec(config, overrides, smoke=smoke, log=echo)
    client = None
    if register is not None:  # refused before anything is written
        from pipeline.tracking.registry import check_registrable

        client = check_registrable(spec, register)
    exported = write_export(spec, out, checkpoint, log=echo, fmt=fmt)
    if register is not None:
        from pipeline.tracking.registry import register as register_export

        register_export(spec, out, register, exported, client, log=echo)


@main.command()
def stages():
    """List the stage kinds and what each does."""
    from stages import STAGES

    for stage in STAGES.values():
        reads = ", ".join(i if isinstance(i, str) else " or ".join(i) for i in stage.inputs)
        click.echo(f"{stage.name:<11} {stage.summary}")
        click.echo(f"{'':<11} reads: {reads or 'nothing'}")


main.add_command(sweep)
main.add_command(launch)
main.add_command(list_)
main.add_command(copy)


def entry() -> None:
    """The console script: `main`, then `distributed.exit_process` with its exit code (tests
    call `main` in-process, where exiting the interpreter is not ours to do). A signal is
    handled from here on, not only once `Main.invoke` has begun: one that came while click
    read the arguments ended the command without a word. Once the exit is decided, a signal
    changes nothing (`unheeded_once_decided`)."""
    import sys

    from pipeline.cluster import distributed
    from pipeline.cluster.signals import RaiseOnSignal, unheeded_once_decided
    from pipeline.commands.click_types import STOPPED
    from pipeline.errors import Interrupted

    code: object = 0
    unheeded_once_decided()  # what the handler below leaves in place as it ends
    try:
        with RaiseOnSignal(after=STOPPED):
            main()
    except SystemExit as e:
        code = e.code
    except Interrupted as e:
        if sys.argv[1:2] == ["--debug"]:
            raise
        echo(f"error: {e}", err=True)
        code = e.exit_code
    distributed.exit_process(code)


if __name__ == "__main__":
    entry()
