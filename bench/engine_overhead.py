"""What the DeepSpeed engine adds to a training step at world size 1, against a plain torch step.

    DS_ACCELERATOR=cpu .venv/bin/python -m bench.engine_overhead [--config configs/quickstart.yaml]
        [--set K=V] [--steps 20] [--batch 8] [--seq 64]

The same model, weights, batch and optimizer (the config's train.optimizer, built by
pipeline.training.optim) step in two ways:

- engine: deepspeed.initialize with pipeline.training.ds_config's config (ZeRO 0, float32
  or with --bf16 DeepSpeed's bf16 mode, one process), then engine(x, y, state),
  engine.backward(loss), engine.step(), as the
  trainer does (inside the model's planned_update(), request_plan() after it);
- plain: model(x, y, state), loss.backward(), clip_grad_norm_ where clip is global (what the
  engine's gradient_clipping does), optimizer.step(), optimizer.zero_grad().

Per step it counts the aten ops that run (a TorchDispatchMode: forward, backward and
optimizer alike) and the host syncs: the ops that make the host wait for the device on
CUDA (`.item()`, `.tolist()`, bool of a tensor, nonzero...; pipeline/diagnostics/host_syncs.py's
HostSyncCounter), with the line that asked for each. Times are the median of --steps steps after
warm-up, the three kinds of step
interleaved. Prints markdown tables; asserts
nothing. Without --config: the quickstart's model (the all-attention network) at a small
shape, with the paper's per-tensor clipped Adagrad; --set train.optimizer.clip=global and
type=adam show the other optimizer paths.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch

from pipeline.diagnostics.host_syncs import HostSyncCounter
from pipeline.diagnostics.step_audit import OpCounter
from pipeline.training.tasks import objective

ROOT = Path(__file__).resolve().parent.parent


def build(spec, vocab: int):
    from pipeline.training.optim import build_optimizer

    torch.manual_seed(spec.train.seed)
    model = spec.build_model(vocab, "the bench")
    return model, build_optimizer(model.parameters(), spec.train.optimizer)


BF16 = False  # --bf16: the engines in DeepSpeed's bf16 mode, the plain step in autocast


class Engine:
    name = "engine, ds_config, allreduce kept"

    def __init__(self, spec, vocab, batch, ds_overrides: dict):
        import deepspeed

        from pipeline.cluster import distributed
        from pipeline.training.ds_config import deepspeed_config
        from pipeline.training.engine import bind_to_engine

        distributed.init_process_group()
        model, optimizer = build(spec, vocab)
        config = deepspeed_config(spec.train, 1, micro_batch_size=batch, bf16=BF16)
        config["train_batch_size"] = batch
        config["gradient_accumulation_steps"] = 1
        config |= ds_overrides
        self.config = config
        self.engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        bind_to_engine(self.engine)
        self.model = self.engine.module

    def step(self, x, y, state):
        with self.model.planned_update():  # as Trainer.train_step drives the model
            out = self.engine(x, y, state)
            _, loss = objective(out.nll, self.model.aux_loss())
            self.engine.backward(loss)
            self.engine.step()
        self.model.request_plan()
        return out.state


class EngineNoAllreduce(Engine):
    name = "engine + the trainer's hook (no allreduce at world size 1 under ZeRO 0)"

    def __init__(self, *args):
        from pipeline.training.engine import skip_single_process_allreduce

        super().__init__(*args)
        skip_single_process_allreduce(self.engine, 1)  # ZeRO 1-3 keep it


class Plain:
    name = "plain torch"

    def __init__(self, spec, vocab, batch, ds_overrides: dict):
        self.model, self.optimizer = build(spec, vocab)
        opt = spec.train.optimizer
        self.clip = opt.clip_norm if opt.clip == "global" else None

    def step(self, x, y, state):
        with self.model.planned_update():  # the model driven as the engine's is
            with torch.autocast(x.device.type, torch.bfloat16, enabled=BF16):
                out = self.model(x, y, state)
            _, loss = objective(out.nll, self.model.aux_loss())
            loss.backward()
            if self.clip is not None:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        self.model.request_plan()
        return out.state


def count(runner, x, y, warmup: int) -> dict:
    """Warm up, then count the ops and host syncs of one step."""
    runner.state = runner.model.init_state(x.shape[0])
    for _ in range(warmup):
        runner.state = runner.step(x, y, runner.state)
    with OpCounter() as counter, HostSyncCounter() as syncs:
        runner.state = runner.step(x, y, runner.state)
    return {"ops": counter.total, "by_op": counter.ops, "syncs": list(syncs.syncs)}


def time_round_robin(runners: dict, x, y, steps: int) -> dict[str, float]:
    """Median ms/step of each runner, their steps interleaved so that a machine whose load
    changes (shared CPUs) slows them alike."""
    times = {name: [] for name in runners}
    for _ in range(steps):
        for name, runner in runners.items():
            start = time.perf_counter()
            runner.state = runner.step(x, y, runner.state)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


# quickstart.yaml shrunk to the measured model: 4 layers, d 64, the paper's clipped Adagrad
SMALL = [
    "model.d_model=64",
    "model.n_layers=4",
    "model.n_heads=4",
    "model.n_persistent=16",
    "model.max_span=128",
    "model.attn_dropout=0.0",
    "model.emb_dropout=0.0",
    "model.out_dropout=0.0",
    "train.optimizer.type=adagrad",
    "train.optimizer.clip=per_param",
    "train.optimizer.clip_norm=0.03",
    "train.optimizer.lr=0.07",
    "tracking.enabled=false",
]
# the engine's config keys the report shows
SHOWN_KEYS = (
    "gradient_clipping",
    "steps_per_print",
    "wall_clock_breakdown",
    "bf16",
    "fp16",
    "zero_optimization",
)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=str(ROOT / "configs" / "quickstart.yaml"))
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument(
        "--ds",
        action="append",
        default=[],
        metavar="KEY=JSON",
        help="override a top-level key of the engine's DeepSpeed config",
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--bf16",
        action="store_true",
        help="engines in DeepSpeed's bf16 "
        "mode (fp32 masters), the plain step under torch.autocast(bf16)",
    )
    return parser.parse_args(argv)


def measure(spec, args) -> tuple[dict, dict, int]:
    """Each step's counts and median time: (results by step name, the engine's DeepSpeed
    config, the model's parameter count)."""
    vocab = 256
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (args.batch, args.seq + 1), generator=gen)
    x, y = tokens[:, :-1], tokens[:, 1:]
    ds_overrides = {k: json.loads(v) for k, v in (item.split("=", 1) for item in args.ds)}
    results, runners = {}, {}
    for kind in (Engine, EngineNoAllreduce, Plain):
        runner = runners[kind.name] = kind(spec, vocab, args.batch, ds_overrides)
        results[kind.name] = count(runner, x, y, args.warmup)
        if kind is Engine:
            engine_config = runner.config
    for name, ms in time_round_robin(runners, x, y, args.steps).items():
        results[name]["ms"] = ms
    params = sum(p.numel() for p in runner.model.parameters())
    return results, engine_config, params


def render(results: dict, engine_config: dict, params: int, spec, args) -> None:
    opt = spec.train.optimizer
    print(
        f"{spec.model_kind}, {params:,} parameters, micro-batch {args.batch} x {args.seq}, "
        f"{'bf16 (plain: autocast)' if BF16 else 'float32'}, "
        f"optimizer {opt.type} (clip {opt.clip}), CPU, {args.threads} thread(s), torch "
        f"{torch.__version__}; host syncs by pipeline/diagnostics/host_syncs.py\n"
    )
    print("| step | ms/step (median) | aten ops/step | host syncs/step |")
    print("|---|---:|---:|---:|")
    for name, r in results.items():
        print(f"| {name} | {r['ms']:.1f} | {r['ops']:,} | {len(r['syncs'])} |")
    eng, plain = results[Engine.name], results[Plain.name]
    print()
    for name in (Engine.name, EngineNoAllreduce.name):
        r = results[name]
        print(
            f"{name} - plain: {r['ops'] - plain['ops']:+,} aten ops, "
            f"{len(r['syncs']) - len(plain['syncs']):+} host syncs, "
            f"{r['ms'] - plain['ms']:+.1f} ms/step"
        )
    print()
    diff = {
        op: eng["by_op"][op] - plain["by_op"][op]
        for op in eng["by_op"].keys() | plain["by_op"].keys()
    }
    shown = sorted((d, op) for op, d in diff.items() if d)[::-1]
    if shown:
        print("| aten op | engine - plain |")
        print("|---|---:|")
        for d, op in shown[:15]:
            print(f"| {op} | {d:+} |")
    for name, r in results.items():
        if r["syncs"]:
            print(f"\nhost syncs of one {name} step, by the line that asked:")
            for line, n in collections.Counter(r["syncs"]).most_common():
                print(f"  {n:>4}  {line}")
    print(
        "\nthe engine's config: "
        + json.dumps({k: engine_config.get(k) for k in SHOWN_KEYS if k in engine_config})
    )


def main() -> None:
    args = parse_args()
    global BF16
    BF16 = args.bf16
    torch.set_num_threads(args.threads)

    from pipeline.spec import load_spec

    small = args.config.endswith("quickstart.yaml")
    spec = load_spec(args.config, [*SMALL, *args.overrides] if small else args.overrides)
    render(*measure(spec, args), spec, args)


if __name__ == "__main__":
    main()
