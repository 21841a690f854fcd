"""train.compile on this machine: wall time of training updates of a config's model, eager
against per-layer torch.compile (compile time included), at the config's batch and span.

    python -m bench.compile_step configs/quickstart.yaml --steps 30 [--backend inductor]

One process, no DeepSpeed (the model's own planned updates and torch.optim.Adam): the
compile question is the model's. Prints, per mode, the first update (compiling), the median
of the rest (the two modes' updates alternate, so that a change in the machine's load hits
both), and the total; spans held at span_init (one bucket: the compile cost of one graph,
forward and backward). Set TORCHINDUCTOR_CACHE_DIR to an empty directory for a cold compile."""

from __future__ import annotations

import argparse
import statistics
import time

import torch


class Updates:
    """A model and its optimizer, trained one update per block the trainer's way."""

    def __init__(self, spec, compiled: bool, backend: str):
        torch.manual_seed(0)
        self.model = spec.build_model(256, "bench").train()
        if compiled:
            self.model.compile_for_training(backend=backend)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-4, foreach=True)
        self.state = self.model.init_state(spec.train.batch_size)

    def update(self, t: torch.Tensor) -> float:
        m, start = self.model, time.perf_counter()
        with m.planned_update():
            out = m(t[:, :-1], t[:, 1:], self.state)
            (out.nll.mean() + m.aux_loss()).backward()
            self.opt.step()
            self.opt.zero_grad()
        m.after_step()
        m.request_plan()
        self.state = out.state
        return time.perf_counter() - start


def main() -> None:
    from pipeline.spec import load_spec

    p = argparse.ArgumentParser()
    p.add_argument("config")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--backend", default="inductor")
    args = p.parse_args()
    spec = load_spec(args.config)
    train = spec.train
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"batch {train.batch_size} x {train.seq_len}"
    )
    tokens = torch.randint(0, 256, (args.steps, train.batch_size, train.seq_len + 1))
    runs = {
        "eager": Updates(spec, False, args.backend),
        f"compiled ({args.backend})": Updates(spec, True, args.backend),
    }
    times: dict[str, list[float]] = {name: [] for name in runs}
    for t in tokens:  # alternating, so that a change in the machine's load hits both
        for name, run in runs.items():
            times[name].append(run.update(t))
    for name, ts in times.items():
        print(
            f"{name:>20}: first update {ts[0]:.2f} s, then median "
            f"{statistics.median(ts[1:]) * 1e3:.0f} ms/update, "
            f"{args.steps} updates {sum(ts):.1f} s"
        )


if __name__ == "__main__":
    main()
