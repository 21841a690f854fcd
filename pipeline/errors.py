"""Errors that are the user's to fix: the CLI prints them as one clear message, no traceback."""


class PipelineError(Exception):
    """Bad input or a refused action; the message says what and where."""

    exit_code = 2


class Preempted(PipelineError):
    """Training stopped on a signal after saving a checkpoint; a re-run resumes from it."""

    exit_code = 143  # 128 + SIGTERM, what a scheduler expects of a job it terminated


class Interrupted(Preempted):
    """A stage stopped on SIGTERM / SIGINT outside the training loop, with nothing saved
    mid-stage (or, `at_once`, any stage on a second signal): a re-run redoes the stage, or
    resumes training from its last checkpoint. Exits 128 + the signal's number, as a shell
    does."""

    def __init__(self, signal_name: str, signal_number: int, at_once: bool = False):
        super().__init__(
            f"stopped at once by a second signal ({signal_name}): nothing more was saved; run "
            f"the pipeline again to resume from the last checkpoint or redo the stage"
            if at_once
            else f"stopped by {signal_name}: the stage that was running is left unfinished; run "
            f"the pipeline again to redo it"
        )
        self.exit_code = 128 + signal_number


def shown(value) -> str:
    """A value as an error line shows it (a path, a key, a name the user gave): control
    characters escaped, so that one holding a newline never breaks the one-line error."""
    text = str(value)
    return text if text.isprintable() else repr(text)[1:-1]
