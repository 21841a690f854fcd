"""One step of the per-parameter clipped Adagrad at a config's parameter shapes: time, aten
ops and host syncs, for pipeline.training.optim.ClippedAdagrad (its multi-tensor update, and
on the CPU its fused one), for the Python loop this project ran before, and for the authors'
AdagradWithGradClip.

    python -m bench.optim_step [configs/enwik8_large.yaml] [--reps 3] [--device cpu]
        [--threads N] [--reference-code DIR]

DIR is a checkout of facebookresearch/adaptive-span; its adagrad_with_grad_clip.py is
imported from there, never copied. The shapes come from building the config's model on the
meta device; the tensors are random, with gradients scaled so that some parameters are
clipped and some not. aten ops are those dispatched from Python (a `_foreach_*` op counts
once); host syncs are the ops that read a device value on the host
(pipeline/diagnostics/host_syncs.py). Prints a table; asserts nothing.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from pathlib import Path

import torch

from pipeline.diagnostics.host_syncs import HostSyncCounter
from pipeline.diagnostics.step_audit import OpCounter
from pipeline.spec import load_spec
from pipeline.training.optim import ClippedAdagrad

ROOT = Path(__file__).resolve().parent.parent

LR, CLIP, EPS = 0.07, 0.03, 1e-10


class LoopClippedAdagrad(torch.optim.Optimizer):
    """The step as this project ran it before the multi-tensor version, for whole parameters:
    ~26 ops per tensor, and segment_reduce checks its lengths on the host."""

    def __init__(self, params, lr, clip_norm, eps):
        super().__init__(params, {"lr": lr, "clip_norm": clip_norm, "eps": eps})
        self.index = {
            p: (
                torch.zeros(1, dtype=torch.long, device=p.device),
                torch.tensor([p.numel()], device=p.device),
            )
            for g in self.param_groups
            for p in g["params"]
        }

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                owners, lengths = self.index[p]
                g = p.grad
                run_sq = torch.segment_reduce(g.reshape(-1).square(), "sum", lengths=lengths)
                sq = run_sq.new_zeros(2).index_add_(0, owners, run_sq)[:1]
                norm = sq.sqrt()
                clip = group["clip_norm"]
                factor = torch.where(norm > clip, clip / (norm + 1e-10), 1.0)
                scale = torch.cat([factor, factor.new_zeros(1)])[owners]
                scale = scale.repeat_interleave(lengths, output_size=p.numel()).view_as(g)
                state = self.state[p]
                if not state:
                    state["sum"] = torch.zeros_like(p)
                state["sum"].addcmul_(g, g)
                std = state["sum"].sqrt().add_(group["eps"])
                p.addcdiv_(g * scale, std, value=-group["lr"])


def authors(params, reference_code: str):
    from bench.reference_code import ReferenceCode

    opt = ReferenceCode(reference_code).adagrad.AdagradWithGradClip(params, lr=LR, grad_clip=CLIP)
    # torch >= 1.12's Adagrad keeps the step count as a tensor; the authors' code was written
    # for a number (a tensor would make the lr one, read back with .item() in every addcdiv_)
    for state in opt.state.values():
        state["step"] = 0
    return opt


def shapes_of(config: str) -> list[torch.Size]:
    spec = load_spec(config)
    with torch.device("meta"):
        model = spec.build_model(256, config)
    return [p.shape for p in model.parameters() if p.requires_grad]


def measure(make, shapes, grads, reps: int, device: torch.device):
    torch.manual_seed(1)
    params = [torch.nn.Parameter(torch.randn(s, device=device) * 0.02) for s in shapes]
    for p, g in zip(params, grads, strict=False):
        p.grad = g
    opt = make(params)
    opt.step()  # warm-up: state, plans
    with OpCounter() as ops, HostSyncCounter() as counted:
        opt.step()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times = []
    for _ in range(reps):
        sync()
        start = time.perf_counter()
        opt.step()
        sync()
        times.append(time.perf_counter() - start)
    ms = statistics.median(times) * 1e3
    return ms, ops.total, len(counted.syncs), [p.detach() for p in params]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("config", nargs="?", default=str(ROOT / "configs" / "enwik8_large.yaml"))
    parser.add_argument("--reps", type=int, default=3, help="timed steps, after 2 untimed")
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads (on a busy machine, 1 times more steadily)",
    )
    parser.add_argument(
        "--reference-code", metavar="DIR", help="a checkout of facebookresearch/adaptive-span"
    )
    return parser.parse_args(argv)


def optimizers(device: torch.device, reference_code: str | None) -> list[tuple[str, object]]:
    """(row name, params -> optimizer) for each optimizer timed."""
    rows = [
        (
            "ClippedAdagrad, multi-tensor (foreach)",
            lambda ps: ClippedAdagrad(ps, lr=LR, clip_norm=CLIP, eps=EPS, fused=False),
        ),
        (
            "this project before, a loop over tensors",
            lambda ps: LoopClippedAdagrad(ps, lr=LR, clip_norm=CLIP, eps=EPS),
        ),
    ]
    if device.type == "cpu":
        rows.append(
            (
                "ClippedAdagrad, fused CPU kernel (the CPU's default)",
                lambda ps: ClippedAdagrad(ps, lr=LR, clip_norm=CLIP, eps=EPS, fused=True),
            )
        )
    if reference_code:
        rows.append(("authors' AdagradWithGradClip", lambda ps: authors(ps, reference_code)))
    return rows


def main() -> None:
    args = parse_args()
    warnings.filterwarnings("ignore", category=UserWarning)  # the authors' old signatures
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)

    shapes = shapes_of(args.config)
    torch.manual_seed(0)
    # gradient norms spread around the clip: some tensors clipped, some not
    grads = [
        torch.randn(s, device=device) * 10 ** torch.empty(()).uniform_(-5, -1).item()
        for s in shapes
    ]
    clipped = sum(g.norm().item() > CLIP for g in grads)
    rows = optimizers(device, args.reference_code)
    print(
        f"{Path(args.config).name}: {len(shapes)} parameter tensors, "
        f"{sum(s.numel() for s in shapes):,} elements ({clipped} clipped), {device}, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; "
        f"median of {args.reps} steps\n"
    )
    print("| optimizer | ms/step | aten ops/step | host syncs/step | max abs diff vs first row |")
    print("|---|---:|---:|---:|---:|")
    first = None
    for name, make in rows:
        ms, ops, syncs, params = measure(make, shapes, grads, args.reps, device)
        first = params if first is None else first
        diff = max((a - b).abs().max().item() for a, b in zip(params, first, strict=False))
        print(f"| {name} | {ms:,.0f} | {ops:,} | {syncs:,} | {diff:.1e} |", flush=True)
        del params


if __name__ == "__main__":
    main()
