"""`allattn-pipe show CFG --estimate`: what a config costs before it runs. Tokens to train
per stage (each training stage's plan counts them: Stage.plan), what the other stages say
they cost (Stage.estimate_lines: evaluate's tokens), the memory plan per GPU
(pipeline/commands/memory_report.py), the run's update timed on this machine
(pipeline/commands/update_timing.py; fewer of its rows where the whole update would take
more than half of this machine's memory), and H100 / H200 time from the model's FLOPs per
token and the MFU the GPU check recorded (pipeline/commands/gpu_records.py). Every number is
printed with where it came from, in the unit its size reads best in."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.commands import gpu_records
from pipeline.commands.report import vocab_size_for
from pipeline.errors import PipelineError

SHORT_SPAN = 1 / 16  # the recorded step's other span fraction


@dataclass(frozen=True)
class StageTokens:
    stage: str
    updates: int
    tokens: int
    how: str
    at_least: bool = False  # a lower bound: the rows grow as the stage runs


def training_tokens(spec) -> list[StageTokens]:
    """Tokens each stage of the spec that trains feeds the model, as its plan counts them
    (pipeline.training.plan.Tokens: updates x sequences per update x tokens per sequence)."""
    from stages import training_plans

    out = []
    for name, plan in training_plans(spec):
        t = plan.tokens
        out.append(StageTokens(name, t.updates, t.tokens, t.how, t.at_least))
    return out


def stage_lines(spec) -> list[str]:
    """What the stages of the spec say they cost beyond a plan's tokens (Stage.estimate_lines:
    evaluate's tokens per split), in the spec's order."""
    from stages import STAGES

    return [
        line
        for name in spec.stages
        if (stage := STAGES.get(name)) is not None and stage.estimate_lines is not None
        for line in stage.estimate_lines(spec)
    ]


def stages_that_train() -> list[str]:
    """The stage kinds installed that declare a training plan, built-in or a plugin's."""
    from stages import STAGES

    return [name for name, stage in STAGES.items() if stage.plan is not None]


def meta_model(spec):
    """The spec's model with sizes only (no memory), for its FLOP count."""
    import torch

    vocab, origin = vocab_size_for(spec)
    if vocab is None:
        raise PipelineError(
            f"{spec.source}: --estimate needs the vocabulary size: run preprocess or set "
            f"dataset.vocab_size"
        )
    with torch.device("meta"):
        return spec.build_model(vocab, origin)


def flops_per_token(model, span_frac: float) -> tuple[float, str]:
    """Training FLOPs per token (the model's ``train_flops_per_token()``) and, for a model
    with attention spans, with every span at ``span_frac`` of its longest
    (``AttentionSpans.train_flops_per_token_at``) and what that span is ("L' 8192", or "")."""
    from pipeline.models.capabilities import AttentionSpans

    if isinstance(model, AttentionSpans):
        return model.train_flops_per_token_at(span_frac)
    return model.train_flops_per_token(), ""


def counts_weights_only(model) -> bool:
    """Whether the model's FLOP count is the protocol's default, 6 per weight, without the
    attention over its context or memory (a family adds those in an override)."""
    from pipeline.models.protocol import SequenceModel

    return type(model).train_flops_per_token is SequenceModel.train_flops_per_token


def gpu_hours(tokens: int, flops: float, mfu: float) -> float:
    """Hours to train `tokens` at `flops` per token and `mfu` of an H100's dense bf16 peak."""
    return tokens * flops / (mfu * gpu_records.H100_BF16_PEAK_TFLOPS * 1e12) / 3600


def format_hours(hours: float) -> str:
    """Hours as the estimate and docs/models.md print them."""
    if hours >= 100:
        return f"{hours:,.0f}"
    if hours >= 1:
        return f"{hours:.1f}"
    if hours >= 0.01:
        return f"{hours:.2f}"
    return f"{hours * 3600:.2g} s"


@dataclass(frozen=True)
class GpuEstimate:
    span: str  # "the full span" / "span 1/16" / "" (no spans)
    flops: float
    span_len: str
    record: dict
    hours: dict[str, float]  # stage -> hours
    weights_only: bool  # the family's FLOP count has no sequence-length terms: a lower bound

    @property
    def total(self) -> float:
        return sum(self.hours.values())


def gpu_estimates(spec, stages: list[StageTokens] | None = None) -> list[GpuEstimate]:
    """H100 hours of the training stages: at the full span with the MFU recorded at span 1
    (an upper bound for an adaptive span, which starts at span_init and grows) and, for an
    adaptive span, at 1/16 of it with the MFU recorded there."""
    from pipeline.models.capabilities import AttentionSpans

    stages = training_tokens(spec) if stages is None else stages
    model = meta_model(spec)
    spans = isinstance(model, AttentionSpans)
    fracs = [1.0, SHORT_SPAN] if spans and model.spans_grow() else [1.0]
    out = []
    for frac in fracs:
        record = gpu_records.estimate_record(frac)
        flops, span_len = flops_per_token(model, frac)
        label = ""
        if spans:
            label = "the full span" if frac == 1.0 else "span 1/16"
        hours = {s.stage: gpu_hours(s.tokens, flops, record["mfu"]) for s in stages}
        out.append(GpuEstimate(label, flops, span_len, record, hours, counts_weights_only(model)))
    return out


def estimate_report(spec, measure: bool = True, progress=None) -> str:
    """The lines `show --estimate` prints."""
    stages = training_tokens(spec)
    lines = ["estimate:"]
    if not stages:
        lines += [f"  {line}" for line in stage_lines(spec)]
        lines.append(
            f"  no stage trains (stages: {', '.join(spec.stages)}): no tokens or hours to "
            f"estimate (the stages that train: {', '.join(stages_that_train())})"
        )
        return "\n".join(lines)
    lines.append("  tokens to train:")
    for s in stages:
        n = f">= {s.tokens:,}" if s.at_least else f"{s.tokens:,}"
        lines.append(f"    {s.stage:<10} {n} tokens = {s.how}")
    lines += [f"  {line}" for line in stage_lines(spec)]
    estimates = gpu_estimates(spec, stages)
    for est in estimates:
        where = f" at {est.span} ({est.span_len})" if est.span else ""
        lines.append(
            f"  model FLOPs per token (forward + backward){where}: {est.flops / 1e9:.3f} GFLOP "
            f"(the model's train_flops_per_token())"
        )
    from pipeline.commands.memory_report import gpu_plan_lines

    lines += gpu_plan_lines(spec, meta_model(spec))
    if measure:  # gpu_estimates has refused a vocabulary unknown before preprocess
        lines += _time_here(spec, stages, progress)
    for est in estimates:
        where = f" at {est.span}" if est.span else ""
        lines.append(
            f"  H100 time{where}: {_times_line(est.hours)} (tokens x FLOPs per token / "
            f"(MFU {est.record['mfu']:.1%} x {gpu_records.H100_BF16_PEAK_TFLOPS:.0f} "
            f"TFLOP/s); {mfu_source(spec, est.record)})"
        )
    peak = gpu_records.H100_BF16_PEAK_TFLOPS
    for est in estimates:
        where = f" at {est.span}" if est.span else ""
        lines.append(
            f"  H200 time{where}: {_times_line(est.hours)} (H200: not measured; H100's MFU "
            f"assumed: the same {peak:.0f} TFLOP/s dense bf16 peak, its faster memory not counted)"
        )
    if any(s.at_least for s in stages):
        lines.append("  (>=: a lower bound: the stage's rows grow as it runs; its count says how)")
    if spec.model_kind != "allattn":
        lines.append(
            f"  assumed: the recorded MFU (an allattn model's) for this {spec.model_kind} model"
        )
    if estimates[0].weights_only:
        lines.append(
            f"  lower bound: {spec.model_kind}'s train_flops_per_token() counts 6 FLOPs per "
            f"weight, not the attention over its context or memory"
        )
    return "\n".join(lines)


def _time_here(spec, stages: list[StageTokens], progress) -> list[str]:
    """The update timed here and the stages' time at it: the run's own update, or fewer of
    its rows where the memory plan says the whole would take more than half of this
    machine's memory (its time scaled by the rows), or one line saying why it was not timed
    (too large even at one row, out of memory after all, or diverged: the GPU time and the
    memory plan need no timing)."""
    from pipeline.commands.memory_report import timing_shape
    from pipeline.commands.update_timing import (
        BUDGET_S,
        TIMED,
        Diverged,
        out_of_memory,
        smaller_update,
        time_updates,
    )

    shape = timing_shape(spec, meta_model(spec))
    if shape.rows is None:
        return [shape.line]
    say = progress if progress is not None else (lambda line: None)
    if shape.line:
        say(shape.line)
    say(
        f"timing updates of {spec.name}'s model here (1 warm-up, then up to {TIMED} "
        f"within {BUDGET_S:.0f} s)..."
    )
    timed = spec if shape.rows == shape.run_rows else smaller_update(spec, shape.rows)
    try:
        step = time_updates(timed, progress=say)
    except Diverged as e:
        return [f"  time here: not timed: {e}"]
    except (RuntimeError, MemoryError, PipelineError) as e:
        if not out_of_memory(e):
            raise
        why = " ".join(str(e).split())[:200] or type(e).__name__
        return [f"  time here: not timed: this machine ran out of memory for an update ({why})"]
    seconds, measured = step.seconds, step.measured + "; the run's own update"
    if shape.rows != shape.run_rows:
        seconds *= shape.run_rows / shape.rows
        measured = (
            f"{step.measured}; {shape.rows} of the update's {shape.run_rows} rows (the whole "
            f"would not fit in half of this machine's memory), scaled by "
            f"{shape.run_rows}/{shape.rows}"
        )
    here = {s.stage: s.updates * seconds / 3600 for s in stages}
    return [
        f"  update time here: {format_duration(seconds / 3600)} (measured: {measured})",
        f"  time here: {_times_line(here)} (updates x the update time here)",
    ]


def mfu_source(spec, record: dict) -> str:
    """Where the MFU comes from, said beside it: whose model it was measured for."""
    config = record["config"]
    name = config.removeprefix("configs/").removesuffix(".yaml")
    whose = "this config" if str(spec.source).endswith(config) else f"{name}, not this config"
    return (
        f"MFU {record['mfu']:.1%} measured for {whose}, on an H100, {record['source']}: "
        f"{record['date']}, {record['machine']}, torch {record['torch']}, bf16, "
        f"{record['code']} (micro-batch {record['micro_batch']}), span "
        f"{_frac(record['span_frac'])}, {record['tokens_s']:,} tok/s"
    )


def format_duration(hours: float) -> str:
    """A duration in the unit its size reads best in, labelled: h, min or s."""
    if hours >= 100:
        return f"{hours:,.0f} h"
    if hours >= 1:
        return f"{hours:.1f} h"
    if hours * 60 >= 1:
        return f"{hours * 60:.0f} min" if hours * 60 >= 10 else f"{hours * 60:.1f} min"
    seconds = hours * 3600
    if seconds >= 10:
        return f"{seconds:.0f} s"
    return f"{seconds:.1f} s" if seconds >= 1 else f"{seconds:.2g} s"


def _times_line(hours: dict[str, float]) -> str:
    parts = [f"{stage} {format_duration(h)}" for stage, h in hours.items()]
    if len(hours) > 1:
        parts.append(f"total {format_duration(sum(hours.values()))}")
    return ", ".join(parts)


def _frac(frac: float) -> str:
    return "1" if frac == 1.0 else f"1/{round(1 / frac)}"
