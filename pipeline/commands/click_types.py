"""What the CLI's commands are built from: a file-path type that refuses impossible names, and
command classes that show a user's mistake as one line `error: ...` (`--debug`: the traceback).
"""

from __future__ import annotations

import errno
import os
import sys
from typing import TYPE_CHECKING, cast

import click

from pipeline.errors import Interrupted, PipelineError, did_not_fit, write_cause
from pipeline.redact import mask


def refuse_unusable_name(kind: click.ParamType, value, param, ctx) -> None:
    """The rule of every option or argument that names a file, a folder or a name a path is
    made of (--out, --plot, --output, --checkpoint, --point, CONFIG): a NUL byte, or a value
    (or a part of it between slashes) of only whitespace and control characters, which is a
    shell variable gone wrong rather than a name (`fsutil.blank_problem`, as the spec's path
    fields), is a usage error naming the option, before anything is made."""
    from pipeline.fsutil import blank_problem

    if "\x00" in str(value):
        kind.fail("a file name cannot hold a NUL byte", param, ctx)
    if problem := blank_problem(str(value)):
        kind.fail(problem, param, ctx)


class FilePath(click.Path):
    """click.Path, refusing as a usage error a name no file can have (a NUL byte, a name
    longer than the filesystem allows) or none given on purpose (`refuse_unusable_name`)
    instead of failing wherever it is first used; `~` is expanded, as in every path the
    project reads (`fsutil.user_path`)."""

    def convert(self, value, param, ctx):
        if isinstance(value, str) and value.startswith("~"):
            value = os.path.expanduser(value)
        if str(value) == "":
            self.fail("the file name is empty", param, ctx)
        if str(value) == "-":  # click's standard stream; ours are files and directories
            self.fail("'-' (a standard stream) is not supported here: give a path", param, ctx)
        refuse_unusable_name(self, value, param, ctx)
        try:
            os.stat(value)
        except OSError as e:
            if e.errno == errno.ENAMETOOLONG:
                self.fail(f"{e.strerror}", param, ctx)
        return super().convert(value, param, ctx)


class PathText(click.ParamType):
    """A value that is a path or a name a path is made of, but not only one (`--checkpoint
    latest|best|PATH`, `--point NAME`): text, under the rule of `refuse_unusable_name`. An
    empty value is left to the command, which says what to give instead."""

    name = "text"

    def convert(self, value, param, ctx):
        refuse_unusable_name(self, value, param, ctx)
        return value


class ConfigArgument(FilePath):
    """A config's path, or the name of a config that ships with the package (`enwik8_large`,
    `ablations/text8_n0`), from any directory: a file at the path wins, and where the other
    reading exists too, one line on stderr says which was taken
    (`pipeline.spec.catalog.find_config`). A name not known is one line with the near ones."""

    def convert(self, value, param, ctx):
        from pipeline.spec.catalog import configs, find_config

        if isinstance(value, str) and value.startswith("~"):
            value = os.path.expanduser(value)
        named = isinstance(value, str) and value in configs() and not os.path.isfile(value)
        if not named:  # a path: FilePath's refusals (a NUL byte, too long, a directory) first
            value = super().convert(value, param, ctx)
        found = find_config(str(value))
        if found.note:
            click.echo(f"note: {mask(found.note)}", err=True)
        return found.path


class OneLineUsageError(click.UsageError):
    """A mistake on the command line (a missing argument, an unknown option, a value click
    cannot convert), shown as the one line every other error is, not click's usage block."""

    def __init__(self, error: click.UsageError):
        super().__init__(error.format_message(), error.ctx)

    def show(self, file=None) -> None:
        # one line even where the value quoted holds newlines
        message = " ".join(self.format_message().split()).rstrip(".")
        hint = f" (see {self.ctx.command_path} --help)" if self.ctx else ""
        click.echo(f"error: {mask(message)}{hint}", err=True)


if TYPE_CHECKING:  # a mixin of click's Command and Group: what its super() calls reach
    _Mixin = click.Group
else:
    _Mixin = object


class OneLineErrors(_Mixin):
    """Click's usage errors of a command or group as one line (--help stays click's)."""

    def make_context(self, info_name, args, parent=None, **extra):
        try:
            return super().make_context(info_name, args, parent, **extra)
        except click.exceptions.NoArgsIsHelpError as e:  # a bare group: what it has
            commands = ", ".join(cast(click.Group, e.ctx.command).list_commands(e.ctx))
            raise OneLineUsageError(
                click.UsageError(f"missing command, one of: {commands}", e.ctx)
            ) from None
        except click.UsageError as e:
            raise _one_line(e) from None

    def resolve_command(self, ctx, args):
        try:
            return super().resolve_command(ctx, args)
        except click.UsageError as e:
            raise _one_line(e) from None


def _temporary_dir_line(error: OSError) -> str | None:
    """The one line for tempfile finding no temporary directory it can write, with the
    cause (`fsutil.temporary_dir_failure`): torch and the libraries it imports ask for one
    before a run has written anything, so a run past `ulimit -f` or on a full /tmp ended in
    tempfile's traceback there. None for any other error."""
    from pipeline.fsutil import temporary_dir_failure

    if (failure := temporary_dir_failure(error)) is None:
        return None
    where = f"a temporary file in {failure.filename} (nor in any other temporary directory)"
    if write_cause(failure):
        return str(did_not_fit(failure, where))
    return (
        f"cannot write {where}: {failure.strerror}; set TMPDIR to a directory you can write "
        f"and run again"
    )


def _one_line(error: click.UsageError) -> click.UsageError:
    return error if isinstance(error, OneLineUsageError) else OneLineUsageError(error)


class Command(OneLineErrors, click.Command):
    pass


class Group(OneLineErrors, click.Group):
    command_class = Command


Group.group_class = Group  # `launch` and its commands too


# what a command stopped by a signal outside a pipeline's stages says it left (`Interrupted`)
STOPPED = "the command did not finish; run it again"


class Main(Group):
    """Prints a user's mistake as one line; `--debug` shows the traceback instead. Every
    command runs under `RaiseOnSignal`: a signal ends it with 128 + its number and one line
    (the rule: pipeline.cluster.signals)."""

    def invoke(self, ctx):
        from pipeline.cluster.signals import RaiseOnSignal

        try:
            # the handler stays while an error line is printed: a signal then still wins
            with RaiseOnSignal(after=STOPPED):
                return self._one_line_errors(ctx)
        except Interrupted as e:
            if ctx.params.get("debug"):
                raise
            click.echo(f"error: {mask(str(e))}", err=True)
            sys.exit(e.exit_code)

    def _one_line_errors(self, ctx):
        try:
            return super().invoke(ctx)
        except click.UsageError as e:  # `allattn-pipe --`: no command after the options
            raise _one_line(e) from None
        except PipelineError as e:
            if ctx.params.get("debug"):
                raise
            click.echo(f"error: {mask(str(e))}", err=True)  # a URL's secret never shown
            sys.exit(e.exit_code)
        except OSError as e:
            # a write that did not fit (disk full, quota, past `ulimit -f`) wherever it was
            # made: one line naming the file; any other OSError is a bug with its traceback
            if ctx.params.get("debug"):
                raise
            if (line := _temporary_dir_line(e)) is None and write_cause(e) is None:
                raise
            click.echo(f"error: {mask(line or str(did_not_fit(e)))}", err=True)
            sys.exit(PipelineError.exit_code)
        except KeyboardInterrupt:  # a ctrl-C in a thread of its own (a test's), or a handler's
            if ctx.params.get("debug"):
                raise
            click.echo("error: interrupted (SIGINT)", err=True)
            sys.exit(130)
