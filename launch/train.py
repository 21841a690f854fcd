"""The distributed entry point: one launched process of a pipeline.

    deepspeed --hostfile hosts launch/train.py --config configs/enwik8_large.yaml

Every process runs the pipeline of --config as one rank: rank 0 downloads, preprocesses,
tracks and evaluates; all ranks train. `allattn-pipe run` starts this itself when the spec's
`train.launcher` asks for more than one process.

It imports the installed package (`pip install -e .` in the checkout), never the folder it
sits in: an interpreter without the package gets one line saying so, exit 2. `run` starts
the launcher in this folder with the working directory off `sys.path` and tells each rank
where to work (`--workdir`); with several nodes the arguments and credentials come in a
file (`--args-file`, see pipeline/cluster/launcher.py `Launch`).
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
