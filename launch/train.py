"""The checkout's distributed entry point, kept so that a launch written by hand goes on
working:

    deepspeed --hostfile hosts launch/train.py --config configs/enwik8_large.yaml

It runs the rank's entry point of the installed package, `pipeline.commands.launched`, which
`allattn-pipe run` and the Slurm script start as a module (`deepspeed --module
pipeline.commands.launched ...`, `python -m pipeline.commands.launched ...`), so that an
installed package needs no checkout: see that module for the arguments.

It imports the installed package (`pip install -e .` in the checkout), never the folder it
sits in: an interpreter without the package gets one line saying so, exit 2.
"""

import sys

try:
    from pipeline.cluster import distributed
    from pipeline.commands.launched import main
except ModuleNotFoundError as error:
    if (error.name or "").partition(".")[0] != "pipeline":
        raise
    print(
        f"error: allattn-pipe is not installed in this interpreter ({sys.executable}): run "
        f"`{sys.executable} -m pip install -e .` in the source checkout",
        file=sys.stderr,
    )
    sys.exit(2)

if __name__ == "__main__":
    distributed.exit_process(main())
