"""What each process of a multi-process launch runs, from the installed package:

    deepspeed --hostfile hosts --module pipeline.commands.launched --config CFG
    srun python -m pipeline.commands.launched --ranks-from-slurm --config CFG

(`allattn-pipe run` and the Slurm script start it so; the checkout's `launch/train.py` runs the
same `main`). Every launched process runs the same pipeline through the same `Runner`; rank 0
does the single-process stages and the bookkeeping, all ranks train (see `Runner.run`).
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback

from pipeline.cluster import distributed
from pipeline.errors import Interrupted, PipelineError, Preempted
from pipeline.redact import mask
from pipeline.spec import load_spec
from pipeline.spec.catalog import config_file
from pipeline.tracking.tracker import make_tracker
from pipeline.workspace.runner import Runner


def arguments(argv: list[str]) -> tuple[list[str], dict[str, str]]:
    """`argv` with the launcher's arguments file (`--args-file PATH`, what a multi-node launch
    names on every node's command line) read in place, and the environment variables that
    file carries (credentials that never go on a command line)."""
    from pipeline.cluster.launcher import ARGS_FILE, read_args_file

    out: list[str] = []
    env: dict[str, str] = {}
    items = iter(argv)
    for item in items:
        if item == ARGS_FILE or item.startswith(ARGS_FILE + "="):
            path = next(items, "") if item == ARGS_FILE else item.partition("=")[2]
            args, carried = read_args_file(path)
            out += args
            env.update(carried)
        else:
            out.append(item)
    return out, env


def main(argv: list[str] | None = None) -> int:
    """One launched process: the pipeline of --config, this process being one rank."""
    parser = argparse.ArgumentParser(
        prog="python -m pipeline.commands.launched",
        description="Run a pipeline as one rank of a multi-process launch: deepspeed "
        "--hostfile hosts --module pipeline.commands.launched --config CFG",
    )
    parser.add_argument("--config", required=True)
    parser.add_argument("--smoke", action="store_true", help="as `allattn-pipe run --smoke`")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--from", dest="start_from", metavar="STAGE")
    parser.add_argument("--only", action="append", default=[], metavar="STAGE")
    parser.add_argument("--force", action="append", default=[], metavar="STAGE")
    parser.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)  # older launchers
    # where `allattn-pipe run` was started: the launcher runs elsewhere (the package's
    # launch/ folder), so that no process it starts has that directory on sys.path
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    parser.add_argument(
        "--ranks-from-slurm",
        action="store_true",
        help="a task of an srun step: rank and world size from Slurm",
    )
    rank, world_size = 0, 1
    try:
        given, env = arguments(sys.argv[1:] if argv is None else argv)
        args = parser.parse_args(given)
        os.environ.update(env)
        if args.workdir:
            os.chdir(args.workdir)
        if args.ranks_from_slurm:
            distributed.take_rank_from_slurm()
        # a config's path, or the name of one of the package's (as `allattn-pipe run` reads it)
        spec = load_spec(config_file(args.config), args.overrides, smoke=args.smoke)
        rank, world_size = distributed.init_process_group()
        runner = Runner(
            spec,
            force=args.force,
            start_from=args.start_from,
            only=args.only,
            log=print if rank == 0 else (lambda m: None),
        )
        runner.run(make_tracker(spec, rank=rank))
    except (PipelineError, Interrupted) as e:
        if rank == 0 or not isinstance(e, Preempted):  # every rank stops the same way
            # masked as a one-process run's error line is (a tracking URI's password)
            print(f"error (rank {rank}): {mask(str(e))}", file=sys.stderr)
        return e.exit_code
    except Exception as e:
        if world_size > 1 and distributed.lost_peer(e):
            # another rank failed and left: its own line says why; this rank's collective
            # only saw the connection close (gloo's 20-line traceback said nothing more)
            print(distributed.stopped_line(rank, world_size), file=sys.stderr)
            return 1
        # a traceback names what it was given (a URL): masked too, on this rank's own
        # output, which a Slurm job's log keeps as it is
        print(mask(traceback.format_exc()).rstrip(), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":  # deepspeed --module, srun python -m: the rank's exit code
    distributed.exit_process(main())
