"""docs/models.md's table of the paper configs: what this pipeline has run of each, and each
one's estimated H100 GPU-hours (pipeline/commands/estimate.py, as `allattn-pipe show CFG
--estimate` prints them; no step is timed here).

    python -m reproduce.cost_table

prints the table in Markdown; paste it over the one in docs/models.md (tests/system/test_docs.py
fails when the page's configs or hours differ from what this prints)."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from pipeline.commands.estimate import format_hours, gpu_estimates, training_tokens
from pipeline.errors import PipelineError
from pipeline.spec import load_spec

ROOT = Path(__file__).resolve().parent.parent
PAPER_CONFIGS = (
    "enwik8_*.yaml",
    "text8_*.yaml",
    "wt103.yaml",
    "baselines/*.yaml",
    "ablations/*.yaml",
    "active_memory/*.yaml",
    "infinity_former/*.yaml",
)
TABLE4_RESULTS = ROOT / "reproduce/results/table4_cpu.jsonl"
CPU = "2 shared CPU cores"

# What has been run of a config, from docs/benchmarks.md, docs/models.md and the git log:
# (scale and steps, result, date, machine). Table 4's CPU cells come from TABLE4_RESULTS.
RUNS = {
    "enwik8_large.yaml": (
        "the update timed only (bench/train_step.py, bf16, micro-batch 4 and 41); no training run",
        "102,093 tok/s at span 1/16, 20,059 at span 1",
        "2026-11-27",
        "H100 80GB HBM3",
    ),
    "enwik8_small.yaml": (
        "its model in the learning check: 300 updates of 8 x 256 on the built-in corpus",
        "float32 runs agree within 1.03%; the bf16 + triton + CUDA graphs run hit a NaN at "
        "update 11 (cause not found)",
        "2026-11-27",
        "H100 80GB HBM3",
    ),
    "infinity_former/sort_4k_cpu.yaml": (
        "the config as it is (512 tokens), ~20 minutes",
        "test loss 2.453, token accuracy 0.154 with the LTM; 2.551 / 0.164 without "
        "(chance 0.05); before issue 19's LTM changes",
        "2026-11-24",
        CPU,
    ),
}
FULL_PROTOCOL = {  # one curriculum at the paper's 10,000 updates (docs/benchmarks.md#table-4)
    "active_memory/add.yaml": "; paper protocol (10,000 updates), self-attention, seed 1: 27",
}


def paper_configs() -> list[str]:
    """Every paper config, relative to configs/."""
    configs = ROOT / "configs"
    return sorted(
        str(p.relative_to(configs)) for pattern in PAPER_CONFIGS for p in configs.glob(pattern)
    )


def table4_run(config: str) -> tuple[str, str, str, str] | None:
    """The CPU protocol's Table 4 cells of a problem's config, as a RUNS entry."""
    if not config.startswith("active_memory/") or not TABLE4_RESULTS.is_file():
        return None
    problem = Path(config).stem
    rows = [json.loads(line) for line in TABLE4_RESULTS.read_text().splitlines() if line]
    cells = [r for r in rows if r["cell"][0] == problem]
    if not cells:
        return None
    updates = cells[0]["protocol"]["epochs"] * cells[0]["protocol"]["steps"]
    scores = {
        mixer: statistics.mean(r["result"]["score"] for r in cells if r["cell"][1] == mixer)
        for mixer in ("conv", "self_attention")
    }
    seeds = len({r["cell"][2] for r in cells})
    return (
        f"Table 4's CPU protocol: the paper's model, {updates:,} updates, {seeds} seeds",
        f"longest solved, mean: conv {scores['conv']:.1f}, self-attention "
        f"{scores['self_attention']:.1f}{FULL_PROTOCOL.get(config, '')}",
        "2026-11-25",
        CPU,
    )


def hours_cell(config: str) -> str:
    """The estimated H100 hours of the config's training stages: a range for an adaptive
    span (at span 1/16 to the full span); '>= ' for a lower bound (a curriculum at its start
    length, or a FLOP count of the weights only)."""
    try:
        spec = load_spec(str(ROOT / "configs" / config), [])
    except PipelineError as e:
        return f"not estimated ({str(e).splitlines()[0]})"
    stages = training_tokens(spec)
    if not stages:
        return "no stage trains"
    estimates = gpu_estimates(spec, stages)
    totals = [format_hours(e.total) for e in estimates]
    prefix = ">= " if any(s.at_least for s in stages) or estimates[0].weights_only else ""
    return prefix + "–".join(reversed(totals))


def run_cells(config: str) -> tuple[str, str, str, str]:
    return RUNS.get(config) or table4_run(config) or ("not run", "", "", "")


def table() -> str:
    lines = [
        "| config | what this pipeline has run of it | result | date | machine | "
        "H100 hours (estimate) |",
        "|---|---|---|---|---|---|",
    ]
    for config in paper_configs():
        scale, result, date, machine = run_cells(config)
        lines.append(
            f"| `{config}` | {scale} | {result} | {date} | {machine} | {hours_cell(config)} |"
        )
    return "\n".join(lines)


def main() -> int:
    print(table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
