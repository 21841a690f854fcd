"""Datasets of whole documents of one length (the ∞-former's sorting task): how preprocess
records them, how train and evaluate read them back, and the training batches.

A split is stored as one flat token stream of its documents end to end; the manifest's
``documents`` entry, ``{"length", "input_length", "separator", "padding", "count"}``, says
how to cut it back: ``length`` tokens per document, of which the first ``input_length`` are
the input, then the separator, then the targets that are scored (``count``: documents per
split).

Training (:class:`DocumentBatches`): optimizer step ``k`` reads ``rows`` documents per rank
from a permutation of the train split drawn from ``(seed, epoch)``; the ranks take disjoint
rows of the step's ``world_size * rows`` documents; the last documents of an epoch that do
not fill a step are left out of it (a different set each epoch). ``batch(k)`` is a function
of ``k`` alone: resuming needs no iterator state.
"""

from __future__ import annotations

import numpy as np
import torch

from pipeline.errors import PipelineError


def as_documents(tokens: np.ndarray, layout: dict, what: str) -> np.ndarray:
    """[count, length] view of a split's flat tokens, refusing a stream that does not cut
    into whole documents."""
    length = layout["length"]
    if tokens.size % length:
        raise PipelineError(
            f"{what}: {tokens.size:,} tokens are not whole documents of "
            f"{length:,}; run the pipeline with --force preprocess to rebuild it"
        )
    return tokens.reshape(-1, length)


class DocumentBatches:
    """``batch(step) -> [rows, length]`` int64: this rank's documents for optimizer step
    ``step``."""

    def __init__(
        self, documents: np.ndarray, rows: int, rank: int = 0, world_size: int = 1, seed: int = 0
    ):
        if documents.ndim != 2:
            raise ValueError(f"documents must be [count, length], got shape {documents.shape}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in 0..{world_size - 1}, got {rank}")
        per_step = rows * world_size
        if len(documents) < per_step:
            raise ValueError(
                f"a step reads {per_step} documents (batch of {rows} x world size "
                f"{world_size}), the split has {len(documents)}"
            )
        self.documents, self.rows, self.rank, self.seed = documents, rows, rank, seed
        self.per_step = per_step
        self.steps_per_epoch = len(documents) // per_step

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The permutation of the documents that epoch ``epoch`` reads them in."""
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.documents))

    def indices(self, step: int) -> np.ndarray:
        """Which documents this rank reads at ``step``."""
        epoch, k = divmod(step, self.steps_per_epoch)
        first = k * self.per_step + self.rank * self.rows
        return self.epoch_order(epoch)[first : first + self.rows]

    def batch(self, step: int) -> torch.Tensor:
        return torch.from_numpy(self.documents[self.indices(step)].astype(np.int64))
