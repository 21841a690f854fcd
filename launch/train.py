"""The distributed entry point: one launched process of a pipeline.

    deepspeed --hostfile hosts launch/train.py --config configs/enwik8_large.yaml

Every process runs the pipeline of --config as one rank: rank 0 downloads, preprocesses,
tracks and evaluates; all ranks train. `allattn-pipe run` starts this itself when the spec's
`train.launcher` asks for more than one process.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a source checkout

from pipeline.cluster import distributed
from pipeline.commands.launched import main

if __name__ == "__main__":
    distributed.exit_process(main())
