"""Throughput and memory of one training step of a config's model, at its batch shape.

    python -m bench.train_step configs/enwik8_small.yaml [--steps 20] [--span 0,0.5,1]
        [--batch 8 | --batch 4,max] [--dtype bf16] [--set model.attention.impl=auto]
        [--reference-code DIR] [--time-budget 150] [--dry-run]

Spans start near 0 and grow as they are learned, and attention cost grows with them, so the
step is timed at several span fractions (of model.max_span), each held fixed. --batch sets
the micro-batch (default: the config's train.batch_size); `max` in the list (CUDA only) is
the largest micro-batch that fits at the largest span fraction, searched in this process:
estimated from the first batch's peak memory, confirmed by two steps, 15% smaller after each
out-of-memory error (the cache emptied in between). --dtype bf16 casts the whole model (and
so the optimizer's state) to bfloat16.

With --reference-code DIR (a checkout of the authors' code, facebookresearch/adaptive-span),
the authors' training step at the same shape follows each row of ours at a fixed micro-batch
(their model, their AdagradWithGradClip, their trainer's update; --reference-dtype, default
float32, as they train), and "vs authors" is our tokens/s over theirs at the same span.

On CUDA it also prints model FLOPs utilisation: the training FLOPs per token the model
reports (``train_flops_per_token``: 6 x weights plus the attention's matmuls at the planned
spans) over the GPU's dense peak for each row's dtype (pipeline.cluster.device's table;
--peak-tflops overrides it, and is needed on a GPU the table lacks). --time-budget
stops starting rows once that many seconds have passed (the rows left are listed as
skipped). --dry-run loads the config and the authors' code, prints the plan, times nothing.
Prints tables; asserts nothing.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pipeline.cluster.device import dense_peak_tflops, peak_memory_mb
from pipeline.commands.report import vocab_size_for
from pipeline.models import build_model
from pipeline.spec import load_spec
from pipeline.training.optim import build_optimizer
from pipeline.training.tasks import objective

DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
}


def is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e)


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


class Ours:
    """Our model and optimizer as the config builds them; one update = forward, nll + span
    loss, backward, optimizer step, the model's after_step (the span clamp), the span put back
    to the held fraction (as the authors' update, minus DeepSpeed's engine)."""

    name = "ours"

    def __init__(self, spec, vocab: int, device, dtype, compile: bool = False, graphs=False):
        torch.manual_seed(0)
        self.model = build_model(spec.model_kind, spec.model_params, vocab).to(device, dtype)
        self.optimizer = build_optimizer(self.model.parameters(), spec.train.optimizer)
        self.vocab, self.seq, self.device = vocab, spec.train.seq_len, device
        # train.compile's path: the layers compiled for the planned updates (the first
        # update of each span bucket compiles; the warm-up updates absorb it)
        if compile or graphs:
            self.model.compile_for_training(graphs=graphs)

    def describe(self) -> str:
        return self.model.describe()

    def prepare(self, batch: int, frac: float):
        model, optimizer = self.model, self.optimizer
        bounded = [p for p, _, _ in model.bounded_parameters()]

        def hold():
            with torch.no_grad():
                for p in bounded:
                    p.fill_(frac)

        hold()
        x = torch.randint(self.vocab, (batch, self.seq), device=self.device)
        y = torch.randint(self.vocab, (batch, self.seq), device=self.device)
        state = [model.init_state(batch, device=self.device)]

        def step():
            # as Trainer.train_step drives the model (pipeline.models.protocol): the update
            # inside planned_update(), so a model with value-dependent shapes (the span
            # lengths) uses the plan requested after the previous update instead of
            # reading the device; request_plan() once the values it plans from are final
            with model.planned_update():
                out = model(x, y, state[0])
                _, loss = objective(out.nll, model.aux_loss())
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
            model.after_step()  # the trainer's clamp of the spans
            hold()  # hold the span fixed while timing
            model.request_plan()
            state[0] = out.state

        return step

    def span_len(self) -> int:
        return max(self.model.span_lens())

    def flops_per_token(self) -> float:
        # after timed updates: at the L' planned for them (the package's count)
        return self.model.train_flops_per_token()

    def close(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        del self.model, self.optimizer


class Authors:
    """The authors' model and update at our config's shape (bench/reference_code.py)."""

    name = "authors"

    def __init__(self, ref, shape, device, dtype):
        torch.manual_seed(0)
        self.ref, self.shape, self.device, self.dtype = ref, shape, device, dtype
        self.model, self.optimizer = ref.build(shape, device, dtype)

    def describe(self) -> str:
        return f"the authors' code ({self.ref.directory}), {str(self.dtype).split('.')[-1]}"

    def prepare(self, batch: int, frac: float):
        ref, model, optimizer = self.ref, self.model, self.optimizer
        ref.hold_span(model, frac)
        x = torch.randint(self.shape.vocab, (batch, self.shape.seq), device=self.device)
        y = torch.randint(self.shape.vocab, (batch, self.shape.seq), device=self.device)
        cache = [ref.init_cache(model, batch, self.device, self.dtype)]

        def step():
            _, cache[0] = ref.step(model, optimizer, x, y, cache[0])
            ref.hold_span(model, frac)

        return step

    def span_len(self) -> int:
        return self.ref.span_len(self.model)

    def flops_per_token(self) -> float:
        s = self.shape
        weights = s.n_layers * (4 * s.d_model**2) + s.d_model * s.vocab
        return 6 * weights + s.n_layers * 6 * 2 * s.d_model * (self.span_len() + s.n_persistent)

    def close(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        del self.model, self.optimizer


def time_step(runner, batch: int, frac: float, steps: int, warmup: int) -> dict:
    """ms per update (median of ``steps`` single-update timings after ``warmup``), peak
    memory; raises the out-of-memory error if it does not fit."""
    device = runner.device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    step = runner.prepare(batch, frac)
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        sync(device)
        start = time.perf_counter()
        step()
        sync(device)
        times.append(time.perf_counter() - start)
    ms = statistics.median(times) * 1000
    return {
        "batch": batch,
        "frac": frac,
        "span": runner.span_len(),
        "ms": ms,
        "tokens_s": batch * runner_seq(runner) / ms * 1000,
        "peak_mb": peak_memory_mb(device),
        "flops": runner.flops_per_token(),
    }


def runner_seq(runner) -> int:
    return runner.seq if isinstance(runner, Ours) else runner.shape.seq


def fits(runner, batch: int, frac: float) -> bool:
    """Two updates at this micro-batch; False on an out-of-memory error (memory freed)."""
    oom = False
    try:
        step = runner.prepare(batch, frac)
        step()
        step()
        sync(runner.device)
    except (torch.cuda.OutOfMemoryError, RuntimeError) as e:
        if not is_oom(e):
            raise
        oom = True
    step = None
    runner.optimizer.zero_grad(set_to_none=True)
    free_memory()
    return not oom


def largest_batch(
    runner, frac: float, known: dict | None, fixed_bytes: int, limit: int = 1024
) -> tuple[int | None, list[int]]:
    """The largest micro-batch that fits at span ``frac``, in this process: the memory of
    ``known`` (a timed row at a smaller batch) gives an estimate, then 15% steps down.
    Returns (batch or None, the batches that did not fit)."""
    total = torch.cuda.get_device_properties(runner.device).total_memory
    if known:
        per_sample = max((known["peak_mb"] * 2**20 - fixed_bytes) / known["batch"], 1.0)
        guess = int((0.92 * total - fixed_bytes) / per_sample)
    else:
        guess = 64
    batch = max(1, min(guess, limit))
    failed = []
    while batch >= 1:
        if known and batch <= known["batch"]:
            return known["batch"], failed
        if fits(runner, batch, frac):
            return batch, failed
        failed.append(batch)
        batch = min(batch - 1, int(batch * 0.85))
    return None, failed


def row_text(code: str, r: dict, gpu: bool, peak_tflops: float | None, vs: str = "") -> str:
    text = (
        f"| {code} | {r['batch']} | {r['frac']:.4g} | {r['span']} | {r['ms']:,.1f} | "
        f"{r['tokens_s']:,.0f} | {r['peak_mb']:,.0f} |"
    )
    if gpu:  # MFU; blank where the GPU's peak is unknown
        mfu = r["tokens_s"] * r["flops"] / peak_tflops / 1e12 if peak_tflops else None
        text += f" {mfu:.1%} |" if mfu is not None else " |"
    return text + f" {vs} |"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("config")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--span", default="0,0.5,1", help="span fractions to time at")
    parser.add_argument(
        "--batch",
        default=None,
        help="micro-batch sizes, comma-separated; 'max': the largest that fits (CUDA)",
    )
    parser.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default="fp32",
        help="the model's dtype (bf16: the whole model in bfloat16)",
    )
    parser.add_argument(
        "--reference-code",
        type=Path,
        help="a checkout of the authors' code: time their step beside ours",
    )
    parser.add_argument("--reference-dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help="the GPU's dense peak in TFLOP/s for MFU, every row (default: the device's, "
        "for each row's dtype, from pipeline.cluster.device's table)",
    )
    parser.add_argument(
        "--time-budget",
        type=float,
        default=None,
        help="seconds after which no further row is started",
    )
    parser.add_argument(
        "--graphs",
        action="store_true",
        help="as --compile, with each layer's forward and backward replayed as CUDA graphs "
        "(train.compile: graphs)",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="compile our layers as train.compile does (the first update of "
        "each span bucket compiles: give --warmup >= 1)",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="load the config (and the authors' code), print the plan, time nothing",
    )
    return parser.parse_args(argv)


@dataclass
class Rows:
    """What every row of the table needs: the device, the time budget, and what was left out
    or is to be said under the table."""

    args: argparse.Namespace
    gpu: bool
    started: float = field(default_factory=time.monotonic)
    skipped: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def over_budget(self) -> bool:
        budget = self.args.time_budget
        return budget is not None and time.monotonic() - self.started > budget

    def out_of_memory(self, code: str, batch: int, frac: float) -> None:
        tail = " |" if self.gpu else ""
        print(f"| {code} | {batch} | {frac:.4g} | | out of memory | | |{tail} |", flush=True)


def time_or_oom(runner, batch: int, frac: float, steps: int, warmup: int) -> dict | None:
    """time_step, or None where the step ran out of memory (the memory freed)."""
    try:
        return time_step(runner, batch, frac, steps, warmup)
    except (torch.cuda.OutOfMemoryError, RuntimeError) as e:
        if not is_oom(e):
            raise
    free_memory()
    return None


def time_ours(ours, sizes, fracs, rows: Rows, peak) -> dict[tuple[int, float], dict]:
    args = rows.args
    timed: dict[tuple[int, float], dict] = {}
    for batch in sizes:
        for frac in fracs:
            if rows.over_budget():
                rows.skipped.append(f"ours at micro-batch {batch}, span {frac:g}")
                continue
            r = time_or_oom(ours, batch, frac, args.steps, args.warmup)
            if r is None:
                rows.out_of_memory("ours", batch, frac)
                continue
            timed[(batch, frac)] = r
            print(row_text("ours", r, rows.gpu, peak), flush=True)
    return timed


def time_authors(authors, sizes, fracs, ours_rows, rows: Rows, peak) -> None:
    args = rows.args
    for batch in sizes:
        for frac in fracs:
            if rows.over_budget():
                rows.skipped.append(f"authors at micro-batch {batch}, span {frac:g}")
                continue
            r, tried = None, batch
            while r is None and tried >= 1:
                r = time_or_oom(authors, tried, frac, args.steps, args.warmup)
                if r is None:  # theirs may not fit where ours does: half of it
                    rows.out_of_memory("authors", tried, frac)
                    tried = tried // 2 if tried == batch else 0
            if r is None:
                continue
            mine = ours_rows.get((batch, frac))
            vs = f"{mine['tokens_s'] / r['tokens_s']:.2f}x" if mine else ""
            print(row_text("authors", r, rows.gpu, peak, vs=vs), flush=True)
    rows.notes.append(
        "vs authors: our tokens/s over the authors' at the same span and "
        "micro-batch (on the authors' row; where theirs ran out of memory, over "
        "theirs at half the micro-batch)"
    )


def time_largest(ours, fracs, ours_rows, fixed_bytes: int, rows: Rows, peak) -> None:
    """Search the largest micro-batch that fits at the longest span, then time it."""
    top = max(fracs)
    known = max(
        (r for (b, f), r in ours_rows.items() if f == top),
        key=lambda r: r["batch"],
        default=None,
    )
    if rows.over_budget():
        rows.skipped.append("ours at the largest micro-batch")
        return
    best, failed = largest_batch(ours, top, known, fixed_bytes)
    rows.notes.append(
        f"the largest micro-batch that fits at span {top:g}: {best or 'none'}"
        + (f" (out of memory at {', '.join(map(str, failed))})" if failed else "")
    )
    if not best:
        return
    for frac in fracs:
        if rows.over_budget():
            rows.skipped.append(f"ours at micro-batch {best}, span {frac:g}")
            continue
        r = ours_rows.get((best, frac)) or time_step(ours, best, frac, min(rows.args.steps, 3), 1)
        print(row_text("ours", r, rows.gpu, peak), flush=True)


def print_header(plan: str, spec, ours, gpu: bool) -> None:
    params = sum(p.numel() for p in ours.model.parameters())
    print(
        f"{plan}\n{spec.name}: {params:,} parameters, {torch.get_num_threads()} threads; "
        f"{ours.describe()}\n"
    )
    header = (
        "| code | micro-batch | span frac | L' tokens | ms/step | tokens/s | peak MB |"
        + (" MFU |" if gpu else "")
        + " vs authors |"
    )
    print(header)
    print("|" + "---|" * (header.count("|") - 1))


def main() -> int:
    args = parse_args()
    rows_started = time.monotonic()
    spec = load_spec(args.config, args.overrides)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gpu = device.type == "cuda"
    rows = Rows(args, gpu, started=rows_started)
    vocab = vocab_size_for(spec)[0] or 256
    fracs = [float(f) for f in args.span.split(",")]
    batches = (args.batch or str(spec.train.batch_size)).split(",")
    sizes = [int(b) for b in batches if b != "max"]
    ref = shape = None
    if args.reference_code:
        from bench.reference_code import ReferenceCode, Shape

        ref = ReferenceCode(args.reference_code)
        shape = Shape.from_spec(spec, vocab, sizes[0] if sizes else 4)

    plan = (
        f"{spec.name}: micro-batch {', '.join(batches)} x {spec.train.seq_len}, spans "
        f"{args.span}, {args.dtype}, {device}, torch {torch.__version__}"
        + (
            f"; the authors' code from {args.reference_code} ({args.reference_dtype})"
            if ref
            else ""
        )
    )
    if args.dry_run:
        print(f"dry run: {plan}")
        return 0
    if "max" in batches and not gpu:
        print("micro-batch 'max' is searched on CUDA only: left out here\n")

    ours = Ours(spec, vocab, device, DTYPES[args.dtype], compile=args.compile, graphs=args.graphs)
    peak_ours = args.peak_tflops or dense_peak_tflops(device, DTYPES[args.dtype])
    peak_authors = args.peak_tflops or dense_peak_tflops(device, DTYPES[args.reference_dtype])
    if gpu and (peak_ours is None or (ref is not None and peak_authors is None)):
        print(f"no dense peak known for {torch.cuda.get_device_name(device)}: give --peak-tflops")
    fixed_bytes = torch.cuda.memory_allocated(device) if gpu else 0
    print_header(plan, spec, ours, gpu)
    ours_rows = time_ours(ours, sizes, fracs, rows, peak_ours)
    free_memory()
    if ref is not None:
        authors = Authors(ref, shape, device, DTYPES[args.reference_dtype])
        time_authors(authors, sizes, fracs, ours_rows, rows, peak_authors)
        authors.close()
        free_memory()
    if "max" in batches and gpu:
        time_largest(ours, fracs, ours_rows, fixed_bytes, rows, peak_ours)
    ours.close()
    if rows.notes:
        print("\n" + "\n".join(rows.notes))
    if rows.skipped:
        print(f"\nskipped (time budget of {args.time_budget:g} s spent): {'; '.join(rows.skipped)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
