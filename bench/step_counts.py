"""What a training step costs, counted on the CPU (issue 26's CPU targets), ours beside the
authors' code where `--reference-code DIR` is given:

    python -m bench.step_counts [--reference-code DIR] [--parts ops,syncs,saved,time]

1. aten ops per steady-state update (forward, backward, optimizer step, span clamp), counted
   with a TorchDispatchMode (pipeline/diagnostics/step_audit.py) at a tiny shape of enwik8_large's
   model (d 64, 4 heads, N 32, max span 256 held at 1, micro-batch 2 x 64, attention dropout
   0.4, the clipped Adagrad), at 2 and 3 layers, extrapolated to 36 (fixed + 36 x per layer);
2. host syncs per steady-state update at the same shape (pipeline/diagnostics/host_syncs.py's
   HostSyncCounter), with the places they come from; ours steps the model as the trainer
   does (each update inside ``planned_update()``, ``request_plan()`` after it);
3. bytes kept for backward per layer at enwik8_large's shape (micro-batch 4 x 512, max span
   8192 held at 1, N 2048, d 512, 8 heads, float32, training mode): the forward on the meta
   device under saved_tensors_hooks, each storage once, parameters left out, at 1 and 2
   layers (per layer = the difference). The only values either model reads back to the
   host in its forward are its span fractions: on meta they are answered with the held one;
   F.dropout runs as CUDA's fused kernel (a bool mask kept, not the CPU's float32 one);
4. the CPU step time at a shape that runs in seconds here (d 512, 8 heads, N 2048 as
   enwik8_large, 2 layers, max span 1024 held at 1, micro-batch 2 x 256): the median of
   --steps timed updates after 2 warm-ups, in each of --repeats rounds that alternate ours
   and theirs; the median round is reported.

Prints markdown tables; asserts nothing. The counts are exact and machine-independent; the
step time depends on this machine's load.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from bench.train_step import Authors, Ours
from pipeline.commands.report import vocab_size_for
from pipeline.diagnostics.host_syncs import HostSyncCounter
from pipeline.diagnostics.step_audit import OpCounter, SavedBytes
from pipeline.spec import load_spec

ROOT = Path(__file__).resolve().parent.parent

CONFIG = ROOT / "configs" / "enwik8_large.yaml"
LAYERS = 36
TINY = dict(d_model=64, n_heads=4, n_persistent=32, max_span=256, seq=64, batch=2, frac=1.0)
LARGE = dict(d_model=512, n_heads=8, n_persistent=2048, max_span=8192, seq=512, batch=4, frac=1.0)
TIMED = dict(
    d_model=512, n_heads=8, n_persistent=2048, max_span=1024, seq=256, batch=2, frac=1.0, layers=2
)


def spec_at(shape: dict, layers: int, overrides=()):
    """enwik8_large's spec (its dropout, span ramp and loss, clipped Adagrad) at this shape."""
    return load_spec(
        str(CONFIG),
        [
            f"model.n_layers={layers}",
            f"model.d_model={shape['d_model']}",
            f"model.n_heads={shape['n_heads']}",
            f"model.n_persistent={shape['n_persistent']}",
            f"model.max_span={shape['max_span']}",
            f"train.seq_len={shape['seq']}",
            *overrides,
        ],
    )


def runners(shape: dict, layers: int, ref, device="cpu"):
    """(ours, the authors' or None) at this shape, float32."""
    from bench.reference_code import Shape

    spec = spec_at(shape, layers)
    vocab = vocab_size_for(spec)[0] or 205
    ours = Ours(spec, vocab, torch.device(device), torch.float32)
    theirs = None
    if ref is not None:
        theirs = Authors(
            ref, Shape.from_spec(spec, vocab, shape["batch"]), torch.device(device), torch.float32
        )
    return ours, theirs


def steady_step(runner, shape: dict, warmup: int = 2):
    """The update closure after ``warmup`` updates (optimizer state made, cache full)."""
    step = runner.prepare(shape["batch"], shape["frac"])
    for _ in range(warmup):
        step()
    return step


# ---- 1 + 2: ops and host syncs ---------------------------------------------------------


def count(shape: dict, layers: int, ref) -> dict:
    out = {}
    for runner in runners(shape, layers, ref):
        if runner is None:
            continue
        step = runner.prepare(shape["batch"], shape["frac"])
        # the warm-up inside the sync counter: it sees the optimizer's state made (the
        # authors' step counters live on the host on a GPU too), then counts one update
        # torch's optimizers keep a tensor step counter on the host (not capturable/fused)
        steps = [
            v
            for st in runner.optimizer.state.values()
            if isinstance(st, dict)
            for k, v in st.items()
            if k == "step" and isinstance(v, torch.Tensor)
        ]
        with HostSyncCounter(host=steps) as syncs:
            step()
            step()
            first = len(syncs.syncs)
            step()
        with OpCounter() as ops:
            step()
        out[runner.name] = {"ops": ops.total, "syncs": list(syncs.syncs[first:]), "by_op": ops.ops}
    return out


def extrapolate(at2: float, at3: float, layers: int = LAYERS) -> tuple[float, float, float]:
    per_layer = at3 - at2
    fixed = at2 - 2 * per_layer
    return per_layer, fixed, fixed + layers * per_layer


def ops_and_syncs(ref) -> None:
    c2, c3 = count(TINY, 2, ref), count(TINY, 3, ref)
    shape = (
        f"d {TINY['d_model']}, {TINY['n_heads']} heads, N {TINY['n_persistent']}, max "
        f"span {TINY['max_span']} held at {TINY['frac']:g}, micro-batch {TINY['batch']} x "
        f"{TINY['seq']}, dropout 0.4, clipped Adagrad, float32, CPU"
    )
    print(f"### aten ops per update ({shape})\n")
    print("| code | 2 layers | 3 layers | per layer | fixed | scaled to 36 layers |")
    print("|---|---:|---:|---:|---:|---:|")
    scaled = {}
    for name in c2:
        per, fixed, total = extrapolate(c2[name]["ops"], c3[name]["ops"])
        scaled[name] = total
        print(
            f"| {name} | {c2[name]['ops']:,} | {c3[name]['ops']:,} | {per:,.0f} | "
            f"{fixed:,.0f} | {total:,.0f} |"
        )
    if "authors" in scaled:
        print(f"\nours / authors at 36 layers: {scaled['ours'] / scaled['authors']:.2f}")
    print(
        "\n### host syncs per steady-state update (same shape; pipeline.diagnostics.host_syncs)\n"
    )
    print("| code | 2 layers | 3 layers | per layer | scaled to 36 layers |")
    print("|---|---:|---:|---:|---:|")
    for name in c2:
        n2, n3 = len(c2[name]["syncs"]), len(c3[name]["syncs"])
        per, _, total = extrapolate(n2, n3)
        print(f"| {name} | {n2} | {n3} | {per:g} | {total:,.0f} |")
    for name in c3:
        sites: dict[str, int] = {}
        for s in c3[name]["syncs"]:
            sites[s] = sites.get(s, 0) + 1
        if sites:
            print(f"\n{name}, 3 layers, where:\n")
            for site, n in sorted(sites.items(), key=lambda kv: -kv[1])[:12]:
                print(f"- {n} x {site}")
    for name in c3:
        top = ", ".join(f"{op} {n}" for op, n in c3[name]["by_op"].most_common(12))
        print(f"\n{name}, 3 layers, most frequent ops: {top}")
    print()


# ---- 3: bytes kept for backward --------------------------------------------------------


class MetaSpanReads(TorchDispatchMode):
    """On the meta device, the host reads of a forward (the span fractions: ``.item()``,
    ``.cpu().tolist()``) get the held fraction instead of an error."""

    def __init__(self, frac: float):
        super().__init__()
        self.frac = frac
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        aten = torch.ops.aten
        meta = [a for a in args if isinstance(a, torch.Tensor) and a.is_meta]
        if meta and func is aten._local_scalar_dense.default:
            self.reads += 1
            return self.frac
        if (
            meta
            and func is aten._to_copy.default
            and kwargs.get("device") is not None
            and torch.device(kwargs["device"]).type == "cpu"
        ):
            self.reads += 1
            return torch.full(meta[0].shape, self.frac, dtype=kwargs.get("dtype") or meta[0].dtype)
        return func(*args, **kwargs)


class FusedDropout(TorchFunctionMode):
    """``F.dropout`` as CUDA runs it: on CUDA it is the fused kernel (``native_dropout``),
    which keeps a bool mask for backward; elsewhere (the CPU, the meta device) torch keeps a
    float32 mask of the same shape, 4x the bytes. The meta run uses the fused op."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.dropout:
            x, p = args[0], kwargs.get("p", args[1] if len(args) > 1 else 0.5)
            training = kwargs.get("training", args[2] if len(args) > 2 else True)
            if training and 0 < p < 1 and x.is_meta:
                return torch.native_dropout(x, p, True)[0]
        return func(*args, **kwargs)


def saved_by_forward(runner, shape: dict) -> tuple[int, int, list]:
    """(bytes autograd keeps for backward after one forward + loss, host reads answered, the
    largest storages kept)."""
    step_model = runner.model
    step_model.train()
    exclude = list(step_model.parameters())
    x = torch.randint(0, 200, (shape["batch"], shape["seq"]), device="meta")
    with MetaSpanReads(shape["frac"]) as reads, FusedDropout():
        if isinstance(runner, Ours):
            with torch.no_grad():
                for p, _, _ in step_model.bounded_parameters():
                    p.fill_(shape["frac"])
            state = step_model.init_state(shape["batch"], device="meta")
            with SavedBytes(exclude=exclude) as saved:
                out = step_model(x, x, state)
                loss = out.nll.mean() + step_model.aux_loss()
        else:
            ref = runner.ref
            ref.hold_span(step_model, shape["frac"])
            cache = ref.init_cache(step_model, shape["batch"], "meta")
            with SavedBytes(exclude=exclude) as saved:
                out, _, _ = step_model(x, cache, target=x)
                loss = torch.nn.functional.nll_loss(out.view(-1, out.size(-1)), x.view(-1))
    del loss, out
    return saved.bytes, reads.reads, saved.largest(6)


def saved_bytes(ref) -> None:
    from bench.reference_code import Shape

    results: dict[str, list[int]] = {}
    reads: dict[str, int] = {}
    largest: dict[str, list] = {}
    for layers in (1, 2):
        spec = spec_at(LARGE, layers)
        vocab = vocab_size_for(spec)[0] or 205
        with torch.device("meta"):
            built = [Ours(spec, vocab, torch.device("meta"), torch.float32)]
            if ref is not None:
                built.append(
                    Authors(
                        ref,
                        Shape.from_spec(spec, vocab, LARGE["batch"]),
                        torch.device("meta"),
                        torch.float32,
                    )
                )
        for runner in built:
            n, r, top = saved_by_forward(runner, LARGE)
            results.setdefault(runner.name, []).append(n)
            reads[runner.name] = r
            if layers == 1:
                largest[runner.name] = top
    print(
        f"### bytes kept for backward per layer (enwik8_large: micro-batch "
        f"{LARGE['batch']} x {LARGE['seq']}, max span {LARGE['max_span']} held at "
        f"{LARGE['frac']:g}, N {LARGE['n_persistent']}, d {LARGE['d_model']}, "
        f"{LARGE['n_heads']} heads, float32, dropout 0.4; meta device)\n"
    )
    print("| code | 1 layer GiB | 2 layers GiB | per layer GiB | span reads answered |")
    print("|---|---:|---:|---:|---:|")
    for name, (one, two) in results.items():
        print(
            f"| {name} | {one / 2**30:.2f} | {two / 2**30:.2f} | {(two - one) / 2**30:.2f} | "
            f"{reads[name]} |"
        )
    for name, top in largest.items():
        print(
            f"\n{name}, 1 layer, the largest storages kept: "
            + ", ".join(f"{what} {b / 2**30:.3f} GiB" for b, what in top)
        )
    print()


# ---- 4: CPU step time -------------------------------------------------------------------


def step_time(ref, steps: int, repeats: int) -> None:
    shape = TIMED
    ours, theirs = runners(shape, shape["layers"], ref)
    rounds: dict[str, list[float]] = {"ours": [], "authors": []}
    for _ in range(repeats):
        for runner in (ours, theirs):
            if runner is None:
                continue
            step = steady_step(runner, shape)
            times = []
            for _ in range(steps):
                t0 = time.perf_counter()
                step()
                times.append(time.perf_counter() - t0)
            rounds[runner.name].append(statistics.median(times) * 1000)
    print(
        f"### CPU step time (d {shape['d_model']}, {shape['n_heads']} heads, N "
        f"{shape['n_persistent']}, {shape['layers']} layers, max span {shape['max_span']} "
        f"held at {shape['frac']:g}, micro-batch {shape['batch']} x {shape['seq']}, dropout "
        f"0.4, clipped Adagrad, float32; {torch.get_num_threads()} threads; median of "
        f"{steps} updates, {repeats} alternating rounds)\n"
    )
    print(f"ours: {ours.describe()}\n")
    print("| code | ms/update (median round) | rounds | tokens/s |")
    print("|---|---:|---|---:|")
    medians = {}
    for name, ms in rounds.items():
        if not ms:
            continue
        medians[name] = statistics.median(ms)
        print(
            f"| {name} | {medians[name]:,.0f} | {', '.join(f'{m:,.0f}' for m in ms)} | "
            f"{shape['batch'] * shape['seq'] / medians[name] * 1000:,.0f} |"
        )
    if "authors" in medians:
        print(
            f"\nours vs authors: {medians['authors'] / medians['ours']:.2f}x "
            f"(the authors' ms over ours)"
        )
    print()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--reference-code",
        type=Path,
        help="a checkout of the authors' code (facebookresearch/adaptive-span)",
    )
    parser.add_argument(
        "--parts",
        default="ops,saved,time",
        help="which tables: ops (aten ops and host syncs), saved, time",
    )
    parser.add_argument("--steps", type=int, default=3, help="timed updates per round")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of the step time")
    args = parser.parse_args()

    ref = None
    if args.reference_code:
        from bench.reference_code import ReferenceCode

        ref = ReferenceCode(args.reference_code)
    parts = args.parts.split(",")
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads"
        + (f"; the authors' code from {args.reference_code}" if ref else "")
        + "\n"
    )
    if "ops" in parts:
        ops_and_syncs(ref)
    if "saved" in parts:
        saved_bytes(ref)
    if "time" in parts:
        step_time(ref, args.steps, args.repeats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
