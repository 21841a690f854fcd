"""Word-level vocabularies, WikiText's convention: every line is ``line.split()`` plus an
end-of-line token, lines end at ``"\n"``; the vocabulary is every word of the training text,
ordered by descending training frequency (ties: first occurrence first), so id 0 is the most
frequent word and adaptive-softmax bands are contiguous id ranges.

Text is tokenized in chunks cut at line ends (`iter_line_chunks`), so a WikiText-103 split
never has to be one Python string. Plain numpy: no torch, no yaml.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np

from pipeline.data.shards import smallest_uint_dtype


class UnknownWordError(ValueError):
    """A word of valid/test text that the (training) vocabulary does not have."""

    def __init__(self, word: str, line: int):
        self.word, self.line = word, line
        super().__init__(
            f"word {word!r} on line {line:,} is not in the vocabulary "
            f"(it never occurs in the training text)"
        )


class _FirstSeen(dict):
    """word -> provisional id, a new id for each new word in order of first occurrence."""

    def __missing__(self, word):
        self[word] = n = len(self)
        return n


LINE_CHUNK = 1 << 24  # bytes of text tokenized at a time


def iter_line_chunks(data, chunk_bytes: int = LINE_CHUNK) -> Iterator[tuple[str, int]]:
    """``(text, first_line)`` pieces of UTF-8 ``data`` cut after a ``"\n"`` (0-based line
    numbers). A UTF-8 sequence never contains the byte 0x0A, so each piece decodes alone."""
    mv = memoryview(data).cast("B")
    n, start, line = len(mv), 0, 0
    while start < n:
        end = min(start + chunk_bytes, n)
        if end < n:
            cut = bytes(mv[end : min(end + chunk_bytes, n)]).find(b"\n")
            end = n if cut < 0 else end + cut + 1
        raw = bytes(mv[start:end])
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"not UTF-8 text at byte {start + e.start:,}") from None
        yield text, line
        line += raw.count(b"\n")
        start = end


def count_lines(data) -> int:
    """Lines of ``data`` as the word tokenizer sees them: pieces ending at ``"\n"``, plus a
    last unterminated piece if it is not empty."""
    mv = memoryview(data).cast("B")
    if len(mv) == 0:
        return 0
    arr = np.frombuffer(mv, dtype=np.uint8)
    return int(np.count_nonzero(arr == 10)) + (0 if arr[-1] == 10 else 1)


def _check_eos(eos: str | None) -> None:
    if eos is not None and (not isinstance(eos, str) or not eos or eos.split() != [eos]):
        raise ValueError(f"eos must be a non-empty word without whitespace, got {eos!r}")


def split_words(text: str, eos: str | None) -> list[str]:
    """The tokens of ``text``: for every line ``line.split() + [eos]`` (no eos when None)."""
    if eos is None:
        return text.split()
    words = text.replace("\n", f" {eos} ").split()
    if text and not text.endswith("\n"):
        words.append(eos)  # the last line has no "\n" but is a line all the same
    return words


class WordVocab:
    """Words in id order (descending training frequency) and the end-of-line token."""

    kind = "word"

    def __init__(self, words: Iterable[str], eos: str | None = "<eos>"):
        _check_eos(eos)
        words = list(words)
        if not words:
            raise ValueError("a vocabulary needs at least one word")
        index: dict[str, int] = {}
        for i, w in enumerate(words):
            if not isinstance(w, str) or w.split() != [w]:
                raise ValueError(
                    f"vocabulary words must be non-empty strings without "
                    f"whitespace, got {w!r} at id {i}"
                )
            if index.setdefault(w, i) != i:
                raise ValueError(f"word {w!r} is listed twice (ids {index[w]} and {i})")
        if eos is not None and eos not in index:
            raise ValueError(f"the end-of-line token {eos!r} is not in the vocabulary")
        self.eos = eos
        self._words = words
        self._index = index
        self._table: np.ndarray | None = None  # object array for decode, made on first use

    # ------------------------------------------------------------------ construction
    @classmethod
    def fit(cls, data, eos: str | None = "<eos>") -> tuple[WordVocab, np.ndarray]:
        """The vocabulary of the training text ``data`` (UTF-8 bytes) and its ids.

        Words are ordered by descending count; equal counts keep the order in which the words
        first occur (so the result depends on the text alone). One pass, no per-token Python
        code: provisional ids by first occurrence, then a permutation.
        """
        _check_eos(eos)
        first = _FirstSeen()
        parts = []
        for text, _ in iter_line_chunks(data):
            words = split_words(text, eos)
            parts.append(
                np.fromiter(map(first.__getitem__, words), dtype=np.uint32, count=len(words))
            )
        if not first:
            raise ValueError("the training text has no words")
        counts = np.zeros(len(first), dtype=np.int64)
        for p in parts:
            counts += np.bincount(p, minlength=len(first))
        order = np.argsort(-counts, kind="stable")  # ties: first occurrence first
        words = list(first)
        vocab = cls([words[i] for i in order], eos)
        remap = np.empty(len(order), dtype=vocab.dtype)
        remap[order] = np.arange(len(order))
        ids = np.empty(sum(p.size for p in parts), dtype=vocab.dtype)
        pos = 0
        for p in parts:
            ids[pos : pos + p.size] = remap[p]
            pos += p.size
        vocab.counts = counts[order]
        return vocab, ids

    counts: np.ndarray | None = None  # training counts in id order, when built by fit()

    # ------------------------------------------------------------------ properties
    @property
    def symbols(self) -> list[str]:
        return list(self._words)

    @property
    def dtype(self) -> np.dtype:
        return smallest_uint_dtype(len(self))

    @property
    def eos_id(self) -> int | None:
        return None if self.eos is None else self._index[self.eos]

    def id(self, word: str) -> int:
        return self._index[word]

    def __len__(self) -> int:
        return len(self._words)

    def __eq__(self, other) -> bool:
        return isinstance(other, WordVocab) and (self.eos, self._words) == (other.eos, other._words)

    def __hash__(self):
        return hash((self.eos, tuple(self._words)))

    def __repr__(self) -> str:
        return f"WordVocab(size={len(self)}, eos={self.eos!r})"

    # ------------------------------------------------------------------ encode / decode
    def encode(self, data) -> np.ndarray:
        """Ids of the tokens of UTF-8 ``data`` (bytes); UnknownWordError names the first word
        that is not in the vocabulary and its (1-based) line."""
        parts = []
        for text, first_line in iter_line_chunks(data):
            words = split_words(text, self.eos)
            try:
                parts.append(
                    np.fromiter(
                        map(self._index.__getitem__, words), dtype=self.dtype, count=len(words)
                    )
                )
            except KeyError:
                for i, line in enumerate(text.split("\n")):
                    for w in line.split():
                        if w not in self._index:
                            raise UnknownWordError(w, first_line + i + 1) from None
                raise
        if not parts:
            return np.zeros(0, dtype=self.dtype)
        return np.concatenate(parts)

    def decode(self, ids) -> list[str]:
        """The tokens that ``ids`` stand for, end-of-line tokens included."""
        arr = np.asarray(ids).reshape(-1)
        if arr.size and not np.issubdtype(arr.dtype, np.integer):
            raise TypeError(f"ids must be integers, got dtype {arr.dtype}")
        if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= len(self)):
            bad = int(np.flatnonzero((arr < 0) | (arr >= len(self)))[0])
            raise ValueError(
                f"id {int(arr[bad])} at position {bad} is out of range for a "
                f"vocabulary of {len(self)} words"
            )
        if self._table is None:
            self._table = np.array(self._words, dtype=object)
        return self._table[arr].tolist()

    def decode_lines(self, ids) -> list[str]:
        """The lines that ``ids`` stand for, words joined by one space (eos ends a line; a
        last line without one is kept)."""
        if self.eos is None:
            raise ValueError("a vocabulary without an end-of-line token has no lines")
        lines: list[str] = []
        cur: list[str] = []
        for w in self.decode(ids):
            if w == self.eos:
                lines.append(" ".join(cur))
                cur = []
            else:
                cur.append(w)
        if cur:
            lines.append(" ".join(cur))
        return lines

    # ------------------------------------------------------------------ serialisation
    def to_json(self) -> dict:
        """``{"kind": "word", "size", "eos", "symbols"}``: the words in id order."""
        return {"kind": "word", "size": len(self), "eos": self.eos, "symbols": self.symbols}

    @classmethod
    def from_json(cls, d: dict) -> WordVocab:
        if not isinstance(d, dict) or d.get("kind") != "word" or "symbols" not in d:
            raise ValueError("a word vocabulary JSON object needs kind 'word' and 'symbols'")
        v = cls(d["symbols"], d.get("eos"))
        if "size" in d and d["size"] != len(v):
            raise ValueError(f"vocabulary JSON says size {d['size']} but lists {len(v)} words")
        return v
