"""`allattn-pipe show CFG --estimate`: what a config costs before it runs. Tokens to train
per stage (arithmetic on the spec), evaluate's tokens, a step timed on this machine, and H100
/ H200 hours from the model's FLOPs per token and the MFU the GPU check recorded
(pipeline/commands/recorded_gpu.py). Every number is printed with where it came from."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

from pipeline.commands import recorded_gpu
from pipeline.commands.report import vocab_size_for
from pipeline.data.manifest import MANIFEST, load_manifest
from pipeline.errors import PipelineError

TRAINING_STAGES = ("train", "finetune", "curriculum")
NON_TRAINING_STAGES = ("download", "preprocess", "evaluate")
SHORT_SPAN = 1 / 16  # the recorded step's other span fraction


@dataclass(frozen=True)
class StageTokens:
    stage: str
    updates: int
    tokens: int
    how: str
    at_least: bool = False  # the curriculum's lengths grow from start_length


def training_tokens(spec) -> list[StageTokens]:
    """Tokens each training stage of the spec feeds the model: updates x sequences per
    update (train.batch_size: every process's micro-batches and accumulation together) x
    tokens per sequence."""
    out = []
    for stage in spec.stages:
        if stage in ("train", "finetune"):
            train = spec.train
            steps = train.steps if stage == "train" else spec.finetune.steps
            key = "train.steps" if stage == "train" else "finetune.steps"
            generator = spec.dataset.generator
            if generator is not None and (task := generator.frequency_sort) is not None:
                # an update reads whole documents, in segments of seq_len with the memory
                # carried: the input, the separator and the sorted vocabulary
                per_row = task.length + 1 + task.vocab
                what = (
                    f"{per_row:,} tokens (a whole document: {task.length:,} "
                    f"(frequency_sort.length) + the separator + {task.vocab} sorted symbols)"
                )
            else:
                per_row, what = train.seq_len, f"{train.seq_len} tokens (train.seq_len)"
            how = (
                f"{steps:,} updates ({key}) x {train.batch_size} sequences (train.batch_size, "
                f"all processes) x {what}"
            )
            out.append(StageTokens(stage, steps, steps * train.batch_size * per_row, how))
        elif stage == "curriculum":
            cur = spec.dataset.generator.algorithmic.curriculum
            updates = cur.epochs * cur.steps_per_epoch
            batch = spec.train.batch_size
            how = (
                f"{cur.epochs} epochs x {cur.steps_per_epoch} updates x {batch} cases x at "
                f"least {cur.start_length} tokens (start_length; the length grows as the "
                f"cases are solved)"
            )
            out.append(StageTokens(stage, updates, updates * batch * cur.start_length, how, True))
    return out


def unknown_stages(spec) -> list[str]:
    """Stages the estimator cannot cost (a plugin's), each as a line."""
    return [
        f"stage '{s}': not estimated (the estimator knows {', '.join(TRAINING_STAGES)})"
        for s in spec.stages
        if s not in TRAINING_STAGES + NON_TRAINING_STAGES
    ]


def evaluate_tokens(spec) -> str | None:
    """The evaluate stage's tokens per split and their source, as a line; None without it."""
    if "evaluate" not in spec.stages:
        return None
    if "curriculum" in spec.stages:
        return "evaluate: generated cases at the curriculum's lengths (not counted)"
    preprocess = spec.workspace_dir / "preprocess"
    if (preprocess / MANIFEST).is_file():
        splits = load_manifest(preprocess)["splits"]
        sizes = {s: splits[s]["tokens"] for s in spec.evaluate.splits}
        return f"evaluate: {_splits(sizes)} (from {preprocess / MANIFEST})"
    card = spec.dataset
    task = card.generator.frequency_sort if card.generator else None
    if task is not None:
        per_doc = task.length + 1 + task.vocab
        sizes = {s: getattr(task.sequences, s) * per_doc for s in spec.evaluate.splits}
        return (
            f"evaluate: {_splits(sizes)} read (dataset card '{card.name}': sequences x "
            f"{per_doc} tokens a document; its {task.vocab} sorted symbols scored)"
        )
    counts = {s: getattr(card.split, s) for s in spec.evaluate.splits}
    if (
        card.generator is None
        and card.split.kind == "tail"
        and card.tokenizer.kind in ("byte", "char")
        and all(v >= 1 for v in counts.values())
    ):
        sizes = {s: int(v) for s, v in counts.items()}
        return (
            f"evaluate: {_splits(sizes)} (dataset card '{card.name}': split sizes in "
            f"{card.tokenizer.kind}s, one token each)"
        )
    return "evaluate: tokens unknown until preprocess has run (the manifest counts them)"


def _splits(sizes: dict[str, int]) -> str:
    return ", ".join(f"{split} {n:,} tokens" for split, n in sizes.items())


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


def adaptive_span(model) -> bool:
    planner = getattr(model, "span_planner", None)
    return bool(planner is not None and planner.adaptive)


def flops_per_token(model, span_frac: float) -> tuple[float, str]:
    """Training FLOPs per token (the model's ``train_flops_per_token()``) with every layer's
    span at ``span_frac`` of max_span, L' planned as the trainer plans it, and what L' was."""
    planner = getattr(model, "span_planner", None)
    if planner is None:
        return model.train_flops_per_token(), ""
    from pipeline.models.allattn.layers import planned_span_len

    span = planner.max_span
    if planner.adaptive:
        span = planned_span_len(span_frac, planner.max_span, planner.ramp)
    planner.planned = [span] * planner.n_layers
    return model.train_flops_per_token(), f"L' {span}"


def counts_weights_only(model) -> bool:
    """Whether the model's FLOP count is the protocol's default, 6 per weight, without the
    attention over its context or memory (a family adds those in an override)."""
    from pipeline.models.protocol import SequenceModel

    return type(model).train_flops_per_token is SequenceModel.train_flops_per_token


def gpu_hours(tokens: int, flops: float, mfu: float) -> float:
    """Hours to train `tokens` at `flops` per token and `mfu` of an H100's dense bf16 peak."""
    return tokens * flops / (mfu * recorded_gpu.H100_BF16_PEAK_TFLOPS * 1e12) / 3600


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
    stages = training_tokens(spec) if stages is None else stages
    model = meta_model(spec)
    fracs = [1.0, SHORT_SPAN] if adaptive_span(model) else [1.0]
    out = []
    for frac in fracs:
        record = recorded_gpu.estimate_record(frac)
        flops, span_len = flops_per_token(model, frac)
        label = ""
        if getattr(model, "span_planner", None) is not None:
            label = "the full span" if frac == 1.0 else "span 1/16"
        hours = {s.stage: gpu_hours(s.tokens, flops, record["mfu"]) for s in stages}
        out.append(GpuEstimate(label, flops, span_len, record, hours, counts_weights_only(model)))
    return out


@dataclass(frozen=True)
class StepTime:
    seconds: float  # per update, extrapolated to the update's rows
    measured: str  # how


def measure_step(spec, budget_s: float = 60.0) -> StepTime:
    """One update of the spec's model and optimizer on its device, timed: 1 warm-up, then up
    to 3 timed updates while they stay within `budget_s`, at micro-batch 1 (a paper-size
    model would not fit or would take minutes at its full batch on a CPU), extrapolated
    linearly to the update's rows. The spans are the config's initial ones (span_init), as
    a run's first updates have them: at the full span a paper model's update takes minutes
    and gigabytes on a CPU (the H100 figures give both ends)."""
    import torch

    from pipeline.cluster.device import resolve_device
    from pipeline.training.optim import build_optimizer

    device = resolve_device(spec.train.device)
    dtype = torch.float32
    ds = spec.train.deepspeed
    if device.type == "cuda" and ds.fp16:
        dtype = torch.float16
    elif device.type == "cuda" and ds.bf16 is not False and torch.cuda.is_bf16_supported():
        dtype = torch.bfloat16
    if "curriculum" in spec.stages:
        seq = spec.dataset.generator.algorithmic.curriculum.start_length
    else:
        seq = spec.train.seq_len
    vocab, origin = vocab_size_for(spec)
    if vocab is None:
        raise PipelineError(f"{spec.source}: the vocabulary size is unknown until preprocess")
    torch.manual_seed(0)
    model = spec.build_model(vocab, origin).to(device, dtype)
    optimizer = build_optimizer(model.parameters(), spec.train.optimizer)
    x = torch.randint(vocab, (1, seq), device=device)
    state = [model.init_state(1, device=device)]

    def update() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        with model.planned_update():
            out = model(x, x, state[0])
            loss = out.nll.float().mean() + model.aux_loss()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        model.after_step()
        model.request_plan()
        state[0] = out.state
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    warmup = update()
    timed: list[float] = []
    while len(timed) < 3 and sum(timed) + (timed[-1] if timed else warmup) <= budget_s:
        timed.append(update())
    per_row = statistics.median(timed) if timed else warmup
    rows = spec.train.batch_size
    what = (
        f"median of {len(timed)} timed"
        if timed
        else "the warm-up alone, over the budget (with its first-call costs: high)"
    )
    measured = (
        f"{device.type}, {str(dtype).removeprefix('torch.')}: 1 warm-up + {len(timed)} timed "
        f"updates of micro-batch 1 x {seq} tokens, {what}: {per_row:.3f} s, x {rows} rows "
        f"(train.batch_size) extrapolated linearly"
    )
    if spans := getattr(model, "span_lens", None):
        measured += f"; the initial spans (L' up to {max(spans())})"
    return StepTime(per_row * rows, measured)


def estimate_report(spec, measure: bool = True, progress=None) -> str:
    """The lines `show --estimate` prints."""
    stages = training_tokens(spec)
    lines = ["estimate:"]
    lines += [f"  {line}" for line in unknown_stages(spec)]
    if not stages:
        lines.append(
            f"  no stage trains (stages: {', '.join(spec.stages)}): no tokens or hours to "
            f"estimate (the estimator costs {', '.join(TRAINING_STAGES)})"
        )
        return "\n".join(lines)
    lines.append("  tokens to train:")
    for s in stages:
        n = f">= {s.tokens:,}" if s.at_least else f"{s.tokens:,}"
        lines.append(f"    {s.stage:<10} {n} tokens = {s.how}")
    if (evaluate := evaluate_tokens(spec)) is not None:
        lines.append(f"  {evaluate}")
    estimates = gpu_estimates(spec, stages)
    for est in estimates:
        where = f" at {est.span} ({est.span_len})" if est.span else ""
        lines.append(
            f"  model FLOPs per token (forward + backward){where}: {est.flops / 1e9:.3f} GFLOP "
            f"(the model's train_flops_per_token())"
        )
    if measure:  # gpu_estimates has refused a vocabulary unknown before preprocess
        if progress is not None:
            progress(
                f"timing updates of {spec.name}'s model here (1 warm-up, then up to 3 "
                f"within 60 s)..."
            )
        step = measure_step(spec)
        lines.append(
            f"  step time here: {step.seconds:,.2f} s per update (measured: {step.measured})"
        )
        here = {s.stage: s.updates * step.seconds / 3600 for s in stages}
        lines.append(f"  hours here: {_hours_line(here)} (updates x the step time here)")
    for est in estimates:
        r = est.record
        where = f" at {est.span}" if est.span else ""
        lines.append(
            f"  H100 hours{where}: {_hours_line(est.hours)} (tokens x FLOPs per token / "
            f"(MFU {r['mfu']:.1%} x {recorded_gpu.H100_BF16_PEAK_TFLOPS:.0f} TFLOP/s); MFU "
            f"recorded {r['date']} on {r['machine']}, torch {r['torch']}, {r['config']}'s model, "
            f"bf16, {r['code']} (micro-batch {r['micro_batch']}), span {_frac(r['span_frac'])}: "
            f"{r['tokens_s']:,} tok/s; {r['source']})"
        )
    peak = recorded_gpu.H100_BF16_PEAK_TFLOPS
    for est in estimates:
        where = f" at {est.span}" if est.span else ""
        lines.append(
            f"  H200 hours{where}: {_hours_line(est.hours)} (H200: not measured; H100's MFU "
            f"assumed: the same {peak:.0f} TFLOP/s dense bf16 peak, its faster memory not counted)"
        )
    if any(s.at_least for s in stages):
        lines.append("  (>=: at the curriculum's start length; longer cases cost more)")
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


def _hours_line(hours: dict[str, float]) -> str:
    parts = [f"{stage} {format_hours(h)}" for stage, h in hours.items()]
    if len(hours) > 1:
        parts.append(f"total {format_hours(sum(hours.values()))}")
    return ", ".join(parts)


def _frac(frac: float) -> str:
    return "1" if frac == 1.0 else f"1/{round(1 / frac)}"
