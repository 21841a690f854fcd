"""The training loop behind the train and finetune stages, on a DeepSpeed engine.

One `Trainer` owns the model, the engine, the data streams and the Transformer-XL cache.
Its state is a step number: the data position and the learning rate follow from it, so a
checkpoint (model, optimizer, cache, RNG, step) resumes exactly where the run stopped.
"""

from __future__ import annotations

import math
import os
import random
import resource
import shutil
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from pipeline import distributed, reshard
from pipeline.data.manifest import load_manifest, load_split
from pipeline.errors import PipelineError, Preempted
from pipeline.checkpoints import (CHECKSUMS, checkpoint_bytes, disk_full, has_room, newest_intact,
                                  out_of_space, read_pointer, rng_state, set_rng_state,
                                  step_dirs, step_of, write_checksums)
from pipeline.fsutil import atomic_write_text
from pipeline.ops import compile_count
from pipeline.optim import before_save_checkpoint
from pipeline.signals import StopSignal

LN2 = math.log(2)


def deepspeed_config(train, world_size: int) -> dict:
    """Render the spec's `train` section as DeepSpeed's JSON config."""
    ds = train.deepspeed
    per_step = world_size * ds.gradient_accumulation_steps
    if train.batch_size % per_step:
        raise PipelineError(f"train.batch_size {train.batch_size} is not divisible by "
                            f"world size {world_size} x gradient_accumulation_steps "
                            f"{ds.gradient_accumulation_steps}")
    return {
        "train_batch_size": train.batch_size,
        "train_micro_batch_size_per_gpu": train.batch_size // per_step,
        "gradient_accumulation_steps": ds.gradient_accumulation_steps,
        "zero_optimization": {"stage": ds.zero_stage},
        "bf16": {"enabled": ds.bf16},
        # dynamic loss scaling: fp16 gradients underflow without it
        "fp16": {"enabled": ds.fp16, "loss_scale": 0, "initial_scale_power": 16},
        "gradient_clipping": (train.optimizer.clip_norm
                              if train.optimizer.clip == "global" else 0.0),
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise PipelineError("train.device is cuda but torch sees no CUDA device")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


@torch.no_grad()
def evaluate_nll(model, tokens: np.ndarray, batch_size: int, seq_len: int, device,
                 max_batches: int | None = None, rank: int = 0,
                 world_size: int = 1) -> tuple[float, int]:
    """Sum of per-token nll (nats) and token count over a split, streamed with the cache.

    Every target is scored once (pipeline.data.eval_batches masks the ragged tail)."""
    from pipeline.data import eval_batches

    was_training = model.training
    model.eval()
    cache = model.init_cache(batch_size, device=device)
    total, count = 0.0, 0
    for i, (x, y, mask) in enumerate(eval_batches(tokens, batch_size, seq_len,
                                                  rank=rank, world_size=world_size)):
        if max_batches is not None and i >= max_batches:
            break
        out = model(x.to(device), y.to(device), cache)
        cache = out.cache
        mask = mask.to(device=device, dtype=out.nll.dtype)
        total += float((out.nll.float() * mask).sum())
        count += int(mask.sum())
    model.train(was_training)
    return total, count


class Trainer:
    def __init__(self, spec, preprocess_dir: Path, tracker, log: Callable[[str], None]):
        from pipeline.data import StreamBatches
        from pipeline.optim import (bind_to_engine, build_optimizer, float32_from_master,
                                    master_clamp)

        self.spec, self.tracker, self.log = spec, tracker, log
        train = spec.train
        self.rank, self.world_size = distributed.init_process_group()
        import deepspeed

        self.device = resolve_device(train.device)
        if train.deepspeed.fp16 and self.device.type != "cuda":
            raise PipelineError("train.deepspeed.fp16 needs a GPU (DeepSpeed refuses fp16 on "
                                "CPU); use bf16 or neither")
        manifest = load_manifest(preprocess_dir)
        self.vocab_size = manifest["vocab_size"]

        # identical initial weights on every rank, then per-rank streams of randomness
        torch.manual_seed(train.seed)
        model = spec.build_model(self.vocab_size, f"{preprocess_dir}/manifest.json")
        torch.manual_seed(train.seed + self.rank)
        np.random.seed(train.seed + self.rank)
        random.seed(train.seed + self.rank)

        self.ds_config = deepspeed_config(train, self.world_size)
        optimizer = build_optimizer(model.parameters(), train.optimizer)
        spans = {n: p.detach().clone() for n, p in model.named_parameters()
                 if n.endswith("adaptive_span.frac")}  # float32, before DeepSpeed's cast
        self.engine, _, _, _ = deepspeed.initialize(
            model=model.to(self.device), optimizer=optimizer, config=self.ds_config)
        self.model = self.engine.module
        self.model.activation_checkpointing = train.deepspeed.activation_checkpointing
        # ZeRO and bf16 hand the optimizer flat partitions: tell the per-tensor clipping
        # which elements belong to which parameter, and clamp the spans on the fp32 masters.
        bind_to_engine(self.engine)
        pairs = [(p, spans[n]) for n, p in self.model.named_parameters() if n in spans]
        span_params = [p for p, _ in pairs]
        self.clamp_spans = master_clamp(self.engine, span_params, 0.0, 1.0)
        # bf16 / fp16: the forward reads the spans from their fp32 masters (see AdaptiveSpan)
        self.spans_to_float32 = float32_from_master(self.engine, span_params,
                                                    [init for _, init in pairs])

        self.micro_batch = self.ds_config["train_micro_batch_size_per_gpu"]
        self.accum = self.ds_config["gradient_accumulation_steps"]
        rows = self.micro_batch * self.accum
        self.train_tokens = load_split(preprocess_dir, "train")
        self.preprocess_dir = preprocess_dir
        self.valid_tokens = None
        try:
            self.batches = StreamBatches(self.train_tokens, rows, train.seq_len,
                                         rank=self.rank, world_size=self.world_size,
                                         seed=train.seed)
        except ValueError as e:
            raise PipelineError(f"train: {e}") from None
        # one Transformer-XL cache per micro-batch: each holds its own rows' history
        self.caches = [self.model.init_cache(self.micro_batch, device=self.device)
                       for _ in range(self.accum)]
        self.step = 0     # optimizer updates done so far
        # checkpoint directories this run wrote or verified: saving at their step writes none
        self.trusted: set[Path] = set()
        self.best_valid: float | None = None
        self.evals_since_best = 0
        self.params = sum(p.numel() for p in self.model.parameters())

    # ------------------------------------------------------------ checkpoints

    def save(self, root: Path, keep: int, best: bool = False) -> Path:
        """Write checkpoint `step-N` under `root` atomically (once per step), its checksums
        last, and point `latest` at it; `best=True` also points `best` at it. The newest
        `keep` checkpoints and the best one survive. A disk without room for it: a one-line
        PipelineError, and the checkpoints already there are left as they were."""
        tag = f"step-{self.step:08d}"
        if root / tag not in self.trusted:
            self._write(root, tag)
            self.trusted.add(root / tag)
        if self.rank == 0:
            atomic_write_text(root / "latest", tag + "\n")
            if best:
                atomic_write_text(root / "best", tag + "\n")
            best_tag = read_pointer(root / "best")
            # Newer ones are damaged leftovers of the run this one resumed: the run rewrites
            # them as it reaches their steps, and they never take an intact one's place.
            older = [p for p in step_dirs(root) if step_of(p.name) < self.step]
            for path in [p for p in older[keep - 1:] if p.name != best_tag] + \
                    list(root.glob("tmp-step-*")):
                shutil.rmtree(path, ignore_errors=True)
        distributed.barrier()
        return root / tag

    def _write(self, root: Path, tag: str) -> None:
        """Every rank writes its files into `tmp-<tag>`; then rank 0 records their checksums
        and renames it to `tag` (replacing a damaged one left from before a resume)."""
        path, tmp = root / tag, root / f"tmp-{tag}"
        root.mkdir(parents=True, exist_ok=True)
        previous = [p for p in step_dirs(root) if (p / CHECKSUMS).exists()]
        # the previous checkpoint's size, or fp32 weights plus Adam's two moments
        needed = checkpoint_bytes(previous[0]) if previous else 12 * self.params
        if not distributed.broadcast_object(has_room(root, needed) if self.rank == 0 else None):
            raise disk_full(path, needed)
        failure = None
        try:
            before_save_checkpoint(self.engine)
            self.engine.save_checkpoint(str(root), tag=tmp.name, save_latest=False)
            torch.save({"step": self.step, "rng": rng_state(),
                        "caches": [[c.cpu() for c in cache] for cache in self.caches],
                        "valid": {"best": self.best_valid, "since_best": self.evals_since_best}},
                       tmp / f"trainer-rank{self.rank}.pt")
        except (OSError, RuntimeError) as e:
            failure = e
        self._settle(failure, tmp, needed)      # every rank's files are written past this
        failure = None
        if self.rank == 0:
            try:
                write_checksums(tmp)
                if path.is_dir():
                    shutil.rmtree(path)
                os.rename(tmp, path)
            except OSError as e:
                failure = e
        self._settle(failure, tmp, needed)

    def _settle(self, failure: BaseException | None, tmp: Path, needed: int) -> None:
        """Raise on every rank if writing failed on any. The half-written `tmp` goes first:
        on a full disk that frees the room MLflow's store needs to record the failure."""
        full = failure is not None and out_of_space(failure, tmp.parent, needed)
        if not distributed.any_rank(failure is not None):
            return
        full = distributed.any_rank(full)
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        if full:
            raise disk_full(tmp.parent / tmp.name.removeprefix("tmp-"), needed) from None
        if failure is not None:
            raise failure
        raise PipelineError(f"writing checkpoint {tmp} failed on another rank")

    def load(self, root: Path, *, with_optimizer: bool = True) -> int:
        """Restore the newest intact checkpoint under `root` (chosen on rank 0, so every rank
        loads the same one); returns its step."""
        choice = None
        if self.rank == 0:
            try:
                tag = newest_intact(root, self.log)
                choice = (tag, None) if tag else (None, f"no checkpoint under {root}")
            except PipelineError as e:
                choice = (None, str(e))
        tag, refusal = distributed.broadcast_object(choice)
        if refusal:
            raise PipelineError(refusal)
        writers = len(list((root / tag).glob("trainer-rank*.pt")))
        reshard.load_engine(self.engine, root, tag, writers, with_optimizer=with_optimizer)
        if writers != self.world_size:
            self.log(reshard.message(writers, self.world_size))
            state = reshard.trainer_state(root / tag, writers, self.rank, self.world_size,
                                          self.accum)
        else:
            state = torch.load(root / tag / f"trainer-rank{self.rank}.pt", weights_only=False)
        self.step = state["step"]
        self.caches = [[c.to(self.device) for c in cache] for cache in state["caches"]]
        self.best_valid = state["valid"]["best"]
        self.evals_since_best = state["valid"]["since_best"]
        if state["rng"] is not None:
            set_rng_state(state["rng"])
        self.trusted.add(root / tag)
        return self.step

    # ------------------------------------------------------------ the loop

    def set_lr(self, lr: float) -> None:
        for group in self.engine.optimizer.param_groups:
            group["lr"] = lr

    def current_lr(self) -> float:
        return self.engine.optimizer.param_groups[0]["lr"]

    def train_step(self) -> float:
        """One optimizer update over all micro-batches; returns this rank's mean token nll."""
        if self.step > 0 and self.batches.starts_epoch(self.step):
            # The streams restart at a new offset: the cached states are no longer the rows'
            # left context, so start from zeros, as the authors' trainer does at the wrap.
            self.caches = [self.model.init_cache(self.micro_batch, device=self.device)
                           for _ in range(self.accum)]
        self.spans_to_float32()  # after a resume, too: the masters are what was loaded
        x, y = self.batches.batch(self.step)
        x, y = x.to(self.device), y.to(self.device)
        mb = self.micro_batch
        losses = []
        for i in range(self.accum):
            rows = slice(i * mb, (i + 1) * mb)
            out = self.engine(x[rows], y[rows], self.caches[i])
            nll = out.nll.float().mean()
            self.engine.backward(nll + self.model.span_loss())
            self.engine.step()
            self.caches[i] = out.cache
            losses.append(nll.item())
        self.clamp_spans()
        self.spans_to_float32()
        self.step += 1
        return sum(losses) / len(losses)

    def validate(self) -> tuple[float, int]:
        """Valid bpc over the first `train.eval_batches` batches of the valid split (or all
        of it) with train's own validation settings, and the number of tokens it covered;
        rank 0's values on every rank so that decisions taken on them agree."""
        train = self.spec.train
        if self.valid_tokens is None:          # read (and checksum) only if validating
            self.valid_tokens = load_split(self.preprocess_dir, "valid")
        total, count = evaluate_nll(
            self.model, self.valid_tokens, train.eval_batch_size,
            train.eval_seq_len or train.seq_len, self.device,
            max_batches=None if train.eval_batches == "all" else train.eval_batches)
        if count == 0:
            raise PipelineError(f"the valid split has {len(self.valid_tokens)} token(s): "
                                f"nothing to validate on; make dataset.split.valid larger")
        return distributed.broadcast_object((total / count / LN2, count))

    def fit(self, until: int, lr_at: Callable[[int], float], ckpt_root: Path,
            expect_lr: float | None = None, patience: int | None = None) -> dict:
        """Train from the current step to `until`, checkpointing into `ckpt_root`.

        `lr_at(k)` gives the lr of update k (1-based). `expect_lr`: after the first update,
        fail loudly unless the optimizer really ran with this lr (the LR-drop check).
        `patience`: stop early once validation has not improved for that many evaluations.
        SIGTERM or SIGINT (a Slurm preemption, ctrl-C) on any rank finishes the current
        update, saves a checkpoint and raises `Preempted`: running the pipeline again
        resumes from there."""
        train = self.spec.train
        first = self.step + 1
        window = _Window(train.batch_size * train.seq_len)
        progress = Progress(self.step, until, enabled=self.rank == 0)
        stopped_early = False
        with StopSignal() as stop, progress:
            while self.step < until:
                self.set_lr(lr_at(self.step + 1))
                window.add(self.train_step())
                progress.advance()
                if expect_lr is not None and self.step == first and \
                        not math.isclose(self.current_lr(), expect_lr, rel_tol=1e-9):
                    raise PipelineError(f"the learning rate in effect is "
                                        f"{self.current_lr():g}, expected {expect_lr:g}: "
                                        f"the LR drop did not take")
                if self.step % train.log_every == 0 or self.step == until:
                    self._report(window, until, progress)
                if train.eval_every and self.step % train.eval_every == 0:
                    if self._track_validation(progress):
                        self.save(ckpt_root, train.keep_checkpoints, best=True)
                    window.restart_clock()
                    if patience and self.evals_since_best >= patience:
                        progress.log(self.log, f"step {self.step}: validation has not "
                                     f"improved for {patience} evaluations, stopping")
                        stopped_early = True
                        break
                if distributed.any_rank(stop.received is not None):
                    path = self.save(ckpt_root, train.keep_checkpoints)
                    raise Preempted(f"{stop.received or 'a signal on another rank'} at step "
                                    f"{self.step}: checkpoint {path} saved; run the pipeline "
                                    f"again to resume from it")
                if train.checkpoint_every and self.step % train.checkpoint_every == 0 \
                        and self.step < until:
                    self.save(ckpt_root, train.keep_checkpoints)
                    window.restart_clock()
        path = self.save(ckpt_root, train.keep_checkpoints)
        return {"step": self.step, "checkpoint": str(path), "stopped_early": stopped_early,
                "best_valid_bpc_estimate": self.best_valid, "parameters": self.params}

    def _track_validation(self, progress: "Progress") -> bool:
        """Validate, log, and count evaluations since the best; True on a new best."""
        valid, tokens = self.validate()
        improved = self.best_valid is None or valid < self.best_valid
        if improved:
            self.best_valid, self.evals_since_best = valid, 0
        else:
            self.evals_since_best += 1
        if self.rank == 0:
            self.tracker.log_metrics({"valid_bpc": valid, "valid_tokens": tokens},
                                     step=self.step)
            scope = ("the whole split" if self.spec.train.eval_batches == "all"
                     else "an estimate")
            progress.log(self.log, f"step {self.step:>6}  valid bpc {valid:.3f} ({scope}, "
                                   f"{tokens:,} tokens){'  (best)' if improved else ''}")
        return improved

    def _report(self, window: "_Window", until: int, progress: "Progress") -> None:
        """Log the mean loss (over all ranks), lr, throughput and memory since the last
        report. Called on every rank: the loss is averaged with a collective."""
        mean, seconds_per_step, tokens_per_s = window.take()
        mean = distributed.mean_over_ranks(mean)
        if self.rank != 0:
            return
        metrics = {"loss": mean, "bpc": mean / LN2, "lr": self.current_lr(),
                   "tokens_per_s": tokens_per_s, "step_time_s": seconds_per_step,
                   "peak_memory_mb": peak_memory_mb(self.device),
                   "attention_compiles": compile_count()}
        spans = [z for layer in self.model.spans() for z in layer]
        if spans:
            metrics |= {"span_mean": sum(spans) / len(spans), "span_max": max(spans)}
        self.tracker.log_metrics(metrics, step=self.step)
        eta = (until - self.step) * seconds_per_step
        progress.show(f"loss {mean:.4f} lr {metrics['lr']:.3g} {tokens_per_s:,.0f} tok/s")
        progress.log(self.log, f"step {self.step:>6}/{until}  loss {mean:.4f}  "
                               f"bpc {mean / LN2:.3f}  lr {metrics['lr']:.3g}  "
                               f"{tokens_per_s:,.0f} tok/s  eta {eta:,.0f}s")


class Progress:
    """A progress bar (steps, ETA, loss / lr / tokens/s) on rank 0 when stderr is a terminal;
    log lines are printed above it. In a log file it stays silent: the log lines say it all."""

    def __init__(self, start: int, total: int, enabled: bool):
        from tqdm import tqdm

        self._tqdm = tqdm
        self.bar = tqdm(total=total, initial=start, unit="step", dynamic_ncols=True,
                        leave=False, disable=not (enabled and sys.stderr.isatty()))

    def advance(self) -> None:
        self.bar.update(1)

    def show(self, text: str) -> None:
        self.bar.set_postfix_str(text, refresh=False)

    def log(self, log: Callable[[str], None], message: str) -> None:
        if self.bar.disable:
            log(message)
        else:
            with self._tqdm.external_write_mode():
                log(message)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.bar.close()


class _Window:
    """Loss and wall time accumulated between two progress reports."""

    def __init__(self, tokens_per_step: int):
        self.tokens_per_step = tokens_per_step
        self.loss, self.steps, self.start = 0.0, 0, time.time()

    def add(self, loss: float) -> None:
        self.loss += loss
        self.steps += 1

    def restart_clock(self) -> None:
        """Leave validation and checkpoint time out of the throughput."""
        self.start = time.time()

    def take(self) -> tuple[float, float, float]:
        """(mean loss, seconds per step, tokens per second), and start a new window."""
        elapsed = time.time() - self.start
        out = (self.loss / self.steps, elapsed / self.steps,
               self.tokens_per_step * self.steps / elapsed)
        self.loss, self.steps, self.start = 0.0, 0, time.time()
        return out
