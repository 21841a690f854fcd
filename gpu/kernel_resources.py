"""What each Triton attention kernel asks of a GPU, counted without one: compiled ahead of time
for a compute capability (Triton's own ptxas), per tile of TILES.

    python -m gpu.kernel_resources [--cc 90] [--dtype bf16] [--head-dim 64]

Prints, per kernel and tile: shared memory (KiB), registers per thread and the bytes each
thread spills to local memory (cuobjdump), and whether it fits an H100's 227 KiB of shared
memory per block. Spills and shared memory are the CPU-side signs of a slow tile; the tile
actually used is the fastest on the GPU (pipeline.ops.triton_attention). Runs in a process
without Triton's interpreter (it sets TRITON_INTERPRET=0 for itself). Asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ["TRITON_INTERPRET"] = "0"  # before triton is imported: compile, do not interpret

import torch

from pipeline.ops.triton_attention import TILES, compile_ahead

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
SHARED_LIMIT = 227 * 1024  # H100 / H200: the most shared memory one block may use


def rows(cc: int, dtype: torch.dtype, head_dim: int):
    for tile in TILES:
        start = time.perf_counter()
        found = compile_ahead(cc, dtype, head_dim, tile)
        took = time.perf_counter() - start
        for kernel, info in found.items():
            fits = "yes" if info["shared"] <= SHARED_LIMIT else "**no**"
            yield (
                f"| {kernel} | {tile['T']} | {tile['num_warps']} | {tile['num_stages']} | "
                f"{info['shared'] / 1024:.1f} | {info['registers']} | {info['spilled']} | "
                f"{fits} | {took:.0f} |"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cc", type=int, default=90, help="compute capability (90: H100)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--head-dim", type=int, default=64)
    args = parser.parse_args()
    print(
        f"Triton attention kernels for sm_{args.cc}, {args.dtype}, d_h {args.head_dim}, "
        "dropout and span mask on\n"
    )
    print("| kernel | T | warps | stages | shared KiB | registers | spilled B | fits | s |")
    print("|---|---:|---:|---:|---:|---:|---:|---|---:|")
    for row in rows(args.cc, DTYPES[args.dtype], args.head_dim):
        print(row, flush=True)


if __name__ == "__main__":
    main()
