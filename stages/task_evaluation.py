"""The evaluate stage of an algorithmic task's pipeline (stages/evaluate.py hands it over
when the curriculum is among its inputs): token and whole-case accuracy at the curriculum's
final length and longer ones, its results naming the weights they are of by content
(`weights`, as evaluate's do: a re-run curriculum makes them stale). Not a stage of its own.
"""

from __future__ import annotations

from pipeline.fsutil import atomic_write_json, read_json
from stages.base import StageContext
from stages.training import CHECKPOINTS

RESULT = "curriculum.json"  # the curriculum stage's result (stages/curriculum.py writes it)
EVAL_CASES = 512  # generated cases scored at each length
EVAL_BATCH = 128


def evaluate_task(ctx: StageContext) -> dict:
    """The evaluate stage of a curriculum pipeline: the score, and token and whole-case
    accuracy of the final checkpoint on EVAL_CASES fresh cases at the final length (the
    last epoch's) and at the lengths of the curriculum's grid (start + k * step) nearest
    above final + 2, + 5, + 10 and 2 x final (generalisation)."""
    import torch

    from pipeline.cluster.device import resolve_device
    from pipeline.data.algorithmic import length_step, vocab_size
    from pipeline.training.checkpoint_dirs import WEIGHTS, load_model_weights, weights_id
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
