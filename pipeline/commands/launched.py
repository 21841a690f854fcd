"""What each process of a multi-process launch runs (`launch/train.py` calls `main`).

Every launched process runs the same pipeline through the same `Runner`; rank 0 does the
single-process stages and the bookkeeping, all ranks train (see `Runner.run`).
"""

from __future__ import annotations

import argparse
import sys

from pipeline.cluster import distributed
from pipeline.errors import PipelineError, Preempted
from pipeline.spec import load_spec
from pipeline.tracking.tracker import make_tracker
from pipeline.workspace.runner import Runner


def arguments(argv: list[str]) -> list[str]:
    """`argv` with the launcher's encoded arguments (`--args-base64 WORD`, what a multi-node
    launch sends through the remote shell) decoded in place."""
    from pipeline.cluster.launcher import ENCODED_ARGS, decode_args

    out: list[str] = []
    items = iter(argv)
    for item in items:
        if item == ENCODED_ARGS:
            out += decode_args(next(items, ""))
        elif item.startswith(ENCODED_ARGS + "="):
            out += decode_args(item.partition("=")[2])
        else:
            out.append(item)
    return out


def main(argv: list[str] | None = None) -> int:
    """One launched process: the pipeline of --config, this process being one rank."""
    parser = argparse.ArgumentParser(
        prog="launch/train.py",
        description="Run a pipeline as one rank of a multi-process "
        "launch: deepspeed --hostfile hosts launch/train.py --config CFG",
    )
    parser.add_argument("--config", required=True)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--from", dest="start_from", metavar="STAGE")
    parser.add_argument("--only", action="append", default=[], metavar="STAGE")
    parser.add_argument("--force", action="append", default=[], metavar="STAGE")
    parser.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)  # older launchers
    parser.add_argument(
        "--ranks-from-slurm",
        action="store_true",
        help="a task of an srun step: rank and world size from Slurm",
    )
    args = parser.parse_args(arguments(sys.argv[1:] if argv is None else argv))
    rank = 0
    try:
        if args.ranks_from_slurm:
            distributed.take_rank_from_slurm()
        spec = load_spec(args.config, args.overrides)
        rank, _ = distributed.init_process_group()
        runner = Runner(
            spec,
            force=args.force,
            start_from=args.start_from,
            only=args.only,
            log=print if rank == 0 else (lambda m: None),
        )
        runner.run(make_tracker(spec, rank=rank))
    except PipelineError as e:
        if rank == 0 or not isinstance(e, Preempted):  # every rank stops the same way
            print(f"error (rank {rank}): {e}", file=sys.stderr)
        return e.exit_code
    return 0
