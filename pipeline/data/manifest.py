"""Reading what the preprocess stage wrote: its manifest, a split's tokens, its tokenizer.

Train, finetune, evaluate and any later tool read preprocessed data through these, never
by walking the shard directory.
"""

from __future__ import annotations

from pathlib import Path

from pipeline.errors import PipelineError
from pipeline.fsutil import read_json, sha256_file


def load_manifest(preprocess_dir: Path) -> dict:
    return read_json(Path(preprocess_dir) / "manifest.json")


def load_split(preprocess_dir: Path, split: str):
    """The token array of one split, checksums verified."""
    from pipeline.data.shards import read_shards

    manifest = load_manifest(preprocess_dir)
    try:
        entry = manifest["splits"][split]
    except KeyError:
        raise PipelineError(f"{preprocess_dir}/manifest.json has no split '{split}'") from None
    return read_shards(Path(preprocess_dir) / "shards", entry["shards"], manifest["dtype"])


def load_tokenizer(preprocess_dir: Path):
    """The manifest's tokenizer: a Vocab (byte, char), WordVocab or SentencePieceTokenizer."""
    from pipeline.data.sentencepiece_tokenizer import SentencePieceTokenizer
    from pipeline.data.vocab import vocab_from_json

    vocab = load_manifest(preprocess_dir)["vocab"]
    if vocab["kind"] != "sentencepiece":
        return vocab_from_json(vocab)
    path = Path(preprocess_dir) / "shards" / vocab["model"]
    if not path.is_file() or sha256_file(path) != vocab["sha256"]:
        raise PipelineError(f"{path}: the sentencepiece model is missing or does not match "
                            f"its sha256 in the manifest; re-run preprocess")
    return SentencePieceTokenizer.load(path)
