"""The `allattn-pipe` command: parse, call the engine, print."""

from __future__ import annotations

import sys

import click

from pipeline.errors import PipelineError

CONFIG = click.argument("config", type=click.Path(dir_okay=False))
SET = click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
                   help="Override any key of the spec, e.g. --set train.optimizer.lr=0.05 "
                        "(values are typed as YAML: 12 is an int, 0.05 a float). Repeatable.")


class Main(click.Group):
    """Prints a user's mistake as one line; `--debug` shows the traceback instead."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except PipelineError as e:
            if ctx.params.get("debug"):
                raise
            click.echo(f"error: {e}", err=True)
            sys.exit(e.exit_code)


@click.group(cls=Main, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--debug", is_flag=True, help="Show full tracebacks for errors.")
def main(debug: bool) -> None:
    """Staged YAML pipelines for long-context attention language models:
    download -> preprocess -> train -> finetune -> evaluate, tracked in MLflow."""


@main.command()
@CONFIG
@SET
@click.option("--from", "start_from", metavar="STAGE",
              help="Re-run STAGE and every stage after it; earlier ones run only if needed.")
@click.option("--only", multiple=True, metavar="STAGE[,STAGE]",
              help="Run only these stages (if out of date); the others are left as they are.")
@click.option("--force", multiple=True, metavar="STAGE",
              help="Re-run STAGE even if up to date (and so everything reading its output).")
@click.option("--dry-run", is_flag=True, help="Print what would run and why; run nothing.")
def run(config, overrides, start_from, only, force, dry_run):
    """Run the pipeline CONFIG, skipping stages whose outputs are up to date."""
    from pipeline.runner import Runner
    from pipeline.spec import load_spec
    from pipeline.tracking import make_tracker

    spec = load_spec(config, list(overrides))
    runner = Runner(spec, force=list(force), start_from=start_from, only=list(only))
    if dry_run:
        click.echo(f"workspace {spec.workspace_dir}")
        for step in runner.plan():
            click.echo(f"  {step.stage:<11} {step.action:<5} {step.reason}")
        return
    runner.run(make_tracker(spec))


@main.command()
@CONFIG
@SET
def validate(config, overrides):
    """Check CONFIG (and its extends, dataset card and overrides) without running anything."""
    from pipeline.spec import load_spec

    spec = load_spec(config, list(overrides))
    click.echo(f"{config}: valid ({spec.name}: {', '.join(spec.stages)})")


@main.command()
@CONFIG
@SET
def show(config, overrides):
    """Print the fully resolved spec and the model's parameter count."""
    import yaml

    from pipeline.report import parameter_report
    from pipeline.spec import load_spec

    spec = load_spec(config, list(overrides))
    click.echo(yaml.safe_dump(spec.resolved(), sort_keys=False).rstrip())
    click.echo()
    click.echo(parameter_report(spec))


@main.command()
def stages():
    """List the stage kinds and what each does."""
    from stages import STAGES

    for stage in STAGES.values():
        reads = ", ".join(i if isinstance(i, str) else " or ".join(i) for i in stage.inputs)
        click.echo(f"{stage.name:<11} {stage.summary}")
        click.echo(f"{'':<11} reads: {reads or 'nothing'}")


if __name__ == "__main__":
    main()
