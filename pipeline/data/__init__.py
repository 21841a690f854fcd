"""Data layer: symbol vocabularies, webdataset token shards, ordered seekable LM batching.

No yaml, mlflow or deepspeed imports here: stages and the runner build on these pieces.
"""

from pipeline.data.shards import (
    ShardError,
    dtype_extension,
    read_shards,
    shard_name,
    verify_shard,
    write_shards,
)
from pipeline.data.stream import StreamBatches, eval_batches, eval_num_batches
from pipeline.data.vocab import Vocab, smallest_uint_dtype, unigram_entropy_bits

__all__ = [
    "ShardError",
    "StreamBatches",
    "Vocab",
    "dtype_extension",
    "eval_batches",
    "eval_num_batches",
    "read_shards",
    "shard_name",
    "smallest_uint_dtype",
    "unigram_entropy_bits",
    "verify_shard",
    "write_shards",
]
