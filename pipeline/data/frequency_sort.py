"""The ∞-former's sorting task (docs/papers.md#sorting-task; the card
datasets/sort_synthetic.yaml), as the authors' generate_data.py defines it, seeded.

A case: two distributions over the vocabulary from integer weights drawn uniformly in
``weight_range`` (inclusive) and normalised, p_start and p_end; token j of ``length`` is drawn
from (1 − r) p_start + r p_end with r = (j + 1)/length; the target is every symbol ordered by
decreasing count in the input, ties by first appearance (what ``Counter.most_common`` gives the
authors), the absent symbols last in index order. A document is the input, the separator
symbol (``vocab``), then the target; ``vocab + 1`` is the padding symbol, so a model's
vocabulary is ``vocab + 2``. A language model reads the document and is scored on the
``vocab`` target symbols after the separator.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

SPLITS = ("train", "valid", "test")


def separator(vocab: int) -> int:
    """The symbol between the input and its sorted target."""
    return vocab


def padding(vocab: int) -> int:
    """The symbol that fills a batch's rows past a document's end."""
    return vocab + 1


def document_length(vocab: int, length: int) -> int:
    """Tokens of a document: the `length` input tokens, the separator, the `vocab` targets."""
    return length + 1 + vocab


def mixture_ends(
    rng: np.random.Generator, vocab: int, weight_range: tuple[int, int]
) -> tuple[np.ndarray, np.ndarray]:
    """p_start, p_end [vocab] (float64): integer weights in weight_range, normalised."""
    low, high = weight_range
    ends = rng.integers(low, high + 1, size=(2, vocab)).astype(np.float64)
    ends /= ends.sum(1, keepdims=True)
    return ends[0], ends[1]


def drifting_tokens(
    rng: np.random.Generator, p_start: np.ndarray, p_end: np.ndarray, length: int
) -> np.ndarray:
    """[length] int64: token j drawn from (1 − r) p_start + r p_end, r = (j + 1)/length."""
    r = (np.arange(length) + 1.0) / length
    cdf = (1 - r)[:, None] * np.cumsum(p_start) + r[:, None] * np.cumsum(p_end)
    u = rng.random(length)
    # the first symbol whose cumulative probability exceeds u (cdf's last column is 1 up to
    # rounding; the clip keeps u just below it from naming a symbol past the end)
    return np.minimum((u[:, None] >= cdf).sum(1), len(p_start) - 1).astype(np.int64)


def sort_by_count(tokens: np.ndarray, vocab: int) -> np.ndarray:
    """[vocab] int64: the symbols by decreasing count in tokens, ties by first appearance,
    absent symbols last in index order."""
    counts = np.bincount(tokens, minlength=vocab)
    first = np.full(vocab, len(tokens), dtype=np.int64) + np.arange(vocab)  # absent: by index
    seen, where = np.unique(tokens, return_index=True)  # first occurrences
    first[seen] = where
    return np.lexsort((first, -counts)).astype(np.int64)


def document(
    rng: np.random.Generator, vocab: int, length: int, weight_range: tuple[int, int]
) -> np.ndarray:
    """[length + 1 + vocab] int64: one case's input, the separator, its target."""
    tokens = drifting_tokens(rng, *mixture_ends(rng, vocab, weight_range), length)
    return np.concatenate([tokens, [separator(vocab)], sort_by_count(tokens, vocab)])


def split_documents(
    seed: int, split: str, sequences: int, vocab: int, length: int, weight_range: tuple[int, int]
) -> Iterator[np.ndarray]:
    """The documents of one split one at a time (a writer need not hold the split). Each
    split has its own stream of random numbers from (seed, split), so changing how many
    sequences one split has leaves the others as they were."""
    rng = np.random.default_rng([seed, SPLITS.index(split)])
    for _ in range(sequences):
        yield document(rng, vocab, length, weight_range)


def generate_split(
    seed: int, split: str, sequences: int, vocab: int, length: int, weight_range: tuple[int, int]
) -> np.ndarray:
    """[sequences, length + 1 + vocab] int64: split_documents' documents, stacked."""
    return np.stack(list(split_documents(seed, split, sequences, vocab, length, weight_range)))
