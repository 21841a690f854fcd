"""Reading what the preprocess stage wrote: its manifest, a split's tokens, its tokenizer.

Train, finetune, evaluate and any later tool read preprocessed data through these, never
by walking the shard directory. The manifest carries a checksum of its own content, so an
edited or damaged manifest (a changed `vocab_size` would silently build another model) is
refused rather than trusted.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from pipeline.errors import PipelineError
from pipeline.fsutil import atomic_write_json, read_text, sha256_file

MANIFEST = "manifest.json"
REBUILD = "run the pipeline with --force preprocess to rebuild it"


def _content_sha256(manifest: dict) -> str:
    body = {k: v for k, v in manifest.items() if k != "sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def write_manifest(preprocess_dir: Path, manifest: dict) -> dict:
    """Write `manifest.json` atomically with the sha256 of its content; returns what was
    written."""
    manifest = {k: v for k, v in manifest.items() if k != "sha256"}
    manifest["sha256"] = _content_sha256(manifest)
    atomic_write_json(Path(preprocess_dir) / MANIFEST, manifest)
    return manifest


def load_manifest(preprocess_dir: Path) -> dict:
    path = Path(preprocess_dir) / MANIFEST
    try:
        # a FIFO or device there is refused in one line, not waited on
        manifest = json.loads(read_text(path, "manifest"))
    except FileNotFoundError:
        raise PipelineError(f"{path}: missing; {REBUILD}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PipelineError(f"{path}: unreadable ({e}); {REBUILD}") from None
    if not isinstance(manifest, dict):
        raise PipelineError(f"{path}: not a manifest (a JSON object); {REBUILD}")
    # manifests written before checksums existed have none; everything later must match
    if "sha256" in manifest and manifest["sha256"] != _content_sha256(manifest):
        raise PipelineError(
            f"{path}: its content does not match its sha256 (edited or "
            f"damaged since preprocess wrote it); {REBUILD}"
        )
    return manifest


def load_split(preprocess_dir: Path, split: str):
    """The token array of one split, checksums verified."""
    from pipeline.data.shards import ShardError, read_shards

    manifest = load_manifest(preprocess_dir)
    try:
        entry = manifest["splits"][split]
    except KeyError:
        raise PipelineError(f"{preprocess_dir}/{MANIFEST} has no split '{split}'") from None
    try:
        return read_shards(Path(preprocess_dir) / "shards", entry["shards"], manifest["dtype"])
    except ShardError as e:
        raise PipelineError(f"{e}; {REBUILD}") from None


def load_tokenizer(preprocess_dir: Path):
    """The manifest's tokenizer: a Vocab (byte, char), WordVocab or SentencePieceTokenizer."""
    from pipeline.data.sentencepiece_tokenizer import SentencePieceTokenizer
    from pipeline.data.vocab import vocab_from_json

    vocab = load_manifest(preprocess_dir)["vocab"]
    if vocab["kind"] != "sentencepiece":
        return vocab_from_json(vocab)
    path = Path(preprocess_dir) / "shards" / vocab["model"]
    if not path.is_file() or sha256_file(path) != vocab["sha256"]:
        raise PipelineError(
            f"{path}: the sentencepiece model is missing or does not match "
            f"its sha256 in the manifest; {REBUILD}"
        )
    return SentencePieceTokenizer.load(path)
