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
(pipeline.training.checkpoint_io, one `checkpoints/step-N` per epoch's last update N, the
newest KEEP kept) and the stop on SIGTERM or SIGINT (the update ends, a checkpoint is saved)
are the trainer's (pipeline.training.trainer), as for the train stage. An interrupted run
resumes from the newest intact checkpoint and ends exactly as an uninterrupted run would.

Outputs: `checkpoints/`, `resolved.json` (the precision it trains in) and `curriculum.json`
(score, next_length, final_length: the last epoch's length, the per-epoch history).
`evaluate_task` is the evaluate stage for these pipelines: token accuracy at the final
length and longer ones, its results naming the weights they are of by content (`weights`, as
evaluate's do: a re-run curriculum makes them stale).
"""

from __future__ import annotations

from pipeline.fsutil import atomic_write_json, read_json
from pipeline.spec.training_schema import CURRICULUM_ENGINE_TRAIN, CURRICULUM_UNUSED_TRAIN
from pipeline.training.checkpoints import CHECKPOINTS
from pipeline.training.settings import trains_with
from stages.base import Stage, StageContext, without
from stages.train import RUNTIME_ONLY, record_resolved, tag_weights

RESULT = "curriculum.json"
KEEP = 2  # checkpoints kept: the newest may be damaged on disk
EVAL_CASES = 512  # generated cases scored at each length by evaluate
EVAL_BATCH = 128


def run(ctx: StageContext) -> dict:
    from pipeline.training.checkpoints import step_dirs
    from pipeline.training.curriculum import LengthCurriculum
    from pipeline.training.micro_batch import read_record
    from pipeline.training.trainer import Cadence, Trainer

    spec, train = ctx.spec, ctx.spec.train
    cur = spec.dataset.generator.algorithmic.curriculum
    root = ctx.out_dir / CHECKPOINTS
    resuming = bool(step_dirs(root))
    curriculum = LengthCurriculum(spec)
    trainer = Trainer(
        spec,
        curriculum,
        ctx.tracker,
        ctx.log,
        recorded=read_record(ctx.out_dir) if resuming else None,
        stage="curriculum",
        hooks=[curriculum],
    )
    record_resolved(ctx, trainer)
    if resuming:  # the newest intact one, or a refusal if none is
        step = trainer.load(root)
        ctx.log(
            f"resuming after epoch {curriculum.epoch} at length {curriculum.length} (update {step})"
        )
    ctx.tracker.log_params(
        {
            "parameters": trainer.params,
            "vocab_size": trainer.vocab_size,
            "length_step": curriculum.step_by,
        }
    )
    ctx.log(
        f"{curriculum.problem}: {trainer.params:,} parameters ({trainer.model.describe()}), "
        f"vocabulary {trainer.vocab_size}, {cur.epochs} epochs of {cur.steps_per_epoch} "
        f"steps x {train.batch_size} cases on {trainer.device}, from length "
        f"{cur.start_length} by {curriculum.step_by}"
    )
    # reports and validation are the epochs' checks; a checkpoint ends every epoch
    epochs = Cadence(
        log_every=0, eval_every=0, checkpoint_every=cur.steps_per_epoch, keep_checkpoints=KEEP
    )
    summary = trainer.fit(curriculum.updates, root, cadence=epochs)
    tag_weights(ctx, trainer, summary)
    result = curriculum.result(trainer.params)
    atomic_write_json(ctx.out_dir / RESULT, result)
    ctx.tracker.log_artifact(ctx.out_dir / RESULT)
    ctx.tracker.log_metrics(
        {"score": result["score"], "next_length": result["next_length"]}, step=result["epochs"]
    )
    ctx.log(
        f"score {result['score']} (the longest length solved in {result['epochs']} epochs); "
        f"next length {result['next_length']} (the authors' script's reading)"
    )
    # the trainer's count of skipped updates (train.nonfinite: skip) goes on the record too
    skipped = {k: v for k, v in summary.items() if k == "nonfinite_skipped"}
    return {key: value for key, value in result.items() if key != "history"} | skipped


def evaluate_task(ctx: StageContext) -> dict:
    """The evaluate stage of a curriculum pipeline: the score, and token and whole-case
    accuracy of the final checkpoint on EVAL_CASES fresh cases at the final length (the
    last epoch's) and at the lengths of the curriculum's grid (start + k * step) nearest
    above final + 2, + 5, + 10 and 2 x final (generalisation)."""
    import torch

    from pipeline.cluster.device import resolve_device
    from pipeline.data.algorithmic import length_step, vocab_size
    from pipeline.training.checkpoints import WEIGHTS, load_model_weights, weights_id
    from pipeline.training.curriculum import score, stream_seed

    spec = ctx.spec
    task, data_seed = spec.dataset.generator.algorithmic, spec.dataset.generator.seed
    source = ctx.inputs["curriculum"]
    trained = read_json(source / RESULT)
    device = resolve_device(spec.train.device)
    model = _build(spec, vocab_size(task.problem, task.vocab), device)
    tag = load_model_weights(model, source / CHECKPOINTS, ctx.log)
    final, start = trained["final_length"], task.curriculum.start_length
    step_by = length_step(task.problem, task.curriculum.length_step)

    def on_grid(n: int) -> int:  # the curriculum's nearest length at or above n
        return start + -(-(n - start) // step_by) * step_by

    lengths = sorted({final, *(on_grid(n) for n in (final + 2, final + 5, final + 10, 2 * final))})
    results = {
        "checkpoint": f"curriculum/{tag}",
        WEIGHTS: weights_id(source / CHECKPOINTS / tag),
        "problem": task.problem,
        "score": trained["score"],
        "final_length": final,
        "cases": EVAL_CASES,
        "lengths": {},
    }
    # as evaluate tags its run (stages.evaluate.tag_scored), before the scores
    ctx.tracker.set_tags(
        {"checkpoint": results["checkpoint"]}
        | ({WEIGHTS: results[WEIGHTS]} if results[WEIGHTS] else {})
    )
    for length in lengths:
        cases = torch.Generator().manual_seed(stream_seed(data_seed, "evaluate", length))
        correct, total, exact = score(
            model, task.problem, length, EVAL_CASES, cases, task.vocab, device, EVAL_BATCH
        )
        results["lengths"][str(length)] = {
            "accuracy": correct / total,
            "sequence_accuracy": exact / EVAL_CASES,
        }
        ctx.tracker.log_metrics(
            {"accuracy": correct / total, "sequence_accuracy": exact / EVAL_CASES}, step=length
        )
        ctx.log(
            f"length {length:>3}{' (final)' if length == final else '':<8}  token "
            f"accuracy {correct / total:.4f}  cases all right {exact / EVAL_CASES:.4f}"
        )
    ctx.tracker.log_metrics({"score": trained["score"]}, step=0)
    atomic_write_json(ctx.out_dir / "results.json", results)
    ctx.tracker.log_artifact(ctx.out_dir / "results.json")
    ctx.log(f"score {trained['score']} ({task.problem}, checkpoint curriculum/{tag})")
    return results


def _build(spec, vocab: int, device):
    """The spec's model, initialised from train.seed, on `device`."""
    import torch

    torch.manual_seed(spec.train.seed)
    return spec.build_model(vocab, f"dataset {spec.dataset.name}").to(device)


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
    runtime_only={"train.compile": RUNTIME_ONLY["train.compile"]},
    # nonfinite stop: a run it lets finish is the run before the key existed
    added_keys={"train.nonfinite": "stop", "train.nonfinite_limit": 100},
)
