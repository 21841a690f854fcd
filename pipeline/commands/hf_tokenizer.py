"""The tokenizer of `export --format hf`: a transformers tokenizer class written into the
folder as remote code (`tokenization_allattn_pipe.py`, named by `tokenizer_config.json`'s
`auto_map`), so that

    AutoTokenizer.from_pretrained("DIR", trust_remote_code=True)
    pipeline("text-generation", model="DIR", trust_remote_code=True)

work without this package. It reads the export's own vocabulary files, vocab.json (byte, char
and word vocabularies) and tokenizer.model (sentencepiece), and encodes and decodes text as
`sample` does (pipeline.commands.sample.encode_prompt and decode): bytes of the UTF-8 text,
characters, `line.split()` words or a sentencepiece model's pieces; the word and sentencepiece
vocabularies end each line ("\\n") with their end-of-line token. A symbol the vocabulary does
not have is refused as the training vocabulary refuses it (ValueError naming it and its
position); sentencepiece maps it to <unk> (or its bytes, with byte_fallback) as it did in
training. The code is a template, never imported here: it imports transformers, which this
package does not need.

Evaluation harnesses (lm-evaluation-harness's `hf` model) read a document's first token after
a token the tokenizer declares (its BOS, else its EOS), pad with the pad token, and stop
generating at the EOS. The folder declares one token as all three: the vocabulary's
separator (`separator`), which is text, never dropped from decoded text.
"""

from __future__ import annotations

import json
from pathlib import Path

TOKENIZER_PY = "tokenization_allattn_pipe.py"
TOKENIZER_CONFIG = "tokenizer_config.json"
TOKENIZER_CLASS = "AllAttnPipeTokenizer"


def tokenizer_file_names() -> list[str]:
    """The tokenizer's files beside vocab.json and tokenizer.model (which export writes for
    either format)."""
    return [TOKENIZER_PY, TOKENIZER_CONFIG]


def separator(vocab: dict) -> tuple[str, str]:
    """(the token, as the folder's tokenizer spells it, that an evaluation harness reads a
    document's first token after, why that one: a line of README). The end of a line where
    the vocabulary has one: WikiText's word and sentencepiece vocabularies end every line with
    their end-of-line token, and a newline ends every line of the byte corpora (python_docs
    separates its documents with a blank line), so training read every line after one.
    Else the space (text8: a-z and the space, one line), else the first symbol."""
    kind, eol = vocab["kind"], vocab.get("eos")
    read_after = "so training read every line after one"
    if kind in ("word", "sentencepiece") and eol is not None:
        return eol, f"`{eol}`, the end-of-line token: it ends every line of the text, {read_after}"
    symbols = vocab.get("symbols") or []
    if kind in ("byte", "char"):
        text = [chr(s) for s in symbols] if kind == "byte" else list(symbols)
        if "\n" in text:
            return "\n", (
                f"`'\\n'`, the newline: it ends every line of the text, {read_after} (and "
                f"every document)"
            )
        if " " in text:
            return " ", "`' '`, the space: the vocabulary has no newline; the space separates words"
        return text[0], f"`{text[0]!r}`, the vocabulary's first symbol: it has no newline or space"
    if kind == "word":
        return symbols[0], f"`{symbols[0]}`, the most frequent word: there is no end-of-line token"
    return "<unk>", "`<unk>` (piece 0): the sentencepiece model has no end-of-line piece"


def tokenizer_config(vocab: dict) -> dict:
    token, _ = separator(vocab)
    return {
        "tokenizer_class": TOKENIZER_CLASS,
        "auto_map": {"AutoTokenizer": [f"{TOKENIZER_PY[:-3]}.{TOKENIZER_CLASS}", None]},
        # the default clean-up rewrites " ." as "." and such: the text would not round-trip
        "clean_up_tokenization_spaces": False,
        # what an evaluation harness reads a document's first token after, pads with and stops
        # at; encoding adds none of them (the class's build_inputs_with_special_tokens), and
        # text that spells one is tokenized as training did, not matched as a special token
        "bos_token": token,
        "eos_token": token,
        "pad_token": token,
        "split_special_tokens": True,
        "model_input_names": ["input_ids", "attention_mask"],
    }


def write_tokenizer_files(tmp: Path, vocab: dict) -> list[str]:
    (tmp / TOKENIZER_PY).write_text(TOKENIZER_SOURCE)
    (tmp / TOKENIZER_CONFIG).write_text(json.dumps(tokenizer_config(vocab), indent=2) + "\n")
    return tokenizer_file_names()


TOKENIZER_SOURCE = '''\
"""Written by allattn-pipe export --format hf: the model's vocabulary as a transformers
tokenizer. vocab.json names the kind: byte (the UTF-8 bytes of the text), char, word
(`line.split()` and an end-of-line token per line) or sentencepiece (tokenizer.model, one
line at a time, each ended by its end-of-line piece). Text with a symbol the vocabulary lacks
is refused, as in training; sentencepiece gives it <unk> (or its bytes) as it did there.
tokenizer_config.json declares the vocabulary's separator (the newline, or the end-of-line
token) as the BOS, EOS and pad token, for evaluation harnesses: it is text all the same, so
encoding adds it nowhere and decoding keeps it, skip_special_tokens or not."""

import json
import os
import shutil

from transformers import PreTrainedTokenizer

NAMES = {"byte": "byte", "char": "character", "word": "word"}


class AllAttnPipeTokenizer(PreTrainedTokenizer):
    # not "vocab_file": transformers 5 passes tokenizer.model under that name when the
    # folder has no tokenizer.json
    vocab_files_names = {"vocab_json": "vocab.json", "spm_file": "tokenizer.model"}
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, vocab_json, spm_file=None, **kwargs):
        with open(vocab_json, encoding="utf-8") as f:
            self.vocabulary = json.load(f)
        self.kind = self.vocabulary["kind"]
        self.spm_file = spm_file
        self.sp = None
        if self.kind == "sentencepiece":
            import sentencepiece

            if spm_file is None:
                raise ValueError("a sentencepiece vocabulary needs its tokenizer.model")
            self.sp = sentencepiece.SentencePieceProcessor(model_file=spm_file)
            self.symbols = [self.sp.id_to_piece(i) for i in range(self.sp.get_piece_size())]
            eos = self.sp.eos_id()
            self.eol = self.symbols[eos] if eos >= 0 else None
        elif self.kind == "byte":  # a byte as the one character of that code: a str token
            self.symbols = [chr(b) for b in self.vocabulary["symbols"]]
            self.eol = None
        else:
            self.symbols = list(self.vocabulary["symbols"])
            self.eol = self.vocabulary.get("eos") if self.kind == "word" else None
        self.ids = {s: i for i, s in enumerate(self.symbols)}
        kwargs.setdefault("clean_up_tokenization_spaces", False)
        super().__init__(**kwargs)

    @property
    def vocab_size(self):
        return len(self.symbols)

    def get_vocab(self):
        return {**self.ids, **self.added_tokens_encoder}

    def _tokenize(self, text, **kwargs):
        if self.kind == "sentencepiece":
            lines = text.split("\\n")
            pieces = []
            for i, line in enumerate(lines):
                pieces += [self.symbols[t] for t in self.sp.encode(line)]
                if i < len(lines) - 1 and self.eol is not None:
                    pieces.append(self.eol)
            return pieces
        if self.kind == "byte":
            tokens = [chr(b) for b in text.encode("utf-8")]
        elif self.kind == "word":
            tokens = (text.replace("\\n", f" {self.eol} ") if self.eol else text).split()
        else:
            tokens = list(text)
        for i, token in enumerate(tokens):
            if token not in self.ids:
                raise ValueError(
                    f"unknown {self._describe(token)} at position {i} (a vocabulary of "
                    f"{len(self.symbols)} {self.kind}s, from the training text)"
                )
        return tokens

    def _describe(self, token):
        if self.kind == "word":
            return f"word {token!r}"
        code = ord(token)
        return f"byte {code} (0x{code:02x})" if self.kind == "byte" else (
            f"character {token!r} (U+{code:04X})"
        )

    def _convert_token_to_id(self, token):
        if token in self.ids:
            return self.ids[token]
        if self.sp is not None:
            return self.sp.piece_to_id(token)  # <unk>'s id
        raise ValueError(f"unknown {self._describe(token)}")

    def _convert_id_to_token(self, index):
        return self.symbols[index]

    def build_inputs_with_special_tokens(self, token_ids_0, token_ids_1=None):
        return token_ids_0 + (token_ids_1 or [])  # the text's tokens alone, as in training

    def convert_ids_to_tokens(self, ids, skip_special_tokens=False):
        # the declared tokens are the text's own separator: never skipped (a newline would be)
        return super().convert_ids_to_tokens(ids, skip_special_tokens=False)

    def convert_tokens_to_string(self, tokens):
        if self.kind == "byte":  # a character cut in two reads as U+FFFD, as sample shows it
            return bytes(ord(t) for t in tokens).decode("utf-8", errors="replace")
        if self.kind == "char":
            return "".join(tokens)
        join = " ".join if self.kind == "word" else self.sp.decode
        lines, line = [], []
        for token in tokens:
            if self.eol is not None and token == self.eol:
                lines.append(join(line))
                line = []
            else:
                line.append(token)
        return "\\n".join([*lines, join(line)])

    def save_vocabulary(self, save_directory, filename_prefix=None):
        prefix = f"{filename_prefix}-" if filename_prefix else ""
        vocab_file = os.path.join(save_directory, prefix + "vocab.json")
        with open(vocab_file, "w", encoding="utf-8") as f:
            json.dump(self.vocabulary, f, indent=1)
        if self.spm_file is None:
            return (vocab_file,)
        sp_file = os.path.join(save_directory, prefix + "tokenizer.model")
        if os.path.abspath(sp_file) != os.path.abspath(self.spm_file):
            shutil.copyfile(self.spm_file, sp_file)
        return (vocab_file, sp_file)
'''
