"""The memory lines of `show --estimate`: the plan per GPU of the run (an H100 and an H200),
and the shape of the update the estimate times on this machine, sized so that the estimate
never takes half of the memory available. The arithmetic is
pipeline/training/memory_plan.py's; this module chooses the shapes and words the lines."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.training.memory_plan import (
    GPUS,
    Gpu,
    Planner,
    StepPlan,
    available_memory,
    dtype_name,
    gib,
    growing_cases,
    hold_shapes_at,
    planner,
    resident_memory,
)
from pipeline.training.micro_batch import divisors_largest_first, fixed_micro_batch

SHARE = 0.45
"""Of the memory available, what the estimate plans to hold at most: under half, with room
for what the machine's other jobs take while it runs (a shared machine's available memory
moves by a gigabyte in seconds)."""
SAFETY, SLACK = 1.2, 128 * 2**20
"""The timed update is planned at SAFETY times its count and SLACK bytes more: glibc's free
lists and fragments keep more resident than torch's tensors hold, and the first calls fill
the libraries' caches (measured: up to 1.2 times and tens of MiB more,
docs/benchmarks.md#memory-plan)."""


def gpu_plan_lines(spec, model) -> list[str]:
    """The plan per GPU at the run's world size and ZeRO stage, at the full span (what
    `micro_batch_size: auto` searches at) and, for an adaptive span, the same micro-batch at
    1/16 of it. `model`: the spec's model on the meta device."""
    train = spec.train
    world = train.launcher.world_size
    rows = train.batch_size // world
    span = hold_shapes_at(model, 1.0)
    plan = planner(spec, model, "cuda", world, rows)
    s = plan.states
    where = f" at the full span ({span})" if span else ""
    if growing_cases(spec) is not None:
        where += " at the curriculum's start length (longer cases take more)"
    lines = [
        f"  memory plan per GPU ({world} process{'es' if world > 1 else ''}, {rows} rows each "
        f"an update; ZeRO "
        f"{train.deepspeed.zero_stage}; {dtype_name(plan.dtype)}){where}:",
        f"    weights {gib(s.weights.bytes)} ({s.weights.how}); optimizer states "
        f"{gib(s.optimizer.bytes)} ({s.optimizer.how})",
        f"    gradients {gib(s.gradients.bytes)} ({s.gradients.how}); DeepSpeed's gradient "
        f"bucket {gib(s.bucket.bytes)} ({s.bucket.how})",
    ]
    if plan.at(1) is None:
        fixed = s.weights.bytes + s.optimizer.bytes + s.bucket.bytes + s.gradients.bytes
        return [
            *lines,
            f"    activations: not counted ({spec.model_kind} declares no MemoryCounts): "
            f"{gib(fixed)} per GPU before them",
        ]
    chosen = {}
    for gpu in GPUS:
        mb, how = _micro_batch(train, world, plan, gpu)
        chosen[gpu.name] = mb
        lines.append(_gpu_line(gpu, plan, mb, how))
    if span and hold_shapes_at(model, 1 / 16) != span:
        short = planner(spec, model, "cuda", world, rows)
        parts = [
            f"{gpu.name} {gib(p.peak)} (micro-batch {mb})"
            for gpu in GPUS
            if (mb := chosen[gpu.name]) and (p := short.at(mb)) is not None
        ]
        if parts:
            lines.append(
                f"    at span 1/16 ({hold_shapes_at(model, 1 / 16)}), where an adaptive span "
                f"starts growing: peak {', '.join(parts)}"
            )
    return lines


def _micro_batch(train, world: int, plan: Planner, gpu: Gpu) -> tuple[int, str]:
    """The micro-batch the run would use on `gpu` and how it is chosen (0: none fits)."""
    fixed = fixed_micro_batch(train, world)
    if fixed is not None:
        if train.micro_batch_size:
            return fixed, "train.micro_batch_size"
        return fixed, "train.batch_size / processes / gradient_accumulation_steps"
    for size in divisors_largest_first(plan.rows):  # what `auto` searches on the GPU
        step = plan.at(size)
        if step is not None and step.peak <= gpu.usable:
            return size, f"auto: the largest divisor of {plan.rows} rows that fits"
    return 0, "auto: no divisor of the rows fits"


def _gpu_line(gpu: Gpu, plan: Planner, mb: int, how: str) -> str:
    head = f"    {gpu.name} ({gpu.sold_as}, {gib(gpu.usable)} to plan with):"
    largest = plan.largest_that_fits(gpu.usable)
    best = f"the largest micro-batch that fits: {largest}"
    if largest == plan.rows:
        best += f" (all {plan.rows} rows)"
    elif not largest:
        best = "not even a micro-batch of 1 row fits"
    if mb == 0:
        return f"{head} no micro-batch ({how}); {best}"
    step: StepPlan = plan.at(mb)  # type: ignore[assignment]  # counted (the caller checked)
    a = step.activations
    accum = plan.rows // mb
    verdict = "fits" if step.peak <= gpu.usable else "does NOT fit"
    return (
        f"{head} micro-batch {mb} ({how}; {accum} accumulation step(s)): activations "
        f"{gib(step.activation_bytes)} (kept for backward {gib(a.saved)}, the backward's "
        f"largest moment {gib(a.working)}, carried states {gib(a.state * step.state_copies)}); "
        f"peak {gib(step.peak)}: {verdict}; {best}"
    )


@dataclass(frozen=True)
class TimedShape:
    rows: int | None  # rows of the update to time (None: too large to time here)
    run_rows: int  # rows of the run's update on one process
    line: str  # what the estimate says of it ("" when the run's own update is timed)


def timing_shape(spec, model) -> TimedShape:
    """How many rows of the run's update to time here: the whole update where its plan (on
    this CPU's dtype, at the initial spans, with SAFETY and SLACK) keeps this process within
    SHARE of the memory available, else the most rows in one micro-batch that do, else
    none."""
    rows = spec.train.batch_size  # the estimate times the whole batch in one process
    hold_shapes_at(model, None)
    room, source = available_memory()
    rss = resident_memory()
    budget = int(SHARE * (room + rss)) - rss  # the process under half of what was available
    cpu = planner(spec, model, "cpu", 1, rows, uniform_tokens=True)
    plan = cpu.at(fixed_micro_batch(spec.train, 1) or rows)
    if plan is None or needed_here(plan) <= budget:  # not counted, or it fits: the run's own
        return TimedShape(rows, rows, "")
    half = f"{SHARE:.0%} of the {gib(room + rss)} this process had ({source})"
    low, high = 0, rows - 1  # the most rows in one micro-batch that fit; the need grows
    while low < high:
        mid = (low + high + 1) // 2
        smaller = cpu.at(mid, rows=mid)
        low, high = (mid, high) if smaller and needed_here(smaller) <= budget else (low, mid - 1)
    if not low:
        one = cpu.at(1, rows=1)
        return TimedShape(
            None,
            rows,
            f"  time here: not timed: one row of the update would take "
            f"{gib(needed_here(one) if one else 0)} here (the memory plan on the CPU, float32), "
            f"over {half}",
        )
    return TimedShape(
        low,
        rows,
        f"timing {low} of the update's {rows} rows in one micro-batch and scaling the time "
        f"by {rows}/{low}: the whole update would take {gib(needed_here(plan))} here, over {half}",
    )


def timed_update_bytes(plan: StepPlan) -> int:
    """What the timed update adds to this process by its plan: the update's peak, or
    DeepSpeed's while it builds the engine (ZeRO 1 and 2 flatten the weights and copy them:
    about four copies of them at once), whichever is larger."""
    weights = plan.states.weights.bytes
    building = 4 * weights if plan.states.zero in (1, 2) else weights
    return max(plan.peak, building)


def needed_here(plan: StepPlan) -> int:
    """What the timed update of `plan` is taken to add here, with the margins."""
    return int(SAFETY * timed_update_bytes(plan)) + SLACK
