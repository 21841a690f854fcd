"""The training stream's epoch boundary, end to end through the Trainer (DeepSpeed, one process).

When the streams run out, the authors' trainer restarts them at a random offset in
[0, seq_len) and zeroes the Transformer-XL cache. Here the offset comes from train.seed, so a
run interrupted before the wrap and resumed from its checkpoint crosses it exactly like the
uninterrupted run. The test preprocesses a corpus of a few hundred bytes (epochs of 5 steps),
then runs this file as a worker process twice: straight through, and resumed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from stages.base import NullStageTracker
from stages.train import plan as train_plan
from tests.fixtures.runs import run_worker
from tests.fixtures.tiny_corpus import ROWS, SEQ_LEN, STEPS, tiny_corpus

ROOT = Path(__file__).resolve().parents[3]

SAVE_AT = 3


def _worker(cfg: Path, preprocess_dir: Path, ckpt: Path, resume: bool, out: Path) -> None:
    """Train to STEPS (from the checkpoint at SAVE_AT if `resume`, else from scratch, saving
    one at SAVE_AT); write per step the loss, whether each micro-batch's cache was all
    zeros when the model got it, and the first input column."""
    import torch

    from pipeline.spec import load_spec
    from pipeline.training.trainer import Trainer
    from pipeline.training.training_data import PreprocessedData

    spec = load_spec(cfg)
    data = PreprocessedData(preprocess_dir, spec.train.seq_len)
    trainer = Trainer(spec, train_plan(spec), data, tracker=NullStageTracker(), log=print)
    seen: list[tuple[bool, list[int]]] = []

    def record(module, args):
        tokens, _, cache = args
        seen.append((all(bool((c == 0).all()) for c in cache), tokens[:, 0].tolist()))

    trainer.model.register_forward_pre_hook(record)
    if resume:
        assert trainer.load(ckpt) == SAVE_AT
    steps = {}
    while trainer.step < STEPS:
        seen.clear()
        step = trainer.step
        loss = float(trainer.train_step())
        steps[step] = {
            "loss": loss,
            "cache_zero": [z for z, _ in seen],
            "first_tokens": [t for _, first in seen for t in first],
        }
        if trainer.step == SAVE_AT and not resume:
            trainer.save(ckpt, keep=1)
    offsets = [trainer.batches.epoch_offset(e) for e in range(4)]
    starts = [s for s in range(STEPS) if trainer.batches.starts_epoch(s)]
    out.write_text(
        json.dumps(
            {
                "steps": steps,
                "offsets": offsets,
                "epoch_starts": starts,
                "stream_len": trainer.batches.stream_len,
            }
        )
    )
    torch.distributed.destroy_process_group()


def test_the_wrap_resets_the_cache_at_a_seeded_offset_and_resumes_exactly(tmp_path):
    from pipeline.data.manifest import load_split

    cfg, pre = tiny_corpus(tmp_path)
    train = load_split(pre, "train")
    ckpt = tmp_path / "checkpoints"
    straight = run_worker(__file__, cfg, pre, ckpt, "straight", tmp_path / "straight.json")
    resumed = run_worker(__file__, cfg, pre, ckpt, "resume", tmp_path / "resumed.json")

    L = straight["stream_len"]
    assert L == len(train) // ROWS
    first_wrap = (L - 1) // SEQ_LEN
    offsets = straight["offsets"]
    assert offsets[0] == 0 and 0 < offsets[1] < SEQ_LEN  # this seed draws a nonzero offset
    wraps = [0, first_wrap, first_wrap + (L - 1 - offsets[1]) // SEQ_LEN]
    assert straight["epoch_starts"] == wraps and wraps[-1] < STEPS
    for step in range(STEPS):
        run = straight["steps"][str(step)]
        # the cache is zero at the first step and at every wrap, never in between
        assert run["cache_zero"] == [step in wraps] * 2, step
        epoch = sum(w <= step for w in wraps) - 1
        pos = offsets[epoch] + (step - wraps[epoch]) * SEQ_LEN
        assert run["first_tokens"] == [int(train[r * L + pos]) for r in range(ROWS)], step

    # resumed at SAVE_AT, before the first wrap: every later loss and cache is the straight
    # run's, exactly
    assert sorted(map(int, resumed["steps"])) == list(range(SAVE_AT, STEPS))
    for step in range(SAVE_AT, STEPS):
        assert resumed["steps"][str(step)] == straight["steps"][str(step)], step


if __name__ == "__main__":
    cfg_path, pre_dir, ckpt_dir, mode, out_path = sys.argv[1:]
    _worker(Path(cfg_path), Path(pre_dir), Path(ckpt_dir), mode == "resume", Path(out_path))
