"""Ordered, seekable batching for language modelling with a Transformer-XL style cache.

Training (:class:`StreamBatches`): the split is cut into ``world_size * batch_size`` contiguous
streams of equal length (the few tokens left at the end are dropped); rank ``r`` owns streams
``r*B .. r*B+B-1``, one per batch row. Step ``k`` of an epoch reads ``seq_len`` inputs from every
stream starting at ``offset + k * seq_len`` and targets shifted by one token, so each row
continues exactly where the previous step stopped and the cached hidden states of the last
segment are the true left context. An epoch ends when a stream has no full segment left; the
next one restarts every stream at a new offset in ``[0, seq_len)``, as the authors' trainer does
to vary the segment boundaries (it draws ``random.randrange(block_size)``; epoch 0 starts at 0).
Here the offset of epoch ``e`` is drawn from a generator seeded with ``(seed, e)``, so the read
position stays a pure function of the step number: resuming at step ``k`` is ``batch(k)``, no
iterator state needs to be saved, and every rank (same seed, same stream length) wraps at the
same step. At the first step of every epoch after the first the rows restart, so the
Transformer-XL cache must be reset (``starts_epoch``).

Evaluation (:func:`eval_batches`): the split's targets ``tokens[1:]`` are cut into
``world_size * batch_size`` contiguous streams of nearly equal length (they differ by at most
one token), so that over all ranks every target is scored exactly once. Positions past the end
of a stream are padded and masked. Every rank yields the same number of batches (fully masked
padding rows/batches where needed) so collectives in the evaluation loop never hang.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator

import numpy as np
import torch


def _check_tokens(tokens) -> np.ndarray:
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"tokens must be a 1-D array, got shape {arr.shape}")
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"tokens must be integer ids, got dtype {arr.dtype}")
    return arr


def _check_layout(batch_size, seq_len, rank, world_size) -> None:
    for name, v in (("batch_size", batch_size), ("seq_len", seq_len), ("world_size", world_size)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    if (
        isinstance(rank, bool)
        or not isinstance(rank, (int, np.integer))
        or not 0 <= rank < world_size
    ):
        raise ValueError(f"rank must be an integer in 0..{world_size - 1}, got {rank!r}")


def _to_long(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))


class StreamBatches:
    """Stateless, seekable next-token batches: ``batch(step) -> (x, y)``, both int64 [B, T]."""

    def __init__(
        self,
        tokens: np.ndarray,
        batch_size: int,
        seq_len: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
    ):
        arr = _check_tokens(tokens)
        _check_layout(batch_size, seq_len, rank, world_size)
        n_streams = world_size * batch_size
        needed = n_streams * (seq_len + 1)
        if arr.size < needed:
            raise ValueError(
                f"split too short: {n_streams} streams (world_size {world_size} x batch_size "
                f"{batch_size}) of at least seq_len+1 = {seq_len + 1} tokens need {needed} "
                f"tokens, but the split has {arr.size}"
            )
        self.batch_size = int(batch_size)
        self.seq_len = int(seq_len)
        self.rank = int(rank)
        self.world_size = int(world_size)
        self.n_streams = int(n_streams)
        self.stream_len = int(arr.size // n_streams)
        #: tokens dropped at the end of the split (fewer than n_streams)
        self.dropped_tokens = int(arr.size - self.stream_len * n_streams)
        streams = arr[: self.stream_len * n_streams].reshape(n_streams, self.stream_len)
        self._rows = streams[self.rank * self.batch_size : (self.rank + 1) * self.batch_size]
        self.seed = int(seed)
        # Offsets are drawn below min(seq_len, stream_len - seq_len) so that every epoch has at
        # least one full segment (stream_len >= seq_len + 1 is all the check above asks).
        self._offset_bound = min(self.seq_len, self.stream_len - self.seq_len)
        # first step of epochs 0, 1, ...: extended on demand, a memo of a pure function of seed
        self._epoch_starts = [0]

    @property
    def tokens_per_step(self) -> int:
        """Target tokens per step over all ranks."""
        return self.n_streams * self.seq_len

    def epoch_offset(self, epoch: int) -> int:
        """Where every stream starts in epoch ``epoch``: 0 for the first, then drawn from
        ``(seed, epoch)`` in ``[0, min(seq_len, stream_len - seq_len))``."""
        if epoch == 0:
            return 0
        # SeedSequence takes non-negative entropy; a negative train.seed is still one seed
        rng = np.random.default_rng([self.seed % 2**64, int(epoch)])
        return int(rng.integers(self._offset_bound))

    def epoch_steps(self, epoch: int) -> int:
        """How many steps epoch ``epoch`` has: full segments (plus the target token) from its
        offset on (``(stream_len - 1) // seq_len`` for epoch 0, at most one fewer after)."""
        return (self.stream_len - 1 - self.epoch_offset(epoch)) // self.seq_len

    def _locate(self, step: int) -> tuple[int, int]:
        """(epoch, step within the epoch) of ``step``."""
        step = self._check_step(step)
        starts = self._epoch_starts
        while starts[-1] <= step:
            starts.append(starts[-1] + self.epoch_steps(len(starts) - 1))
        epoch = bisect.bisect_right(starts, step) - 1
        return epoch, step - starts[epoch]

    def epoch(self, step: int) -> int:
        """The (0-based) epoch that ``step`` belongs to."""
        return self._locate(step)[0]

    def offset(self, step: int) -> int:
        """Start of step ``step``'s inputs within every stream."""
        epoch, k = self._locate(step)
        return self.epoch_offset(epoch) + k * self.seq_len

    def starts_epoch(self, step: int) -> bool:
        """True when ``step`` begins an epoch: rows restart, so a segment cache must be reset."""
        return self._locate(step)[1] == 0

    def _check_step(self, step) -> int:
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
            raise ValueError(f"step must be a non-negative integer, got {step!r}")
        return int(step)

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        off = self.offset(step)
        chunk = self._rows[:, off : off + self.seq_len + 1]
        x = _to_long(chunk[:, :-1])
        y = _to_long(chunk[:, 1:])
        return x, y

    def iter_from(self, start_step: int = 0, num_steps: int | None = None) -> Iterator:
        """Yield ``(step, x, y)`` from ``start_step`` on (forever, or ``num_steps`` times)."""
        step = self._check_step(start_step)
        end = None if num_steps is None else step + int(num_steps)
        while end is None or step < end:
            x, y = self.batch(step)
            yield step, x, y
            step += 1

    def __repr__(self) -> str:
        return (
            f"StreamBatches(streams={self.n_streams}, stream_len={self.stream_len}, "
            f"seq_len={self.seq_len}, rank={self.rank}/{self.world_size}, seed={self.seed})"
        )


def _eval_layout(n_tokens: int, batch_size: int, seq_len: int, world_size: int):
    n_targets = n_tokens - 1
    n_streams = world_size * batch_size
    base, extra = divmod(n_targets, n_streams)
    s = np.arange(n_streams, dtype=np.int64)
    lengths = base + (s < extra).astype(np.int64)
    starts = s * base + np.minimum(s, extra)  # offset of each stream's first target in tokens[1:]
    longest = base + (1 if extra else 0)
    n_batches = -(-longest // seq_len)
    return starts, lengths, n_batches


def eval_num_batches(n_tokens: int, batch_size: int, seq_len: int, world_size: int = 1) -> int:
    """How many batches :func:`eval_batches` yields (the same on every rank)."""
    _check_layout(batch_size, seq_len, 0, world_size)
    if n_tokens < 2:
        raise ValueError(f"evaluation needs at least 2 tokens, the split has {n_tokens}")
    return _eval_layout(n_tokens, batch_size, seq_len, world_size)[2]


def eval_batches(
    tokens: np.ndarray,
    batch_size: int,
    seq_len: int,
    rank: int = 0,
    world_size: int = 1,
) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Yield ``(x, y, mask)``: int64 [B, T] inputs and targets, bool [B, T] mask of real targets.

    Over all ranks, every target ``tokens[i]`` for ``i >= 1`` has ``mask`` True exactly once, with
    input ``tokens[i-1]``. Each row is a contiguous stream across batches (keep the segment cache
    between batches); masked positions hold id 0 in ``x`` and ``y``. ``mask.sum()`` over all
    batches and ranks equals ``len(tokens) - 1``.
    """
    arr = _check_tokens(tokens)
    _check_layout(batch_size, seq_len, rank, world_size)
    if arr.size < 2:
        raise ValueError(f"evaluation needs at least 2 tokens, the split has {arr.size}")
    starts, lengths, n_batches = _eval_layout(int(arr.size), batch_size, seq_len, world_size)
    rows = slice(rank * batch_size, (rank + 1) * batch_size)
    starts, lengths = starts[rows, None], lengths[rows, None]
    cols = np.arange(seq_len, dtype=np.int64)[None, :]
    for j in range(n_batches):
        pos = j * seq_len + cols  # position within each stream
        mask = pos < lengths
        idx = np.where(mask, starts + pos, 0)  # input index; its target is idx + 1
        x = np.where(mask, arr[idx], 0)
        y = np.where(mask, arr[idx + 1], 0)
        yield _to_long(x), _to_long(y), torch.from_numpy(mask)
