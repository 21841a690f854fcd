"""DS_ACCELERATOR naming an accelerator DeepSpeed does not know: one line naming the variable
when the process group starts (DeepSpeed reads it when imported, so a fresh process is
needed); it was a ValueError traceback from deep inside DeepSpeed's import. ~12 s: a fresh
process imports torch and fails to import DeepSpeed."""

from __future__ import annotations

import os
import subprocess
import sys

START_A_GROUP = """
from pipeline.cluster import distributed
from pipeline.errors import PipelineError
try:
    distributed.init_process_group()
except PipelineError as e:
    print(e)
    raise SystemExit(2)
"""


def test_an_accelerator_deepspeed_does_not_know_is_one_line(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    result = subprocess.run(
        [sys.executable, "-c", START_A_GROUP],
        env=dict(env, DS_ACCELERATOR="bogus"),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    line = result.stdout.strip()
    assert "\n" not in line
    assert line.startswith("environment variable DS_ACCELERATOR bogus: DS_ACCELERATOR must be")
    assert line.endswith('Value "bogus" is not supported; unset it to let DeepSpeed choose')
