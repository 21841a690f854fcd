"""`corpus_stats`: the preprocessed corpus in numbers (tokens per split, vocabulary), as a
JSON file in the stage's output and as metrics in MLflow."""

from __future__ import annotations

import json

from pipeline.data.manifest import load_manifest
from stages.base import Stage, StageContext


def run(ctx: StageContext) -> dict:
    manifest = load_manifest(ctx.inputs["preprocess"])
    stats = {
        "vocab_size": manifest["vocab_size"],
        **{f"{name}_tokens": split["tokens"] for name, split in manifest["splits"].items()},
    }
    # the runner publishes out_dir as a whole once run returns
    (ctx.out_dir / "stats.json").write_text(json.dumps(stats, indent=2))
    ctx.tracker.log_metrics(stats, step=0)
    ctx.log(", ".join(f"{k} {v:,}" for k, v in stats.items()))
    return stats


STAGE = Stage(
    name="corpus_stats",
    summary="Count the preprocessed corpus's tokens per split.",
    inputs=("preprocess",),
    section_key=None,
    # its result depends on preprocess's output alone, whose fingerprint the runner chains in
    config=lambda spec: {},
    run=run,
)
