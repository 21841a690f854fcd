"""Errors that are the user's to fix: the CLI prints them as one clear message, no traceback."""

import errno
import os


class PipelineError(Exception):
    """Bad input or a refused action; the message says what and where."""

    exit_code = 2


class Preempted(PipelineError):
    """Training stopped on a signal after saving a checkpoint; a re-run resumes from it."""

    exit_code = 143  # 128 + SIGTERM, what a scheduler expects of a job it terminated


class Interrupted(BaseException):
    """A command stopped by SIGTERM / SIGINT / SIGHUP outside the training loop (or, `at_once`,
    anywhere on a second signal): raised where the program is, with nothing saved mid-way.
    Exits 128 + the signal's number, as a shell does (pipeline.cluster.signals says when).

    A BaseException, as KeyboardInterrupt is: it arrives between any two lines, so a handler
    written for the errors of what it wraps (`except Exception`: a request that failed, a
    file that did not parse) must never take it for one of those and carry on. `after`: what
    the command that stopped left, and what to do now."""

    def __init__(
        self, signal_name: str, signal_number: int, at_once: bool = False, after: str | None = None
    ):
        if at_once:
            after = after or (
                "run the pipeline again to resume from the last checkpoint or redo the stage"
            )
            message = f"stopped at once by a second signal ({signal_name}): nothing more was saved"
        else:
            after = after or (
                "the stage that was running is left unfinished; run the pipeline again to redo it"
            )
            message = f"stopped by {signal_name}"
        super().__init__(f"{message}; {after}" if at_once else f"{message}: {after}")
        self.signal_name = signal_name
        self.exit_code = 128 + signal_number


def shown(value) -> str:
    """A value as an error line shows it (a path, a key, a name the user gave): control
    characters escaped, so that one holding a newline never breaks the one-line error."""
    text = str(value)
    return text if text.isprintable() else repr(text)[1:-1]


# A write that did not fit, by errno: the cause as every error line words it, and what the
# user can do. EFBIG is a file past `ulimit -f` (RLIMIT_FSIZE; Python ignores SIGXFSZ, so the
# write fails instead of killing the process) or past the filesystem's largest file (FAT32's
# 4 GiB).
WRITE_FAILURES = {
    errno.ENOSPC: ("disk full", "free space"),
    errno.EDQUOT: ("disk quota exceeded", "free space within your quota"),
    errno.EFBIG: (
        "file larger than this filesystem or ulimit -f allows",
        "raise `ulimit -f` or use a filesystem that takes larger files",
    ),
}


def write_cause(error: BaseException) -> str | None:
    """The cause in words when `error` is a write that did not fit (disk full, quota, file
    too large); None for any other error."""
    if isinstance(error, OSError) and error.errno in WRITE_FAILURES:
        return WRITE_FAILURES[error.errno][0]
    return None


def write_hint(error: OSError) -> str:
    """What to do about a write `write_cause` named."""
    return WRITE_FAILURES[error.errno or 0][1]


def did_not_fit(error: OSError, path=None) -> PipelineError:
    """The one line for a write that did not fit: the file (`path`, else the one the error
    names), the cause, and that nothing published was replaced by a part of it. Every file
    the pipeline publishes is written whole to a temporary name and renamed into place, so
    what was there before is as it was."""
    where = path if path is not None else error.filename
    strerror = error.strerror or os.strerror(error.errno or 0)
    return PipelineError(
        f"cannot write {shown(where) if where is not None else 'a file'}: "
        f"{write_cause(error)} ({strerror}); nothing already written was replaced: "
        f"{write_hint(error)} and run again"
    )
