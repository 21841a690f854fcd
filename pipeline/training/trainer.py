"""The one training loop, behind every stage that trains, on a DeepSpeed engine.

One `Trainer` owns the model (any pipeline.models.SequenceModel, used only through that
protocol), the engine, the data streams, the learning rate (the stage's plan's schedule,
pipeline.training.plan) and the model's state for each micro-batch. Its state is a step
number: the data position and the learning rate follow from it, so a checkpoint (model,
optimizer, model states, RNG, step, its hooks' states) resumes exactly where the run
stopped. A stage adds what is its own as a `TrainingHook` in its plan (the curriculum's
lengths: pipeline.training.curriculum), never a loop.

What the loop does with its kind of data (token streams, whole documents) is the data's
`Task` (pipeline.training.tasks): its micro-batches and their forward, the states they carry,
its validation and its metrics' names. The update body around any task's forward is one:
`EngineUpdates.micro_batch`.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from contextlib import nullcontext
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

import numpy as np
import torch

from pipeline.cluster import distributed
from pipeline.cluster.device import dense_peak_tflops, peak_memory_mb, resolve_device
from pipeline.cluster.signals import StopSignal
from pipeline.data.vocab import bits_name
from pipeline.errors import PipelineError, Preempted
from pipeline.models.capabilities import (
    BoundedParameters,
    PlannedShapes,
    TrainingBackends,
    TrainingMetrics,
    bounded_parameters,
)
from pipeline.models.protocol import SequenceModel, State
from pipeline.ops import compile_count
from pipeline.training.ds_config import deepspeed_config
from pipeline.training.engine import (
    Float32Masters,
    MasterClamp,
    bind_to_engine,
    initialize,
    param_groups,
    skip_single_process_allreduce,
    stepped_optimizer,
)
from pipeline.training.engine_checkpoints import CheckpointIO, LoopState
from pipeline.training.evaluation import LN2
from pipeline.training.micro_batch import resolve
from pipeline.training.nonfinite import NonfiniteGuard
from pipeline.training.optim import build_optimizer
from pipeline.training.plan import TrainingPlan
from pipeline.training.progress import LossWindow, Progress, gpu_memory_text
from pipeline.training.settings import as_trained
from pipeline.training.tasks import Forward, objective

if TYPE_CHECKING:
    from pipeline.training.training_data import TrainingData


Losses = TypeVar("Losses")


class MicroBatchLoss(NamedTuple):
    nll: torch.Tensor  # the mean token nll, detached, float32
    objective: torch.Tensor  # what was minimised (tasks.objective), detached
    state: State  # the model's state after the micro-batch


def mean_nll(losses: list[MicroBatchLoss]) -> torch.Tensor:
    """An update's mean token nll over its micro-batches, on the device."""
    return torch.stack([loss.nll for loss in losses]).mean()


class EngineUpdates:
    """Optimizer updates on a DeepSpeed engine: the `Trainer`'s update, apart from the loop.

    Around each update (`run`) the model's bounded parameters are read in float32 from the
    fp32 masters DeepSpeed steps and clamped on them (engine.MasterClamp, Float32Masters),
    and a model with planned shapes plans them (planned_update, request_plan); each
    micro-batch
    (`micro_batch`) goes forward (its task's), backward and through the non-finite guard to
    the engine's step. `bounded_init`: the bounded parameters' float32 values from before
    DeepSpeed's cast. Build it after the guard is attached and the model compiled."""

    def __init__(self, engine, guard: NonfiniteGuard, bounded_init: list[torch.Tensor]):
        self.engine, self.guard, self.model = engine, guard, engine.module
        bounded = bounded_parameters(self.model)
        # the model's capabilities (pipeline.models.capabilities), asked once
        self.plans = self.model if isinstance(self.model, PlannedShapes) else None
        self.bounds = self.model if isinstance(self.model, BoundedParameters) else None
        self.master_clamp = MasterClamp(engine, bounded)
        self.float32_masters = Float32Masters(engine, [p for p, _, _ in bounded], bounded_init)

    def run(self, micro_batches: Callable[[], Losses]) -> Losses:
        """One update: `micro_batches()` runs its micro-batches; returns what it returns."""
        self.float32_masters.copy_to_params()  # after a resume, too: the masters were loaded
        with self.plans.planned_update() if self.plans is not None else nullcontext():
            losses = micro_batches()
        self.master_clamp.clamp()  # the fp32 masters DeepSpeed steps, and the model's copies
        if self.bounds is not None:
            self.bounds.after_step()  # the model's own hook (by default the clamp above)
        self.float32_masters.copy_to_params()
        if self.plans is not None:
            self.plans.request_plan()
        return losses

    def micro_batch(self, forward: Callable[[], Forward]) -> MicroBatchLoss:
        """One micro-batch: `forward()` (a task's, pipeline.training.tasks, through the
        engine), backward on its objective, the non-finite guard, then the engine's step
        (which updates at the update's last micro-batch): every task's update body."""
        out = forward()
        nll, minimised = objective(out.nll, out.aux)
        self.engine.backward(minimised)
        self.guard.loss(nll)
        self.engine.step()
        return MicroBatchLoss(nll.detach(), minimised.detach(), out.state)


class Trainer:
    """The one training loop: every training stage builds one from the spec, its plan
    (pipeline.training.plan: the learning rates, hooks and cadences) and its data
    (pipeline.training.training_data). It reads the spec as trained
    (pipeline.training.settings.as_trained): a key that does nothing under the other settings
    (a curriculum's train.deepspeed from a base) at its default, as every fingerprint counts
    it."""

    def __init__(
        self,
        spec,
        plan: TrainingPlan,
        data: TrainingData,
        tracker,
        log: Callable[[str], None],
        recorded: dict | None = None,
    ):
        self.spec, self.tracker, self.log, self.stage = as_trained(spec), tracker, log, plan.name
        self.plan, self.data, self.hooks = plan, data, list(plan.hooks(data))
        train = self.spec.train
        self.rank, self.world_size = distributed.init_process_group()
        self.device = build_device(train)
        self.vocab_size, self.task = data.vocab_size, data.task(self.spec.train)
        self.block_len = data.block_len  # the tokens of one training row
        # what the lines call bits per token: bpc for characters and bytes only
        self.bits = bits_name(getattr(getattr(self.spec.dataset, "tokenizer", None), "kind", None))
        self.lr_at = plan.lr  # the lr of update k; set by `advance`, the only writer of lr
        model = build_model(self.spec, self.vocab_size, data.origin, self.device, self.rank)
        self.resolved, self.ds_config = build_ds_config(self, model, recorded)
        self.peak_tflops = dense_peak_tflops(self.device, matmul_dtype(self.ds_config))
        bounded_init = [p.detach().clone() for p, _, _ in bounded_parameters(model)]
        self.engine = build_engine(model.to(self.device), self.ds_config, train, self.world_size)
        self.model = self.engine.module
        self.guard = build_guard(train, plan.name, self.device, self.engine, tracker, self.rank)
        self.compiled = compile_model(self.model, train.compile, self.device, log)
        self.updates = EngineUpdates(self.engine, self.guard, bounded_init)
        self.micro_batch, self.accum = micro_batches(self.ds_config)
        self.valid_split: Any = None  # read when first validating (the task's split)
        self.batches = data.train_batches(
            self.micro_batch * self.accum, self.rank, self.world_size, train.seed
        )
        self.states = self._initial_states()  # one per micro-batch: its rows' history
        self.step = 0  # optimizer updates done so far
        self.best_valid: float | None = None
        self.evals_since_best = 0
        self.params = sum(p.numel() for p in self.model.parameters())
        self.checkpoints = CheckpointIO(self.engine, self.rank, self.world_size, self.params, log)

    def _initial_states(self) -> list[State]:
        """The model's state before its rows' first token, one per micro-batch (the task's:
        none for documents, which carry nothing across updates)."""
        return [
            self.task.initial_state(self.model, self.micro_batch, self.device)
            for _ in range(self.accum)
        ]

    # ------------------------------------------------------------ the loop

    def fit(self, until: int, ckpt_root: Path) -> dict:
        """Train from the current step to `until`, checkpointing into `ckpt_root`, as the
        plan says: its learning rates, hooks and cadences; with `patience`, stop once
        validation has not improved in that many evaluations; with `check_lr`, fail loudly
        after the stage's first update unless the optimizer ran at its lr.
        SIGTERM or SIGINT (a Slurm preemption, ctrl-C) on any rank finishes the current
        update, saves a checkpoint and raises `Preempted`: running the pipeline again
        resumes from there."""
        every, keep = self.plan.cadence, self.plan.cadence.keep_checkpoints
        check_lr = self.plan.check_lr and self.step == until - self.plan.updates
        window = LossWindow(self.spec.train.batch_size * self.block_len)
        progress = Progress(self.step, until, enabled=self.rank == 0)
        self.guard.start(self.step)
        stopped_early = False
        with StopSignal() as stop, progress:
            while self.step < until:
                losses = self.advance()
                window.add(mean_nll(losses))
                progress.advance()
                if check_lr:
                    self._check_lr()
                    check_lr = False
                for hook in self.hooks:
                    hook.after_update(self, losses, lambda line: progress.log(self.log, line))
                if due(every.log_every, self.step) or (every.log_every and self.step == until):
                    self._report(window, until, progress)
                if due(every.eval_every, self.step):
                    stopped_early = self._validate(ckpt_root, keep, progress)
                    window.restart_clock()
                    if stopped_early:
                        break
                if distributed.any_rank(stop.received is not None):
                    path = self.save(ckpt_root, keep)
                    raise Preempted(
                        f"{stop.received or 'a signal on another rank'} at step "
                        f"{self.step}: checkpoint {path} saved; run the pipeline "
                        f"again to resume from it"
                    )
                if due(every.checkpoint_every, self.step) and self.step < until:
                    self.save(ckpt_root, keep)
                    window.restart_clock()
            # under StopSignal: a signal during the last write lets it complete, then stops
            path = self.save(ckpt_root, keep)
            if distributed.any_rank(stop.received is not None):
                raise Preempted(
                    f"{stop.received or 'a signal on another rank'} during the "
                    f"last checkpoint, step {self.step}: {path} saved; run the "
                    f"pipeline again to finish the stage"
                )
        best = self.task.best_key
        skipped = {"nonfinite_skipped": self.guard.skipped} if self.guard.mode == "skip" else {}
        return {
            "step": self.step,
            "checkpoint": str(path),
            "stopped_early": stopped_early,
            best: self.best_valid,
            "parameters": self.params,
        } | skipped

    def advance(self) -> list[MicroBatchLoss]:
        """The next update as the loop runs it: its learning rate, the hooks' before_update,
        the update (`update`); what `fit` and the estimate's timing both run."""
        self.set_lr(self.lr_at(self.step + 1))
        for hook in self.hooks:
            hook.before_update(self, self.step + 1)
        try:
            return self.update()
        except PipelineError:
            raise
        except Exception:
            # a model that reads its weights on the host (its spans) fails on a non-finite
            # one: name the update that made it instead (this rank's view: the others are
            # not here to agree)
            self.guard.read_and_check(self.model.parameters(), self.step, agree=False)
            raise

    def _check_lr(self) -> None:
        """The LR-drop check: the rate the optimizer ran the update at is the plan's."""
        expected = self.lr_at(self.step)
        if not math.isclose(self.current_lr(), expected, rel_tol=1e-9):
            raise PipelineError(
                f"the learning rate in effect is {self.current_lr():g}, expected "
                f"{expected:g}: the LR drop did not take"
            )

    def _validate(self, ckpt_root: Path, keep: int, progress: Progress) -> bool:
        """Validate; a new best is checkpointed as `best`. True when the plan's patience has
        run out (validation has not improved in that many evaluations)."""
        if self._track_validation(progress):
            self.save(ckpt_root, keep, best=True)
        patience = self.plan.patience
        if not (patience and self.evals_since_best >= patience):
            return False
        progress.log(
            self.log,
            f"step {self.step}: validation has not improved for {patience} evaluations, stopping",
        )
        return True

    def train_step(self) -> torch.Tensor:
        """One optimizer update over all micro-batches; returns this rank's mean token nll
        (of the scored targets, for documents) as a 0-dim float32 tensor on the device.

        Nothing in it waits for the device (tests/integration/training/test_host_syncs.py): the loss
        stays on the device until a report reads it, and a model with value-dependent shapes
        plans them ahead (``planned_update`` / ``request_plan``, pipeline.models.protocol).
        ``float()`` of the result waits for the step to finish."""
        return mean_nll(self.update())

    def update(self) -> list[MicroBatchLoss]:
        """train_step, returning each micro-batch's losses (on the device)."""
        losses = self.updates.run(self._micro_batches)
        self.step += 1
        return losses

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        """A host batch to the device without waiting for it: pinned and non-blocking on
        CUDA (a pageable copy would wait for the device's queue to drain)."""
        if self.device.type == "cuda":
            return t.pin_memory().to(self.device, non_blocking=True)
        return t.to(self.device)

    def _micro_batches(self) -> list[MicroBatchLoss]:
        """The update's micro-batches (the task's), each from its carried state."""
        if self.task.restarts(self.batches, self.step):
            self.states = self._initial_states()
        micro_batches = self.task.micro_batches(
            self.batches, self.step, self.micro_batch, self._to_device
        )
        losses = []
        for i, inputs in enumerate(micro_batches):
            forward = partial(self.task.forward, self.engine, inputs, self.states[i])
            losses.append(self.updates.micro_batch(forward))
            self.states[i] = losses[-1].state
        if self.guard.skipped_last:
            # the skipped update's forward left its (non-finite) activations in the carried
            # states: the next update starts the streams from the initial ones
            self.states = self._initial_states()
        return losses

    def set_lr(self, lr: float) -> None:
        for group in param_groups(self.engine):
            group["lr"] = lr

    def current_lr(self) -> float:
        return param_groups(self.engine)[0]["lr"]

    def validate(self) -> dict[str, float]:
        """The task's validation over the first `train.eval_batches` batches of the valid
        split (or all of it) with train's own validation settings; rank 0's values on every
        rank so that decisions taken on them agree."""
        if self.valid_split is None:  # read (and checksum) only if validating
            self.valid_split = self.data.valid_split()
        metrics = self.task.validate(self.model, self.valid_split, self.spec.train, self.device)
        return distributed.broadcast_object(metrics)

    def _track_validation(self, progress: Progress) -> bool:
        """Validate, log, and count evaluations since the best (by the task's metric); True
        on a new best."""
        self.guard.read_and_check()  # names the first non-finite update, if one ran
        metrics = self.validate()
        valid = metrics[self.task.metric]
        if not math.isfinite(valid):  # never the best, never saved
            raise PipelineError(
                f"{self.stage}: the validation at step {self.step} is not finite ({valid}): "
                f"training stopped; the last checkpoint saved before it is kept; {self.guard.hint}"
            )
        improved = self.best_valid is None or valid < self.best_valid
        if improved:
            self.best_valid, self.evals_since_best = valid, 0
        else:
            self.evals_since_best += 1
        if self.rank == 0:
            self.tracker.log_metrics({f"valid_{k}": v for k, v in metrics.items()}, step=self.step)
            scope = "the whole split" if self.spec.train.eval_batches == "all" else "an estimate"
            line = self.task.valid_line(metrics, self.bits, scope)
            progress.log(self.log, f"step {self.step:>6}  {line}{'  (best)' if improved else ''}")
        return improved

    def _read_once(self, tensors: dict[str, torch.Tensor]) -> dict[str, float]:
        """The values of 0-dim tensors, read from the device in one transfer: the one time
        a report waits for the device."""
        if not tensors:
            return {}
        stacked = torch.stack(
            [
                t.detach().to(self.device, torch.float64, non_blocking=True).reshape(())
                for t in tensors.values()
            ]
        )
        return dict(zip(tensors, stacked.tolist(), strict=False))

    def _report(self, window: LossWindow, until: int, progress: Progress) -> None:
        """Log the mean loss (over all ranks), lr, throughput, memory and the model's own
        metrics since the last report, all read from the device at once. Called on every
        rank: the loss is averaged with a collective."""
        mean, seconds_per_step, tokens_per_s = window.take()
        metered = self.model if isinstance(self.model, TrainingMetrics) else None
        own: dict[str, torch.Tensor] = metered.metric_tensors() if metered is not None else {}
        values = self._read_once({"loss": torch.as_tensor(mean)} | own | self.guard.tensors())
        self.guard.check(values)  # in the same read: a non-finite update stops here
        mean = distributed.mean_over_ranks(values.pop("loss"))
        warnings = metered.metric_warnings(values) if metered is not None else []
        if self.rank != 0:
            return
        metrics = {
            "loss": mean,
            "lr": self.current_lr(),
            "tokens_per_s": tokens_per_s,
            "step_time_s": seconds_per_step,
            "peak_memory_mb": peak_memory_mb(self.device),
            "attention_compiles": compile_count(),
        }
        if self.task.reports_bits:
            metrics["bpc"] = mean / LN2
        bpc = f"{self.bits} {metrics['bpc']:.3f}  " if "bpc" in metrics else ""
        mfu = ""
        if self.peak_tflops is not None:
            # per GPU: tokens_per_s counts every rank's tokens (the window's step is
            # train.batch_size rows, the global batch), the peak is one GPU's
            per_gpu = tokens_per_s / self.world_size / (self.peak_tflops * 1e12)
            metrics["mfu"] = per_gpu * self.model.train_flops_per_token()
            # what the kernels execute: recomputation and the cache's projections included
            metrics["hfu"] = per_gpu * self.model.train_hardware_flops_per_token(self.block_len)
            mfu = f"  mfu {metrics['mfu']:.1%}  hfu {metrics['hfu']:.1%}"
        metrics |= values
        self.tracker.log_metrics(metrics, step=self.step)
        progress.eta.update(seconds_per_step)
        eta = progress.eta.remaining(until - self.step)
        memory = gpu_memory_text(self.device)
        progress.show(f"loss {mean:.4f} lr {metrics['lr']:.3g} {tokens_per_s:,.0f} tok/s")
        progress.log(
            self.log,
            f"step {self.step:>6}/{until}  loss {mean:.4f}  "
            f"{bpc}lr {metrics['lr']:.3g}  "
            f"{tokens_per_s:,.0f} tok/s{mfu}{memory}  eta {eta:,.0f}s",
        )
        for line in warnings:
            progress.log(self.log, f"step {self.step:>6}/{until}  {line}")

    # ------------------------------------------------------------ checkpoints

    def save(self, root: Path, keep: int, best: bool = False) -> Path:
        """Checkpoint this step under `root`
        (pipeline.training.engine_checkpoints.CheckpointIO.save), once the metrics logged up to
        it are durable: a run resumed from it logs none of them again. Refuses (PipelineError) to
        save a non-finite state: the last checkpoint stays the last finite one."""
        self._check_finite()
        self.tracker.make_durable()
        return self.checkpoints.save(
            root,
            keep,
            LoopState(
                self.step,
                self.states,
                self.best_valid,
                self.evals_since_best,
                self.model.plan_state() if isinstance(self.model, PlannedShapes) else None,
                {hook.name: hook.state_dict() for hook in self.hooks},
            ),
            best=best,
        )

    def _check_finite(self) -> None:
        """Stop if an update was not finite or the weights are not: one read, at a
        checkpoint, which reads them anyway."""
        self.guard.read_and_check(self.model.parameters(), self.step)

    def load(self, root: Path, continued: bool = False) -> int:
        """Restore the newest intact checkpoint under `root`; returns its step. `continued`:
        another stage's checkpoint, whose hooks' states are that stage's: this stage's
        hooks start afresh."""
        loop = self.checkpoints.load(root, self.accum, self.device)
        self.step, self.states = loop.step, loop.states
        self.best_valid, self.evals_since_best = loop.best_valid, loop.evals_since_best
        if isinstance(self.model, PlannedShapes):
            self.model.load_plan_state(loop.plan)
        for hook in [] if continued else self.hooks:
            if hook.name not in loop.hooks:
                raise PipelineError(
                    f"the checkpoint under {root} at step {self.step} holds no {hook.name} "
                    f"state: it was written by another stage; run this one again with --force"
                )
            hook.load_state_dict(loop.hooks[hook.name])
        return self.step


def due(every: int, step: int) -> bool:
    """Whether a cadence of `every` updates (0: never) falls on `step`."""
    return bool(every) and step % every == 0


# ------------------------------------------------------------ what a Trainer is built from


def build_device(train) -> torch.device:
    """train.device on this process; fp16 only on a GPU (DeepSpeed refuses it on the CPU)."""
    device = resolve_device(train.device)
    if train.deepspeed.fp16 and device.type != "cuda":
        raise PipelineError(
            "train.deepspeed.fp16 needs a GPU (DeepSpeed refuses fp16 on CPU); use bf16 or neither"
        )
    return device


def build_model(spec, vocab_size: int, origin: str, device, rank: int) -> SequenceModel:
    """The spec's model for a vocabulary read from `origin`, with identical initial weights
    on every rank (from train.seed); then each rank's own streams of randomness are seeded."""
    seed = spec.train.seed
    torch.manual_seed(seed)
    model = spec.build_model(vocab_size, origin)
    if isinstance(model, TrainingBackends) and (why := model.cannot_train_on(device)):
        raise PipelineError(why)
    torch.manual_seed(seed + rank)
    np.random.seed(seed + rank)
    random.seed(seed + rank)
    return model


def build_ds_config(trainer: Trainer, model: SequenceModel, recorded: dict | None):
    """train.micro_batch_size and deepspeed.bf16 as this run has them, and DeepSpeed's config
    for them: `auto` is settled on this device once; `recorded`, a resume's or (for
    finetune) train's record, is never searched again."""
    resolved = resolve(
        trainer.spec,
        model,
        trainer.vocab_size,
        trainer.task,
        trainer.device,
        trainer.world_size,
        recorded,
        trainer.log,
    )
    train, bf16 = trainer.spec.train, resolved["bf16"]
    return resolved, deepspeed_config(train, trainer.world_size, resolved["micro_batch_size"], bf16)


def matmul_dtype(ds_config: dict) -> torch.dtype:
    """The dtype the model's matmuls run in (DeepSpeed casts the model to bf16 / fp16): the
    GPU's dense peak in it is the reports' model FLOPs utilisation's denominator."""
    if ds_config["bf16"]["enabled"]:
        return torch.bfloat16
    return torch.float16 if ds_config["fp16"]["enabled"] else torch.float32


def micro_batches(ds_config: dict) -> tuple[int, int]:
    """(rows per micro-batch, micro-batches per update) on this rank."""
    return ds_config["train_micro_batch_size_per_gpu"], ds_config["gradient_accumulation_steps"]


def build_engine(model: SequenceModel, ds_config: dict, train, world_size: int):
    """The DeepSpeed engine around `model` (on its device) and train.optimizer."""
    engine = initialize(model, build_optimizer(model.parameters(), train.optimizer), ds_config)
    engine.module.activation_checkpointing = train.deepspeed.activation_checkpointing
    # ZeRO and bf16 hand the optimizer flat partitions: tell the per-tensor clipping which
    # elements belong to which parameter
    bind_to_engine(engine)
    # one process, no ZeRO: no allreduce over a group of one (engine.py says why)
    skip_single_process_allreduce(engine, world_size)
    return engine


def build_guard(train, stage: str, device, engine, tracker, rank: int) -> NonfiniteGuard:
    """train.nonfinite, in front of the optimizer DeepSpeed really steps."""
    guard = NonfiniteGuard(
        train.nonfinite,
        train.nonfinite_limit,
        stage,
        device,
        log_metrics=tracker.log_metrics if rank == 0 else None,
    )
    guard.attach(stepped_optimizer(engine))
    return guard


def compile_model(model: SequenceModel, compile_mode, device, log) -> bool:
    """train.compile: whether the model's compiled training path is in use."""
    if not (compile_mode in (True, "graphs") or (compile_mode == "auto" and device.type == "cuda")):
        return False
    graphs = compile_mode == "graphs" and device.type == "cuda"
    if compile_mode == "graphs" and not graphs:
        log(f"train.compile: graphs needs CUDA; compiling without them on {device}")
    compiled = isinstance(model, TrainingBackends) and model.compile_for_training(graphs=graphs)
    if not compiled and compile_mode in (True, "graphs"):
        log(f"train.compile: {type(model).__name__} has no compiled path; training eagerly")
    return compiled
