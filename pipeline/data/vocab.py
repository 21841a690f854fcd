"""Symbol-level vocabularies (bytes or unicode characters) and simple corpus statistics.

:class:`Vocab`: the sorted list of distinct symbols that occur in the text; a symbol's id is
its index in that list. Word-level vocabularies (WikiText's convention) are in `word_vocab`;
`vocab_from_json` reads either from a manifest.

Ids are stored in the smallest unsigned dtype that holds them, so a byte/character corpus costs
one byte (or two) per token on disk and in memory.

Everything here is plain numpy: no torch, no yaml.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from pipeline.data.shards import smallest_uint_dtype
from pipeline.data.word_vocab import WordVocab

KINDS = ("byte", "char")


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
    def build(cls, kind: str, data) -> Vocab:
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
        if hi >= len(known):  # a character beyond the vocabulary's highest code point
            known = np.zeros(hi + 1, dtype=bool)
            known[: len(self._known)] = self._known
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
    def from_json(cls, d: dict) -> Vocab:
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
        counts += np.bincount(codes[i : i + _CHUNK], minlength=size)
    return counts


def vocab_from_json(d: dict) -> Vocab | WordVocab:
    """The vocabulary a manifest describes (kinds byte, char and word)."""
    if isinstance(d, dict) and d.get("kind") == "word":
        return WordVocab.from_json(d)
    return Vocab.from_json(d)


def bits_name(tokenizer: str | None) -> str:
    """What a line calls bits per token: bpc where a token is a character or a byte (the
    name the character-level papers use), bits/token for words and sentencepiece pieces,
    whose bits per token are no bits per character. None (a result recorded before its
    tokenizer was) is bpc, as it was printed then."""
    return "bpc" if tokenizer in (None, "byte", "char") else "bits/token"


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
