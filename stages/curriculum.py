"""curriculum: the active-memory paper's length curriculum on an algorithmic task
(docs/papers.md#active-memory-tasks), trained by the one trainer.

Training starts at `start_length`. An epoch is `steps_per_epoch` Adam updates, each on a fresh
batch of `train.batch_size` generated cases; after it, `check_cases` fresh cases are scored
without dropout, and at `promote_accuracy` token accuracy (the paper: 100%) the length grows
by `length_step` (2 for add and mult, else 1). After `epochs` epochs two readings of the
result are recorded: `score`, the longest length solved (0 if none), the paper's (its "104 is
the maximum" on not: 100 epochs from 5 solve 5..104), and `next_length`, the length the
curriculum would train next (longest solved + step; the start length if none was solved),
which is what the authors' script prints as "Maximum Sequence Size". Metrics per epoch
(step = epoch): length, accuracy, loss.

The lengths, promotions and history are a hook of the trainer
(pipeline.training.curriculum.LengthCurriculum); the updates (train.optimizer, its clipping,
train.nonfinite), the learning-rate schedule over all the epochs' updates, the checkpoints
(pipeline.training.engine_checkpoints, one `checkpoints/step-N` per epoch's last update N, the
newest KEEP kept) and the stop on SIGTERM or SIGINT (the update ends, a checkpoint is saved)
are the trainer's (pipeline.training.trainer), as for the train stage. An interrupted run
resumes from the newest intact checkpoint and ends exactly as an uninterrupted run would.

Outputs: `checkpoints/`, `resolved.json` (the precision it trains in) and `curriculum.json`
(score, next_length, final_length: the last epoch's length, the per-epoch history).
The evaluate stage scores these pipelines by stages/task_evaluation.py: token accuracy at the
final length and longer ones.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

from pipeline.fsutil import atomic_write_json
from pipeline.spec.training_schema import CURRICULUM_ENGINE_TRAIN, CURRICULUM_UNUSED_TRAIN
from pipeline.training.settings import trains_with
from stages.base import Stage, StageContext, without
from stages.task_evaluation import RESULT
from stages.training import TRAINER_RUNTIME_ONLY, finish, log_params, start

if TYPE_CHECKING:
    from pipeline.training.curriculum import LengthCurriculum

KEEP = 2  # checkpoints kept: the newest may be damaged on disk


def plan(spec):
    """epochs x steps_per_epoch updates on generated cases, train.optimizer's schedule over
    them all; the lengths, checks and promotions are a hook (LengthCurriculum); no reports
    or validation (the epochs' checks are), a checkpoint at every epoch's end."""
    from pipeline.training.curriculum import LengthCurriculum
    from pipeline.training.optim import LrSchedule
    from pipeline.training.plan import Cadence, Tokens, TrainingPlan

    cur, batch = spec.dataset.generator.algorithmic.curriculum, spec.train.batch_size
    updates = cur.epochs * cur.steps_per_epoch
    how = (
        f"{cur.epochs} epochs x {cur.steps_per_epoch} updates x {batch} cases x at "
        f"least {cur.start_length} tokens (start_length; the length grows as the "
        f"cases are solved)"
    )
    return TrainingPlan(
        name="curriculum",
        updates=updates,
        lr=LrSchedule.of(spec.train.optimizer, updates),
        cadence=Cadence(
            log_every=0, eval_every=0, checkpoint_every=cur.steps_per_epoch, keep_checkpoints=KEEP
        ),
        tokens=Tokens(updates, updates * batch * cur.start_length, how, at_least=True),
        data=lambda inputs: LengthCurriculum(spec, "curriculum"),
        # its own vocabulary
        timing_data=lambda vocab_size, origin: LengthCurriculum(spec, "curriculum"),
        hooks=lambda curriculum: [cast(LengthCurriculum, curriculum)],
    )


def run(ctx: StageContext) -> dict:
    spec, train = ctx.spec, ctx.spec.train
    cur = spec.dataset.generator.algorithmic.curriculum
    started = start(ctx, plan(spec))
    trainer, curriculum = started.trainer, cast("LengthCurriculum", started.trainer.data)
    if started.resumed:
        ctx.log(
            f"resuming after epoch {curriculum.epoch} at length {curriculum.length} "
            f"(update {trainer.step})"
        )
    log_params(ctx, trainer, {"length_step": curriculum.step_by})
    ctx.log(
        f"{curriculum.problem}: {trainer.params:,} parameters ({trainer.model.describe()}), "
        f"vocabulary {trainer.vocab_size}, {cur.epochs} epochs of {cur.steps_per_epoch} "
        f"steps x {train.batch_size} cases on {trainer.device}, from length "
        f"{cur.start_length} by {curriculum.step_by}"
    )
    summary = finish(ctx, started, head_tables=False)
    result = record_result(ctx, curriculum.result(trainer.params))
    # the trainer's count of skipped updates (train.nonfinite: skip) goes on the record too
    skipped = {k: v for k, v in summary.items() if k == "nonfinite_skipped"}
    return {key: value for key, value in result.items() if key != "history"} | skipped


def record_result(ctx: StageContext, result: dict) -> dict:
    """curriculum.json, the score and next length as metrics, and the line saying them."""
    atomic_write_json(ctx.out_dir / RESULT, result)
    ctx.tracker.log_artifact(ctx.out_dir / RESULT)
    ctx.tracker.log_metrics(
        {"score": result["score"], "next_length": result["next_length"]}, step=result["epochs"]
    )
    ctx.log(
        f"score {result['score']} (the longest length solved in {result['epochs']} epochs); "
        f"next length {result['next_length']} (the authors' script's reading)"
    )
    return result


def config(spec) -> dict:
    """What the trainer trains with (pipeline.training.settings.trains_with: a train.* key
    added to the schema counts here unless declared below), less the keys a curriculum has no
    use for, which the trainer reads at their defaults under it (Spec.inert_keys), and the
    generated task."""
    unused = [*CURRICULUM_UNUSED_TRAIN, *CURRICULUM_ENGINE_TRAIN]
    return without(trains_with(spec), unused) | {
        "task": spec.dataset.generator.model_dump(mode="json")
    }


STAGE = Stage(
    name="curriculum",
    summary="Train on a generated algorithmic task with the length curriculum; resumable.",
    inputs=(),
    section_key="train",
    config=config,
    run=run,
    plan=plan,
    runtime_only={"train.compile": TRAINER_RUNTIME_ONLY["train.compile"]},
    # nonfinite stop: a run it lets finish is the run before the key existed
    added_keys={"train.nonfinite": "stop", "train.nonfinite_limit": 100},
)
