"""The body every training stage runs its plan (pipeline.training.plan) with: resume or
continue, build the `Trainer`, record what it resolved, fit, tag the weights, save the
model's tables. Not a stage: train, finetune, curriculum and a plugin's training stage each
call `start` and `finish` from their `run`.

A stage's outputs: `checkpoints/` (`step-N`, `latest`, and `best` by validation) and
`resolved.json`, the micro-batch and precision it trains with (pipeline.training.micro_batch),
read back by a resume and by a stage that continues its checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.fsutil import atomic_write_json
from pipeline.training.checkpoint_dirs import CHECKPOINTS
from stages.base import StageContext

if TYPE_CHECKING:
    from pipeline.training.plan import Tokens, TrainingPlan
    from pipeline.training.trainer import Trainer
    from pipeline.training.training_data import TrainingData


@dataclass
class Started:
    trainer: Trainer
    resumed: bool  # from the stage's own checkpoint (an interrupted run)
    begin: int  # the step the stage starts from: the continued checkpoint's, else 0

    @property
    def until(self) -> int:
        return self.begin + self.trainer.plan.updates


def start(ctx: StageContext, plan: TrainingPlan) -> Started:
    """The stage's Trainer, at the newest intact checkpoint of its own (a resume), else of
    the stage it continues (`plan.continues`), else at the initial weights; what it
    resolved (micro-batch, precision) recorded before its first update."""
    from pipeline.training.checkpoint_dirs import newest_intact, step_dirs, step_of
    from pipeline.training.micro_batch import read_record
    from pipeline.training.trainer import Trainer

    root = ctx.out_dir / CHECKPOINTS
    resuming = bool(step_dirs(root))
    continued = ctx.inputs[plan.continues] if plan.continues else None
    # a resume, or a continued checkpoint, runs at the micro-batch and precision it was
    # written with, never searched again
    recorded = (resuming and read_record(ctx.out_dir)) or (
        read_record(continued) if continued else None
    )
    trainer = Trainer(ctx.spec, plan, plan.data(ctx.inputs), ctx.tracker, ctx.log, recorded)
    record_resolved(ctx, trainer)
    if resuming:  # the newest intact one, or a refusal if none is
        trainer.load(root)
    begin = 0
    if continued is not None and not resuming:
        begin = trainer.load(continued / CHECKPOINTS, continued=True)
    elif continued is not None:
        # where the first attempt began: the continued stage's newest intact checkpoint,
        # as trainer.load chose it (not `latest`, which may name a damaged one)
        newest = newest_intact(continued / CHECKPOINTS, ctx.log)
        assert newest is not None  # that stage finished: it left an intact checkpoint
        begin = step_of(newest)
    return Started(trainer, resuming, begin)


def finish(ctx: StageContext, started: Started, head_tables: bool = True) -> dict:
    """Fit to the plan's last update, tag the stage's run with the weights it ended with and
    (`head_tables`) save the model's per-head tables; the loop's summary."""
    trainer = started.trainer
    summary = trainer.fit(started.until, ctx.out_dir / CHECKPOINTS)
    tag_weights(ctx, trainer, summary)
    if head_tables:
        log_head_tables(ctx, trainer)
    return summary


def log_params(ctx: StageContext, trainer: Trainer, params: dict) -> None:
    """The model's size and vocabulary, and `params`, as the stage run's parameters."""
    if trainer.rank == 0:
        ctx.tracker.log_params(
            {"parameters": trainer.params, "vocab_size": trainer.vocab_size} | params
        )


def record_resolved(ctx: StageContext, trainer: Trainer) -> None:
    """Write what the run trains with (trainer.resolved) into its output before the first
    step, and log it to the tracker as parameters; rank 0 only."""
    from pipeline.training.micro_batch import RECORD

    if trainer.rank != 0:
        return
    atomic_write_json(ctx.out_dir / RECORD, trainer.resolved)
    ctx.tracker.log_params(
        {f"resolved.{key}": value for key, value in resolved_summary(trainer).items()}
    )


def tag_weights(ctx: StageContext, trainer: Trainer, summary: dict) -> None:
    """Tag the stage's MLflow run with the checkpoint it ended with, and the ids of its
    weights and of the checkpoint its validations marked best
    (pipeline.training.checkpoint_dirs.weights_id): what `compare` binds evaluate's scores to, by
    content. Rank 0 only."""
    from pipeline.training.checkpoint_dirs import BEST_WEIGHTS, WEIGHTS, read_pointer, weights_id

    if trainer.rank != 0:
        return
    final = Path(summary["checkpoint"])
    best = read_pointer(final.parent / "best")
    ids = {
        WEIGHTS: weights_id(final),
        BEST_WEIGHTS: weights_id(final.parent / best) if best else None,
    }
    ctx.tracker.set_tags(
        {"checkpoint": str(final)} | {key: value for key, value in ids.items() if value}
    )


def resolved_summary(trainer: Trainer) -> dict:
    """For the stage's record (stage.json): the micro-batch and precision that ran."""
    r = trainer.resolved
    return {
        "micro_batch_size": r["micro_batch_size"],
        "gradient_accumulation_steps": trainer.accum,
        "precision": "bf16"
        if r["bf16"]
        else ("fp16" if trainer.ds_config["fp16"]["enabled"] else "float32"),
    }


def log_head_tables(ctx: StageContext, trainer: Trainer) -> None:
    """What the model reports per layer and head at the end of the stage (its learned spans:
    `spans.json`, `spans.png`) into out_dir, logged as artifacts; rank 0 only. Nothing for
    a model without HeadReports."""
    from pipeline.models.capabilities import HeadReports
    from pipeline.training.head_maps import save_head_tables

    if trainer.rank != 0 or not isinstance(trainer.model, HeadReports):
        return
    for path in save_head_tables(
        trainer.model.head_tables(),
        ctx.out_dir,
        f"after step {trainer.step} ({ctx.spec.name}, {trainer.plan.name})",
    ):
        ctx.tracker.log_artifact(path)


# ---------------------------------------------------------------- the preprocessed data


def preprocessed_data(spec) -> Callable[[Mapping[str, Path]], TrainingData]:
    """The preprocess stage's shards (its output among the stage's inputs)."""

    def data(inputs: Mapping[str, Path]) -> TrainingData:
        from pipeline.training.training_data import PreprocessedData

        return PreprocessedData(inputs["preprocess"], spec.train.seq_len)

    return data


def document_task(spec):
    """The dataset's task of whole documents (frequency sort), or None: token streams."""
    generator = spec.dataset.generator
    return generator.frequency_sort if generator is not None else None


def preprocessed_timing_data(spec) -> Callable[[int, str], TrainingData]:
    """Random tokens in the shape preprocess will give (streams of train.seq_len, or the
    frequency-sort task's documents), for a vocabulary: what the estimate times on."""

    def data(vocab_size: int, origin: str) -> TrainingData:
        from pipeline.training.training_data import RandomDocuments, RandomStreams

        if (task := document_task(spec)) is not None:
            from pipeline.data.frequency_sort import document_length

            # preprocess's layout (stages/preprocess.py): input, separator, sorted vocabulary
            layout = {
                "length": document_length(task.vocab, task.length),
                "input_length": task.length,
            }
            return RandomDocuments(vocab_size, layout, origin)
        return RandomStreams(vocab_size, spec.train.seq_len, origin)

    return data


def preprocessed_tokens(spec, updates: int, key: str) -> Tokens:
    """The tokens of `updates` updates (the spec's `key`) of train.batch_size rows: of
    train.seq_len tokens, or of a whole document each."""
    from pipeline.training.plan import Tokens

    train = spec.train
    if (task := document_task(spec)) is not None:
        # an update reads whole documents, in segments of seq_len with the memory carried:
        # the input, the separator and the sorted vocabulary
        from pipeline.data.frequency_sort import document_length

        per_row = document_length(task.vocab, task.length)
        what = (
            f"{per_row:,} tokens (a whole document: {task.length:,} "
            f"(frequency_sort.length) + the separator + {task.vocab} sorted symbols)"
        )
    else:
        per_row, what = train.seq_len, f"{train.seq_len} tokens (train.seq_len)"
    how = (
        f"{updates:,} updates ({key}) x {train.batch_size} sequences (train.batch_size, "
        f"all processes) x {what}"
    )
    return Tokens(updates, updates * train.batch_size * per_row, how)


# The train.* keys that change how the Trainer runs but not what it trains, each with its
# reason: runtime-only in every stage that trains on them (Stage.runtime_only). Everything
# else does change the weights, deliberately including train.device (cpu and cuda draw
# dropout from different generators) and train.deepspeed.activation_checkpointing
# (recomputation replays dropout: not proven exact).
TRAINER_RUNTIME_ONLY = {
    "train.launcher": "the global batch is fixed, so the process count does not change the "
    "numbers (a checkpoint still resumes only at the world size that wrote it)",
    "train.log_every": "logging reads the loss and changes no state",
    "train.eval_every": "validation runs in eval mode under no_grad with its own cache: no "
    "dropout, no RNG draw (with finetune.patience it is under validation.*)",
    "train.eval_batches": "as eval_every: it only sizes the validation estimate",
    "train.eval_batch_size": "as eval_batches",
    "train.eval_seq_len": "as eval_batches",
    "train.checkpoint_every": "saving reads the state; a resumed run is the uninterrupted run",
    "train.keep_checkpoints": "only which older checkpoints are deleted",
    "model.attention.impl": "every backend computes the reference op's maths (up to float "
    "rounding) or refuses the configuration; with attention dropout each "
    "draws its own masks from the same distribution, so the steps after "
    "the edit are the same training, not the same bits",
    "train.compile": "compiled layers compute the eager layers' maths (up to float rounding), "
    "their dropout drawn from torch's generator as in eager mode",
}
