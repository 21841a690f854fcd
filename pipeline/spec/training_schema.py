"""The `train:`, `finetune:` and `evaluate:` blocks of a spec: the optimizer and its schedule,
DeepSpeed, the launcher, and what each training and evaluation stage runs."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from pipeline.spec.section_base import MAX_ROWS, MAX_SEQ_LEN, MAX_STEPS, Section, check_path


class OptimizerSpec(Section):
    """The optimizer and its learning-rate schedule (pipeline/training/optim.py)."""

    type: Literal["adagrad", "adam"] = Field(
        "adagrad",
        description="adagrad (eps 1e-10): the paper's character-level optimizer; "
        "adam: the word-level model's and the tasks' (the curriculum "
        "stage requires it)",
    )
    lr: float = Field(
        0.07,
        gt=0,
        description="the base learning rate the schedule warms up "
        "to (transformer: scales); finetune divides it. Paper: 0.07 (Adagrad, "
        "character level), 2.5e-4 (Adam, WikiText-103)",
    )
    warmup_steps: int = Field(
        0,
        ge=0,
        le=MAX_STEPS,
        description="updates of warm-up; 0: "
        "none. Paper: 32,000 character level, 8,000 WikiText-103",
    )
    schedule: Literal["linear_warmup", "transformer", "cosine"] = Field(
        "linear_warmup",
        description="the lr of update k: linear_warmup = lr * min(1, k / "
        "warmup_steps), then constant; transformer = lr * min(k^-0.5, k * warmup_steps^-1.5), "
        "the Transformer's (Vaswani et al. 2017), whose peak is lr / sqrt(warmup_steps); "
        "cosine = linear warm-up, then lr * (1 + cos(pi (k - 1) / steps)) / 2 (the ∞-former's)",
    )
    clip: Literal["per_param", "global", "none"] = Field(
        "per_param",
        description="per_param: the paper's Adagrad, each tensor's step scaled "
        "by min(1, clip_norm / |g|) (adagrad only); global: the gradient scaled to a total "
        "norm of at most clip_norm; none: no clipping. Default: per_param for adagrad, "
        "global for adam (each as its paper)",
    )
    clip_norm: float = Field(
        0.03,
        gt=0,
        description="the norm clip bounds: per tensor "
        "(per_param) or of the whole gradient (global). Default: 0.03; 1 with "
        "adam's default clip. Paper: 0.03 per "
        "tensor (character level), 1 global (WikiText-103)",
    )
    betas: list[Annotated[float, Field(ge=0, lt=1)]] = Field(
        [0.9, 0.999],
        min_length=2,
        max_length=2,
        description="Adam's moment decays [beta1, beta2]; adam only",
    )
    weight_decay: float = Field(
        0.0,
        ge=0,
        description="torch's weight decay (L2) of Adam "
        "or Adagrad; adam, or adagrad without per_param",
    )

    @model_validator(mode="after")
    def _clip_defaults_fit_type(self):
        # per_param / 0.03 is the paper's Adagrad only; an Adam config that sets no clip gets
        # the word-level paper's global clip at 1 rather than a refusal. The field defaults
        # stay Adagrad's (a fingerprint counts an inert clip_norm at its field default), and
        # a clip: global written without clip_norm keeps 0.03, as the runs made with it
        if self.type == "adam" and "clip" not in self.model_fields_set:
            self.clip = "global"
            if "clip_norm" not in self.model_fields_set:
                self.clip_norm = 1.0
        return self


class DeepSpeedSpec(Section):
    """The DeepSpeed engine's settings (its config: pipeline/training/ds_config.py)."""

    zero_stage: Literal[0, 1, 2, 3] = Field(
        0,
        description="ZeRO partitioning across processes: 0 none, 1 optimizer state, 2 and "
        "gradients, 3 and parameters (not with model.adaptive_span: "
        "true)",
    )
    bf16: bool | Literal["auto"] = Field(
        False,
        description="train in bfloat16 (DeepSpeed's bf16 mode); not with fp16. auto: "
        "bf16 on a GPU that supports it, else float32, resolved once per "
        "run and recorded (the paper configs set it)",
    )
    fp16: bool = Field(
        False, description="train in float16 with dynamic loss scaling; needs a GPU; not with bf16"
    )
    gradient_accumulation_steps: int = Field(
        1,
        gt=0,
        le=2**16,
        description="micro-batches per update: each process's micro-batch "
        "is batch_size / (processes x this)",
    )
    activation_checkpointing: bool = Field(
        False,
        description="recompute each layer's activations in backward to save memory "
        "(the allattn model; the others ignore it)",
    )

    @model_validator(mode="after")
    def _one_precision(self):
        if self.bf16 is not False and self.fp16:
            raise ValueError(
                f"choose one of bf16 and fp16 (bf16 is {str(self.bf16).lower()}"
                f"; with fp16 set it to false)"
            )
        return self


class LauncherSpec(Section):
    """How many processes train. More than one: `allattn-pipe run` starts the `deepspeed`
    launcher (a hostfile for several nodes); under Slurm, srun starts them and these record
    the job's world size."""

    nodes: int = Field(
        1, gt=0, le=2**16, description="machines to train on; more than one needs hostfile"
    )
    procs_per_node: int = Field(1, gt=0, le=1024, description="processes per node (one per GPU)")
    hostfile: str | None = Field(
        None,
        description="DeepSpeed hostfile ('host slots=N' lines); required for more than one node",
    )
    master_port: int | None = Field(
        None, gt=0, lt=65536, description="rendezvous port; default: a free one"
    )

    _hostfile_is_a_path = field_validator("hostfile")(check_path)

    @property
    def world_size(self) -> int:
        return self.nodes * self.procs_per_node


class TrainSpec(Section):
    """The train stage's settings. finetune runs with them too (its own steps and lr),
    evaluate takes device and the default seq_len, the curriculum stage all but deepspeed,
    launcher, micro_batch_size, steps, seq_len and the cadence of logs, validations and
    checkpoints."""

    # numpy seeds each rank with seed + rank, and takes only seeds below 2^32
    seed: int = Field(
        1234,
        ge=0,
        lt=2**31,
        description="seeds the initial weights, then each "
        "rank's dropout (seed + rank) and the data order",
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto",
        description="auto: cuda if torch sees a GPU, else cpu; under a launcher, the "
        "GPU of the process's local rank",
    )
    # required by the train stage (pipeline.spec checks it); a curriculum has no use for them
    steps: int | None = Field(
        None,
        gt=0,
        le=MAX_STEPS,
        description="optimizer updates of the "
        "train stage; required by it. Published scripts: 450,000 small, "
        "200,000 large, 800,000 WikiText-103",
    )
    batch_size: int = Field(
        gt=0,
        le=MAX_ROWS,
        description="sequences per optimizer step, all ranks; divisible by processes x "
        "gradient_accumulation_steps (or by processes x micro_batch_size). "
        "Paper: 64",
    )
    micro_batch_size: Annotated[int, Field(gt=0, le=MAX_ROWS)] | Literal["auto"] | None = Field(
        None,
        description="rows per forward and backward in each process; the rest of "
        "the process's batch_size / processes rows is gradient accumulation. auto: the "
        "largest divisor that fits in the GPU's memory, searched once at the start and "
        "recorded (resume and finetune reuse it); on a CPU the whole per-rank batch. "
        "Default: from deepspeed.gradient_accumulation_steps",
    )
    seq_len: int | None = Field(
        None,
        gt=0,
        le=MAX_SEQ_LEN,
        description="tokens per segment "
        "(M); required by the train stage. Paper: 512 character "
        "level, 256 WikiText-103",
    )
    optimizer: OptimizerSpec = OptimizerSpec()
    deepspeed: DeepSpeedSpec = DeepSpeedSpec()
    launcher: LauncherSpec = LauncherSpec()
    log_every: int = Field(
        10, gt=0, le=MAX_STEPS, description="steps between reports of the training loss"
    )
    eval_every: int = Field(
        0, ge=0, le=MAX_STEPS, description="steps between validation estimates; 0 = off"
    )
    eval_batches: Annotated[int, Field(gt=0, le=MAX_STEPS)] | Literal["all"] = Field(
        16, description="batches per validation estimate; all: the whole valid split"
    )
    eval_batch_size: int = Field(
        8,
        gt=0,
        le=MAX_ROWS,
        description="rows of a validation batch (train's own: evaluate.* is the final score's)",
    )
    eval_seq_len: int | None = Field(
        None, gt=0, le=MAX_SEQ_LEN, description="validation segment length; default: seq_len"
    )
    checkpoint_every: int = Field(
        0,
        ge=0,
        le=MAX_STEPS,
        description="steps between checkpoints, besides the one at the end; 0 = only at the end",
    )
    keep_checkpoints: int = Field(
        2,
        gt=0,
        le=10**6,
        description="newest checkpoints kept (the best validation's is kept besides)",
    )
    nonfinite: Literal["stop", "skip"] = Field(
        "stop",
        description="an update whose loss or gradient is NaN or inf: stop = training stops "
        "there, naming the step, and the run fails (nothing non-finite is saved or marked "
        "best); skip = the update is not applied (no optimizer step) and counted, as fp16 "
        "loss scalers do, until more than nonfinite_limit are skipped (one host sync per "
        "update)",
    )
    nonfinite_limit: int = Field(
        100,
        ge=0,
        le=MAX_STEPS,
        description="with nonfinite: skip, the most updates skipped in one run of a stage; "
        "the next non-finite one stops training as stop does",
    )
    compile: bool | Literal["auto", "graphs"] = Field(
        "auto",
        description="torch.compile each layer for the training updates (regional: "
        "one compiled code for all layers, a graph per span bucket, no "
        "graph break; evaluation stays uncompiled). auto: on with CUDA; "
        "off on CPU, where inductor needs a C++ compiler and ~25 s per "
        "span bucket that pay back after ~400 updates in that bucket "
        "(quickstart's model: 23% faster updates; "
        "docs/benchmarks.md#torchcompile). graphs: compiled as with true, and "
        "each layer's forward and backward replayed as CUDA graphs "
        "(torch.compile's reduce-overhead mode: no kernel launches from Python; "
        "CUDA only, elsewhere the same as true)",
    )

    @model_validator(mode="after")
    def _schedule_has_warmup(self):
        if self.optimizer.schedule == "transformer" and not self.optimizer.warmup_steps:
            raise ValueError(
                "optimizer.schedule transformer needs warmup_steps > 0 (its lr "
                "grows over them, then decays as k^-0.5)"
            )
        return self

    @model_validator(mode="after")
    def _clipping_fits_optimizer(self):
        opt = self.optimizer
        if opt.clip == "per_param" and opt.type != "adagrad":
            raise ValueError(
                "optimizer.clip per_param scales the Adagrad step per tensor (the "
                "paper's optimizer); with adam use clip: global or none"
            )
        # every ZeRO stage is fine: pipeline.training.engine.bind_to_engine assembles the per-tensor
        # norms across DeepSpeed's partitions
        return self

    @model_validator(mode="after")
    def _batch_splits_over_processes(self):
        nodes, procs = self.launcher.nodes, self.launcher.procs_per_node
        gas = self.deepspeed.gradient_accumulation_steps
        if self.micro_batch_size is not None and gas != 1:
            raise ValueError(
                f"set one of micro_batch_size ({self.micro_batch_size}) and "
                f"deepspeed.gradient_accumulation_steps ({gas}): each gives "
                f"the other"
            )
        if isinstance(self.micro_batch_size, int) and self.batch_size % (
            nodes * procs * self.micro_batch_size
        ):
            raise ValueError(
                f"train.batch_size {self.batch_size} is not divisible by {nodes} nodes x "
                f"{procs} processes x micro_batch_size {self.micro_batch_size}: every "
                f"process needs the same whole number of micro-batches"
            )
        per_step = nodes * procs * gas
        if self.batch_size % per_step:
            raise ValueError(
                f"train.batch_size {self.batch_size} is not divisible by {nodes} nodes x "
                f"{procs} processes x {gas} gradient accumulation steps = {per_step}: every "
                f"process needs the same whole number of sequences per micro-batch"
            )
        return self


class FinetuneSpec(Section):
    """The LR-drop phase: train's checkpoint continued, optimizer state kept, at a constant
    lr of train.optimizer.lr / lr_divisor."""

    steps: int = Field(
        gt=0,
        le=MAX_STEPS,
        description="updates after train's last. Published "
        "scripts: 30,000 small, 10,000 large, 50,000 WikiText-103",
    )
    lr_divisor: float = Field(
        10.0, gt=0, description="the phase's lr is train.optimizer.lr / lr_divisor (paper: 10)"
    )
    patience: int | None = Field(
        None,
        gt=0,
        description="start the LR drop once validation has not improved for this "
        "many evaluations (train stops early); default: after "
        "train.steps, as the published scripts do",
    )


class EvaluateSpec(Section):
    """The evaluate stage: every token of each split scored once, streamed with the cache
    (the paper's "full eval"); documents are scored on their targets. A curriculum's
    evaluate scores generated cases and has no use for this section."""

    splits: list[Literal["valid", "test"]] = Field(
        ["valid", "test"], description="the splits scored"
    )
    batch_size: int = Field(
        8,
        gt=0,
        le=MAX_ROWS,
        description="rows of a batch: each split is "
        "scored as this many contiguous streams (documents: documents "
        "per batch). Paper: 8",
    )
    seq_len: int | None = Field(
        None, gt=0, le=MAX_SEQ_LEN, description="segment length; defaults to train.seq_len"
    )
    checkpoint: Literal["latest", "best"] = Field(
        "latest",
        description="latest: the last step; best: the best validation of train and "
        "finetune (needs train.eval_every)",
    )
    line_losses: bool = Field(
        False,
        description="also score every line on its own, as the active-memory paper "
        "does: its padded 'loss per token' and the true per-token NLL "
        "of those lines (pipeline/training/paper_loss.py); needs an eos token",
    )


# the engine settings a curriculum does without: it trains in one process, float32, no ZeRO
CURRICULUM_ENGINE_TRAIN = ("train.deepspeed", "train.launcher")

# the train.* keys of a language-model run that a curriculum has no use for
CURRICULUM_UNUSED_TRAIN = tuple(
    f"train.{key}"
    for key in (
        "steps",
        "seq_len",
        "micro_batch_size",
        "log_every",
        "eval_every",
        "eval_batches",
        "eval_batch_size",
        "eval_seq_len",
        "checkpoint_every",
        "keep_checkpoints",
    )
)
