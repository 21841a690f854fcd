"""Sentencepiece (BPE or unigram) subword tokenizers, trained reproducibly.

Text is read as lines (pieces ending at ``"\\n"``, as the word tokenizer reads them). Each line
is encoded on its own and followed by the end-of-line piece (``eos``, a control symbol, so text
that spells ``<eos>`` is not mistaken for it); ``eos=None`` concatenates lines without one.

Reproducibility: the trainer never samples. We draw up to ``sample_sentences`` non-empty lines of
the training text ourselves with a fixed seed (kept in text order) and pass them with
``input_sentence_size=0`` (use all of them); sentencepiece's own random generator is seeded too.
The same text and options give a byte-identical model file. ``num_threads`` is part of the
options: the unigram trainer's result depends on it (BPE's does not), and the model file records
it either way.

Defaults keep the text recoverable: ``normalization="identity"`` and no whitespace clean-up,
so decoding gives back each line exactly, except characters that ``character_coverage`` left
out (they become ``<unk>`` unless ``byte_fallback``).
"""

from __future__ import annotations

import io
import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.data.shards import smallest_uint_dtype
from pipeline.data.word_vocab import iter_line_chunks

UNK_ID, EOS_ID = 0, 1


@dataclass(frozen=True)
class SentencePieceOptions:
    vocab_size: int
    model_type: str = "bpe"  # "bpe" or "unigram"
    character_coverage: float = 1.0
    byte_fallback: bool = False
    normalization: str = "identity"  # a sentencepiece normalization rule name
    sample_sentences: int = 1_000_000  # lines of the training text to train on, at most
    seed: int = 0
    num_threads: int = 4
    eos: str | None = "<eos>"

    def __post_init__(self):
        if self.model_type not in ("bpe", "unigram"):
            raise ValueError(f"model_type must be 'bpe' or 'unigram', got {self.model_type!r}")
        if self.vocab_size < 3:
            raise ValueError(f"vocab_size must be at least 3, got {self.vocab_size}")


def text_lines(data) -> list[str]:
    """The lines of UTF-8 ``data`` without their ``"\\n"`` (a last unterminated one kept)."""
    lines: list[str] = []
    for text, _ in iter_line_chunks(data):
        part = text.split("\n")
        if part and part[-1] == "":
            part.pop()
        lines += part
    return lines


def sample_lines(lines: list[str], n: int, seed: int) -> list[str]:
    """Up to ``n`` non-empty lines drawn without replacement with ``seed``, in text order."""
    nonempty = [line for line in lines if line.strip()]
    if len(nonempty) <= n:
        return nonempty
    rng = np.random.default_rng(seed)
    keep = np.sort(rng.choice(len(nonempty), size=n, replace=False))
    return [nonempty[i] for i in keep]


def train_sentencepiece(train_data, options: SentencePieceOptions) -> bytes:
    """A sentencepiece model (serialized proto) trained on the lines of ``train_data``."""
    import sentencepiece as spm

    sentences = sample_lines(text_lines(train_data), options.sample_sentences, options.seed)
    if not sentences:
        raise ValueError("the training text has no non-empty lines to train sentencepiece on")
    spm.set_random_generator_seed(options.seed)
    model = io.BytesIO()
    kwargs: dict[str, Any] = dict(
        sentence_iterator=iter(sentences),
        model_writer=model,
        model_type=options.model_type,
        vocab_size=options.vocab_size,
        character_coverage=options.character_coverage,
        byte_fallback=options.byte_fallback,
        normalization_rule_name=options.normalization,
        remove_extra_whitespaces=False,
        input_sentence_size=0,
        shuffle_input_sentence=False,
        num_threads=options.num_threads,
        unk_id=UNK_ID,
        bos_id=-1,
        pad_id=-1,
        minloglevel=2,
    )
    if options.eos is None:
        kwargs["eos_id"] = -1
    else:
        kwargs.update(eos_id=EOS_ID, eos_piece=options.eos)
    try:
        spm.SentencePieceTrainer.train(**kwargs)
    except RuntimeError as e:
        raise ValueError(f"sentencepiece training failed: {e}") from None
    return model.getvalue()


class SentencePieceTokenizer:
    """A trained model: text <-> ids, one line at a time, ``eos`` after every line."""

    kind = "sentencepiece"

    def __init__(self, model_proto: bytes):
        import sentencepiece as spm

        self.model_proto = bytes(model_proto)
        self._sp = spm.SentencePieceProcessor(model_proto=self.model_proto)
        eos = self._sp.eos_id()
        self.eos_id: int | None = None if eos < 0 else int(eos)
        self.eos: str | None = None if eos < 0 else self._sp.id_to_piece(eos)

    @classmethod
    def load(cls, path: str | Path) -> SentencePieceTokenizer:
        from pipeline.fsutil import read_bytes

        return cls(read_bytes(path, "sentencepiece model"))

    def __len__(self) -> int:
        return int(self._sp.get_piece_size())

    @property
    def dtype(self) -> np.dtype:
        return smallest_uint_dtype(len(self))

    @property
    def pieces(self) -> list[str]:
        return [self._sp.id_to_piece(i) for i in range(len(self))]

    def encode(self, data, num_threads: int = 0) -> np.ndarray:
        """Ids of the lines of UTF-8 ``data``, each followed by the eos id."""
        parts = []
        for text, _ in iter_line_chunks(data):
            lines = text.split("\n")
            if lines[-1] == "":
                lines.pop()
            encoded = self._sp.encode(lines, num_threads=num_threads)
            n = sum(map(len, encoded)) + (len(lines) if self.eos_id is not None else 0)
            if self.eos_id is not None:
                for ids in encoded:
                    ids.append(self.eos_id)
            parts.append(
                np.fromiter(itertools.chain.from_iterable(encoded), dtype=self.dtype, count=n)
            )
        if not parts:
            return np.zeros(0, dtype=self.dtype)
        return np.concatenate(parts)

    def decode_lines(self, ids) -> list[str]:
        """The lines that ``ids`` stand for (eos ends a line; a last line without one kept)."""
        arr = np.asarray(ids).reshape(-1).astype(np.int64)
        if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= len(self)):
            raise ValueError(f"ids out of range for a vocabulary of {len(self)} pieces")
        if self.eos_id is None:
            return [self._sp.decode(arr.tolist())]
        ends = np.flatnonzero(arr == self.eos_id)
        starts = np.concatenate([[0], ends + 1])
        stops = np.concatenate([ends, [arr.size]])
        pieces = [arr[a:b].tolist() for a, b in zip(starts, stops, strict=False)]
        if not pieces[-1]:
            pieces.pop()
        return self._sp.decode(pieces)

    def decode(self, ids) -> str:
        """The text ``ids`` stand for, lines ended by ``"\\n"``."""
        arr = np.asarray(ids).reshape(-1)
        lines = self.decode_lines(arr)
        text = "\n".join(lines)
        if self.eos_id is not None and arr.size and int(arr[-1]) == self.eos_id:
            text += "\n"
        return text

    def to_json(self, model_file: str, model_sha256: str) -> dict:
        """The manifest's description: the model file (beside the shards) and its sha256."""
        return {
            "kind": "sentencepiece",
            "size": len(self),
            "eos": self.eos,
            "model": model_file,
            "sha256": model_sha256,
        }
