"""Errors that are the user's to fix: the CLI prints them as one clear message, no traceback."""


class PipelineError(Exception):
    """Bad input or a refused action; the message says what and where."""
    exit_code = 2


class Preempted(PipelineError):
    """Training stopped on a signal after saving a checkpoint; a re-run resumes from it."""
    exit_code = 143   # 128 + SIGTERM, what a scheduler expects of a job it terminated
