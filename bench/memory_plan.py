"""The memory plan (pipeline/training/memory_plan.py) against measured peaks: on this machine,
the update `show --estimate` times, planned and then run; on an H100 and an H200, the steps
whose peaks docs/benchmarks.md records.

    python -m bench.memory_plan [--configs quickstart,sort_4k_cpu,...] [--no-cpu]

On the CPU each config runs in a fresh process: the libraries are loaded and a tiny
update is run first (so their lazy imports are not counted), the resident set's high-water
mark is reset (/proc/self/clear_refs) and the baseline taken, then the trainer is built and
two updates run; measured = the high-water mark (VmHWM) less the baseline. Twice: with
glibc's allocator as it is, and with MALLOC_MMAP_THRESHOLD_=65536, where every block over 64
KiB is its own mapping and goes back to the system when freed, so the resident set follows
torch's tensors instead of the allocator's free lists. Planned = the plan of that update on
the CPU in float32 at the initial spans (what the estimate plans before it times), without
the estimate's margin.

The GPU rows are enwik8_large's step as bench/train_step.py measured it (gpu_records.py,
docs/benchmarks.md): the model cast to bf16 whole, torch's Adagrad (its state bf16 too), no
DeepSpeed, the state carried from the previous step, spans held at a fraction; planned =
that setting's plan (weights, Adagrad's sum and the gradients 2 bytes a weight each).
Prints tables; asserts nothing."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = {
    "quickstart": ("configs/quickstart.yaml", []),
    "sort_4k_cpu": ("configs/infinity_former/sort_4k_cpu.yaml", []),
    "sort_4k/batch1": ("configs/infinity_former/sort_4k.yaml", ["train.batch_size=1"]),
    "wt103_conv/batch4": ("configs/active_memory/wt103_conv.yaml", ["train.batch_size=4"]),
    "enwik8_large/4layers/batch2": (
        "configs/enwik8_large.yaml",
        ["model.n_layers=4", "train.batch_size=2"],
    ),
}
"""name: (config, --set): updates that run in a minute or two on 2 cores, one per family
(and the paper's layer)."""

MMAP = {"MALLOC_MMAP_THRESHOLD_": "65536"}
H200_REFERENCE = ("H200", "reference op, eager (bf16)", 4, 1.0, 35.3 * 1024)
"""docs/benchmarks.md#auto: enwik8_large's reference step, bf16, micro-batch 4, span 1, on an
H200 (torch 2.11, 2026-11-26): 35.3 GiB."""


def status_bytes(key: str) -> int:
    return int(re.search(rf"{key}:\s+(\d+)", open("/proc/self/status").read()).group(1)) * 1024


def child(config: str, sets: list[str]) -> None:
    """In a fresh process: plan the update, then measure it (module doc); prints JSON."""
    import ctypes
    import gc

    from pipeline.commands.estimate import meta_model
    from pipeline.commands.memory_report import timed_update_bytes
    from pipeline.commands.update_timing import UpdateTimer
    from pipeline.spec import load_spec
    from pipeline.training.memory_plan import planner
    from pipeline.training.micro_batch import fixed_micro_batch

    with tempfile.TemporaryDirectory() as tmp:
        common = [f"workspace.root={tmp}", "tracking.enabled=false"]
        tiny = ["model.n_layers=1", "train.batch_size=2", "train.seq_len=8"]
        warm = UpdateTimer(load_spec("configs/quickstart.yaml", [*common, *tiny]))
        warm.time(1)
        warm.close()
        spec = load_spec(config, [*sets, *common])
        model = meta_model(spec)
        model.hold_shapes_at(None)
        rows = spec.train.batch_size
        plan = planner(spec, model, "cpu", 1, rows, uniform_tokens=True)
        step = plan.at(fixed_micro_batch(spec.train, 1) or rows)
        assert step is not None, f"{spec.model_kind} counts no activations"
        del model
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the high-water mark to the resident set now
        base = status_bytes("VmRSS")
        timer = UpdateTimer(spec)
        timer.time(2)
        measured = status_bytes("VmHWM") - base
    print(json.dumps({"planned": timed_update_bytes(step), "measured": measured}))


def measure(config: str, sets: list[str], env: dict[str, str]) -> dict:
    """{"planned", "measured"} bytes of `config`'s timed update (`child`, in a fresh process
    started in the checkout, whatever the caller's directory)."""
    command = [sys.executable, "-m", "bench.memory_plan", "--child", config, *sets]
    out = subprocess.run(
        command, env={**os.environ, **env}, cwd=ROOT, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def cpu_table(names: list[str]) -> None:
    print("| config | planned MiB | measured MiB (glibc) | planned / measured | measured MiB "
          "(mmap threshold 64 KiB) | planned / measured |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|")
    for name in names:
        config, sets = CONFIGS[name]
        plain = measure(config, sets, {})
        mapped = measure(config, sets, MMAP)
        mib = 2**20
        print(
            f"| {name} | {plain['planned'] / mib:,.0f} | {plain['measured'] / mib:,.0f} | "
            f"{plain['planned'] / plain['measured']:.2f} | {mapped['measured'] / mib:,.0f} | "
            f"{mapped['planned'] / mapped['measured']:.2f} |",
            flush=True,
        )


def gpu_plan(code: str, micro_batch: int, span_frac: float) -> int:
    """The plan of bench/train_step.py's step of enwik8_large on a GPU (module doc)."""
    import torch

    from pipeline.commands.estimate import meta_model
    from pipeline.models.capabilities import ActivationMemory
    from pipeline.models.protocol import count_elements
    from pipeline.spec import load_spec
    from pipeline.training.memory_plan import ModelStates, Part, StepPlan

    impl = "triton" if code.startswith("triton") else "reference"
    with tempfile.TemporaryDirectory() as tmp:
        spec = load_spec(
            "configs/enwik8_large.yaml",
            [f"workspace.root={tmp}", f"model.attention.impl={impl}"],
        )
    model = meta_model(spec)
    model.hold_shapes_at(span_frac)
    bf16 = 2 * count_elements(model.parameters())  # the weights, Adagrad's sum, the gradients
    states = ModelStates(0, Part(bf16, ""), Part(bf16, ""), Part(bf16, ""), Part(0, ""))
    counts: ActivationMemory = model.activation_memory(micro_batch, 512, torch.bfloat16, "cuda")
    return StepPlan(states, micro_batch, counts, 2).peak  # the state in and out


def gpu_table() -> None:
    from pipeline.commands import gpu_records

    rows = [
        ("H100", r["code"], r["micro_batch"], r["span_frac"], r["peak_mb"])
        for r in gpu_records.records()
        if "eager" in r["code"]
    ]
    print("| GPU | code | micro-batch | span | measured MiB | planned MiB | planned / measured |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for gpu, code, mb, frac, peak in [*rows, H200_REFERENCE]:
        planned = gpu_plan(code, mb, frac) / 2**20
        span = "1" if frac == 1 else f"1/{round(1 / frac)}"
        print(
            f"| {gpu} | {code} | {mb} | {span} | {peak:,.0f} | {planned:,.0f} | "
            f"{planned / peak:.2f} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default=",".join(CONFIGS), help="names from CONFIGS")
    parser.add_argument("--no-cpu", action="store_true", help="the GPU table only")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], args.child[1:])
        return
    gpu_table()
    if not args.no_cpu:
        print()
        cpu_table(args.configs.split(","))


if __name__ == "__main__":
    main()
