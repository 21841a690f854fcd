"""Vocabularies and simple corpus statistics.

:class:`Vocab` (symbol level, bytes or unicode characters): the sorted list of distinct symbols
that occur in the text; a symbol's id is its index in that list.

:class:`WordVocab` (word level, WikiText's convention): every line is ``line.split()`` plus an
end-of-line token, lines end at ``"\n"``; the vocabulary is every word of the training text,
ordered by descending training frequency (ties: first occurrence first), so id 0 is the most
frequent word and adaptive-softmax bands are contiguous id ranges.

Ids are stored in the smallest unsigned dtype that holds them, so a byte/character corpus costs
one byte (or two) per token on disk and in memory.

Everything here is plain numpy: no torch, no yaml.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator

import numpy as np

KINDS = ("byte", "char")

_UINT_DTYPES = (np.dtype(np.uint8), np.dtype(np.uint16), np.dtype(np.uint32))


def smallest_uint_dtype(n_symbols: int) -> np.dtype:
    """The smallest unsigned dtype that holds ids ``0 .. n_symbols - 1``."""
    if n_symbols < 0:
        raise ValueError(f"n_symbols must be >= 0, got {n_symbols}")
    for dt in _UINT_DTYPES:
        if n_symbols <= int(np.iinfo(dt).max) + 1:
            return dt
    raise ValueError(f"{n_symbols} symbols do not fit in uint32 ids")


def _bytes_array(data: Any) -> np.ndarray:
    """A uint8 view of bytes-like input (bytes, bytearray, memoryview, uint8 array)."""
    if isinstance(data, str):
        raise TypeError("a byte vocabulary takes bytes, not str (encode the text first)")
    if isinstance(data, np.ndarray):
        if data.dtype != np.uint8:
            raise TypeError(f"a byte vocabulary takes a uint8 array, got dtype {data.dtype}")
        return data.reshape(-1)
    try:
        return np.frombuffer(memoryview(data), dtype=np.uint8)
    except TypeError:
        raise TypeError(
            f"a byte vocabulary takes bytes-like input, got {type(data).__name__}"
        ) from None


def _codepoints(text: Any) -> np.ndarray:
    """Unicode code points of a str as uint32 (lone surrogates kept as their code points)."""
    if not isinstance(text, str):
        raise TypeError(f"a char vocabulary takes str, got {type(text).__name__}")
    return np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype="<u4")


def _chars_from_codepoints(cps: np.ndarray) -> str:
    return np.ascontiguousarray(cps, dtype="<u4").tobytes().decode("utf-32-le", "surrogatepass")


class Vocab:
    """A sorted symbol inventory for ``kind`` "byte" (ints 0..255) or "char" (1-char strs)."""

    def __init__(self, kind: str, symbols: Iterable):
        if kind not in KINDS:
            raise ValueError(f"unknown vocabulary kind {kind!r}; expected one of {KINDS}")
        symbols = list(symbols)
        if kind == "byte":
            for s in symbols:
                if isinstance(s, bool) or not isinstance(s, (int, np.integer)) or not 0 <= s <= 255:
                    raise ValueError(f"byte vocabulary symbols must be ints in 0..255, got {s!r}")
            codes = np.asarray([int(s) for s in symbols], dtype=np.int64)
        else:
            for s in symbols:
                if not isinstance(s, str) or len(s) != 1:
                    raise ValueError(
                        f"char vocabulary symbols must be single-character strings, got {s!r}"
                    )
            codes = np.asarray([ord(s) for s in symbols], dtype=np.int64)
        if len(codes) == 0:
            raise ValueError("a vocabulary needs at least one symbol")
        if np.any(np.diff(codes) <= 0):
            raise ValueError("vocabulary symbols must be distinct and sorted")
        self.kind = kind
        self._codes = codes  # sorted code of each symbol (byte value or code point)
        # code -> id lookup table in the id dtype, and which codes are in the vocabulary
        size = 256 if kind == "byte" else int(codes[-1]) + 1
        self._lut = np.zeros(size, dtype=smallest_uint_dtype(len(codes)))
        self._lut[codes] = np.arange(len(codes))
        self._known = np.zeros(size, dtype=bool)
        self._known[codes] = True

    # ------------------------------------------------------------------ construction
    @classmethod
    def build(cls, kind: str, data) -> "Vocab":
        """The distinct symbols occurring in ``data`` (bytes for "byte", str for "char"), sorted."""
        if kind == "byte":
            codes = np.flatnonzero(_code_counts(_bytes_array(data), 256))
            return cls("byte", [int(c) for c in codes])
        if kind == "char":
            cps = _codepoints(data)
            if cps.size == 0:
                raise ValueError("a vocabulary needs at least one symbol")
            codes = np.flatnonzero(_code_counts(cps, int(cps.max()) + 1))
            return cls("char", list(_chars_from_codepoints(codes)))
        raise ValueError(f"unknown vocabulary kind {kind!r}; expected one of {KINDS}")

    # ------------------------------------------------------------------ properties
    @property
    def symbols(self) -> list:
        if self.kind == "byte":
            return [int(c) for c in self._codes]
        return list(_chars_from_codepoints(self._codes))

    @property
    def dtype(self) -> np.dtype:
        """The smallest unsigned dtype that holds every id of this vocabulary."""
        return smallest_uint_dtype(len(self))

    def __len__(self) -> int:
        return int(len(self._codes))

    def __eq__(self, other) -> bool:
        return (
            isinstance(other, Vocab)
            and self.kind == other.kind
            and np.array_equal(self._codes, other._codes)
        )

    def __hash__(self):
        return hash((self.kind, self._codes.tobytes()))

    def __repr__(self) -> str:
        return f"Vocab(kind={self.kind!r}, size={len(self)})"

    # ------------------------------------------------------------------ encode / decode
    def _describe(self, code: int) -> str:
        if self.kind == "byte":
            return f"byte {code} (0x{code:02x})"
        return f"character {chr(code)!r} (U+{code:04X})"

    def encode(self, data) -> np.ndarray:
        """Ids of ``data``'s symbols as a 1-D array of :attr:`dtype`.

        Raises ValueError naming the first symbol not in the vocabulary and its position.
        """
        codes = _bytes_array(data) if self.kind == "byte" else _codepoints(data)
        if codes.size == 0:
            return np.zeros(0, dtype=self.dtype)
        known = self._known
        hi = int(codes.max())
        if hi >= len(known):   # a character beyond the vocabulary's highest code point
            known = np.zeros(hi + 1, dtype=bool)
            known[:len(self._known)] = self._known
        bad_codes = np.flatnonzero((_code_counts(codes, len(known)) > 0) & ~known)
        if bad_codes.size:
            is_bad = np.zeros(len(known), dtype=bool)
            is_bad[bad_codes] = True
            bad = np.flatnonzero(is_bad[codes])
            i = int(bad[0])
            raise ValueError(
                f"unknown {self._describe(int(codes[i]))} at position {i} "
                f"({bad.size} unknown symbol(s) in total; vocabulary of {len(self)} {self.kind}s)"
            )
        return self._lut[codes]

    def decode(self, ids) -> bytes | str:
        """The bytes ("byte") or str ("char") that ``ids`` stand for."""
        arr = np.asarray(ids)
        if arr.size and not np.issubdtype(arr.dtype, np.integer):
            raise TypeError(f"ids must be integers, got dtype {arr.dtype}")
        arr = arr.reshape(-1).astype(np.int64, copy=False)
        if arr.size:
            bad = np.flatnonzero((arr < 0) | (arr >= len(self)))
            if bad.size:
                i = int(bad[0])
                raise ValueError(
                    f"id {int(arr[i])} at position {i} is out of range for a vocabulary of "
                    f"{len(self)} symbols"
                )
        codes = self._codes[arr]
        if self.kind == "byte":
            return codes.astype(np.uint8).tobytes()
        return _chars_from_codepoints(codes)

    # ------------------------------------------------------------------ serialisation
    def to_json(self) -> dict:
        """A JSON-safe dict: ``{"kind", "size", "symbols"}`` (bytes as ints, chars as strs)."""
        return {"kind": self.kind, "size": len(self), "symbols": self.symbols}

    @classmethod
    def from_json(cls, d: dict) -> "Vocab":
        if not isinstance(d, dict) or "kind" not in d or "symbols" not in d:
            raise ValueError("a vocabulary JSON object needs 'kind' and 'symbols'")
        v = cls(d["kind"], d["symbols"])
        if "size" in d and d["size"] != len(v):
            raise ValueError(f"vocabulary JSON says size {d['size']} but lists {len(v)} symbols")
        return v


_CHUNK = 1 << 22


def _code_counts(codes: np.ndarray, size: int) -> np.ndarray:
    """Occurrences of each code 0..size-1 (chunked: bincount would copy all of it to int64)."""
    counts = np.zeros(size, dtype=np.int64)
    for i in range(0, codes.size, _CHUNK):
        counts += np.bincount(codes[i:i + _CHUNK], minlength=size)
    return counts


# ---------------------------------------------------------------------------- words


class UnknownWordError(ValueError):
    """A word of valid/test text that the (training) vocabulary does not have."""

    def __init__(self, word: str, line: int):
        self.word, self.line = word, line
        super().__init__(f"word {word!r} on line {line:,} is not in the vocabulary "
                         f"(it never occurs in the training text)")


class _FirstSeen(dict):
    """word -> provisional id, a new id for each new word in order of first occurrence."""

    def __missing__(self, word):
        self[word] = n = len(self)
        return n


LINE_CHUNK = 1 << 24   # bytes of text tokenized at a time


def iter_line_chunks(data, chunk_bytes: int = LINE_CHUNK) -> Iterator[tuple[str, int]]:
    """``(text, first_line)`` pieces of UTF-8 ``data`` cut after a ``"\n"`` (0-based line
    numbers). A UTF-8 sequence never contains the byte 0x0A, so each piece decodes alone."""
    mv = memoryview(data).cast("B")
    n, start, line = len(mv), 0, 0
    while start < n:
        end = min(start + chunk_bytes, n)
        if end < n:
            cut = bytes(mv[end:min(end + chunk_bytes, n)]).find(b"\n")
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
        words.append(eos)   # the last line has no "\n" but is a line all the same
    return words


class WordVocab:
    """Words in id order (descending training frequency) and the end-of-line token."""

    kind = "word"

    def __init__(self, words: Iterable[str], eos: str | None = "<eos>"):
        _check_eos(eos)
        words = list(words)
        if not words:
            raise ValueError("a vocabulary needs at least one word")
        index = {}
        for i, w in enumerate(words):
            if not isinstance(w, str) or w.split() != [w]:
                raise ValueError(f"vocabulary words must be non-empty strings without "
                                 f"whitespace, got {w!r} at id {i}")
            if index.setdefault(w, i) != i:
                raise ValueError(f"word {w!r} is listed twice (ids {index[w]} and {i})")
        if eos is not None and eos not in index:
            raise ValueError(f"the end-of-line token {eos!r} is not in the vocabulary")
        self.eos = eos
        self._words = words
        self._index = index
        self._table: np.ndarray | None = None   # object array for decode, made on first use

    # ------------------------------------------------------------------ construction
    @classmethod
    def fit(cls, data, eos: str | None = "<eos>") -> tuple["WordVocab", np.ndarray]:
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
            parts.append(np.fromiter(map(first.__getitem__, words), dtype=np.uint32,
                                     count=len(words)))
        if not first:
            raise ValueError("the training text has no words")
        counts = np.zeros(len(first), dtype=np.int64)
        for p in parts:
            counts += np.bincount(p, minlength=len(first))
        order = np.argsort(-counts, kind="stable")       # ties: first occurrence first
        words = list(first)
        vocab = cls([words[i] for i in order], eos)
        remap = np.empty(len(order), dtype=vocab.dtype)
        remap[order] = np.arange(len(order))
        ids = np.empty(sum(p.size for p in parts), dtype=vocab.dtype)
        pos = 0
        for p in parts:
            ids[pos:pos + p.size] = remap[p]
            pos += p.size
        vocab.counts = counts[order]
        return vocab, ids

    counts: np.ndarray | None = None   # training counts in id order, when built by fit()

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
        return isinstance(other, WordVocab) and (self.eos, self._words) == (other.eos,
                                                                           other._words)

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
                parts.append(np.fromiter(map(self._index.__getitem__, words),
                                         dtype=self.dtype, count=len(words)))
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
            raise ValueError(f"id {int(arr[bad])} at position {bad} is out of range for a "
                             f"vocabulary of {len(self)} words")
        if self._table is None:
            self._table = np.array(self._words, dtype=object)
        return self._table[arr].tolist()

    def decode_lines(self, ids) -> list[str]:
        """The lines that ``ids`` stand for, words joined by one space (eos ends a line; a
        last line without one is kept)."""
        if self.eos is None:
            raise ValueError("a vocabulary without an end-of-line token has no lines")
        lines, cur = [], []
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
    def from_json(cls, d: dict) -> "WordVocab":
        if not isinstance(d, dict) or d.get("kind") != "word" or "symbols" not in d:
            raise ValueError("a word vocabulary JSON object needs kind 'word' and 'symbols'")
        v = cls(d["symbols"], d.get("eos"))
        if "size" in d and d["size"] != len(v):
            raise ValueError(f"vocabulary JSON says size {d['size']} but lists {len(v)} words")
        return v


def vocab_from_json(d: dict) -> "Vocab | WordVocab":
    """The vocabulary a manifest describes (kinds byte, char and word)."""
    if isinstance(d, dict) and d.get("kind") == "word":
        return WordVocab.from_json(d)
    return Vocab.from_json(d)


def unigram_entropy_bits(ids, vocab_size: int) -> float:
    """Entropy in bits per symbol of the empirical symbol distribution of ``ids``.

    A useful sanity reference: a language model's bits per character should end far below it.
    """
    arr = np.asarray(ids).reshape(-1)
    if arr.size == 0:
        raise ValueError("cannot compute the entropy of an empty id array")
    if not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"ids must be integers, got dtype {arr.dtype}")
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi >= vocab_size:
        raise ValueError(f"ids span {lo}..{hi}, outside 0..{vocab_size - 1}")
    counts = _code_counts(arr, vocab_size)
    p = counts[counts > 0] / arr.size
    return float(-(p * np.log2(p)).sum())
