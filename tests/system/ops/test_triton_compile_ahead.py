"""The Triton kernels compiled for real GPUs on any machine: the interpreter runs what a GPU
compiler could refuse, so each kernel is compiled ahead of time with Triton's own ptxas, in a
process of its own."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_the_kernels_compile_for_hopper_in_bf16_and_ampere_in_fp16():
    """The interpreter runs what a GPU compiler could refuse (layouts, types of constants,
    shared memory): compile every kernel ahead of time with Triton's own ptxas, for an H100
    (sm_90) in bf16 and an A100 (sm_80) in fp16, dropout and mask on, at the default tile.
    In a process of its own: the interpreter's process cannot compile."""
    script = (
        "import sys, torch\n"
        "from pipeline.ops.triton_attention import compile_ahead\n"
        "for cc, dtype in ((90, torch.bfloat16), (80, torch.float16)):\n"
        "    for name, info in compile_ahead(cc, dtype, head_dim=64).items():\n"
        "        print(cc, name, info['shared'], info['registers'], flush=True)\n"
    )
    env = dict(os.environ, TRITON_INTERPRET="0")
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.split("\n")
    for cc in ("90", "80"):
        for kernel in ("forward", "backward dq", "backward dk dv", "backward persistent"):
            assert any(line.startswith(f"{cc} {kernel} ") for line in lines), (cc, kernel)
