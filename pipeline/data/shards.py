"""Webdataset tar shards of fixed-size token blocks: a deterministic writer and a verifying reader.

Layout of one split in ``out_dir``::

    train-000000.tar   train-000001.tar   ...

Each shard is a plain (uncompressed, USTAR) tar archive in webdataset's convention: one sample
per token block, key = the block's index within the split (zero-padded, 9 digits), and one
member ``{key}.{ext}`` holding the block's tokens as raw little-endian array bytes, where the
extension names the dtype (``u8``, ``u16``, ``u32``, ...). The last block of a split may be
shorter than ``block_size`` so that every token is kept.

Shards are byte-for-byte reproducible (mtime 0, uid/gid 0, empty user/group names, mode 0o644,
blocks in index order) so their sha256 is a content fingerprint, and each is written to a
temporary name and renamed into place. The reader verifies every shard's checksum and token
count against the manifest entries before trusting its content.

webdataset itself reads these files (``webdataset.WebDataset(urls, shardshuffle=False)``
yields ``{"__key__": "000000000", "u8": b"..."}``); for language modelling we use the ordered
reader below instead, since webdataset has no resumable, ordered state.
"""

from __future__ import annotations

import hashlib
import io
import re
import tarfile
from pathlib import Path

import numpy as np

from pipeline.errors import PipelineError
from pipeline.fsutil import atomic_write_bytes, read_bytes, sha256_file

KEY_DIGITS = 9
SHARD_DIGITS = 6

# dtype <-> member extension. Unsigned ids are what vocabularies produce; signed kinds are
# accepted so that any integer token array can be stored.
_EXT_BY_DTYPE = {
    np.dtype(np.uint8): "u8",
    np.dtype(np.uint16): "u16",
    np.dtype(np.uint32): "u32",
    np.dtype(np.uint64): "u64",
    np.dtype(np.int8): "i8",
    np.dtype(np.int16): "i16",
    np.dtype(np.int32): "i32",
    np.dtype(np.int64): "i64",
}
_DTYPE_BY_EXT = {ext: dt for dt, ext in _EXT_BY_DTYPE.items()}

_MEMBER_RE = re.compile(r"^(\d+)\.([a-z0-9]+)$")


class ShardError(Exception):
    """A shard is missing, damaged or does not match its manifest entry."""


_UINT_DTYPES = (np.dtype(np.uint8), np.dtype(np.uint16), np.dtype(np.uint32))


def smallest_uint_dtype(n_symbols: int) -> np.dtype:
    """The smallest unsigned dtype that holds ids ``0 .. n_symbols - 1``."""
    if n_symbols < 0:
        raise ValueError(f"n_symbols must be >= 0, got {n_symbols}")
    for dt in _UINT_DTYPES:
        if n_symbols <= int(np.iinfo(dt).max) + 1:
            return dt
    raise ValueError(f"{n_symbols} symbols do not fit in uint32 ids")


def _norm_dtype(dtype) -> np.dtype:
    dt = np.dtype(dtype).newbyteorder("=")
    if dt not in _EXT_BY_DTYPE:
        raise ValueError(
            f"unsupported token dtype {np.dtype(dtype)}; expected one of "
            f"{sorted(str(d) for d in _EXT_BY_DTYPE)}"
        )
    return dt


def dtype_extension(dtype) -> str:
    """The member extension used for tokens of ``dtype`` (e.g. uint16 -> "u16")."""
    return _EXT_BY_DTYPE[_norm_dtype(dtype)]


def shard_name(split: str, index: int) -> str:
    return f"{split}-{index:0{SHARD_DIGITS}d}.tar"


def _tarinfo(name: str, size: int) -> tarfile.TarInfo:
    ti = tarfile.TarInfo(name)
    ti.size = size
    ti.type = tarfile.REGTYPE
    ti.mtime = 0
    ti.mode = 0o644
    ti.uid = ti.gid = 0
    ti.uname = ti.gname = ""
    return ti


def _build_tar(members: list[tuple[str, bytes]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tf:
        for name, data in members:
            tf.addfile(_tarinfo(name, len(data)), io.BytesIO(data))
    return buf.getvalue()


def write_shards(
    tokens: np.ndarray,
    out_dir: Path,
    split: str,
    block_size: int,
    blocks_per_shard: int,
) -> list[dict]:
    """Write ``tokens`` (1-D integer array) as the shards of ``split`` in ``out_dir``.

    Returns one manifest entry per shard, in order:
    ``{"name": "train-000000.tar", "sha256": hex, "tokens": int, "blocks": int}``.
    Shards of this split left over from an earlier, longer write (higher indices) are removed
    after the new ones are in place, so the directory matches the returned list.
    """
    tokens = np.asarray(tokens)
    if tokens.ndim != 1:
        raise ValueError(f"tokens must be a 1-D array, got shape {tokens.shape}")
    if tokens.size == 0:
        raise ValueError(f"split {split!r} has no tokens to write")
    dt = _norm_dtype(tokens.dtype)
    if not isinstance(block_size, (int, np.integer)) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    if not isinstance(blocks_per_shard, (int, np.integer)) or blocks_per_shard < 1:
        raise ValueError(f"blocks_per_shard must be a positive int, got {blocks_per_shard!r}")
    if not split or not re.fullmatch(r"[A-Za-z0-9_.]+", split):
        raise ValueError(f"split name must be non-empty [A-Za-z0-9_.], got {split!r}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    ext = _EXT_BY_DTYPE[dt]
    le = tokens.astype(dt.newbyteorder("<"), copy=False)
    n = int(le.size)
    n_blocks = -(-n // block_size)
    entries: list[dict] = []
    for shard_idx, first_block in enumerate(range(0, n_blocks, blocks_per_shard)):
        last_block = min(first_block + blocks_per_shard, n_blocks)
        members = []
        n_tok = 0
        for b in range(first_block, last_block):
            block = le[b * block_size : (b + 1) * block_size]
            n_tok += int(block.size)
            members.append((f"{b:0{KEY_DIGITS}d}.{ext}", block.tobytes()))
        name = shard_name(split, shard_idx)
        path = out_dir / name
        atomic_write_bytes(path, _build_tar(members))
        entries.append(
            {"name": name, "sha256": sha256_file(path), "tokens": n_tok, "blocks": len(members)}
        )

    # Remove stale higher-numbered shards of this split from a previous, longer write.
    pat = re.compile(rf"^{re.escape(split)}-(\d{{{SHARD_DIGITS},}})\.tar$")
    for p in out_dir.iterdir():
        m = pat.match(p.name)
        if m and int(m.group(1)) >= len(entries):
            p.unlink(missing_ok=True)
    return entries


def _load_verified(out_dir: Path, entry: dict) -> bytes:
    path = Path(out_dir) / entry["name"]
    try:
        data = read_bytes(path, "shard")  # a FIFO is refused, not waited on
    except FileNotFoundError:
        raise ShardError(f"shard {path}: missing (file not found)") from None
    except OSError as e:
        raise ShardError(f"shard {path}: unreadable ({e})") from None
    except PipelineError as e:  # a FIFO, a device: refused as any unreadable shard
        raise ShardError(str(e)) from None
    found = hashlib.sha256(data).hexdigest()
    if found != entry["sha256"]:
        raise ShardError(
            f"shard {path}: checksum mismatch, expected sha256 {entry['sha256']} "
            f"found {found} ({len(data)} bytes; the file is truncated, corrupted or was "
            f"rewritten since the manifest was made)"
        )
    return data


def verify_shard(out_dir: Path, entry: dict) -> None:
    """Raise ShardError unless the shard exists and its sha256 matches ``entry``."""
    _load_verified(out_dir, entry)


def _read_one(out_dir: Path, entry: dict, dt: np.dtype, first_block: int) -> list[np.ndarray]:
    path = Path(out_dir) / entry["name"]
    data = _load_verified(out_dir, entry)
    ext = _EXT_BY_DTYPE[dt]
    le = dt.newbyteorder("<")
    blocks: list[np.ndarray] = []
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tf:
            for ti in tf:
                m = _MEMBER_RE.match(ti.name)
                if not ti.isfile() or m is None:
                    raise ShardError(f"shard {path}: unexpected member {ti.name!r}")
                key, mext = int(m.group(1)), m.group(2)
                if mext != ext:
                    raise ShardError(
                        f"shard {path}: member {ti.name!r} holds dtype {mext!r}, expected {ext!r}"
                    )
                expected = first_block + len(blocks)
                if key != expected:
                    raise ShardError(
                        f"shard {path}: block order, expected block {expected} found {key}"
                    )
                member = tf.extractfile(ti)
                assert member is not None  # a regular file: checked above
                raw = member.read()
                if len(raw) % dt.itemsize:
                    raise ShardError(
                        f"shard {path}: member {ti.name!r} has {len(raw)} bytes, not a multiple "
                        f"of {dt.itemsize}"
                    )
                blocks.append(np.frombuffer(raw, dtype=le))
    except tarfile.TarError as e:
        raise ShardError(f"shard {path}: not a readable tar archive ({e})") from None
    n_tok = sum(int(b.size) for b in blocks)
    if n_tok != entry["tokens"]:
        raise ShardError(
            f"shard {path}: token count mismatch, manifest says {entry['tokens']} found {n_tok}"
        )
    if "blocks" in entry and len(blocks) != entry["blocks"]:
        raise ShardError(
            f"shard {path}: block count mismatch, manifest says {entry['blocks']} "
            f"found {len(blocks)}"
        )
    return blocks


def read_shards(out_dir: Path, shards: list[dict], dtype) -> np.ndarray:
    """The split's tokens: every shard's blocks concatenated in order, as a 1-D ``dtype`` array.

    Each shard's sha256 and token count are checked against its manifest entry; a missing,
    truncated or corrupted shard raises :class:`ShardError` naming the file.
    """
    dt = _norm_dtype(dtype)
    if not shards:
        raise ShardError(f"no shards listed for {out_dir}")
    total = sum(int(e["tokens"]) for e in shards)
    out = np.empty(total, dtype=dt)
    pos = 0
    first_block = 0
    for entry in shards:
        blocks = _read_one(out_dir, entry, dt, first_block)
        for b in blocks:
            out[pos : pos + b.size] = b
            pos += b.size
        first_block += len(blocks)
    return out
