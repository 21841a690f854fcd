"""The memory plan: what one training update of a spec takes per process, before the run,
from the spec and the model's own count of its activations (``activation_memory``,
pipeline/models/capabilities.py), without running or inspecting the model. `show --estimate`
prints it for an H100 and an H200, and plans the update it times on this machine with it.

Per process, for Ψ weights over N processes at ZeRO stage z, in the training dtype of e bytes
(DeepSpeed's layout, pipeline/training/ds_config.py's config):

- weights: e Ψ (ZeRO 3: e Ψ / N);
- optimizer states: the optimizer's float32 moments (adam 2, adagrad 1 a weight) and, where
  DeepSpeed keeps them, float32 masters of the weights (bf16 / fp16; every ZeRO stage copies
  them in float32 too), 4 (masters + moments) Ψ, over N from ZeRO 1;
- gradients, at the optimizer step: e Ψ (ZeRO 2 and 3: over N), the float32 copy of the
  partition the optimizer steps (ZeRO 1 to 3, and bf16 / fp16 without ZeRO: DeepSpeed's
  flat float32 gradients) and the step's own float32 temporary of that partition (Adam's and
  Adagrad's square root of the second moment);
- DeepSpeed's gradient bucket (ZeRO 1 and 2): reduce_bucket_size (5e8) elements of e bytes,
  allocated at every backward: memory on a GPU, untouched pages on the CPU; ZeRO 3's gathered
  layers and prefetch buckets are not counted;
- activations at the micro-batch: what the model keeps for backward and the backward's
  largest moment beyond it (its count), and the states carried between blocks: those of the
  update's other micro-batches and this one's in and out (a stream), or one document's
  in and out.

The step's peak is weights + optimizer states + bucket + the larger of the activations (the
backward, before the gradients exist) and the gradients (the optimizer step, once the
activations are freed). Checked against torch's peak on CPU and on an H100
(bench/memory_plan.py, docs/benchmarks.md#memory-plan)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from pipeline.models.capabilities import ActivationMemory, MemoryCounts

GIB = 2**30
BUCKET_ELEMENTS = 500_000_000
"""DeepSpeed's default reduce_bucket_size, which ds_config.py leaves as it is."""
MOMENTS = {"adam": 2, "adagrad": 1}
"""float32 tensors of the weights' size each optimizer keeps (pipeline/training/optim.py)."""


@dataclass(frozen=True)
class Gpu:
    name: str
    sold_as: str
    total: int  # bytes, as the driver (and torch.cuda.get_device_properties) reports them

    @property
    def usable(self) -> int:
        """What a run may plan to fill: 90% of the card (the CUDA context, cuBLAS's workspace
        and the caching allocator's fragments take the rest)."""
        return int(0.9 * self.total)


GPUS = (Gpu("H100", "80 GB", 81_559 * 2**20), Gpu("H200", "141 GB", 143_771 * 2**20))
"""nvidia-smi's totals for an H100 80GB HBM3 and an H200."""


def training_dtype(train, device_type: str) -> torch.dtype:
    """The dtype train.deepspeed gives the weights on a device of `device_type` (bf16: auto
    is bf16 on a GPU that has it, as an H100 and an H200 do, float32 on the CPU)."""
    ds = train.deepspeed
    if ds.fp16:
        return torch.float16
    if ds.bf16 is True or (ds.bf16 == "auto" and device_type == "cuda"):
        return torch.bfloat16
    return torch.float32


def dtype_name(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "float32")


@dataclass(frozen=True)
class Part:
    bytes: int
    how: str


@dataclass(frozen=True)
class ModelStates:
    zero: int
    weights: Part
    gradients: Part
    optimizer: Part
    bucket: Part


def model_states(
    params: int, zero: int, world: int, dtype: torch.dtype, optimizer: str, device_type: str
) -> ModelStates:
    """The weights, gradients, optimizer states and bucket of one process (module doc)."""
    e = torch.empty((), dtype=dtype).element_size()
    low = dtype != torch.float32
    dt = dtype_name(dtype)
    over = f" / {world} processes" if world > 1 else ""
    weights = Part(
        e * params // (world if zero == 3 else 1),
        f"{params:,} x {e} bytes ({dt})" + (over if zero == 3 else ""),
    )
    masters = low or zero >= 1
    per_weight = 4 * (MOMENTS[optimizer] + masters)
    sharded = world if zero >= 1 else 1
    what = f"{optimizer}'s {MOMENTS[optimizer]} float32 moment(s)"
    optimizer_part = Part(
        per_weight * params // sharded,
        f"{what}{' + float32 masters' if masters else ''}: {per_weight} bytes a weight"
        + (over if zero >= 1 else ""),
    )
    grads = e * params // (world if zero >= 2 else 1)
    copy = 4 * params // sharded if (zero >= 1 or low) else 0
    temporary = 4 * params // sharded  # the step's square root of its moment (adam, adagrad)
    gradients = Part(
        grads + copy + temporary,
        f"{e} bytes a weight ({dt}){over if zero >= 2 else ''}"
        + (f" + DeepSpeed's float32 copy{over if zero >= 1 else ''}" if copy else "")
        + " + the step's float32 temporary",
    )
    on_gpu = device_type == "cuda" and zero in (1, 2)
    bucket = Part(
        e * BUCKET_ELEMENTS if on_gpu else 0,
        f"reduce_bucket_size {BUCKET_ELEMENTS:.0e} x {e} bytes, ZeRO {zero}'s"
        if on_gpu
        else "none" + ("" if zero in (1, 2) else f" at ZeRO {zero}"),
    )
    return ModelStates(zero, weights, gradients, optimizer_part, bucket)


@dataclass(frozen=True)
class StepPlan:
    """One process's update at one micro-batch: its model states and its activations."""

    states: ModelStates
    micro_batch: int
    activations: ActivationMemory
    state_copies: int  # the carried states held at once, in micro-batches

    @property
    def activation_bytes(self) -> int:
        a = self.activations
        return a.saved + a.working + a.state * self.state_copies

    @property
    def peak(self) -> int:
        s = self.states
        fixed = s.weights.bytes + s.optimizer.bytes + s.bucket.bytes
        return fixed + max(self.activation_bytes, s.gradients.bytes)


@dataclass(frozen=True)
class Planner:
    """Plans of one model's update on one kind of device: ``at(micro_batch)``."""

    model: object  # a SequenceModel, its shapes held where the plan is wanted
    states: ModelStates
    block_len: int
    dtype: torch.dtype
    device_type: str
    rows: int  # the process's rows per update
    documents: bool  # whole documents per row: no state carried from update to update
    uniform_tokens: bool = False

    def at(self, micro_batch: int, rows: int | None = None) -> StepPlan | None:
        """The plan at `micro_batch` rows, of an update of `rows` (default: the process's);
        None: the model does not count its memory."""
        if not isinstance(self.model, MemoryCounts):
            return None
        counts = self.model.activation_memory(
            micro_batch, self.block_len, self.dtype, self.device_type, self.uniform_tokens
        )
        if counts is None:
            return None
        # a stream's update holds every micro-batch's state, and this one's in and out
        rows = self.rows if rows is None else rows
        copies = 2 if self.documents else rows // micro_batch + 1
        return StepPlan(self.states, micro_batch, counts, copies)

    def largest_that_fits(self, limit: int) -> int:
        """The largest micro-batch up to the process's rows whose peak is within `limit`
        bytes; 0 where not even one row fits."""

        def fits(mb: int) -> bool:
            return (p := self.at(mb)) is not None and p.peak <= limit

        low, high = 0, self.rows
        while low < high:  # the largest mb with fits(mb); the peak grows with mb
            mid = (low + high + 1) // 2
            low, high = (mid, high) if fits(mid) else (low, mid - 1)
        return low


def planner(
    spec,
    model,
    device_type: str,
    world: int,
    rows: int,
    dtype: torch.dtype | None = None,
    uniform_tokens: bool = False,
) -> Planner:
    """The update of `spec`'s training on `world` processes of `device_type`, each with
    `rows` rows an update; `model` (on the meta device: sizes only) is held at the shapes
    wanted (``hold_shapes_at``)."""
    from pipeline.models.protocol import count_elements

    train = spec.train
    dtype = training_dtype(train, device_type) if dtype is None else dtype
    params = count_elements(model.parameters())
    states = model_states(
        params, train.deepspeed.zero_stage, world, dtype, train.optimizer.type, device_type
    )
    generator = spec.dataset.generator
    documents = generator is not None and generator.frequency_sort is not None
    block = train.seq_len if train.seq_len else 1
    if (cases := growing_cases(spec)) is not None:  # generated at the start length
        block = cases.start_length
    return Planner(model, states, block, dtype, device_type, rows, documents, uniform_tokens)


def hold_shapes_at(model, fraction: float | None) -> str:
    """`MemoryCounts.hold_shapes_at` for a model that counts its memory: the shapes the plan
    counts, in words ("" for a model whose shapes learn nothing, or that counts none)."""
    return model.hold_shapes_at(fraction) if isinstance(model, MemoryCounts) else ""


def growing_cases(spec):
    """The length curriculum of an algorithmic task (its cases generated at start_length and
    longer as they are solved), or None for data of a fixed shape: an update's rows are read
    off the data the spec trains on, whichever stage trains on it."""
    generator = spec.dataset.generator
    return generator.algorithmic.curriculum if generator and generator.algorithmic else None


# ---------------------------------------------------------------- this machine's memory


def available_memory() -> tuple[int, str]:
    """Bytes this process may still take, and from where: psutil's available memory, or
    the cgroup's limit less its usage where that is lower (a container, a Slurm job)."""
    import psutil

    available, source = psutil.virtual_memory().available, "available memory (psutil)"
    limit = _cgroup_room()
    if limit is not None and limit < available:
        return limit, "the cgroup's memory limit less its usage"
    return available, source


def _cgroup_room() -> int | None:
    """The cgroup's limit less its usage (v2, then v1); None without a limit."""
    for limit_file, usage_file in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        (
            "/sys/fs/cgroup/memory/memory.limit_in_bytes",
            "/sys/fs/cgroup/memory/memory.usage_in_bytes",
        ),
    ):
        try:
            limit = Path(limit_file).read_text().strip()
            usage = int(Path(usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit == "max" or int(limit) >= 2**60:  # unlimited
            return None
        return max(int(limit) - usage, 0)
    return None


def resident_memory() -> int:
    """This process's resident set, bytes."""
    import psutil

    return psutil.Process().memory_info().rss


def gib(n: int | float) -> str:
    """Bytes as the plan prints them: GiB, or MiB below one GiB."""
    if n < GIB:
        return f"{n / 2**20:.0f} MiB" if n >= 10 * 2**20 else f"{n / 2**20:.1f} MiB"
    value = n / GIB
    return f"{value:.2f} GiB" if value < 10 else f"{value:.1f} GiB"
