"""preprocess: tokenize, split, and write webdataset shards with a manifest.

Input: the download stage's `download.json`,
`{"url", "sha256", "files": {role: {"path": "files/<name>", "sha256", "bytes"}}}`. Role "all"
(one stream: builtin, gz, a plain file, a one-member zip) is cut by a tail split; roles
"train" / "valid" / "test" are the three splits as they are (`dataset.split.kind: files`).
Each file's size and sha256 are checked against download.json before it is used.

Tokenizers (`dataset.tokenizer.kind`): byte, char, word (WikiText: `line.split() + [eos]`,
vocabulary by descending training frequency), sentencepiece (BPE / unigram trained on the
train split only, the model written beside the shards as `shards/sentencepiece.model`).

Outputs: `shards/<split>-NNNNNN.tar` and `manifest.json`:

    dataset, source_sha256, sources {role: {path, sha256, bytes}},
    tokenizer (the kind), tokenizer_config (the kind's settings; sentencepiece: + model file),
    split {kind, unit, train, valid, test} (sizes in the split's units),
    vocab_size, vocab (byte/char: {kind, size, symbols}; word: {kind, size, eos, symbols} in
    id order; sentencepiece: {kind, size, eos, model, sha256}), dtype,
    unigram_entropy_bits (of the train split), splits {name: {tokens, shards: [{name, sha256,
    tokens, blocks}]}}

A generated sorting task (`dataset.generator.frequency_sort`) reads no download: each split
is generated (seeded) and written as one flat stream of whole documents; its manifest adds
`generator` and `documents` {length, input_length, separator, padding, count}
(pipeline.data.documents) and has no sources. Algorithmic tasks are the curriculum stage's.

The same input and settings give byte-identical shards (and sentencepiece model).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, cast

from pipeline.data.manifest import write_manifest
from pipeline.errors import PipelineError
from pipeline.fsutil import atomic_write_bytes, read_bytes, read_json, sha256_file
from stages.base import Stage, StageContext

SPLITS = ("train", "valid", "test")
SPM_MODEL = "sentencepiece.model"
UNITS = {"byte": "bytes", "char": "characters", "word": "lines", "sentencepiece": "lines"}


def split_sizes(total: int, valid: float, test: float) -> dict[str, int]:
    """Tail split: the last `test` symbols are test, the `valid` before them valid."""

    def size(x: float) -> int:
        return int(x) if x >= 1 else round(total * x)

    n_valid, n_test = size(valid), size(test)
    for name, n, given in (("valid", n_valid, valid), ("test", n_test, test)):
        if n == 0:
            raise PipelineError(
                f"dataset.split.{name}: {given} of {total:,} units is "
                f"nothing; give a count or a larger fraction"
            )
    n_train = total - n_valid - n_test
    if n_train <= 0:
        raise PipelineError(
            f"dataset.split: valid ({n_valid:,}) + test ({n_test:,}) symbols "
            f"leave nothing to train on in {total:,} symbols"
        )
    return {"train": n_train, "valid": n_valid, "test": n_test}


# ---------------------------------------------------------------- reading the download


def _download_roles(download_dir: Path, ds) -> tuple[dict, dict]:
    """download.json and the roles preprocess reads: {split or 'all': role entry}."""
    info = read_json(download_dir / "download.json")
    files = info.get("files")
    if not isinstance(files, dict) or not all(isinstance(v, dict) for v in files.values()):
        raise PipelineError(
            f"{download_dir}/download.json lists no files by role (written by "
            f"an older download stage?); re-run it: --force download"
        )
    roles = sorted(files)
    if ds.split.kind == "tail":
        if "all" in files:
            return info, {"all": files["all"]}
        if len(files) == 1:  # a zip's only member, files: {} in the card
            return info, {"all": files[roles[0]]}
        raise PipelineError(
            f"dataset '{ds.name}': a tail split reads one stream (role 'all'); "
            f"the download has {len(roles)} files ({', '.join(roles)}): name "
            f"the one to use in dataset.files.all, or use split kind 'files'"
        )
    missing = [s for s in SPLITS if s not in files]
    if missing:
        raise PipelineError(
            f"dataset '{ds.name}': split kind 'files' needs the roles train, "
            f"valid and test; the download has {', '.join(roles)} (missing "
            f"{', '.join(missing)}): map them in dataset.files"
        )
    return info, {s: files[s] for s in SPLITS}


def _read_checked(download_dir: Path, role: str, entry: dict) -> bytes:
    path = download_dir / entry["path"]
    try:
        data = read_bytes(path, "downloaded file")  # a FIFO is refused, not waited on
    except OSError as e:
        raise PipelineError(
            f"{path} (role '{role}'): cannot read ({e.strerror}); re-run download"
        ) from None
    found = hashlib.sha256(data).hexdigest()
    if len(data) != entry.get("bytes", len(data)) or found != entry["sha256"]:
        raise PipelineError(
            f"{path} (role '{role}'): changed since download (sha256 {found}, "
            f"download.json says {entry['sha256']}); re-run download"
        )
    return data


def _line_tail_parts(data: bytes, split) -> tuple[dict, dict]:
    """A tail split in whole lines: byte slices of `data` and the line counts."""
    import numpy as np

    from pipeline.data import count_lines

    sizes = split_sizes(count_lines(data), split.valid, split.test)
    newlines = np.flatnonzero(np.frombuffer(data, dtype=np.uint8) == 10)

    def start(line: int) -> int:
        return 0 if line == 0 else int(newlines[line - 1]) + 1

    a, b = start(sizes["train"]), start(sizes["train"] + sizes["valid"])
    mv = memoryview(data)
    return {"train": mv[:a], "valid": mv[a:b], "test": mv[b:]}, sizes


def _decode_utf8(data, what: str) -> str:
    try:
        return bytes(data).decode("utf-8")
    except UnicodeDecodeError as e:
        raise PipelineError(
            f"{what}: not UTF-8 text at byte {e.start:,}; use dataset.tokenizer: byte"
        ) from None


# ---------------------------------------------------------------- tokenizing


def _symbol_tokens(kind: str, parts: dict):
    """byte / char: the symbol set of all splits together, and each split's ids."""
    from pipeline.data import Vocab

    symbols: set = set()
    for part in parts.values():
        symbols.update(Vocab.build(kind, part).symbols)
    vocab = Vocab(kind, sorted(symbols))
    return vocab, {name: vocab.encode(parts[name]) for name in SPLITS}


def _word_tokens(ds, parts: dict, log):
    from pipeline.data import UnknownWordError, WordVocab

    eos = ds.tokenizer.eos
    try:
        vocab, train_ids = WordVocab.fit(parts["train"], eos)
    except ValueError as e:
        raise PipelineError(f"dataset '{ds.name}', train split: {e}") from None
    ids = {"train": train_ids}
    for name in ("valid", "test"):
        try:
            ids[name] = vocab.encode(parts[name])
        except UnknownWordError as e:
            raise PipelineError(
                f"dataset '{ds.name}', {name} split: {e}; a word vocabulary "
                f"comes from the train split alone"
            ) from None
        except ValueError as e:
            raise PipelineError(f"dataset '{ds.name}', {name} split: {e}") from None
    log(f"word vocabulary: {len(vocab):,} types; most frequent: " + " ".join(vocab.symbols[:8]))
    return vocab, ids


def _sentencepiece_tokens(ds, parts: dict, shard_dir: Path, log):
    from pipeline.data import SentencePieceOptions, SentencePieceTokenizer, train_sentencepiece

    t = ds.tokenizer
    options = SentencePieceOptions(
        vocab_size=t.vocab_size,
        model_type=t.model_type,
        character_coverage=t.character_coverage,
        byte_fallback=t.byte_fallback,
        normalization=t.normalization,
        sample_sentences=t.sample_sentences,
        seed=t.seed,
        num_threads=t.num_threads,
        eos=t.eos,
    )
    log(
        f"training sentencepiece {t.model_type}, {t.vocab_size:,} pieces, on the train split "
        f"(up to {t.sample_sentences:,} lines, seed {t.seed})"
    )
    try:
        model = train_sentencepiece(parts["train"], options)
    except ValueError as e:
        raise PipelineError(f"dataset '{ds.name}': {e}") from None
    atomic_write_bytes(shard_dir / SPM_MODEL, model)
    tok = SentencePieceTokenizer(model)
    try:
        ids = {name: tok.encode(parts[name], num_threads=t.num_threads) for name in SPLITS}
    except ValueError as e:
        raise PipelineError(f"dataset '{ds.name}': {e}") from None
    return tok, ids


# ---------------------------------------------------------------- the stage


def preprocess(ds, download_dir: Path | None, out_dir: Path, log=print) -> dict:
    """Tokenize and split the download of dataset card `ds` into `out_dir`; the manifest."""
    import numpy as np

    from pipeline.data import unigram_entropy_bits, write_shards

    if ds.generator is not None and ds.generator.frequency_sort is not None:
        return _frequency_sort(ds, Path(out_dir), log)
    if ds.generator is not None:
        raise PipelineError(
            f"dataset '{ds.name}' is a generated task (generator: "
            f"{ds.generator.task}): its cases are made online by the curriculum "
            f"stage, not by download and preprocess"
        )
    assert download_dir is not None  # a downloaded dataset: the download stage ran
    download_dir, out_dir = Path(download_dir), Path(out_dir)
    info, roles = _download_roles(download_dir, ds)
    raw = {role: _read_checked(download_dir, role, entry) for role, entry in roles.items()}
    kind = ds.tokenizer.kind
    shard_dir = out_dir / "shards"
    shard_dir.mkdir(parents=True, exist_ok=True)

    # the splits as bytes (or text for char), cut by a tail split or given as files
    parts: dict[str, Any]
    if ds.split.kind == "files":
        parts = raw
        if kind == "char":
            parts = {s: _decode_utf8(raw[s], f"{roles[s]['path']}") for s in SPLITS}
        split = {"kind": "files", **{s: roles[s]["path"] for s in SPLITS}}
    elif kind in ("word", "sentencepiece"):
        parts, sizes = _line_tail_parts(raw["all"], ds.split)
        split = {"kind": "tail", "unit": UNITS[kind], **sizes}
    else:
        stream = raw["all"] if kind == "byte" else _decode_utf8(raw["all"], roles["all"]["path"])
        sizes = split_sizes(len(stream), ds.split.valid, ds.split.test)
        cut1, cut2 = sizes["train"], sizes["train"] + sizes["valid"]
        view = memoryview(cast(bytes, stream)) if kind == "byte" else stream
        parts = {"train": view[:cut1], "valid": view[cut1:cut2], "test": view[cut2:]}
        split = {"kind": "tail", "unit": UNITS[kind], **sizes}
    if split["kind"] == "tail":
        log(f"tail split in {split['unit']}: " + " / ".join(f"{s} {split[s]:,}" for s in SPLITS))

    tokenizer_config = ds.tokenizer.settings()
    if kind in ("byte", "char"):
        tok, ids = _symbol_tokens(kind, parts)
        vocab_json = tok.to_json()
    elif kind == "word":
        tok, ids = _word_tokens(ds, parts, log)
        vocab_json = tok.to_json()
    else:
        tok, ids = _sentencepiece_tokens(ds, parts, shard_dir, log)
        model_sha = sha256_file(shard_dir / SPM_MODEL)
        vocab_json = tok.to_json(SPM_MODEL, model_sha)
        tokenizer_config |= {"model": SPM_MODEL, "model_sha256": model_sha}
    del parts, raw

    splits = {}
    for name in SPLITS:
        if ids[name].size < 2:  # one input and its target, at the very least
            raise PipelineError(
                f"dataset '{ds.name}': the {name} split has {ids[name].size} "
                f"token(s); it needs at least 2 to be scored: make "
                f"dataset.split.{'valid or test' if name == 'train' else name} "
                f"{'smaller' if name == 'train' else 'larger'}"
            )
        shards = write_shards(
            ids[name], shard_dir, name, ds.shards.block_tokens, ds.shards.blocks_per_shard
        )
        splits[name] = {"tokens": int(ids[name].size), "shards": shards}
    log(
        f"{len(tok):,} {kind} tokens in the vocabulary; tokens "
        + " / ".join(f"{s} {splits[s]['tokens']:,}" for s in SPLITS)
    )
    if ds.vocab_size is not None and ds.vocab_size != len(tok):
        log(
            f"warning: the card expects a vocabulary of {ds.vocab_size:,}, the data has "
            f"{len(tok):,}"
        )
    entropy = unigram_entropy_bits(ids["train"], len(tok))
    manifest = {
        "dataset": ds.name,
        "source_sha256": info["sha256"],
        "sources": {
            role: {k: e[k] for k in ("path", "sha256", "bytes") if k in e}
            for role, e in roles.items()
        },
        "tokenizer": kind,
        "tokenizer_config": tokenizer_config,
        "split": split,
        "vocab_size": len(tok),
        "vocab": vocab_json,
        "dtype": np.dtype(tok.dtype).name,
        "unigram_entropy_bits": entropy,
        "splits": splits,
    }
    manifest = write_manifest(out_dir, manifest)
    log(f"unigram entropy of train: {entropy:.3f} bits per token")
    return manifest


def _frequency_sort(ds, out_dir: Path, log) -> dict:
    """The sorting task's splits (pipeline.data.frequency_sort), each one flat stream of whole
    documents, and a manifest whose `documents` entry tells how to cut them (see
    pipeline.data.documents); the symbols are "0".."vocab-1", "<sep>", "<pad>"."""
    import numpy as np

    from pipeline.data import WordVocab, unigram_entropy_bits, write_shards
    from pipeline.data.frequency_sort import document_length, padding, separator, split_documents

    task, seed = ds.generator.frequency_sort, ds.generator.seed
    doc_len = document_length(task.vocab, task.length)
    vocab = WordVocab([str(s) for s in range(task.vocab)] + ["<sep>", "<pad>"], eos=None)
    shard_dir = out_dir / "shards"
    shard_dir.mkdir(parents=True, exist_ok=True)
    splits, entropy = {}, None
    for name in SPLITS:
        count = getattr(task.sequences, name)
        # filled document by document: the split is held once, in the vocabulary's dtype
        # (one byte a token), never as the int64 stack generate_split would make
        tokens = np.empty(count * doc_len, dtype=vocab.dtype)
        for i, doc in enumerate(
            split_documents(seed, name, count, task.vocab, task.length, tuple(task.weight_range))
        ):
            tokens[i * doc_len : (i + 1) * doc_len] = doc
        shards = write_shards(
            tokens, shard_dir, name, ds.shards.block_tokens, ds.shards.blocks_per_shard
        )
        splits[name] = {"tokens": int(tokens.size), "shards": shards}
        if name == "train":
            entropy = unigram_entropy_bits(tokens, len(vocab))
        del tokens
    log(
        f"{task.vocab} symbols + separator + padding; documents of {task.length:,} + 1 + "
        f"{task.vocab} tokens: " + " / ".join(f"{s} {getattr(task.sequences, s):,}" for s in SPLITS)
    )
    manifest = {
        "dataset": ds.name,
        "source_sha256": None,
        "sources": {},
        "generator": ds.generator.model_dump(mode="json"),
        "tokenizer": vocab.kind,
        "tokenizer_config": {"kind": vocab.kind, "eos": None},
        "split": {
            "kind": "generated",
            "unit": "documents",
            **{s: getattr(task.sequences, s) for s in SPLITS},
        },
        "vocab_size": len(vocab),
        "vocab": vocab.to_json(),
        "dtype": np.dtype(vocab.dtype).name,
        "unigram_entropy_bits": entropy,
        "splits": splits,
        "documents": {
            "length": doc_len,
            "input_length": task.length,
            "separator": separator(task.vocab),
            "padding": padding(task.vocab),
            "count": {s: getattr(task.sequences, s) for s in SPLITS},
        },
    }
    return write_manifest(out_dir, manifest)


def run(ctx: StageContext) -> dict:
    # a generated dataset reads no download (the pipeline may not run that stage at all)
    manifest = preprocess(ctx.spec.dataset, ctx.inputs.get("download"), ctx.out_dir, ctx.log)
    tokens = {name: s["tokens"] for name, s in manifest["splits"].items()}
    entropy, vocab_size = manifest["unigram_entropy_bits"], manifest["vocab_size"]
    ctx.tracker.log_metrics(
        {f"tokens_{k}": v for k, v in tokens.items()}
        | {"vocab_size": vocab_size, "unigram_entropy_bits": entropy},
        step=0,
    )
    ctx.tracker.log_artifact(ctx.out_dir / "manifest.json")
    if manifest["vocab"]["kind"] == "sentencepiece":
        ctx.tracker.log_artifact(ctx.out_dir / "shards" / SPM_MODEL)
    return {"vocab_size": vocab_size, "tokens": tokens, "unigram_entropy_bits": entropy}


STAGE = Stage(
    name="preprocess",
    summary="Tokenize, split train/valid/test, write webdataset shards + manifest.",
    inputs=("download",),
    section_key=None,
    config=lambda spec: spec.dataset.model_dump(
        mode="json", include={"tokenizer", "split", "shards", "generator"}
    ),
    run=run,
)
