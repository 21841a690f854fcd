"""preprocess: tokenize, split, and write webdataset shards with a manifest.

Outputs: `shards/<split>-NNNNNN.tar` and `manifest.json` (vocabulary, tokenizer, dtype,
tokens per split, each shard's name, sha256 and token count, the train split's unigram
entropy). The same input gives byte-identical shards.
"""

from __future__ import annotations

from pathlib import Path

from pipeline.errors import PipelineError
from pipeline.fsutil import atomic_write_json, read_json
from stages import Stage, StageContext

SPLITS = ("train", "valid", "test")


def split_sizes(total: int, valid: float, test: float) -> dict[str, int]:
    """Tail split: the last `test` symbols are test, the `valid` before them valid."""
    def size(x: float) -> int:
        return int(x) if x >= 1 else round(total * x)

    n_valid, n_test = size(valid), size(test)
    n_train = total - n_valid - n_test
    if n_train <= 0:
        raise PipelineError(f"dataset.split: valid ({n_valid:,}) + test ({n_test:,}) symbols "
                            f"leave nothing to train on in {total:,} symbols")
    return {"train": n_train, "valid": n_valid, "test": n_test}


def load_manifest(preprocess_dir: Path) -> dict:
    return read_json(Path(preprocess_dir) / "manifest.json")


def load_split(preprocess_dir: Path, split: str):
    """The token array of one split, checksums verified."""
    from pipeline.data import read_shards

    manifest = load_manifest(preprocess_dir)
    try:
        entry = manifest["splits"][split]
    except KeyError:
        raise PipelineError(f"{preprocess_dir}/manifest.json has no split '{split}'") from None
    return read_shards(Path(preprocess_dir) / "shards", entry["shards"], manifest["dtype"])


def run(ctx: StageContext) -> dict:
    import numpy as np

    from pipeline.data import Vocab, unigram_entropy_bits, write_shards

    ds = ctx.spec.dataset
    files = sorted((ctx.inputs["download"] / "files").iterdir())
    if len(files) != 1:
        names = ", ".join(p.name for p in files)
        raise PipelineError(f"dataset '{ds.name}': a tail split needs exactly one data file; "
                            f"the download holds {len(files)} ({names}); set dataset.member")
    raw = files[0].read_bytes()
    if ds.tokenizer == "char":
        try:
            data = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise PipelineError(f"{files[0].name}: not UTF-8 text at byte {e.start}; use "
                                f"dataset.tokenizer: byte") from None
    else:
        data = raw
    vocab = Vocab.build(ds.tokenizer, data)
    ids = vocab.encode(data)
    sizes = split_sizes(len(ids), ds.split.valid, ds.split.test)
    ctx.log(f"{len(ids):,} symbols, vocabulary {len(vocab)}; split "
            + " / ".join(f"{k} {v:,}" for k, v in sizes.items()))

    shard_dir = ctx.out_dir / "shards"
    shard_dir.mkdir(exist_ok=True)
    splits, start = {}, 0
    for name in SPLITS:
        part = ids[start:start + sizes[name]]
        start += sizes[name]
        shards = write_shards(part, shard_dir, name, ds.shards.block_tokens,
                              ds.shards.blocks_per_shard)
        splits[name] = {"tokens": int(len(part)), "shards": shards}
    entropy = unigram_entropy_bits(ids[:sizes["train"]], len(vocab))
    manifest = {
        "dataset": ds.name,
        "source_sha256": read_json(ctx.inputs["download"] / "download.json")["sha256"],
        "tokenizer": ds.tokenizer,
        "vocab_size": len(vocab),
        "vocab": vocab.to_json(),
        "dtype": np.dtype(vocab.dtype).name,
        "unigram_entropy_bits": entropy,
        "splits": splits,
    }
    atomic_write_json(ctx.out_dir / "manifest.json", manifest)
    ctx.log(f"unigram entropy of train: {entropy:.3f} bits per symbol")
    ctx.tracker.log_metrics({f"tokens_{k}": v for k, v in sizes.items()}
                            | {"vocab_size": len(vocab), "unigram_entropy_bits": entropy},
                            step=0)
    ctx.tracker.log_artifact(ctx.out_dir / "manifest.json")
    return {"vocab_size": len(vocab), "tokens": sizes, "unigram_entropy_bits": entropy}


STAGE = Stage(
    name="preprocess",
    summary="Tokenize, split train/valid/test, write webdataset shards + manifest.",
    inputs=("download",),
    section_key=None,
    config=lambda spec: spec.dataset.model_dump(include={"tokenizer", "split", "shards"}),
    run=run,
)
