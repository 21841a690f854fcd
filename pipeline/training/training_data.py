"""What a `Trainer` trains on (`TrainingData`): the preprocess stage's shards
(`PreprocessedData`), the curriculum's generated task
(pipeline.training.curriculum.LengthCurriculum), or random tokens of the shards' shape
(`RandomStreams`, `RandomDocuments`: what the estimate times an update on, before
preprocess has run)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import torch

from pipeline.data.documents import DocumentBatches, as_documents
from pipeline.data.manifest import load_manifest, load_split
from pipeline.errors import PipelineError
from pipeline.training.tasks import Documents, Task, TokenStreams


class TrainingData(Protocol):
    @property
    def vocab_size(self) -> int: ...

    @property
    def documents(self) -> dict | None:
        """The manifest's documents; None: token streams."""

    @property
    def block_len(self) -> int:
        """The tokens of one training row."""

    @property
    def origin(self) -> str:
        """Where the vocabulary was read, for messages."""

    def train_batches(self, rows: int, rank: int, world_size: int, seed: int) -> Any:
        """This rank's batches: `batch(step)` gives update `step`'s rows (x, y, or
        documents); for token streams `starts_epoch(step)` says when the streams restart."""

    def valid_split(self) -> Any:
        """What validation reads: tokens, or documents."""

    def task(self, train) -> Task:
        """What the Trainer does with these batches and this split
        (pipeline.training.tasks), under the spec's train settings."""


class PreprocessedData:
    """The shards of a preprocess stage's output directory."""

    def __init__(self, preprocess_dir: Path, seq_len: int | None):
        self.dir = Path(preprocess_dir)
        manifest = load_manifest(self.dir)
        self.vocab_size: int = manifest["vocab_size"]
        self.documents: dict | None = manifest.get("documents")  # None: a token stream
        # a document less its last token, or train.seq_len
        if self.documents is not None:
            self.block_len: int = self.documents["length"] - 1
        elif seq_len is not None:
            self.block_len = seq_len
        else:
            raise PipelineError("train.seq_len: required to train on a token stream")
        self.origin = f"{self.dir}/manifest.json"

    def train_batches(self, rows: int, rank: int, world_size: int, seed: int):
        """The train split's batches of `rows` rows for this rank: token streams, or whole
        documents where the manifest has them."""
        from pipeline.data import StreamBatches

        tokens = load_split(self.dir, "train")
        split = dict(rank=rank, world_size=world_size, seed=seed)
        try:
            if self.documents is None:
                return StreamBatches(tokens, rows, self.block_len, **split)
            docs = as_documents(tokens, self.documents, f"{self.dir}, train split")
            return DocumentBatches(docs, rows, **split)
        except ValueError as e:
            raise PipelineError(f"train: {e}") from None

    def valid_split(self):
        """The valid split (read and checksummed): its tokens, or its documents."""
        tokens = load_split(self.dir, "valid")
        if self.documents is None:
            return tokens
        return as_documents(tokens, self.documents, f"{self.dir}, valid split")

    def task(self, train) -> Task:
        if self.documents is None:
            return TokenStreams()
        return Documents(self.documents, train.seq_len)


class RandomStreams:
    """TrainingData of token streams: random rows of the run's shape, one stream."""

    documents = None

    def __init__(self, vocab_size: int, block_len: int, origin: str):
        self.vocab_size, self.block_len, self.origin = vocab_size, block_len, origin
        self.rows = 0
        self.generator = torch.Generator().manual_seed(0)

    def train_batches(self, rows: int, rank: int, world_size: int, seed: int):
        self.rows = rows
        return self

    def starts_epoch(self, step: int) -> bool:
        return False

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (self.rows, self.block_len)
        x = torch.randint(self.vocab_size, shape, generator=self.generator)
        return x, torch.randint(self.vocab_size, shape, generator=self.generator)

    def valid_split(self):
        raise PipelineError("the update timing does not validate")

    def task(self, train) -> Task:
        return TokenStreams()


class RandomDocuments(RandomStreams):
    """TrainingData of whole documents (the frequency-sort task's layout), random tokens."""

    def __init__(self, vocab_size: int, layout: dict, origin: str):
        super().__init__(vocab_size, layout["length"] - 1, origin)
        self.documents = layout  # type: ignore[assignment]
        self.layout = layout

    def batch(self, step: int) -> torch.Tensor:  # type: ignore[override]
        shape = (self.rows, self.block_len + 1)
        return torch.randint(self.vocab_size, shape, generator=self.generator)

    def task(self, train) -> Task:
        return Documents(self.layout, train.seq_len)
