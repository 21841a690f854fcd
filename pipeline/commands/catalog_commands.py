"""The commands about what ships with the package: `list` (its dataset cards and configs, one
line each) and `copy` (a config written out as one file to edit). Finding them by name is
`pipeline.spec.catalog`'s."""

from __future__ import annotations

import os
from pathlib import Path

import click

from pipeline.commands.click_types import Command, FilePath
from pipeline.commands.options import CONFIG
from pipeline.errors import PipelineError, shown


@click.command("list", cls=Command)
def list_() -> None:
    """List the dataset cards and the configs that ship with the package, one line each: a
    config runs by its name (`allattn-pipe run enwik8_large`) from any directory, and a card
    is named in a config (`dataset: enwik8`)."""
    from pipeline.resources import project_dir
    from pipeline.spec.catalog import listing

    cards, configs = listing()
    sections = [
        (f"dataset cards (a config's `dataset: NAME`), in {project_dir('datasets')}:", cards),
        (
            f"configs (`allattn-pipe run NAME`; `allattn-pipe copy NAME` writes one out to "
            f"edit), in {project_dir('configs')}:",
            configs,
        ),
    ]
    for i, (title, entries) in enumerate(sections):
        if i:
            click.echo()
        click.echo(title)
        width = max((len(e.name) for e in entries), default=0)
        for e in entries:
            click.echo(f"  {e.name:<{width}}  {e.description}".rstrip())


@click.command(cls=Command)
@CONFIG
@click.argument("dest", required=False, type=FilePath())
def copy(config, dest) -> None:
    """Write CONFIG (a name from `allattn-pipe list`, or a path) to DEST as one file to edit
    and run: its `extends` merged in, so that every key the config sets is in that file and a
    later version of the package changes nothing in it (the keys it leaves to their defaults
    are not written: `allattn-pipe show DEST` prints them). A dataset card stays a name, found
    from any directory. DEST defaults to the config's file name here (a directory: that name
    in it); a file already there is never replaced."""
    from pipeline.spec.catalog import resolved_copy

    source = Path(config)
    target = Path(dest) if dest is not None else Path(source.name)
    if target.is_dir():
        target = target / source.name
    elif dest is not None and dest.endswith(os.sep):
        raise PipelineError(f"{shown(dest)}: no such directory")
    text = resolved_copy(source, str(target), _version())
    _write_new(target, text)
    click.echo(f"wrote {shown(target)}; run it with: allattn-pipe run {shown(target)}")


def _version() -> str:
    from importlib import metadata

    try:
        return metadata.version("allattn-pipe")
    except metadata.PackageNotFoundError:  # a checkout on PYTHONPATH, never installed
        return "from a source checkout"


def _write_new(path: Path, text: str) -> None:
    """`text` in a new file at `path`: created exclusively, so that nothing there (a file, a
    link, whatever appeared since it was checked) is ever replaced."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags, 0o666)
    except FileExistsError:
        raise PipelineError(
            f"{shown(path)}: already exists; copy never replaces a file: give another "
            f"destination, or remove that one"
        ) from None
    except OSError as e:
        raise PipelineError(f"{shown(path)}: cannot write it: {e.strerror or e}") from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        path.unlink(missing_ok=True)  # no half-written config left to be run
        raise
