"""Run in a checkout of the code whose checkpoint is kept: a train stage of the tiny corpus
for 4 steps, checkpointing at 2 and 4; what a run stopped after step 2 leaves is copied out."""

import shutil
import sys
from pathlib import Path

from pipeline.spec import load_spec
from stages import STAGES, StageContext
from stages.base import NullStageTracker
from tests.fixtures.tiny_corpus import tiny_corpus

tmp, out = Path(sys.argv[1]), Path(sys.argv[2])
cfg, pre = tiny_corpus(tmp)
spec = load_spec(
    cfg,
    ["train.steps=4", "train.checkpoint_every=2", "train.keep_checkpoints=2", "train.log_every=1"],
)
train_out = tmp / "train.partial"
STAGES["train"].run(
    StageContext(
        spec=spec,
        out_dir=train_out,
        inputs={"preprocess": pre},
        tracker=NullStageTracker(),
        log=print,
    )
)
shutil.copytree(train_out, out, ignore=shutil.ignore_patterns("spans*"))
