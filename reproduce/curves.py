"""Short learning curves on real text: the all-attention network against the Transformer +
adaptive span baseline at (nearly) equal parameter count, character level, on CPU.

    python -m reproduce.curves [--steps 400] [--eval-every 50] [--models allattn,transformer]

Data: WikiText-2 (the shared copy, ../shared/data/wikitext-2 beside the checkout) read as
unicode characters; the vocabulary is the training file's characters plus one id for
characters only the validation file has. Training: B parallel streams over the training
text, consecutive segments of M characters, the cache carried from segment to segment (the
paper's Transformer-XL-style training), the project's model and optimizers
(``pipeline.training.optim``: Adam with global clipping, or the paper's ClippedAdagrad), linear
warmup.
Validation: the first --valid-chars characters of the validation file, cut into 8 streams,
scored block by block with the cache (every character once), in bits per character.

Equal parameters, matched the way the paper matches its small models (18 all-attention
layers with N = 2d vs 12 Transformer layers with FF 4d: 18 x 8d^2 = 12 x 12d^2): here
6 all-attention layers with N = 2d persistent vectors per head against 4 Transformer layers
with a 4d ReLU feed-forward; both have d, H, the span settings, embeddings and output in
common. The exact counts are printed.

A benchmark: it prints a table and asserts nothing. The numbers depend on the machine only
through floating-point reordering (seeded; threads fixed with --threads).
"""

from __future__ import annotations

import argparse
import gzip
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch

from pipeline.data import StreamBatches
from pipeline.models import AllAttnConfig, AllAttnLM, count_parameters
from pipeline.training.evaluation import LN2, evaluate_nll
from pipeline.training.optim import ClippedAdagrad, LrSchedule

ROOT = Path(__file__).resolve().parent.parent


def find_data() -> Path:
    for base in (ROOT.parent / "shared" / "data", ROOT / "shared" / "data"):
        if (base / "wikitext-2" / "wiki.train.tokens.gz").exists():
            return base / "wikitext-2"
    raise SystemExit(
        "WikiText-2 not found in ../shared/data/wikitext-2 (see shared/data/README.md)"
    )


def load_chars(data: Path, train_chars: int, valid_chars: int):
    """Character ids of the train text and a valid slice; a character the training text
    never has gets one extra id."""
    train = gzip.open(data / "wiki.train.tokens.gz", "rt", encoding="utf-8").read()
    valid = gzip.open(data / "wiki.valid.tokens.gz", "rt", encoding="utf-8").read()
    if train_chars:
        train = train[:train_chars]
    valid = valid[:valid_chars]
    chars = sorted(set(train))
    index = {c: i for i, c in enumerate(chars)}
    unk = len(chars)
    enc = lambda text: np.array([index.get(c, unk) for c in text], dtype=np.int64)  # noqa: E731
    return enc(train), enc(valid), len(chars) + 1


def model_configs(args) -> dict[str, AllAttnConfig]:
    common = dict(
        d_model=args.d,
        n_heads=args.heads,
        max_span=args.max_span,
        adaptive_span=True,
        span_ramp=32,
        span_loss_coef=args.span_loss,
        attn_dropout=args.dropout,
    )
    return {
        "allattn": AllAttnConfig(
            n_layers=args.allattn_layers, n_persistent=args.n_persistent, ff_dim=0, **common
        ),
        "transformer": AllAttnConfig(
            n_layers=args.transformer_layers,
            n_persistent=0,
            ff_dim=args.ff_dim,
            ff_kind="relu",
            **common,
        ),
    }


def valid_bpc(model, valid: np.ndarray, seq_len: int) -> float:
    """The pipeline's full evaluation (every character scored once, with the cache)."""
    total, count = evaluate_nll(
        model, valid, batch_size=8, seq_len=seq_len, device=torch.device("cpu")
    )
    return total / count / LN2


def train_curve(name, cfg, train, valid, vocab, args) -> list[tuple[int, float, float, float]]:
    torch.manual_seed(args.seed)
    model = AllAttnLM(cfg, vocab)
    groups = Counter(model.parameter_groups())
    print(
        f"\n[{name}] {cfg.n_layers} layers, d {cfg.d_model}, H {cfg.n_heads}, "
        f"N {cfg.n_persistent}, ff {cfg.ff_dim}: {count_parameters(model):,} parameters "
        f"({', '.join(f'{k} {v:,}' for k, v in groups.most_common())})",
        flush=True,
    )
    if args.optimizer == "adagrad":
        opt = ClippedAdagrad(model.parameters(), lr=args.lr, clip_norm=args.clip)
    else:
        opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    schedule = LrSchedule(args.lr, args.warmup, "linear_warmup")  # the pipeline's, from --lr
    bsz, m = args.batch, args.seq_len
    batches = StreamBatches(train, bsz, m)
    state = model.init_state(bsz)
    curve = [(0, valid_bpc(model, valid, m), float("nan"), 0.0)]
    print(f"[{name}] step {0:>5}  valid bpc {curve[0][1]:.3f}", flush=True)
    start, run_loss, run_n = time.perf_counter(), 0.0, 0
    for step in range(1, args.steps + 1):
        if step > 1 and batches.starts_epoch(step - 1):  # streams restart: so does the state
            state = model.init_state(bsz)
        out = model(*batches.batch(step - 1), state)
        state = out.state
        loss = out.nll.mean()
        (loss + model.aux_loss()).backward()
        for group in opt.param_groups:
            group["lr"] = schedule(step)
        if args.optimizer == "adam":
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        model.after_step()
        run_loss, run_n = run_loss + loss.item(), run_n + 1
        if step % args.eval_every == 0 or step == args.steps:
            bpc = valid_bpc(model, valid, m)
            train_bpc = run_loss / run_n / LN2
            run_loss, run_n = 0.0, 0
            elapsed = time.perf_counter() - start
            spans = [z for layer in model.spans() for z in layer]
            curve.append((step, bpc, train_bpc, elapsed))
            print(
                f"[{name}] step {step:>5}  valid bpc {bpc:.3f}  train bpc {train_bpc:.3f}  "
                f"max span {max(spans):6.1f}  {elapsed:6.0f}s",
                flush=True,
            )
    return curve


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="allattn,transformer")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--allattn-layers", type=int, default=6)
    p.add_argument("--n-persistent", type=int, default=256, help="N per head (paper: 2d)")
    p.add_argument("--transformer-layers", type=int, default=4)
    p.add_argument("--ff-dim", type=int, default=512, help="paper's baseline: 4d")
    p.add_argument("--max-span", type=int, default=512)
    p.add_argument("--span-loss", type=float, default=1e-6)
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--optimizer", choices=["adam", "adagrad"], default="adam")
    p.add_argument("--lr", type=float, default=3e-3, help="adagrad: the paper's 0.07")
    p.add_argument("--clip", type=float, default=1.0, help="adagrad: the paper's 0.03 per tensor")
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--train-chars", type=int, default=0, help="0 = the whole training file")
    p.add_argument("--valid-chars", type=int, default=32768)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=1234)
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    train, valid, vocab = load_chars(find_data(), args.train_chars, args.valid_chars)
    print(
        f"WikiText-2 as characters: train {train.size:,}, valid slice {valid.size:,}, "
        f"vocabulary {vocab}; batch {args.batch} x {args.seq_len}, {args.optimizer} "
        f"lr {args.lr}, {args.steps} steps, {args.threads} threads"
    )
    cfgs = model_configs(args)
    curves = {}
    for name in args.models.split(","):
        curves[name] = train_curve(name, cfgs[name], train, valid, vocab, args)

    names = list(curves)
    print("\nvalid bpc by step")
    print("  step  " + "  ".join(f"{n:>12}" for n in names))
    for row in zip(*(curves[n] for n in names), strict=False):
        print(f"{row[0][0]:>6}  " + "  ".join(f"{r[1]:>12.3f}" for r in row))


if __name__ == "__main__":
    main()
