"""The token an `export --format hf` folder declares as its BOS, EOS and pad token (what an
evaluation harness reads a document's first token after), for each vocabulary kind: the end
of a line where the vocabulary has one, else the space, else its first symbol; and the
tokenizer config that declares it."""

from __future__ import annotations

import pytest

from pipeline.commands.hf_tokenizer import separator, tokenizer_config

WORDS = ["the", "<eos>", ",", "of"]


@pytest.mark.parametrize(
    "vocab, token, why",
    [
        ({"kind": "byte", "symbols": [9, 10, 32, 97]}, "\n", "the newline"),
        ({"kind": "byte", "symbols": [32, 97, 122]}, " ", "the space"),  # text8
        ({"kind": "byte", "symbols": [97, 200]}, "a", "the vocabulary's first symbol"),
        ({"kind": "char", "symbols": ["\n", " ", "é"]}, "\n", "the newline"),
        ({"kind": "char", "symbols": ["a", "é"]}, "a", "the vocabulary's first symbol"),
        ({"kind": "word", "eos": "<eos>", "symbols": WORDS}, "<eos>", "the end-of-line token"),
        ({"kind": "word", "eos": None, "symbols": WORDS}, "the", "the most frequent word"),
        ({"kind": "sentencepiece", "eos": "<eos>", "model": "m"}, "<eos>", "the end-of-line"),
        ({"kind": "sentencepiece", "eos": None, "model": "m"}, "<unk>", "piece 0"),
    ],
)
def test_the_separator_is_the_end_of_a_line_where_the_vocabulary_has_one(vocab, token, why):
    got, reason = separator(vocab)
    assert got == token
    assert why in reason


def test_the_tokenizer_config_declares_the_separator_and_adds_it_to_no_text():
    config = tokenizer_config({"kind": "byte", "symbols": [10, 32, 97]})
    assert [config[k] for k in ("bos_token", "eos_token", "pad_token")] == ["\n"] * 3
    # text that spells the token is tokenized as training did, not matched as a special token
    assert config["split_special_tokens"] is True
