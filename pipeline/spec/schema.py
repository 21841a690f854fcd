"""The pipeline spec's schema: one pydantic section per block of the YAML file.

Every section refuses unknown keys and wrong types (strict: a quoted "4" is not an int).
The `model:` section is the exception: it is checked against the registered model's own
config dataclass (pipeline/models), so models stay plain torch. Loading, merging and error
reporting are in pipeline/spec.py.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    field_validator,
    model_validator,
)

from pipeline.redact import mask

# The output layer scores every token of the vocabulary at every position; far larger
# vocabularies than any tokenizer makes would not fit in an accelerator's memory.
VOCAB_LIMIT = 1 << 24
TASK_SYMBOLS_LIMIT = VOCAB_LIMIT - 2
"""A generated task's symbols: its vocabulary adds a separator and padding to them."""


def check_task_symbols(value: int | None) -> int | None:
    """The validator of a task's `vocab`: at most TASK_SYMBOLS_LIMIT symbols."""
    if value is not None and value > TASK_SYMBOLS_LIMIT:
        raise ValueError(
            f"at most {TASK_SYMBOLS_LIMIT:,} symbols: with the separator and "
            f"padding they are the vocabulary, which the output layer scores at "
            f"every position (the papers' tasks use 20 to 100)"
        )
    return value


# Upper bounds on counts and sizes: a value past them cannot run on any machine (it
# overflows, or asks for more memory than exists), so `validate` refuses it rather than `run`
# failing deep inside. They are far above the papers' settings (batch 64 x 512, 450k steps).
MAX_STEPS = 10**12
MAX_ROWS = 2**20
MAX_SEQ_LEN = 2**20


class Section(BaseModel):
    # Unknown keys are errors; "12" is not an int. YAML already gives us real types.
    # No setting means infinity, and NaN would pass no check (.inf and .nan are YAML floats).
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class SplitSpec(Section):
    """How the source becomes train / valid / test.

    tail: one stream (the download's role 'all'): the last `test` units are test, the `valid`
    units before them valid, the rest train. Units: bytes for the byte tokenizer, characters
    for char, lines for word and sentencepiece (a line is never cut). >= 1: a count (a whole
    number); < 1: a fraction of the stream. enwik8 / text8: valid 5000000, test 5000000.
    files: the download's roles train / valid / test, one file each, taken as they are.
    """

    kind: Literal["tail", "files"] = Field(
        "tail",
        description="tail: cut the one stream (role 'all') into train / valid / test; "
        "files: the download's train, valid and test files, one each (a "
        "zip archive)",
    )
    valid: float = Field(
        0.05,
        gt=0,
        le=2**53,
        description="tail: the valid split's size, "
        "just before test: units when >= 1 (a whole number), a fraction of "
        "the stream when < 1. enwik8 / text8: 5000000",
    )
    test: float = Field(
        0.05,
        gt=0,
        le=2**53,
        description="tail: the test split's size, at "
        "the stream's end: units when >= 1 (a whole number), a fraction of "
        "the stream when < 1. enwik8 / text8: 5000000",
    )

    @model_validator(mode="after")
    def _sizes_fit_kind(self):
        if self.kind == "files":
            given = sorted({"valid", "test"} & self.model_fields_set)
            if given:
                verb = "apply" if len(given) > 1 else "applies"
                raise ValueError(
                    f"{' and '.join(given)} only {verb} to kind 'tail'; kind "
                    f"'files' takes the train, valid and test files as they are"
                )
        for key in ("valid", "test"):
            value = getattr(self, key)
            if value >= 1 and value != int(value):
                raise ValueError(
                    f"{key}: {value} is neither a fraction (< 1) nor a whole number of units"
                )
        return self


# which tokenizer settings apply to which kind
_TOKENIZER_KEYS = {
    "byte": (),
    "char": (),
    "word": ("eos",),
    "sentencepiece": (
        "eos",
        "model_type",
        "vocab_size",
        "character_coverage",
        "byte_fallback",
        "normalization",
        "sample_sentences",
        "seed",
        "num_threads",
    ),
}


class TokenizerSpec(Section):
    """How text becomes tokens. `tokenizer: byte` is short for `tokenizer: {kind: byte}`.

    byte: one token per byte; char: one per unicode character (UTF-8 text); both with the
    sorted symbol set of the whole source as vocabulary (as the reference code does).
    word: every line (lines end at "\\n") is `line.split()` plus `eos`; the vocabulary is the
    training split's words by descending frequency (ties: first occurrence); a valid/test word
    never seen in train is an error. sentencepiece: a BPE or unigram model trained on the
    training split only, up to `sample_sentences` lines drawn with `seed`; each line is encoded
    alone and followed by `eos`; the model file is written beside the shards.
    """

    kind: Literal["byte", "char", "word", "sentencepiece"] = Field(
        "byte",
        description="byte: a token per byte; char: per unicode character; word: "
        "whitespace-separated words plus eos per line; sentencepiece: a "
        "BPE or unigram model trained on the train split",
    )
    eos: str | None = Field(
        "<eos>", description="word, sentencepiece: the token ending every line; null: none"
    )
    model_type: Literal["bpe", "unigram"] = Field(
        "bpe", description="sentencepiece: the segmentation model the trainer learns"
    )
    vocab_size: int | None = Field(
        None,
        ge=3,
        le=VOCAB_LIMIT,
        description="sentencepiece: the number of pieces, i.e. the vocabulary (required)",
    )
    character_coverage: float = Field(
        1.0,
        gt=0,
        le=1,
        description="sentencepiece: the share of the training characters "
        "that get a symbol of their own; the rarest rest are "
        "unknown (or bytes, with byte_fallback)",
    )
    byte_fallback: bool = Field(
        False,
        description="sentencepiece: a character without a "
        "piece becomes its UTF-8 bytes, not unknown",
    )
    normalization: Literal["identity", "nmt_nfkc", "nfkc", "nmt_nfkc_cf", "nfkc_cf"] = Field(
        "identity", description="sentencepiece: identity keeps the text recoverable"
    )
    sample_sentences: int = Field(
        1_000_000,
        gt=0,
        le=2**31,
        description="sentencepiece: training lines drawn from the train split",
    )
    seed: int = Field(
        0, ge=0, lt=2**31, description="sentencepiece: the line sample and the trainer"
    )
    num_threads: int = Field(
        4,
        gt=0,
        le=1024,
        description="sentencepiece trainer threads; part of the "
        "model (unigram results depend on it)",
    )

    @model_validator(mode="after")
    def _settings_fit_kind(self):
        allowed = _TOKENIZER_KEYS[self.kind]
        stray = sorted(k for k in self.model_fields_set - {"kind"} if k not in allowed)
        if stray:
            owners = {
                k: [kind for kind, keys in _TOKENIZER_KEYS.items() if k in keys] for k in stray
            }
            said = "; ".join(f"{k} applies to kind {' / '.join(owners[k])}" for k in stray)
            raise ValueError(f"{said}, not to kind '{self.kind}'")
        if self.eos is not None and (not self.eos or self.eos.split() != [self.eos]):
            raise ValueError(f"eos must be one word without whitespace, got {self.eos!r}")
        if self.kind == "sentencepiece" and self.vocab_size is None:
            raise ValueError("kind sentencepiece needs vocab_size (the number of pieces)")
        return self

    def settings(self) -> dict:
        """The kind and the settings that apply to it (what the manifest records)."""
        return {"kind": self.kind, **{k: getattr(self, k) for k in _TOKENIZER_KEYS[self.kind]}}


class SplitSizesSpec(Section):
    train: int = Field(gt=0, le=2**31, description="sequences of the train split (paper: 8,000)")
    valid: int = Field(gt=0, le=2**31, description="sequences of the valid split (paper: 800)")
    test: int = Field(gt=0, le=2**31, description="sequences of the test split (paper: 800)")


class FrequencySortTask(Section):
    """The ∞-former's sorting task (docs/papers.md#sorting-task): `length` tokens drawn from a
    mixture of two distributions over `vocab` symbols whose weight drifts from the first to the
    second along the sequence; target = the symbols by decreasing count (absent ones last, in
    index order). Each distribution: integer weights drawn uniformly from `weight_range`,
    normalised."""

    vocab: Annotated[int, AfterValidator(check_task_symbols)] = Field(
        20,
        gt=1,
        description="symbols the inputs are drawn from; the model's vocabulary is "
        "vocab + 2 (separator and padding). Paper: 20",
    )
    length: int = Field(
        4000,
        gt=0,
        le=2**24,
        description="input tokens per sequence; a "
        "document is length + 1 + vocab tokens (input, separator, sorted "
        "target). Paper: 4,000 / 8,000 / 16,000",
    )
    weight_range: list[int] = Field(
        [1, 9],
        min_length=2,
        max_length=2,
        description="[low, "
        "high], 0 < low <= high: each symbol's weight in the two "
        "distributions is an integer drawn uniformly from low..high "
        "(inclusive), then normalised. The authors' code: [1, 9]",
    )
    sequences: SplitSizesSpec = Field(
        SplitSizesSpec(train=8000, valid=800, test=800), description="sequences per split"
    )

    @model_validator(mode="after")
    def _range(self):
        lo, hi = self.weight_range
        if not 0 < lo <= hi:
            raise ValueError(
                f"weight_range must be [low, high] with 0 < low <= high, got {self.weight_range}"
            )
        return self


class CurriculumSpec(Section):
    """The curriculum stage's length curriculum (docs/papers.md#active-memory-tasks): train at
    one length for an epoch, score fresh cases, grow the length once they are solved. The
    score is the longest length solved."""

    start_length: int = Field(
        5,
        gt=0,
        le=2**24,
        description="the cases' length in the first "
        "epoch; add and mult: odd and at least 3. Paper: 5",
    )
    epochs: int = Field(
        100, gt=0, le=MAX_STEPS, description="epochs the curriculum trains (paper: 100)"
    )
    steps_per_epoch: int = Field(
        100,
        gt=0,
        le=MAX_STEPS,
        description="Adam updates per epoch, each on train.batch_size fresh cases (paper: 100)",
    )
    check_cases: int = Field(
        32,
        gt=0,
        le=2**20,
        description="fresh cases scored, without dropout, after each epoch (paper: 32)",
    )
    promote_accuracy: float = Field(
        1.0,
        gt=0,
        le=1,
        description="grow the length when the "
        "check's token accuracy is at least this (paper: 1.0, "
        "i.e. 100%)",
    )
    length_step: int | None = Field(
        None,
        gt=0,
        description="how much a solved length "
        "grows; default: 2 for add and mult (lengths stay odd), "
        "else 1, as the paper; add and mult need an even one",
    )


class AlgorithmicTask(Section):
    """The active-memory paper's algorithmic tasks (docs/papers.md#active-memory-tasks),
    generated online with a length curriculum; position-wise targets of the input's length."""

    problem: Literal["reverse", "sort", "add", "mult", "not", "remember"] = Field(
        description="the task (layouts in pipeline/data/algorithmic.py): reverse / sort the "
        "input; add / mult two binary numbers; not: flip bits; remember: repeat "
        "N tokens after N zeros"
    )
    vocab: Annotated[int | None, AfterValidator(check_task_symbols)] = Field(
        None,
        gt=1,
        description="the model's vocabulary; default as in the paper: 100 reverse, "
        "20 sort and remember, 3 add, mult and not (their tokens stay "
        "0, 1, separator 2; the authors' script: 20)",
    )
    curriculum: CurriculumSpec = CurriculumSpec()

    @model_validator(mode="after")
    def _vocab_fits_problem(self):
        if self.vocab is not None and self.problem in ("add", "mult", "not") and self.vocab < 3:
            raise ValueError(
                f"problem '{self.problem}' uses the tokens 0, 1 and the separator "
                f"2: its vocab must be at least 3; got {self.vocab}"
            )
        return self

    @model_validator(mode="after")
    def _lengths_fit_problem(self):
        cur = self.curriculum
        if self.problem in ("add", "mult") and (
            cur.start_length % 2 == 0 or cur.start_length < 3 or (cur.length_step or 2) % 2
        ):
            raise ValueError(
                f"problem '{self.problem}' needs odd lengths of at least 3 (two "
                f"operands of (length - 1) / 2 bits and a separator): an odd "
                f"curriculum.start_length and an even length_step; found "
                f"{cur.start_length} and {cur.length_step}"
            )
        return self


GENERATOR_TASKS = ("frequency_sort", "algorithmic")


class GeneratorSpec(Section):
    """A generated (synthetic) task instead of a download: exactly one task section.
    frequency_sort is generated by preprocess (documents); algorithmic online by the
    curriculum stage."""

    seed: int = Field(
        0,
        ge=0,
        lt=2**32,
        description="seeds the generated data: the sorting "
        "task's splits, or the algorithmic task's training, check and "
        "evaluation cases (train.seed seeds the model)",
    )
    frequency_sort: FrequencySortTask | None = None
    algorithmic: AlgorithmicTask | None = None

    @model_validator(mode="after")
    def _one_task(self):
        given = [t for t in GENERATOR_TASKS if getattr(self, t) is not None]
        if len(given) != 1:
            raise ValueError(
                f"give exactly one task section ({' or '.join(GENERATOR_TASKS)}); "
                f"found {', '.join(given) or 'none'}"
            )
        return self

    @property
    def task(self) -> str:
        return next(t for t in GENERATOR_TASKS if getattr(self, t) is not None)


class ShardSpec(Section):
    """How preprocess packs each split's token ids: webdataset tar shards
    (shards/<split>-NNNNNN.tar) of fixed-size blocks."""

    block_tokens: int = Field(65536, gt=0, le=2**28, description="tokens per webdataset sample")
    blocks_per_shard: int = Field(64, gt=0, le=2**20, description="samples per tar shard")


class FileSpec(Section):
    """One data file the dataset is made of, checked after download and extraction."""

    path: str = Field(description="path inside the archive (the file's name if none)")
    sha256: str | None = Field(
        None, description="the extracted file's expected sha256 (hex), checked when it is extracted"
    )
    md5: str | None = Field(
        None,
        description="the extracted file's expected md5 (hex), "
        "where the publisher gives only an md5",
    )


# what a generated dataset has no use for
_DOWNLOAD_ONLY = ("url", "sha256", "archive", "files", "tokenizer", "split")


class DatasetSpec(Section):
    """A dataset card: a source to download (url) or a task to generate (generator)."""

    name: str = Field(description="the dataset's name, recorded in the manifest and in messages")
    description: str = Field("", description="one line for people; no stage reads it")
    url: str | None = Field(
        None,
        description="where the data comes from: builtin://NAME (made "
        "here, no network), file:///path or "
        "http(s)://...",
    )
    generator: GeneratorSpec | None = Field(None, description="a synthetic task instead of url")
    sha256: str | None = Field(
        None,
        description="the downloaded file's sha256 (hex), checked "
        "and the download cache's key; required for "
        "http(s)",
    )
    archive: Literal["none", "zip", "gz"] = Field(
        "none",
        description="how the download is packed: none (a plain file), gz (one gzipped "
        "file), zip (files picks its members); builtin:// is none",
    )
    files: dict[str, FileSpec] = Field(
        {},
        description="role (all | train | valid | test) -> the file that plays it; "
        "empty: every file of the download, role = its name",
    )
    tokenizer: TokenizerSpec = TokenizerSpec()
    split: SplitSpec = SplitSpec()
    shards: ShardSpec = ShardSpec()
    vocab_size: int | None = Field(
        None,
        gt=0,
        le=VOCAB_LIMIT,
        description="the vocabulary size expected, for `show`'s "
        "parameter count before preprocessing (the "
        "manifest has the real one)",
    )

    def resolved(self) -> dict:
        """The card as plain data with only the settings that apply to its source, tokenizer
        kind and split kind: the validators refuse the others when the card is read back."""
        out = self.model_dump(mode="json")
        if self.generator is not None:
            for key in _DOWNLOAD_ONLY:
                del out[key]
            return out
        out["tokenizer"] = self.tokenizer.settings()
        if self.split.kind == "files":
            out["split"] = {"kind": "files"}
        return out

    @field_validator("url")
    @classmethod
    def _fetchable(cls, value: str | None) -> str | None:
        """A URL urllib.parse accepts but no request can be made with (a port that is no
        number, an unbalanced `[`, no host) is refused here, not by a traceback mid-run."""
        from pipeline.data.fetch import url_problem

        problem = url_problem(value) if value is not None else None
        if problem:
            raise ValueError(problem)
        return value

    @model_validator(mode="before")
    @classmethod
    def _tokenizer_shorthand(cls, data):
        if isinstance(data, dict) and isinstance(data.get("tokenizer"), str):
            data = {**data, "tokenizer": {"kind": data["tokenizer"]}}
        return data

    @model_validator(mode="after")
    def _source_fits_split(self):
        if self.generator is not None:
            stray = sorted(set(_DOWNLOAD_ONLY) & self.model_fields_set)
            if stray:
                raise ValueError(
                    f"a generated dataset (generator: {self.generator.task}) has "
                    f"no {', '.join(stray)}: its data is made, not downloaded"
                )
            task = self.generator.frequency_sort
            if task is not None:  # its symbols, the separator and the padding
                if self.vocab_size not in (None, task.vocab + 2):
                    raise ValueError(
                        f"vocab_size {self.vocab_size} differs from the sorting "
                        f"task's {task.vocab} symbols + separator + padding"
                    )
                self.vocab_size = task.vocab + 2
            return self
        if self.url is None:
            raise ValueError(
                "a dataset needs a url (builtin://, file://, http(s)://) or a generator section"
            )
        roles = set(self.files)
        single = self.archive != "zip" or self.url.startswith("builtin://")
        if self.split.kind == "tail":
            if roles and roles != {"all"}:
                raise ValueError(
                    f"split kind 'tail' reads one stream, the file of role 'all'; "
                    f"files has roles {', '.join(sorted(roles))}"
                )
        else:
            if single:
                raise ValueError(
                    "split kind 'files' needs train / valid / test files: a zip "
                    "archive (archive: zip); this source is a single stream"
                )
            if roles and roles != {"train", "valid", "test"}:
                raise ValueError(
                    f"split kind 'files' needs exactly the roles train, valid and "
                    f"test in files; found {', '.join(sorted(roles))}"
                )
        tok = self.tokenizer
        if tok.kind == "sentencepiece":
            if self.vocab_size is None:
                self.vocab_size = tok.vocab_size
            elif self.vocab_size != tok.vocab_size:
                raise ValueError(
                    f"vocab_size {self.vocab_size} differs from the sentencepiece "
                    f"tokenizer's vocab_size {tok.vocab_size}"
                )
        return self


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

    @property
    def world_size(self) -> int:
        return self.nodes * self.procs_per_node


class TrainSpec(Section):
    """The train stage's settings. finetune runs with them too (its own steps and lr),
    evaluate takes device and the default seq_len, the curriculum stage seed, device,
    batch_size, optimizer and nonfinite."""

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


class TrackingSpec(Section):
    """MLflow tracking of the runs: parameters, metrics and artifacts of every stage."""

    enabled: bool = Field(True, description="false: nothing is sent to MLflow")
    uri: str | None = Field(
        None,
        description="the MLflow tracking server or store; default: "
        "MLFLOW_TRACKING_URI, else sqlite file "
        "<workspace.root>/mlflow.db",
    )
    experiment: str | None = Field(
        None,
        description="the MLflow experiment the runs are recorded in; defaults to the spec's name",
    )

    @field_validator("uri")
    @classmethod
    def _reachable(cls, value: str | None) -> str | None:
        """An http(s) server's URI with a port that is no number, an unbalanced `[` or no
        host is refused here; MLflow would fail on it only once a run starts. A store
        (sqlite:, file:, a path) is its own scheme's to check."""
        from pipeline.data.fetch import url_problem

        if not value or "://" not in value:
            return value
        problem = url_problem(value, schemes=("http", "https"))
        if problem and not problem.startswith(("unsupported scheme", "no scheme")):
            raise ValueError(problem)
        return value


class WorkspaceSpec(Section):
    """Where runs are kept on disk."""

    root: str = Field(
        "runs",
        description="holds each run's workspace <root>/<name> and the "
        "default MLflow store; relative to the current "
        "directory",
    )
    cache: str | None = Field(
        None, description="downloads cached by sha256, shared by every run; default <root>/cache"
    )

    @field_validator("root", "cache")
    @classmethod
    def _a_directory(cls, value: str | None) -> str | None:
        """A directory, or one that can be made: its nearest existing ancestor is one."""
        if value is None:
            return value
        path = Path(value)
        try:
            existing = next(p for p in (path, *path.parents) if p.exists())
        except OSError as e:  # a name too long for the filesystem, say
            raise ValueError(e.strerror) from None
        if not existing.is_dir():
            raise ValueError(f"{existing} is not a directory")
        return value


# what evaluate logs, under the names a paper row is written with
PAPER_METRICS = ("valid_bpc", "test_bpc", "valid_ppl", "test_ppl", "test_paper_loss")


class PaperSpec(Section):
    """A published result this config reproduces: `show` prints it, `compare` puts it beside
    the runs' numbers. Not part of any stage's fingerprint: it describes, it does not run."""

    table: str = Field(
        min_length=1, description="where it is published, e.g. 'Sukhbaatar et al. 2019, table 2'"
    )
    parameters: int | None = Field(
        None, gt=0, description="the published parameter count (none: the paper gives none)"
    )
    results: dict[Literal[PAPER_METRICS], float] = Field(  # type: ignore[valid-type]
        min_length=1, description="metric -> published value (valid is the paper's dev)"
    )


class Spec(Section):
    # the workspace directory's name: a file name has at most 255 bytes; `+` for a sweep
    # point's value (mixersa+conv), which a directory, a run name and a shell word all take
    name: str = Field(
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.+-]*$",
        max_length=100,
        description="the run's name: its workspace <workspace.root>/<name> and "
        "default MLflow experiment",
    )
    dataset: DatasetSpec
    model: dict[str, Any] = Field(
        description="the model: `kind` names the family, the other "
        "keys are that family's config fields"
    )
    train: TrainSpec | None = None
    finetune: FinetuneSpec | None = None
    evaluate: EvaluateSpec = EvaluateSpec()
    tracking: TrackingSpec = TrackingSpec()
    workspace: WorkspaceSpec = WorkspaceSpec()
    paper: PaperSpec | None = None
    # names checked against the registered stage kinds (plugins included) in validation
    stages: list[str] = Field(
        min_length=1,
        description="the stages to run, in order; each after the stages whose outputs it reads",
    )

    _model_params: Any = PrivateAttr(None)
    _source: str = PrivateAttr("")

    @model_validator(mode="after")
    def _patience_needs_validation(self):
        if self.finetune and self.finetune.patience and not (self.train and self.train.eval_every):
            raise ValueError("finetune.patience counts validations: set train.eval_every")
        return self

    @model_validator(mode="after")
    def _lr_drop_needs_a_constant_lr(self):
        if (
            "finetune" in self.stages
            and self.train
            and self.train.optimizer.schedule != "linear_warmup"
        ):
            raise ValueError(
                f"the finetune stage divides a constant lr; train.optimizer."
                f"schedule {self.train.optimizer.schedule} decays it already: "
                f"drop finetune from stages or use schedule linear_warmup"
            )
        return self

    @model_validator(mode="after")
    def _best_needs_validation(self):
        if (
            self.evaluate.checkpoint == "best"
            and "evaluate" in self.stages
            and not (self.train and self.train.eval_every)
        ):
            raise ValueError(
                "evaluate.checkpoint best is the checkpoint of the best "
                "validation: set train.eval_every"
            )
        return self

    @property
    def model_kind(self) -> str:
        return self.model["kind"]

    @property
    def model_params(self):
        """The model section as the model's own config dataclass."""
        return self._model_params

    @property
    def source(self) -> str:
        return self._source

    @property
    def workspace_dir(self) -> Path:
        return Path(self.workspace.root) / self.name

    def build_model(self, vocab_size: int, origin: str):
        """The spec's model for a vocabulary of `vocab_size` (from `origin`); a model that
        refuses it (adaptive_cutoffs past the vocabulary, say) is one line naming both."""
        from pipeline.errors import PipelineError
        from pipeline.models import build_model

        try:
            return build_model(self.model_kind, self.model_params, vocab_size)
        except ValueError as e:
            raise PipelineError(
                f"{self.source}: model: {e} (vocabulary {vocab_size} from {origin})"
            ) from None

    def resolved(self) -> dict:
        """The spec as plain data, every default filled in: what `show` prints and MLflow keeps,
        so the credentials of its URLs are masked (pipeline.redact)."""
        out = self.model_dump(mode="json")
        out["dataset"] = self.dataset.resolved()
        out["model"] = {"kind": self.model_kind, **asdict(self.model_params)}
        for path, _ in self.inert_keys():  # they would be refused when read back
            parent = out
            for part in path[:-1]:
                parent = parent[part]
            parent.pop(path[-1], None)
        return mask(out)

    def inert_keys(self) -> list[tuple[tuple[str, ...], str]]:
        """The keys that do nothing under this spec's other settings, each with why. Written
        in the config being run (or by --set) they are refused; inherited from a shared base
        that a variant switches off, they are accepted (pipeline.spec)."""
        out = []
        opt = self.train.optimizer if self.train else None
        params = self.model_params
        curriculum = "curriculum" in self.stages
        for applies, keys, why in (
            (
                curriculum,
                CURRICULUM_UNUSED_TRAIN,
                "the curriculum stage's epochs, lengths and checkpoints are set by "
                "dataset.generator.algorithmic.curriculum",
            ),
            (
                curriculum,
                ("train.deepspeed", "train.launcher"),
                "the curriculum stage trains in one process on a float32 engine without ZeRO",
            ),
            (
                curriculum,
                tuple(f"evaluate.{key}" for key in EvaluateSpec.model_fields),
                "an algorithmic task is scored on generated cases at the curriculum's lengths",
            ),
            (
                opt and opt.type == "adagrad",
                ("train.optimizer.betas",),
                "betas are Adam's moment decays; adagrad has none",
            ),
            (
                opt and opt.type == "adagrad" and opt.clip == "per_param",
                ("train.optimizer.weight_decay",),
                "the paper's Adagrad (clip: per_param) has no weight decay",
            ),
            (opt and opt.clip == "none", ("train.optimizer.clip_norm",), "clip is none"),
            (
                self.train and self.train.nonfinite == "stop",
                ("train.nonfinite_limit",),
                "train.nonfinite is stop: the first non-finite update stops training",
            ),
        ):
            if applies:
                out += [(tuple(key.split(".")), why) for key in keys]
        # each model kind's config knows its own; a plugin's config may have none
        if params is not None and hasattr(params, "inert_keys"):
            out += [(("model", key), why) for key, why in params.inert_keys()]
        return out

    def inert_defaults(self) -> dict[str, object]:
        """The inert keys of the pipeline's sections (inert_keys; the model's are left out of
        its resolved section), dotted, each with its default as JSON: the value a stage's
        fingerprint counts for it, whatever a base sets, so that an unset one hashes as it
        always did and editing one changes nothing."""
        out = {}
        for path, _ in self.inert_keys():
            section: Any = self
            for part in path[:-1]:
                section = getattr(section, part, None)
            if isinstance(section, BaseModel):
                default = (
                    type(section).model_fields[path[-1]].get_default(call_default_factory=True)
                )
                out[".".join(path)] = (
                    default.model_dump(mode="json") if isinstance(default, BaseModel) else default
                )
        return out
