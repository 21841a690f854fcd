"""One rank of tests/training/test_optim.py's two-process check of ClippedAdagrad under DeepSpeed.

Run with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT set (the test does).
For each DeepSpeed configuration it trains a toy model a few steps with ClippedAdagrad and
reports, as JSON in argv[1] (rank 0 only), how far the fp32 master weights are from a
float64 implementation of the update rule run on the same data, and which ops of the
optimizer's steps would make the host wait for the device.
"""

from __future__ import annotations

import json
import sys

import torch

from pipeline.cluster import distributed

SHAPES = {  # offsets in a 2-rank flat buffer: "emb" straddles the partitions
    "weight": (7, 5),
    "bias": (5,),
    "emb": (11, 3),
    "vec": (13,),
    "cube": (2, 3, 4),
    "frac": (3,),  # bounded to [0, 1] like the span fractions
}
# loss = Σ_k c_k/2 · ‖p_k - x_k‖²: big c_k gives ‖g_k‖ above the clip, small c_k below it
COEF = {"weight": 1.0, "bias": 1e-3, "emb": 0.5, "vec": 2e-4, "cube": 2e-3, "frac": 1.0}
LR, CLIP, EPS, STEPS = 0.1, 0.03, 1e-10, 4

CONFIGS = {
    "zero0": {"zero_optimization": {"stage": 0}},
    "zero1": {"zero_optimization": {"stage": 1}},
    "zero2": {"zero_optimization": {"stage": 2}},
    "zero3": {"zero_optimization": {"stage": 3}},
    "zero0_bf16": {"zero_optimization": {"stage": 0}, "bf16": {"enabled": True}},
    "zero1_bf16_fp32acc": {
        "zero_optimization": {"stage": 1},
        "bf16": {"enabled": True},
        "data_types": {"grad_accum_dtype": "fp32"},
    },
    "zero2_bf16": {"zero_optimization": {"stage": 2}, "bf16": {"enabled": True}},
    "zero2_foreach": {"zero_optimization": {"stage": 2}},
}
# on the CPU ClippedAdagrad updates with torch's fused kernel; these use the multi-tensor ops
# every other device runs
FOREACH = {"zero2_foreach"}


class Toy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.p = torch.nn.ParameterDict(
            {k: torch.nn.Parameter(torch.randn(s) * 0.5) for k, s in SHAPES.items()}
        )
        with torch.no_grad():
            self.p["frac"].fill_(0.5)

    def forward(self, xs: dict[str, torch.Tensor]) -> torch.Tensor:
        return sum(COEF[k] / 2 * (self.p[k].float() - xs[k]).square().sum() for k in SHAPES)


def data(step: int, rank: int, bf16: bool) -> dict[str, torch.Tensor]:
    """Each rank's inputs. Under bf16 the ranks share them: gradients of opposite sign
    averaged in bf16 cancel to values with no correct digits, and Adagrad's first steps,
    lr·g/|g|, would then flip sign where the float64 reference does not."""
    gen = torch.Generator().manual_seed(1000 * step + (0 if bf16 else rank))
    xs = {k: torch.randn(s, generator=gen) for k, s in SHAPES.items()}
    xs["frac"] -= 2.0  # pulls the bounded parameter below 0: the clamp must act
    return xs


def reference(init: dict, world: int, bf16: bool) -> tuple[list[dict], list[int]]:
    """Float64 ClippedAdagrad on the rank-averaged gradient; per step the parameters and
    (clipped, unclipped) tensor counts. With bf16, DeepSpeed's fp32 master starts from the
    bf16 model and the forward sees bf16-rounded weights: so does this."""
    p = {k: (v.to(torch.bfloat16) if bf16 else v).double() for k, v in init.items()}
    acc = {k: torch.zeros_like(v) for k, v in p.items()}
    history, counts = [], [0, 0]
    for step in range(STEPS):
        seen = {k: v.to(torch.bfloat16).double() if bf16 else v for k, v in p.items()}
        for k in SHAPES:
            g = (
                sum(COEF[k] * (seen[k] - data(step, r, bf16)[k].double()) for r in range(world))
                / world
            )
            acc[k] += g * g
            norm = g.norm().item()
            factor = min(1.0, CLIP / (norm + 1e-10))
            counts[norm <= CLIP] += 1
            p[k] = p[k] - LR * factor * g / (acc[k].sqrt() + EPS)
        p["frac"] = p["frac"].clamp(0.0, 1.0)
        history.append({k: v.clone() for k, v in p.items()})
    return history, counts


def fp32_master(engine, name: str, param: torch.Tensor) -> torch.Tensor:
    from deepspeed.utils import safe_get_full_fp32_param

    full = safe_get_full_fp32_param(param)
    if full is not None:
        return full.detach().double().view(SHAPES[name])
    if engine.optimizer is engine.basic_optimizer:  # ZeRO 0, fp32: the parameter itself
        return param.detach().double()
    # ZeRO 0, bf16: DeepSpeed's unfused wrapper keeps one fp32 copy per parameter
    for masters, params in zip(
        engine.optimizer.fp32_groups, engine.optimizer.fp16_groups, strict=False
    ):
        for m, p in zip(masters, params, strict=False):
            if p is param:
                return m.detach().double()
    raise AssertionError(f"no fp32 master found for {name}")


def straddling(engine, names: dict[int, str]) -> list[str]:
    """Parameters of which this rank's optimizer partition holds some but not all elements."""
    from pipeline.training.engine import master_layouts

    held = {}
    for layout in master_layouts(engine).values():
        for run in layout.runs:
            if run.owner < len(layout.params):
                key = id(layout.params[run.owner])
                held[key] = held.get(key, 0) + run.length
    sizes = {
        id(p): p.ds_numel if hasattr(p, "ds_numel") else p.numel()
        for p in engine.module.parameters()
    }
    return sorted(names[k] for k, n in held.items() if 0 < n < sizes[k])


def count_host_syncs(optimizer) -> dict:
    """From now on, counts the calls of `optimizer.step` (those the DeepSpeed wrappers make)
    and lists their ops that would make the host wait for the device."""
    from pipeline.diagnostics.host_syncs import HostSyncCounter

    seen, step = {"steps": 0, "syncs": []}, optimizer.step

    def counted_step(*args, **kwargs):
        with HostSyncCounter() as counted:
            out = step(*args, **kwargs)
        seen["steps"] += 1
        seen["syncs"] += counted.syncs
        return out

    optimizer.step = counted_step
    return seen


def run(name: str, extra: dict, rank: int, world: int) -> dict:
    import deepspeed

    from pipeline.training.engine import MasterClamp, bind_to_engine
    from pipeline.training.optim import ClippedAdagrad

    torch.manual_seed(0)
    model = Toy()
    init = {k: v.detach().clone() for k, v in model.p.items()}
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1 << 30,
    } | extra
    optimizer = ClippedAdagrad(
        model.parameters(), lr=LR, clip_norm=CLIP, eps=EPS, fused=False if name in FOREACH else None
    )
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    bind_to_engine(engine)
    stepped = count_host_syncs(engine.basic_optimizer)
    params = dict(engine.module.p.items())
    clamp = MasterClamp(engine, [(params["frac"], 0.0, 1.0)]).clamp
    bf16 = "bf16" in extra
    expected, counts = reference(init, world, bf16)
    errors = []
    for step in range(STEPS):
        engine.backward(engine(data(step, rank, bf16)))
        engine.step()
        clamp()
        err = 0.0
        for k, p in params.items():
            got, want = fp32_master(engine, k, p), expected[step][k]
            err = max(
                err, ((got - want).abs() / (ATOL[bf16] + RTOL[bf16] * want.abs())).max().item()
            )
        errors.append(err)
    return {
        "wrapper": type(engine.optimizer).__name__,
        "errors": errors,
        "clipped": counts[0],
        "unclipped": counts[1],
        "optimizer": stepped,
        "straddling": straddling(engine, {id(p): k for k, p in params.items()}),
    }


# fp32: the DeepSpeed run rounds each op to fp32 (2^-24 relative) over a few steps on values
# of order 1; 1e-5 relative leaves a wide margin yet is far below any clipping mistake, which
# changes updates of size ~LR by a large factor. bf16: gradients are computed, rounded and
# averaged in bf16 (each element within 2^-8 relative, the ranks sharing their data); Adagrad's
# update g/sqrt(Σg²) then moves by at most ~2^-7·LR a step: 4 steps stay within 0.05·LR.
ATOL = {False: 1e-7, True: 0.05 * LR}
RTOL = {False: 1e-5, True: 0.0}


def main() -> None:
    rank, world = distributed.init_process_group()
    names = sys.argv[2:] or list(CONFIGS)
    results = {name: run(name, CONFIGS[name], rank, world) for name in names}
    if rank == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
    distributed.exit_process(0)
