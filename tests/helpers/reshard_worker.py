"""One rank of tests/training/test_reshard.py's check of pipeline.training.reshard.load_engine on
DeepSpeed engines.

    reshard_worker.py OUT.json CKPT_ROOT PHASE...     (RANK, WORLD_SIZE, ... set by the test)

For every configuration of tests/helpers/dist_optim_worker.py named below, on the toy model there,
with ClippedAdagrad. The global batch is two rows (one per rank in 2 processes, both in 1):
- phase `fresh`: train STEPS steps, checkpoint after step SAVE into CKPT_ROOT/<config>/<world>;
- phase `resume`: load the checkpoint the other world size wrote and train the steps after it.
Rank 0 writes {config: {phase: [fp32 masters after each recorded step]}} as JSON (or, for a
refused configuration, {"refused": message}).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from dist_optim_worker import CLIP, CONFIGS, EPS, LR, SHAPES, Toy, data, fp32_master

from pipeline.cluster import distributed

NAMES = ["zero0", "zero1", "zero2", "zero3", "zero0_bf16", "zero2_bf16"]
STEPS, SAVE, ROWS = 4, 2, 2


def batch(step: int, rank: int, world: int, bf16: bool) -> dict[str, torch.Tensor]:
    """This rank's rows' data. The toy loss is quadratic in the data, so the gradient of the
    mean of several rows' data is the mean of their gradients: what the ranks average."""
    mine = range(rank * ROWS // world, (rank + 1) * ROWS // world)
    rows = [data(step, row, bf16) for row in mine]
    return {k: sum(r[k] for r in rows) / len(rows) for k in SHAPES}


def engine_for(name: str):
    import deepspeed

    from pipeline.training.engine import bind_to_engine
    from pipeline.training.optim import ClippedAdagrad

    torch.manual_seed(0)
    model = Toy()
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1 << 30,
    } | CONFIGS[name]
    optimizer = ClippedAdagrad(model.parameters(), lr=LR, clip_norm=CLIP, eps=EPS)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    bind_to_engine(engine)
    return engine


def train(engine, name: str, steps: range, rank: int, world: int, save: Path | None) -> list:
    from pipeline.training.engine import before_save_checkpoint

    bf16 = "bf16" in CONFIGS[name]
    params = dict(engine.module.p.items())
    masters = []
    for step in steps:
        engine.backward(engine(batch(step, rank, world, bf16)))
        engine.step()
        masters.append({k: fp32_master(engine, k, p).view(-1).tolist() for k, p in params.items()})
        if save is not None and step + 1 == SAVE:
            before_save_checkpoint(engine)
            engine.save_checkpoint(str(save), tag="ckpt", save_latest=False)
    return masters


def main() -> None:
    from pipeline.errors import PipelineError
    from pipeline.training.reshard import load_engine

    rank, world = distributed.init_process_group()
    out, root, phases = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]
    other = ROWS // world  # the world size that wrote the checkpoint to resume
    results = {}
    for name in NAMES:
        results[name] = {}
        if "fresh" in phases:
            results[name]["fresh"] = train(
                engine_for(name), name, range(STEPS), rank, world, save=root / name / str(world)
            )
        if "resume" in phases:
            engine = engine_for(name)
            try:
                load_engine(engine, root / name / str(other), "ckpt", other)
            except PipelineError as e:
                results[name]["refused"] = str(e)
                continue
            results[name]["resume"] = train(
                engine, name, range(SAVE, STEPS), rank, world, save=None
            )
    if rank == 0:
        out.write_text(json.dumps(results))


if __name__ == "__main__":
    main()
    distributed.exit_process(0)
