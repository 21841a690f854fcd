"""Symbol-level vocabularies (bytes or unicode characters) and simple corpus statistics.

A vocabulary is the sorted list of distinct symbols that occur in the training text; a symbol's
id is its index in that list. Ids are stored in the smallest unsigned dtype that holds them, so
a byte/character corpus costs one byte (or two) per token on disk and in memory.

Everything here is plain numpy: no torch, no yaml.
"""

from __future__ import annotations

from typing import Any, Iterable

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
        if kind == "byte":
            lut = np.full(256, -1, dtype=np.int64)
            lut[codes] = np.arange(len(codes))
            self._lut = lut

    # ------------------------------------------------------------------ construction
    @classmethod
    def build(cls, kind: str, data) -> "Vocab":
        """The distinct symbols occurring in ``data`` (bytes for "byte", str for "char"), sorted."""
        if kind == "byte":
            codes = np.unique(_bytes_array(data))
            return cls("byte", [int(c) for c in codes])
        if kind == "char":
            codes = np.unique(_codepoints(data))
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
        if self.kind == "byte":
            codes = _bytes_array(data)
            ids = self._lut[codes]
            bad = np.flatnonzero(ids < 0)
        else:
            codes = _codepoints(data)
            pos = np.searchsorted(self._codes, codes)
            pos_c = np.minimum(pos, len(self._codes) - 1)
            bad = np.flatnonzero(self._codes[pos_c] != codes)
            ids = pos_c
        if bad.size:
            i = int(bad[0])
            raise ValueError(
                f"unknown {self._describe(int(codes[i]))} at position {i} "
                f"({bad.size} unknown symbol(s) in total; vocabulary of {len(self)} {self.kind}s)"
            )
        return ids.astype(self.dtype, copy=False)

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
    counts = np.bincount(arr.astype(np.int64, copy=False), minlength=vocab_size)
    p = counts[counts > 0] / arr.size
    return float(-(p * np.log2(p)).sum())
