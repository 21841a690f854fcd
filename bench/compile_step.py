"""train.compile on this machine: wall time of training updates of a config's model, eager
against per-layer torch.compile (compile time included), at the config's batch and span.

    python bench/compile_step.py configs/quickstart.yaml --steps 30 [--backend inductor]

One process, no DeepSpeed (the model's own planned updates and torch.optim.Adam): the
compile question is the model's. Prints, per mode, the first update (compiling), the mean
of the rest, and the total; spans held at span_init (one bucket: the compile cost of one
graph per layer shape, forward and backward)."""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def run(spec, compiled: bool, steps: int, backend: str) -> list[float]:
    torch.manual_seed(0)
    train = spec.train
    model = spec.build_model(256, "bench").train()
    if compiled:
        model.compile_for_training(backend=backend)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4, foreach=True)
    tokens = torch.randint(0, 256, (steps, train.batch_size, train.seq_len + 1))
    state, times = model.init_state(train.batch_size), []
    for t in tokens:
        start = time.perf_counter()
        with model.planned_update():
            out = model(t[:, :-1], t[:, 1:], state)
            (out.nll.mean() + model.aux_loss()).backward()
            opt.step()
            opt.zero_grad()
        model.after_step()
        model.request_plan()
        state = out.state
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    from pipeline.spec import load_spec

    p = argparse.ArgumentParser()
    p.add_argument("config")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--backend", default="inductor")
    args = p.parse_args()
    spec = load_spec(args.config)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"batch {spec.train.batch_size} x {spec.train.seq_len}")
    for compiled in (False, True):
        times = run(spec, compiled, args.steps, args.backend)
        name = f"compiled ({args.backend})" if compiled else "eager"
        print(f"{name:>20}: first update {times[0]:.2f} s, then "
              f"{statistics.mean(times[1:]) * 1e3:.0f} ms/update, "
              f"{args.steps} updates {sum(times):.1f} s")


if __name__ == "__main__":
    main()
