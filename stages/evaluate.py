"""evaluate: bits per character (and perplexity) of the final checkpoint.

Every token of each split is scored exactly once, streamed with the cache ("full eval").
Outputs `results.json`; prints the numbers beside the train split's unigram entropy.
"""

from __future__ import annotations

import math

from pipeline.fsutil import atomic_write_json
from stages import Stage, StageContext


def run(ctx: StageContext) -> dict:
    import torch

    from pipeline.models import build_model
    from pipeline.checkpoints import load_model_weights
    from pipeline.trainer import LN2, evaluate_nll, resolve_device
    from pipeline.data.manifest import load_manifest, load_split

    spec, ev = ctx.spec, ctx.spec.evaluate
    manifest = load_manifest(ctx.inputs["preprocess"])
    source = "finetune" if "finetune" in ctx.inputs else "train"
    device = resolve_device(spec.train.device if spec.train else "auto")
    model = build_model(spec.model_kind, spec.model_params, manifest["vocab_size"])
    tag = load_model_weights(model, ctx.inputs[source] / "checkpoints", ctx.log)
    model.to(device)
    seq_len = ev.seq_len or spec.train.seq_len
    results = {"checkpoint": f"{source}/{tag}",
               "unigram_entropy_bits": manifest["unigram_entropy_bits"]}
    for split in ev.splits:
        tokens = load_split(ctx.inputs["preprocess"], split)
        with torch.no_grad():
            total, count = evaluate_nll(model, tokens, ev.batch_size, seq_len, device)
        nats = total / count
        results[split] = {"tokens": count, "loss": nats, "bpc": nats / LN2,
                          "ppl": math.exp(nats)}
        ctx.tracker.log_metrics({f"{split}_bpc": nats / LN2, f"{split}_loss": nats,
                                 f"{split}_ppl": math.exp(nats)}, step=0)
    atomic_write_json(ctx.out_dir / "results.json", results)
    ctx.tracker.log_artifact(ctx.out_dir / "results.json")
    ctx.log(f"checkpoint {source}/{tag}; unigram entropy of the train split "
            f"{results['unigram_entropy_bits']:.3f} bits")
    for split in ev.splits:
        r = results[split]
        ctx.log(f"{split:<5} bpc {r['bpc']:.3f}   ppl {r['ppl']:.2f}   ({r['tokens']:,} tokens)")
    return results


STAGE = Stage(
    name="evaluate",
    summary="Score every token of valid/test with the cache: bpc, perplexity.",
    inputs=("preprocess", ("train", "finetune")),
    section_key=None,
    # Every key changes the numbers (batch_size and seq_len set where the cached streams cut
    # the splits): no runtime_only.
    config=lambda spec: spec.evaluate.model_dump(mode="json"),
    run=run,
)
