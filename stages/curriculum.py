"""curriculum: the active-memory paper's length curriculum on an algorithmic task
(docs/papers.md#active-memory-tasks).

Training starts at `start_length`. An epoch is `steps_per_epoch` Adam updates, each on a fresh
batch of `train.batch_size` generated cases; after it, `check_cases` fresh cases are scored
without dropout, and at `promote_accuracy` token accuracy (the paper: 100%) the length grows
by `length_step` (2 for add and mult, else 1). After `epochs` epochs two readings of the
result are recorded: `score`, the longest length solved (0 if none), the paper's (its "104 is
the maximum" on not: 100 epochs from 5 solve 5..104), and `next_length`, the length the
curriculum would train next (longest solved + step; the start length if none was solved),
which is what the authors' script prints as "Maximum Sequence Size". Metrics per epoch
(step = epoch): length, accuracy, loss.

One process: the paper's task model is small. Its updates are the train stage's
(pipeline.training.trainer.EngineUpdates on an engine from its build_engine: Adam in float32,
no ZeRO, train.optimizer's clipping, the train.nonfinite guard), so a fix to the update
reaches both; what is the curriculum's own is the lengths, the promotion and the history.
Every epoch ends with a checkpoint `checkpoints/step-<epoch>` (model, Adam state, curriculum
history), written aside and renamed into place with checksums once the metrics logged before
it are durable; SIGTERM or SIGINT ends the current epoch, saves it and stops. An interrupted
run resumes from the newest intact checkpoint and ends exactly as an uninterrupted run would:
each epoch's batches and dropout are drawn from streams seeded by (seed, epoch), so no RNG
state needs carrying over.

Outputs: `checkpoints/` and `curriculum.json` (score, next_length, final_length: the last
epoch's length, the per-epoch history).
`evaluate_task` is the evaluate stage for these pipelines: token accuracy at the final
length and longer ones.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

from pipeline.errors import PipelineError
from pipeline.fsutil import atomic_write_json, read_json
from stages.base import Stage, StageContext

CHECKPOINTS = "checkpoints"
RESULT = "curriculum.json"
STATE = "state.pt"
KEEP = 2  # checkpoints kept: the newest may be damaged on disk
EVAL_CASES = 512  # generated cases scored at each length by evaluate
EVAL_BATCH = 128


def stream_seed(seed: int, purpose: str, epoch: int) -> int:
    """A seed for one epoch's draws of one kind (train batches, the check, dropout):
    independent streams that a resumed run re-creates from the epoch number alone."""
    digest = hashlib.sha256(f"{seed}:{purpose}:{epoch}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def run(ctx: StageContext) -> dict:
    import torch

    from pipeline.cluster.device import resolve_device
    from pipeline.cluster.signals import StopSignal
    from pipeline.data.algorithmic import length_step, vocab_size
    from pipeline.errors import Preempted
    from pipeline.training.engine import stepped_optimizer
    from pipeline.training.trainer import EngineUpdates, build_guard

    spec, train = ctx.spec, ctx.spec.train
    task, data_seed = spec.dataset.generator.algorithmic, spec.dataset.generator.seed
    cur = task.curriculum
    step_by = length_step(task.problem, cur.length_step)
    vocab = vocab_size(task.problem, task.vocab)
    device = resolve_device(train.device)
    engine = _engine(spec, vocab, device)
    model, optimizer = engine.module, stepped_optimizer(engine)
    root = ctx.out_dir / CHECKPOINTS
    state = {"epoch": 0, "length": cur.start_length, "history": []}
    if (tag := _newest(root, ctx.log)) is not None:
        state = _load(root / tag, model, optimizer)
        ctx.log(f"resuming after epoch {state['epoch']} at length {state['length']}")
    params = sum(p.numel() for p in model.parameters())
    ctx.tracker.log_params({"parameters": params, "vocab_size": vocab, "length_step": step_by})
    ctx.log(
        f"{task.problem}: {params:,} parameters ({model.describe()}), vocabulary {vocab}, "
        f"{cur.epochs} epochs of {cur.steps_per_epoch} steps x {train.batch_size} cases "
        f"on {device}, from length {cur.start_length} by {step_by}"
    )
    # train.nonfinite and the update itself: the train stage's (pipeline.training.trainer)
    guard = build_guard(train, "curriculum", device, engine, ctx.tracker, rank=0)
    # fp32 throughout (DeepSpeed casts nothing): the bounded parameters' values are float32
    bounded = [p.detach().clone() for p, _, _ in model.bounded_parameters()]
    updates = EngineUpdates(engine, guard, bounded)
    guard.start(state["epoch"] * cur.steps_per_epoch)
    # SIGTERM / SIGINT (a preemption, ctrl-C) ends the epoch, which is then saved
    with StopSignal() as stop:
        for epoch in range(state["epoch"] + 1, cur.epochs + 1):
            length = state["length"]
            loss = _train_epoch(updates, ctx.spec, epoch, length, device)
            # before anything reads the epoch's result or saves it
            guard.read_and_check(model.parameters(), epoch * cur.steps_per_epoch)
            check = torch.Generator().manual_seed(stream_seed(data_seed, "check", epoch))
            correct, total, _ = score(
                model, task.problem, length, cur.check_cases, check, task.vocab, device
            )
            accuracy = correct / total
            solved = accuracy >= cur.promote_accuracy
            state["history"].append(
                {
                    "epoch": epoch,
                    "length": length,
                    "loss": loss,
                    "accuracy": accuracy,
                    "solved": solved,
                }
            )
            if solved:
                state["length"] = length + step_by
            state["epoch"] = epoch
            metrics = {"length": length, "accuracy": accuracy, "loss": loss}
            ctx.tracker.log_metrics({k: v for k, v in metrics.items() if v is not None}, step=epoch)
            ctx.log(
                f"epoch {epoch:>3}  length {length:>3}  "
                f"loss {'-' if loss is None else f'{loss:.4f}'}  accuracy "
                f"{accuracy:.4f}{'  solved' if solved else ''}"
            )
            # the metrics logged up to the checkpoint are kept: a resumed run logs none again
            ctx.tracker.make_durable()
            _save(root, epoch, model, optimizer, state)
            if stop.received:
                raise Preempted(
                    f"{stop.received} in epoch {epoch}: its checkpoint is saved; run the "
                    f"pipeline again to resume from it"
                )
    result = {
        "problem": task.problem,
        "score": best_length(state["history"]),
        "next_length": state["length"],
        "final_length": state["history"][-1]["length"],
        "epochs": state["epoch"],
        "parameters": params,
        "history": state["history"],
    }
    atomic_write_json(ctx.out_dir / RESULT, result)
    ctx.tracker.log_artifact(ctx.out_dir / RESULT)
    ctx.tracker.log_metrics(
        {"score": result["score"], "next_length": result["next_length"]}, step=state["epoch"]
    )
    ctx.log(
        f"score {result['score']} (the longest length solved in {state['epoch']} epochs); "
        f"next length {result['next_length']} (the authors' script's reading)"
    )
    skipped = {"nonfinite_skipped": guard.skipped} if train.nonfinite == "skip" else {}
    return {
        key: result[key]
        for key in ("problem", "score", "next_length", "final_length", "epochs", "parameters")
    } | skipped


def _train_epoch(updates, spec, epoch: int, length: int, device) -> float | None:
    """Epoch `epoch`'s updates at `length`, its batches and dropout drawn from the epoch's
    own streams; returns their mean loss (the model's objective), None when train.nonfinite
    skip skipped every one."""
    import torch

    from pipeline.data.algorithmic import generate
    from pipeline.training.engine import param_groups
    from pipeline.training.optim import scheduled_lr

    train, opt = spec.train, spec.train.optimizer
    task, cur = spec.dataset.generator.algorithmic, spec.dataset.generator.algorithmic.curriculum
    torch.manual_seed(stream_seed(train.seed, "dropout", epoch))
    batches = torch.Generator().manual_seed(
        stream_seed(spec.dataset.generator.seed, "train", epoch)
    )
    updates.model.train()
    loss_sum = torch.zeros((), device=device)
    applied = 0  # updates not skipped (train.nonfinite: skip)
    for i in range(cur.steps_per_epoch):
        update = (epoch - 1) * cur.steps_per_epoch + i + 1
        for group in param_groups(updates.engine):
            group["lr"] = scheduled_lr(
                opt.lr, opt.warmup_steps, update, opt.schedule, cur.epochs * cur.steps_per_epoch
            )
        x, y = generate(task.problem, length, train.batch_size, batches, task.vocab)
        x, y = x.to(device), y.to(device)
        (step,) = updates.run(lambda: [updates.micro_batch(x, y)])  # noqa: B023 (run calls it now)
        if not updates.guard.skipped_last:
            loss_sum += step.objective
            applied += 1
    return loss_sum.item() / applied if applied else None


def best_length(history: list[dict]) -> int:
    """The curriculum's score: the longest length solved, 0 if none was."""
    return max((h["length"] for h in history if h["solved"]), default=0)


def score(
    model,
    problem: str,
    length: int,
    cases: int,
    generator,
    vocab: int | None,
    device,
    batch: int | None = None,
) -> tuple[int, int, int]:
    """(correct tokens, tokens, fully correct cases) of `cases` fresh cases at `length`,
    scored in eval mode (no dropout), `batch` cases at a time (default: all at once)."""
    import torch

    from pipeline.data.algorithmic import generate

    was_training = model.training
    model.eval()
    correct = total = exact = 0
    with torch.no_grad():
        for start in range(0, cases, batch or cases):
            rows = min(batch or cases, cases - start)
            x, y = generate(problem, length, rows, generator, vocab)
            y = y.to(device)
            hit = model(x.to(device)).logits.argmax(-1) == y
            correct += int(hit.sum())
            total += y.numel()
            exact += int(hit.all(dim=1).sum())
    model.train(was_training)
    return correct, total, exact


def evaluate_task(ctx: StageContext) -> dict:
    """The evaluate stage of a curriculum pipeline: the score, and token and whole-case
    accuracy of the final checkpoint on EVAL_CASES fresh cases at the final length (the
    last epoch's) and at the lengths of the curriculum's grid (start + k * step) nearest
    above final + 2, + 5, + 10 and 2 x final (generalisation)."""
    import torch

    from pipeline.cluster.device import resolve_device
    from pipeline.data.algorithmic import length_step, vocab_size

    spec = ctx.spec
    task, data_seed = spec.dataset.generator.algorithmic, spec.dataset.generator.seed
    source = ctx.inputs["curriculum"]
    trained = read_json(source / RESULT)
    device = resolve_device(spec.train.device)
    model = _build(spec, vocab_size(task.problem, task.vocab), device)
    tag = _newest(source / CHECKPOINTS, ctx.log)
    if tag is None:
        raise PipelineError(f"no checkpoint under {source / CHECKPOINTS}")
    _load(source / CHECKPOINTS / tag, model)
    final, start = trained["final_length"], task.curriculum.start_length
    step_by = length_step(task.problem, task.curriculum.length_step)

    def on_grid(n: int) -> int:  # the curriculum's nearest length at or above n
        return start + -(-(n - start) // step_by) * step_by

    lengths = sorted({final, *(on_grid(n) for n in (final + 2, final + 5, final + 10, 2 * final))})
    results = {
        "checkpoint": f"curriculum/{tag}",
        "problem": task.problem,
        "score": trained["score"],
        "final_length": final,
        "cases": EVAL_CASES,
        "lengths": {},
    }
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


def _engine(spec, vocab: int, device):
    """The spec's model in a one-process DeepSpeed engine built as the train stage builds
    its own (pipeline.training.trainer.build_engine): Adam, float32, no ZeRO,
    train.optimizer's clipping."""
    from pipeline.cluster import distributed
    from pipeline.training.ds_config import deepspeed_config
    from pipeline.training.trainer import build_engine

    distributed.init_process_group()  # a group of one: DeepSpeed needs one
    train = spec.train
    config = deepspeed_config(train, 1, micro_batch_size=train.batch_size, bf16=False)
    return build_engine(_build(spec, vocab, device), config, train, 1)


def _save(root: Path, epoch: int, model, optimizer, state: dict) -> None:
    """Checkpoint `step-<epoch>`: written in a side directory, checksummed, renamed into
    place; then all but the newest KEEP are removed. The train stage's refusals: a disk
    without room, a directory that refuses writes or a link planted at the side directory
    is one line, and the checkpoints already there are left as they were."""
    import torch

    from pipeline.fsutil import refuse_link
    from pipeline.training.checkpoint_io import cannot_write
    from pipeline.training.checkpoints import (
        checkpoint_bytes,
        disk_full,
        has_room,
        out_of_space,
        step_dirs,
        write_checksums,
    )

    tag = f"step-{epoch:08d}"
    aside = root / f".{tag}.tmp"
    refuse_link(aside, "checkpoint directory", directory=True)
    if aside.exists():
        shutil.rmtree(aside)
    previous = step_dirs(root) if root.is_dir() else []
    # the previous checkpoint's size, or float32 weights plus Adam's two moments
    needed = (
        checkpoint_bytes(previous[0])
        if previous
        else 12 * sum(p.numel() for p in model.parameters())
    )
    try:
        aside.mkdir(parents=True)
        if not has_room(root, needed):
            raise disk_full(root / tag, needed)
        torch.save(
            {"model": model.state_dict(), "optimizer": optimizer.state_dict(), **state},
            aside / STATE,
        )
        write_checksums(aside)
        os.replace(aside, root / tag)
    except (OSError, RuntimeError) as e:
        shutil.rmtree(aside, ignore_errors=True)
        if out_of_space(e, root, needed):
            raise disk_full(root / tag, needed) from None
        raise cannot_write(root / tag, e) or e from None
    except PipelineError:
        shutil.rmtree(aside, ignore_errors=True)
        raise
    for old in step_dirs(root)[KEEP:]:
        shutil.rmtree(old)


def _newest(root: Path, log) -> str | None:
    from pipeline.training.checkpoints import newest_intact

    return newest_intact(root, log) if root.is_dir() else None


def _load(path: Path, model, optimizer=None) -> dict:
    """Restore a checkpoint into `model` (and `optimizer`); returns the curriculum state."""
    from pipeline.training.checkpoints import read_checkpoint_file

    saved = read_checkpoint_file(path / STATE)
    model.load_state_dict(saved["model"])
    if optimizer is not None:
        optimizer.load_state_dict(saved["optimizer"])
    return {key: saved[key] for key in ("epoch", "length", "history")}


def config(spec) -> dict:
    train = spec.train
    return {
        "model": spec.resolved()["model"],
        "task": spec.dataset.generator.model_dump(mode="json"),
        "train": {
            "seed": train.seed,
            "device": train.device,
            "batch_size": train.batch_size,
            "optimizer": train.optimizer.model_dump(mode="json"),
            "nonfinite": train.nonfinite,
            "nonfinite_limit": train.nonfinite_limit,
        },
    }


STAGE = Stage(
    name="curriculum",
    summary="Train on a generated algorithmic task with the length curriculum; resumable.",
    inputs=(),
    section_key="train",
    config=config,
    run=run,
    # nonfinite stop: a run it lets finish is the run before the key existed
    added_keys={"train.nonfinite": "stop", "train.nonfinite_limit": 100},
)
