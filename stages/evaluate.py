"""evaluate: bits per character (and perplexity) of the last checkpoint, or of the best
validation's (`evaluate.checkpoint: best`).

Every token of each split is scored exactly once, streamed with the cache ("full eval").
Outputs `results.json`; prints the numbers beside the train split's unigram entropy. While a
split is scored it shows tokens done, tokens/s and ETA (a bar on a terminal, a line per tenth
or per 30 s in a log).
A dataset of documents (the sorting task) is scored document by document instead, on the
targets after each separator: loss per scored target, token accuracy and exact match
(pipeline.training.document_passes).

The results name the weights they are of by content, not by path: `weights` is the scored
checkpoint's id (pipeline.training.checkpoint_dirs.weights_id), in results.json and as a tag of
the stage's MLflow run, so that whatever shows them later shows them beside those weights only
(pipeline.workspace.scores, `compare`).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from pipeline.errors import PipelineError
from pipeline.fsutil import atomic_write_json
from pipeline.training.checkpoint_dirs import CHECKPOINTS, WEIGHTS
from stages.base import Stage, StageContext
from stages.trained_checkpoint import trained_checkpoint, trained_stages

if TYPE_CHECKING:
    from pipeline.models.protocol import SequenceModel

# below this many tokens a split's bpc is too noisy to compare runs on (its standard error
# is roughly 1/sqrt(n) of the per-token spread), so evaluate says so
FEW_TOKENS = 1000


def run(ctx: StageContext) -> dict:
    if "curriculum" in ctx.inputs:  # an algorithmic task: scored by its lengths
        from stages.task_evaluation import evaluate_task

        return evaluate_task(ctx)
    import torch

    from pipeline.cluster.device import resolve_device
    from pipeline.data.manifest import load_manifest, load_split
    from pipeline.data.vocab import bits_name
    from pipeline.training.checkpoint_dirs import load_model_weights, weights_id
    from pipeline.training.evaluation import LN2, evaluate_nll
    from pipeline.training.paper_loss import line_losses
    from pipeline.training.progress import ScoringProgress

    spec, ev = ctx.spec, ctx.spec.evaluate
    manifest = load_manifest(ctx.inputs["preprocess"])
    source, tag = checkpoint_source(spec, ctx.inputs)
    device = resolve_device(spec.train.device if spec.train else "auto")
    model = spec.build_model(manifest["vocab_size"], f"{ctx.inputs['preprocess']}/manifest.json")
    tag = load_model_weights(model, ctx.inputs[source] / CHECKPOINTS, ctx.log, tag)
    model.to(device)
    eos_id = _eos_id(ctx) if ev.line_losses else None
    seq_len = ev.seq_len or spec.train.seq_len
    results = {
        "checkpoint": f"{source}/{tag}",
        WEIGHTS: weights_id(ctx.inputs[source] / CHECKPOINTS / tag),
        "unigram_entropy_bits": manifest["unigram_entropy_bits"],
        "tokenizer": manifest.get("tokenizer"),  # what result_lines calls the bits per token
    }
    tag_scored(ctx, results)
    if manifest.get("documents"):
        return _evaluate_documents(ctx, model, seq_len, device, manifest["documents"], results)
    loaded = {}  # split -> tokens: the persistent share reads valid again
    for split in ev.splits:
        tokens = loaded[split] = load_split(ctx.inputs["preprocess"], split)
        with (
            torch.no_grad(),
            # the log line's prefix already says [evaluate]
            ScoringProgress(split, max(len(tokens) - 1, 0), ctx.log) as shown,
        ):
            total, count = evaluate_nll(
                model, tokens, ev.batch_size, seq_len, device, progress=shown
            )
        nats = total / count
        _refuse_nonfinite(f"the {split} split's loss", nats, results["checkpoint"])
        if count < FEW_TOKENS:
            ctx.log(
                f"warning: the {split} split has only {count:,} scored tokens: its "
                f"{bits_name(manifest.get('tokenizer'))} is "
                f"a rough estimate (make dataset.split.{split} larger)"
            )
        results[split] = {"tokens": count, "loss": nats, "bpc": nats / LN2, "ppl": math.exp(nats)}
        ctx.tracker.log_metrics(
            {f"{split}_bpc": nats / LN2, f"{split}_loss": nats, f"{split}_ppl": math.exp(nats)},
            step=0,
        )
        if ev.line_losses:
            assert eos_id is not None  # read above when line_losses is asked for
            lines = line_losses(model, tokens, eos_id, ev.batch_size, device)
            for key in ("paper_loss", "line_nll"):
                _refuse_nonfinite(f"the {split} split's {key}", lines[key], results["checkpoint"])
            results[split]["lines"] = lines
            ctx.tracker.log_metrics(
                {
                    f"{split}_paper_loss": lines["paper_loss"],
                    f"{split}_line_nll": lines["line_nll"],
                },
                step=0,
            )
    results |= _persistent_share(ctx, model, seq_len, device, loaded.get("valid"))
    atomic_write_json(ctx.out_dir / "results.json", results)
    ctx.tracker.log_artifact(ctx.out_dir / "results.json")
    for line in result_lines(results):
        ctx.log(line)
    return results


def result_lines(results: dict) -> list[str]:
    """The lines evaluate prints of its results (results.json): the checkpoint, then each
    split's bpc and perplexity, or, for documents, loss and accuracies. A no-op re-run
    reprints a recorded one with these (pipeline.workspace.runner)."""
    if "score" in results:  # an algorithmic task's (stages/task_evaluation.py): its last line
        return [
            f"score {results['score']} ({results['problem']}, checkpoint {results['checkpoint']})"
        ]
    splits = [k for k, v in results.items() if isinstance(v, dict) and "loss" in v]
    if any("exact_match" in results[s] for s in splits):
        out = [f"checkpoint {results['checkpoint']}"]
        for split in splits:
            r = results[split]
            out.append(
                f"{split:<5} loss {r['loss']:.4f}   token accuracy {r['token_accuracy']:.3f}   "
                f"exact match {r['exact_match']:.3f}   ({r['documents']:,} documents)"
            )
        return out
    out = [
        f"checkpoint {results['checkpoint']}; unigram entropy of the train split "
        f"{results['unigram_entropy_bits']:.3f} bits"
    ]
    from pipeline.data.vocab import bits_name

    bits = bits_name(results.get("tokenizer"))
    for split in splits:
        r = results[split]
        out.append(
            f"{split:<5} {bits} {r['bpc']:.3f}   ppl {r['ppl']:.2f}   ({r['tokens']:,} tokens)"
        )
        if "lines" in r:
            lines = r["lines"]
            out.append(
                f"{split:<5} line by line: loss per token {lines['paper_loss']:.4f} as the "
                f"active-memory paper averages it (padding included), "
                f"{lines['line_nll']:.4f} nats per token ({lines['lines']:,} lines, "
                f"{lines['skipped_lines']:,} longer ones skipped)"
            )
    return out


SHARE_BATCHES = 16
"""The persistent share is measured on the valid split's first this many batches of
evaluate.batch_size x seq_len (streamed with the cache, as scoring does): a per-head mean
over thousands of query rows, at a fraction of a full pass's cost."""


def _persistent_share(
    ctx: StageContext, model: SequenceModel, seq_len: int, device, valid=None
) -> dict:
    """{"persistent_share": [[...]]} (per layer x head, the mean attention weight on the
    persistent vectors on the valid split) and its heat map `persistent_share.png`, logged
    as an artifact; {} for a model that reports none (HeadReports.measure_persistent_share).
    Every query row of the batches run counts, the padded tail of a short split's last
    batch included. `valid`: the split's tokens if scoring already read them."""
    from pipeline.data.manifest import load_split
    from pipeline.models.capabilities import HeadReports
    from pipeline.training.evaluation import evaluate_nll
    from pipeline.training.head_maps import head_heat_map

    if not isinstance(model, HeadReports):
        return {}
    batch_size = ctx.spec.evaluate.batch_size
    with model.measure_persistent_share() as tables:
        if tables is not None:
            if valid is None:
                valid = load_split(ctx.inputs["preprocess"], "valid")
            evaluate_nll(model, valid, batch_size, seq_len, device, max_batches=SHARE_BATCHES)
    if not tables:
        return {}
    share = tables["persistent_share"]
    ctx.log(
        f"persistent share measured on (at most) the first {SHARE_BATCHES} valid batches "
        f"of {batch_size} x {seq_len} with the reference op's attention weights "
        f"(scoring used {model.describe()})"
    )
    title = f"share of attention weight on the persistent vectors, valid split ({ctx.spec.name})"
    path = head_heat_map(share, title, ctx.out_dir / "persistent_share.png")
    ctx.tracker.log_artifact(path)
    return {"persistent_share": share}


def _evaluate_documents(
    ctx: StageContext, model, seq_len: int, device, layout: dict, results: dict
) -> dict:
    """Each split's documents (the manifest's `layout`): loss per scored target, token
    accuracy, exact match."""
    from pipeline.data.documents import as_documents
    from pipeline.data.manifest import load_split
    from pipeline.training.document_passes import score_documents

    ev = ctx.spec.evaluate
    if ev.line_losses:
        raise PipelineError(
            "evaluate.line_losses scores lines of text; this dataset is "
            "documents, scored on the targets after their separator"
        )
    for split in ev.splits:
        docs = as_documents(
            load_split(ctx.inputs["preprocess"], split),
            layout,
            f"{ctx.inputs['preprocess']}, {split} split",
        )
        scores = score_documents(
            model, docs, ev.batch_size, seq_len, layout["input_length"], device
        )
        results[split] = scores.metrics()
        _refuse_nonfinite(
            f"the {split} split's loss", results[split]["loss"], results["checkpoint"]
        )
        ctx.tracker.log_metrics(
            {f"{split}_{k}": results[split][k] for k in ("loss", "token_accuracy", "exact_match")},
            step=0,
        )
    atomic_write_json(ctx.out_dir / "results.json", results)
    ctx.tracker.log_artifact(ctx.out_dir / "results.json")
    for line in result_lines(results):
        ctx.log(line)
    return results


def _refuse_nonfinite(what: str, value: float, checkpoint: str) -> None:
    """A NaN or infinite score is no result: the stage fails before recording it."""
    if not math.isfinite(value):
        raise PipelineError(
            f"evaluate: {what} is not finite ({value}) with checkpoint {checkpoint}: nothing "
            f"recorded; the checkpoint's weights or the evaluation overflowed"
        )


def _eos_id(ctx: StageContext) -> int:
    """The end-of-line id that evaluate.line_losses splits lines at."""
    from pipeline.data.manifest import load_tokenizer

    eos = getattr(load_tokenizer(ctx.inputs["preprocess"]), "eos_id", None)
    if eos is None:
        raise PipelineError(
            f"evaluate.line_losses scores lines, but the dataset's tokenizer "
            f"({ctx.spec.dataset.tokenizer.kind}) marks no line ends: give it "
            f"an eos (word or sentencepiece tokenizers)"
        )
    return eos


def tag_scored(ctx: StageContext, results: dict) -> None:
    """Tag the stage's MLflow run with the checkpoint scored and its weights' id, before the
    scores: `compare` shows a score only beside the weights it names (an algorithmic task's
    evaluation, stages.task_evaluation.evaluate_task, tags its run so too)."""
    ctx.tracker.set_tags(
        {"checkpoint": results["checkpoint"]}
        | ({WEIGHTS: results[WEIGHTS]} if results[WEIGHTS] else {})
    )


def checkpoint_source(spec, inputs: dict) -> tuple[str, str | None]:
    """The stage whose checkpoint is scored, and its tag (None: the newest intact one), with
    `inputs` the directories of evaluate's inputs: the checkpoint `evaluate.checkpoint` names,
    as sample and export choose one (stages.trained_checkpoint). An algorithmic task: the
    curriculum's newest (evaluate's keys do nothing there)."""
    if "curriculum" in inputs:
        return "curriculum", None
    trained = {s: inputs[s] for s in trained_stages(spec.stages) if s in inputs}
    if found := trained_checkpoint(spec.evaluate.checkpoint, trained):
        source, _, tag = found
        return source, tag
    searched = ", ".join(str(folder / CHECKPOINTS) for folder in trained.values())
    raise PipelineError(
        f"evaluate.checkpoint is best, but no checkpoint is marked best under "
        f"{searched} (it is set by train.eval_every's validations)"
    )


def recorded_lines(spec, summary: dict) -> list[str]:
    """What a `run` that finds evaluate up to date reprints of its recorded results: the
    lines it printed (result_lines), the splits in the order it scored them (stage.json keeps
    keys sorted); none for a record that names no checkpoint."""
    if "checkpoint" not in summary:
        return []
    splits = spec.evaluate.splits
    return result_lines({**{k: summary[k] for k in splits if k in summary}, **summary})


def estimate_lines(spec) -> list[str]:
    """What `show --estimate` says evaluate reads: its tokens per split and their source (the
    preprocess manifest, else the dataset card), or that an algorithmic task's generated
    cases are not counted."""
    if "curriculum" in spec.stages:
        return ["evaluate: generated cases at the curriculum's lengths (not counted)"]
    from pipeline.data.frequency_sort import document_length
    from pipeline.data.manifest import MANIFEST, load_manifest

    preprocess = spec.workspace_dir / "preprocess"
    if (preprocess / MANIFEST).is_file():
        splits = load_manifest(preprocess)["splits"]
        sizes = {s: splits[s]["tokens"] for s in spec.evaluate.splits}
        return [f"evaluate: {_splits(sizes)} (from {preprocess / MANIFEST})"]
    card = spec.dataset
    task = card.generator.frequency_sort if card.generator else None
    if task is not None:
        per_doc = document_length(task.vocab, task.length)
        sizes = {s: getattr(task.sequences, s) * per_doc for s in spec.evaluate.splits}
        return [
            f"evaluate: {_splits(sizes)} read (dataset card '{card.name}': sequences x "
            f"{per_doc} tokens a document; its {task.vocab} sorted symbols scored)"
        ]
    counts = {s: getattr(card.split, s) for s in spec.evaluate.splits}
    if (
        card.generator is None
        and card.split.kind == "tail"
        and card.tokenizer.kind in ("byte", "char")
        and all(v >= 1 for v in counts.values())
    ):
        sizes = {s: int(v) for s, v in counts.items()}
        return [
            f"evaluate: {_splits(sizes)} (dataset card '{card.name}': split sizes in "
            f"{card.tokenizer.kind}s, one token each)"
        ]
    return ["evaluate: tokens unknown until preprocess has run (the manifest counts them)"]


def _splits(sizes: dict[str, int]) -> str:
    return ", ".join(f"{split} {n:,} tokens" for split, n in sizes.items())


STAGE = Stage(
    name="evaluate",
    summary="Score every token of valid/test with the cache: bpc, perplexity (a task: accuracy "
    "by length).",
    # the data it scores, then the stages whose checkpoints hold the model
    # (stages.trained_checkpoint): train too, as with evaluate.checkpoint best the best may be
    # train's
    inputs=(
        ("preprocess", "curriculum"),
        ("train", "finetune", "curriculum"),
        ("train", "curriculum"),
    ),
    section_key=None,
    # Every key changes the numbers (batch_size and seq_len set where the cached streams cut
    # the splits): no runtime_only.
    config=lambda spec: spec.evaluate.model_dump(mode="json"),
    config_section="evaluate",
    run=run,
    added_keys={"line_losses": False},
    result_lines=recorded_lines,
    estimate_lines=estimate_lines,
)
