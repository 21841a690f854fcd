"""launch/train.py in an interpreter that cannot import allattn-pipe (the deepspeed launcher
running it from a checkout nobody installed): one line that says what to do, exit 2, no
traceback. It imports the installed package and never the folder beside it
(tests/unit/test_launch_imports.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ENTRY = Path(__file__).resolve().parents[3] / "launch" / "train.py"


def test_an_interpreter_without_the_package_gets_one_line_and_exit_2(tmp_path):
    # -S: no site-packages, so neither the editable install nor anything else is importable;
    # run from elsewhere, with no PYTHONPATH, as a launcher on a fresh node would.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run(
        [sys.executable, "-S", str(ENTRY), "--config", "x.yaml"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    assert result.stderr == (
        f"error: allattn-pipe is not installed in this interpreter ({sys.executable}): run "
        f"`{sys.executable} -m pip install -e .` in the source checkout\n"
    )
    assert not any(tmp_path.iterdir())
