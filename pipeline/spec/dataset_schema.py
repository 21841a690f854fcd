"""The `dataset:` block of a spec, a dataset card: where the data comes from (a URL, a file,
the built-in corpus) or the task that generates it, how it is split and tokenized."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, Field, field_validator, model_validator

from pipeline.spec.section_base import (
    MAX_STEPS,
    VOCAB_LIMIT,
    Section,
    check_path,
    check_task_symbols,
)


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
    _a_path = field_validator("path")(check_path)
    sha256: str | None = Field(
        None, description="the extracted file's expected sha256 (hex), checked when it is extracted"
    )
    md5: str | None = Field(
        None,
        description="the extracted file's expected md5 (hex), "
        "where the publisher gives only an md5",
    )


def _source_path_problem(url: str) -> str | None:
    """What no download can be made of: a file:// URL without an absolute path, or a file://
    path or a file name (an http(s) URL's last part, which the download is saved as) that no
    path can hold."""
    import urllib.parse

    from pipeline.data.fetch import file_name
    from pipeline.fsutil import path_problem

    scheme = urllib.parse.urlsplit(url).scheme.lower()
    if scheme == "builtin":  # a name, which the download stage checks
        return None
    if scheme == "file":
        parts = urllib.parse.urlsplit(url)
        path = urllib.parse.unquote(parts.path)
        if parts.netloc not in ("", "localhost") or not path.startswith("/"):
            return "a file URL names an absolute path, with three slashes: file:///path/to/file"
        problem = path_problem(path)
        return f"its path: {problem}" if problem else None
    problem = path_problem(file_name(url))
    return f"the file name it is saved as: {problem}" if problem else None


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
        if value is not None and (problem := _source_path_problem(value)):
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
