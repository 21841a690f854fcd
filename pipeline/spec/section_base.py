"""What every section of the spec's schema shares: the pydantic base that refuses unknown keys
and wrong types (strict: a quoted "4" is not an int), and the upper bounds on sizes."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

# The output layer scores every token of the vocabulary at every position; far larger
# vocabularies than any tokenizer makes would not fit in an accelerator's memory.
VOCAB_LIMIT = 1 << 24
TASK_SYMBOLS_LIMIT = VOCAB_LIMIT - 2
"""A generated task's symbols: its vocabulary adds a separator and padding to them."""


def check_task_symbols(value: int | None) -> int | None:
    """The validator of a task's `vocab`: at most TASK_SYMBOLS_LIMIT symbols."""
    if value is not None and value > TASK_SYMBOLS_LIMIT:
        raise ValueError(
            f"at most {TASK_SYMBOLS_LIMIT:,} symbols: with the separator and "
            f"padding they are the vocabulary, which the output layer scores at "
            f"every position (the papers' tasks use 20 to 100)"
        )
    return value


# Upper bounds on counts and sizes: a value past them cannot run on any machine (it
# overflows, or asks for more memory than exists), so `validate` refuses it rather than `run`
# failing deep inside. They are far above the papers' settings (batch 64 x 512, 450k steps).
MAX_STEPS = 10**12
MAX_ROWS = 2**20
MAX_SEQ_LEN = 2**20


def check_path(value: str | None) -> str | None:
    """The validator of a field that names a file or folder: a value no path can hold (a NUL
    byte, a name or path too long for any file system) is refused at `validate`."""
    from pipeline.fsutil import path_problem

    if value is not None and (problem := path_problem(value)):
        raise ValueError(problem)
    return value


class Section(BaseModel):
    # Unknown keys are errors; "12" is not an int. YAML already gives us real types.
    # No setting means infinity, and NaN would pass no check (.inf and .nan are YAML floats).
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
