"""What the `allattn-pipe` commands share: the CONFIG argument, --set, --smoke and --point,
and how a command prints its progress and names the option an error is about."""

from __future__ import annotations

import contextlib

import click

from pipeline.commands.click_types import ConfigArgument, PathText
from pipeline.errors import PipelineError

# a config's path, or the name of one the package ships (`allattn-pipe list`)
CONFIG = click.argument("config", type=ConfigArgument(dir_okay=False))
SET = click.option(
    "--set",
    "overrides",
    multiple=True,
    metavar="KEY=VALUE",
    help="Override any key of the spec, e.g. --set train.optimizer.lr=0.05 "
    "(values are typed as YAML: 12 is an int, 0.05 a float). Repeatable.",
)
SMOKE = click.option(
    "--smoke",
    is_flag=True,
    help="A tiny model of the same kind and a few steps of every stage, as "
    "NAME-smoke, in one process on whatever device is here; a downloaded "
    "dataset becomes the built-in corpus (--set dataset=NAME keeps it).",
)

POINT = click.option(
    "--point",
    type=PathText(),
    metavar="NAME",
    help="A point of a sweep of CONFIG, named as the sweep printed it (or by the end of "
    "that name, e.g. mixerconv): its --set and --smoke, which the sweep recorded in the "
    "point's workspace, come before these --set.",
)


def point_sets(config, overrides, point, smoke=False) -> tuple[list[str], bool]:
    """The --set and --smoke of CONFIG's sweep point `point` (if one is named), then
    `overrides`."""
    if point is None:
        return list(overrides), smoke
    from pipeline.commands.sweep_points import point_overrides

    sets, recorded_smoke = point_overrides(config, point, list(overrides), smoke)
    return sets, smoke or recorded_smoke


@contextlib.contextmanager
def about_option(flag: str):
    """A PipelineError raised within names the option whose value it is about."""
    try:
        yield
    except PipelineError as e:
        raise PipelineError(f"{flag} {e}") from None


def echo(message: str, err: bool = False) -> None:
    """How the commands' progress lines are printed: a URL's credentials masked (a point's
    failure, a tracking URI) as in every error line."""
    from pipeline.redact import mask

    click.echo(mask(message), err=err)
