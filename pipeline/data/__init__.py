"""Data layer: vocabularies and tokenizers, webdataset token shards, ordered seekable LM batching.

No yaml, mlflow or deepspeed imports here: stages and the runner build on these pieces.
"""

from pipeline.data.sentencepiece_tokenizer import (
    SentencePieceOptions,
    SentencePieceTokenizer,
    sample_lines,
    train_sentencepiece,
)
from pipeline.data.shards import (
    ShardError,
    dtype_extension,
    read_shards,
    shard_name,
    smallest_uint_dtype,
    verify_shard,
    write_shards,
)
from pipeline.data.stream import StreamBatches, eval_batches, eval_num_batches
from pipeline.data.vocab import Vocab, unigram_entropy_bits, vocab_from_json
from pipeline.data.word_vocab import UnknownWordError, WordVocab, count_lines, split_words

__all__ = [
    "SentencePieceOptions",
    "SentencePieceTokenizer",
    "ShardError",
    "StreamBatches",
    "UnknownWordError",
    "Vocab",
    "WordVocab",
    "count_lines",
    "dtype_extension",
    "eval_batches",
    "eval_num_batches",
    "read_shards",
    "sample_lines",
    "shard_name",
    "smallest_uint_dtype",
    "split_words",
    "train_sentencepiece",
    "unigram_entropy_bits",
    "verify_shard",
    "vocab_from_json",
    "write_shards",
]
