"""Errors that are the user's to fix: the CLI prints them as one clear message, no traceback."""


class PipelineError(Exception):
    """Bad input or a refused action; the message says what and where."""
