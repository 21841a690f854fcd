"""Tests for pipeline.data: vocabularies, webdataset token shards, ordered stream batching."""

from __future__ import annotations

import collections
import json
import math
import tarfile

import numpy as np
import pytest
import torch

from pipeline.data import (
    ShardError,
    StreamBatches,
    Vocab,
    eval_batches,
    eval_num_batches,
    read_shards,
    smallest_uint_dtype,
    unigram_entropy_bits,
    write_shards,
)
from pipeline.fsutil import sha256_file
from tests.fixtures.shared_data import find_shared_data


@pytest.fixture(scope="module")
def text() -> str:
    """60k characters of real text: Tiny Shakespeare, or Python's help topics on a checkout
    without the shared data (CI has it)."""
    shakespeare = find_shared_data("tinyshakespeare/input.txt")
    if shakespeare is not None:
        with open(shakespeare, encoding="utf-8") as f:
            return f.read(60_000)
    from pydoc_data.topics import topics

    return "\n".join(topics[k] for k in sorted(topics))[:60_000]


# ----------------------------------------------------------------------------- vocab


def test_byte_vocab_round_trip(text):
    data = text.encode("utf-8") + "naïve — ok".encode()
    v = Vocab.build("byte", data)
    assert v.symbols == sorted(set(data))
    ids = v.encode(data)
    assert ids.dtype == np.uint8 and ids.shape == (len(data),)
    assert v.decode(ids) == data
    # ids follow the sorted order of symbols
    assert all(v.symbols[i] == b for i, b in zip(ids[:500].tolist(), data[:500], strict=False))


def test_char_vocab_round_trip_unicode(text):
    s = text[:5000] + "naïve café — 日本語 🎉 \ud800"  # includes a lone surrogate
    v = Vocab.build("char", s)
    assert v.symbols == sorted(set(s))
    assert len(v) == len(set(s))
    ids = v.encode(s)
    assert v.decode(ids) == s
    assert v.decode(ids.tolist()) == s
    assert [v.symbols[i] for i in ids[:100]] == list(s[:100])


def test_vocab_json_round_trip():
    for v in (Vocab.build("byte", bytes(range(0, 256, 3))), Vocab.build("char", "zyx日🎉a")):
        d = json.loads(json.dumps(v.to_json()))
        w = Vocab.from_json(d)
        assert w == v and w.kind == v.kind and w.symbols == v.symbols
    assert Vocab.build("byte", b"ba").to_json()["symbols"] == [97, 98]
    assert Vocab.build("char", "ba").to_json()["symbols"] == ["a", "b"]
    with pytest.raises(ValueError):
        Vocab.from_json({"kind": "char", "symbols": ["b", "a"]})  # not sorted
    with pytest.raises(ValueError):
        Vocab.from_json({"kind": "word", "symbols": ["a"]})


def test_dtype_selection():
    assert smallest_uint_dtype(256) == np.uint8
    assert smallest_uint_dtype(257) == np.uint16
    assert smallest_uint_dtype(65536) == np.uint16
    assert smallest_uint_dtype(65537) == np.uint32
    assert Vocab.build("byte", bytes(range(256))).dtype == np.uint8
    s300 = "".join(chr(0x100 + i) for i in range(300))
    v = Vocab.build("char", s300)
    assert v.dtype == np.uint16 and v.encode(s300).dtype == np.uint16
    assert v.encode(s300).max() == 299
    s70k = "".join(chr(0x20 + i) for i in range(70_000))
    v = Vocab.build("char", s70k)
    ids = v.encode(s70k)
    assert v.dtype == np.uint32 and ids.dtype == np.uint32
    assert np.array_equal(ids, np.arange(70_000))
    assert v.decode(ids) == s70k


def test_unknown_symbol_error():
    v = Vocab.build("char", "abc")
    with pytest.raises(ValueError, match=r"'x'.*position 3"):
        v.encode("abcxa")
    vb = Vocab.build("byte", b"abc")
    with pytest.raises(ValueError, match=r"byte 122.*position 1"):
        vb.encode(b"azb")
    with pytest.raises(TypeError):
        v.encode(b"abc")
    with pytest.raises(TypeError):
        vb.encode("abc")
    with pytest.raises(ValueError, match="out of range"):
        v.decode([0, 3])


def test_unigram_entropy(text):
    assert unigram_entropy_bits(np.array([0, 1, 2, 3] * 5), 4) == pytest.approx(2.0)
    assert unigram_entropy_bits(np.array([7, 7, 7]), 8) == 0.0
    v = Vocab.build("char", text)
    counts = collections.Counter(text)
    expected = -sum(c / len(text) * math.log2(c / len(text)) for c in counts.values())
    got = unigram_entropy_bits(v.encode(text), len(v))
    assert got == pytest.approx(expected, rel=1e-12)
    assert 3.0 < got < 5.5  # English characters
    with pytest.raises(ValueError):
        unigram_entropy_bits(np.array([0, 5]), 5)


# ----------------------------------------------------------------------------- shards


@pytest.fixture(scope="module")
def byte_tokens(text) -> np.ndarray:
    data = text.encode("utf-8")
    return Vocab.build("byte", data).encode(data)


def _write(tokens, d, split="train", block_size=1000, blocks_per_shard=7):
    return write_shards(tokens, d, split, block_size, blocks_per_shard)


def test_shards_round_trip_exact(byte_tokens, tmp_path):
    toks = byte_tokens[:20_500]  # 21 blocks of 1000 (last one 500) -> shards of 7, 7, 7
    entries = _write(toks, tmp_path)
    assert [e["name"] for e in entries] == [f"train-{i:06d}.tar" for i in range(3)]
    assert [e["blocks"] for e in entries] == [7, 7, 7]
    assert [e["tokens"] for e in entries] == [7000, 7000, 6500]
    for e in entries:
        assert e["sha256"] == sha256_file(tmp_path / e["name"])
    out = read_shards(tmp_path, entries, np.uint8)
    assert out.dtype == np.uint8 and np.array_equal(out, toks)
    # no temporary files left behind
    assert sorted(p.name for p in tmp_path.iterdir()) == [e["name"] for e in entries]


@pytest.mark.parametrize("dtype,hi", [(np.uint16, 65535), (np.uint32, 2**32 - 1)])
def test_shards_round_trip_wide_dtypes(tmp_path, dtype, hi):
    rng = np.random.default_rng(0)
    toks = rng.integers(0, hi, size=3_333, endpoint=True).astype(dtype)
    toks[:3] = [hi, 0, 258]
    entries = write_shards(toks, tmp_path, "valid", 256, 4)
    assert sum(e["tokens"] for e in entries) == toks.size
    out = read_shards(tmp_path, entries, dtype)
    assert out.dtype == dtype and np.array_equal(out, toks)
    ext = {np.uint16: "u16", np.uint32: "u32"}[dtype]
    with tarfile.open(tmp_path / entries[0]["name"]) as tf:
        names = tf.getnames()
        raw = tf.extractfile(names[0]).read()
    assert names[:2] == [f"000000000.{ext}", f"000000001.{ext}"]
    assert raw == toks[:256].astype(np.dtype(dtype).newbyteorder("<")).tobytes()


def test_shards_deterministic(byte_tokens, tmp_path):
    toks = byte_tokens[:9_000]
    a = _write(toks, tmp_path / "a")
    b = _write(toks, tmp_path / "b")
    again = _write(toks, tmp_path / "a")  # rewrite in place
    assert a == b == again
    for e in a:
        assert sha256_file(tmp_path / "a" / e["name"]) == sha256_file(tmp_path / "b" / e["name"])
        assert (tmp_path / "a" / e["name"]).read_bytes() == (
            tmp_path / "b" / e["name"]
        ).read_bytes()
        with tarfile.open(tmp_path / "a" / e["name"]) as tf:
            for ti in tf.getmembers():
                assert (ti.mtime, ti.uid, ti.gid, ti.uname, ti.gname, ti.mode) == (
                    0,
                    0,
                    0,
                    "",
                    "",
                    0o644,
                )
    # a different input gives a different fingerprint
    c = _write(toks[::-1].copy(), tmp_path / "c")
    assert [e["sha256"] for e in c] != [e["sha256"] for e in a]


def test_shards_rewrite_removes_stale(byte_tokens, tmp_path):
    _write(byte_tokens[:30_000], tmp_path)  # 5 shards
    _write(byte_tokens[:30_000], tmp_path, split="valid")
    short = _write(byte_tokens[:8_000], tmp_path)  # 2 shards
    names = sorted(p.name for p in tmp_path.iterdir())
    assert [n for n in names if n.startswith("train-")] == [e["name"] for e in short]
    assert len([n for n in names if n.startswith("valid-")]) == 5


def test_shards_readable_by_webdataset(byte_tokens, tmp_path):
    import webdataset as wds

    toks = byte_tokens[:12_345]
    entries = _write(toks, tmp_path)
    urls = [str(tmp_path / e["name"]) for e in entries]
    samples = list(wds.WebDataset(urls, shardshuffle=False))
    assert len(samples) == sum(e["blocks"] for e in entries) == 13
    assert [s["__key__"] for s in samples] == [f"{i:09d}" for i in range(13)]
    assert all(set(k for k in s if not k.startswith("__")) == {"u8"} for s in samples)
    got = np.concatenate([np.frombuffer(s["u8"], dtype=np.uint8) for s in samples])
    assert np.array_equal(got, toks)

    # The same samples written by webdataset's own TarWriter read back identically.
    wd_path = tmp_path / "wds-000000.tar"
    with wds.TarWriter(str(wd_path)) as w:
        for s in samples:
            w.write({"__key__": s["__key__"], "u8": s["u8"]})
    again = list(wds.WebDataset([str(wd_path)], shardshuffle=False))
    assert [(s["__key__"], s["u8"]) for s in again] == [(s["__key__"], s["u8"]) for s in samples]


def _damage_setup(byte_tokens, tmp_path):
    entries = _write(byte_tokens[:20_000], tmp_path)
    return entries, tmp_path / entries[1]["name"]


def test_shard_truncated(byte_tokens, tmp_path):
    entries, victim = _damage_setup(byte_tokens, tmp_path)
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) // 2])
    with pytest.raises(ShardError, match=rf"{victim.name}.*checksum mismatch") as ei:
        read_shards(tmp_path, entries, np.uint8)
    assert entries[1]["sha256"] in str(ei.value)
    assert sha256_file(victim) in str(ei.value)


def test_shard_flipped_byte(byte_tokens, tmp_path):
    entries, victim = _damage_setup(byte_tokens, tmp_path)
    data = bytearray(victim.read_bytes())
    data[1200] ^= 0x01  # inside the first member's payload: the tar still parses
    victim.write_bytes(bytes(data))
    with pytest.raises(ShardError, match=rf"{victim.name}.*checksum mismatch"):
        read_shards(tmp_path, entries, np.uint8)


def test_shard_missing(byte_tokens, tmp_path):
    entries, victim = _damage_setup(byte_tokens, tmp_path)
    victim.unlink()
    with pytest.raises(ShardError, match=rf"{victim.name}.*missing"):
        read_shards(tmp_path, entries, np.uint8)


def test_shard_manifest_mismatch(byte_tokens, tmp_path):
    entries, victim = _damage_setup(byte_tokens, tmp_path)
    bad = [dict(e) for e in entries]
    bad[1]["tokens"] += 1
    with pytest.raises(ShardError, match=rf"{victim.name}.*token count"):
        read_shards(tmp_path, bad, np.uint8)
    with pytest.raises(ShardError, match="expected 'u16'"):
        read_shards(tmp_path, entries, np.uint16)
    with pytest.raises(ShardError, match="block order"):
        read_shards(tmp_path, entries[1:], np.uint8)  # a shard left out


def test_write_shards_validation(tmp_path):
    with pytest.raises(ValueError):
        write_shards(np.zeros(0, np.uint8), tmp_path, "train", 10, 2)
    with pytest.raises(ValueError):
        write_shards(np.zeros(10, np.uint8), tmp_path, "train", 0, 2)
    with pytest.raises(ValueError):
        write_shards(np.zeros(10, np.float32), tmp_path, "train", 4, 2)


# ----------------------------------------------------------------------------- streams


def test_stream_contiguous_rows():
    toks = np.arange(10_007, dtype=np.int64)
    sb = StreamBatches(toks, batch_size=4, seq_len=32)
    L = sb.stream_len
    assert L == 10_007 // 4 and sb.epoch_steps(0) == (L - 1) // 32
    assert sb.tokens_per_step == 4 * 32 and sb.dropped_tokens == 10_007 - 4 * L
    prev = None
    rows = [[] for _ in range(4)]
    for k in range(sb.epoch_steps(0)):
        x, y = sb.batch(k)
        assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (4, 32)
        assert torch.equal(y, x + 1)  # next-token targets from the same stream
        if prev is not None:
            assert torch.equal(x[:, 0], prev[:, -1] + 1)  # row continues where it stopped
        prev = x
        for i in range(4):
            rows[i].append(x[i].numpy())
    for i in range(4):
        got = np.concatenate(rows[i])
        assert np.array_equal(got, toks[i * L : i * L + sb.epoch_steps(0) * 32])


def test_stream_ranks_disjoint_and_cover():
    N, B, W, T = 5_003, 3, 4, 16
    toks = np.arange(N, dtype=np.int64)
    per_rank = []
    for r in range(W):
        sb = StreamBatches(toks, B, T, rank=r, world_size=W)
        seen = set()
        for k in range(sb.epoch_steps(0)):
            x, y = sb.batch(k)
            seen.update(x.flatten().tolist())
            seen.update(y.flatten().tolist())
        assert sb.tokens_per_step == B * W * T  # over all ranks
        assert sb.batch(0)[0][:, 0].tolist() == [(r * B + i) * sb.stream_len for i in range(B)]
        per_rank.append(seen)
    for a in range(W):
        for b in range(a + 1, W):
            assert not per_rank[a] & per_rank[b]
    L = N // (B * W)
    used = sb.epoch_steps(0) * T + 1
    expected = {s * L + j for s in range(B * W) for j in range(used)}
    assert set().union(*per_rank) == expected


def test_stream_resume_equals_sequential(text):
    v = Vocab.build("char", text)
    ids = v.encode(text)
    sb = StreamBatches(ids, batch_size=3, seq_len=64, rank=1, world_size=2)
    seq = [(x.clone(), y.clone()) for _, x, y in sb.iter_from(0, num_steps=40)]
    fresh = StreamBatches(ids, batch_size=3, seq_len=64, rank=1, world_size=2)
    for k in (0, 1, 17, 39, 25):
        x, y = fresh.batch(k)
        assert torch.equal(x, seq[k][0]) and torch.equal(y, seq[k][1])
    resumed = [x for _, x, _ in fresh.iter_from(25, num_steps=15)]
    assert all(torch.equal(a, b[0]) for a, b in zip(resumed, seq[25:], strict=False))
    # rows are real, continuous text from the split
    row = "".join(v.decode(seq[k][0][0].numpy()) for k in range(5))
    assert row in text and len(row) == 5 * 64


def test_stream_wraps_at_a_seeded_random_offset():
    """After epoch 0 (offset 0) every stream restarts at an offset drawn from (seed, epoch)
    in [0, seq_len), the same on every rank; the epoch then has the full segments left."""
    toks = np.arange(1_000, dtype=np.int32)
    T = 30
    ranks = [
        StreamBatches(toks, batch_size=2, seq_len=T, world_size=2, rank=r, seed=7) for r in range(2)
    ]
    sb = ranks[0]
    L = sb.stream_len
    assert L == 250 and sb.epoch_steps(0) == (L - 1) // T == 8
    offsets = [sb.epoch_offset(e) for e in range(40)]
    assert offsets[0] == 0 and all(0 <= o < T for o in offsets)
    assert len(set(offsets[1:])) > 10  # drawn, not a constant
    step = 0
    for e, off in enumerate(offsets):
        steps = (L - 1 - off) // T
        assert sb.epoch_steps(e) == steps and steps in (7, 8)
        for k in range(steps):
            for r, rb in enumerate(ranks):
                x, y = rb.batch(step + k)
                first = (r * 2 + np.arange(2)) * L + off + k * T  # rows r*B .. r*B+B-1
                assert x[:, 0].tolist() == first.tolist() and torch.equal(y, x + 1)
                assert int(y[:, -1].max()) < (r * 2 + 2) * L  # never past the stream
                assert rb.epoch(step + k) == e and rb.starts_epoch(step + k) == (k == 0)
                assert rb.offset(step + k) == off + k * T
        step += steps
    # a fresh object (a resumed run) seeks straight to a late step; another seed differs
    late = StreamBatches(toks, batch_size=2, seq_len=T, world_size=2, rank=1, seed=7)
    for k in (step - 1, 200, 57):
        assert torch.equal(late.batch(k)[0], ranks[1].batch(k)[0])
    other = StreamBatches(toks, batch_size=2, seq_len=T, world_size=2, seed=8)
    assert [other.epoch_offset(e) for e in range(40)] != offsets


def test_stream_offset_leaves_a_full_segment_in_a_short_stream():
    """A stream of fewer than 2 * seq_len tokens: offsets are drawn below stream_len - seq_len
    so that every epoch still has one step."""
    sb = StreamBatches(np.arange(40) % 5, batch_size=1, seq_len=32, seed=3)
    assert sb.stream_len == 40
    assert {sb.epoch_offset(e) for e in range(1, 200)} == set(range(8))
    assert all(sb.epoch_steps(e) == 1 for e in range(200))
    assert [sb.offset(k) for k in range(200)] == [sb.epoch_offset(e) for e in range(200)]


def test_stream_validation():
    toks = np.arange(100, dtype=np.uint8)
    with pytest.raises(ValueError, match=r"need 132 tokens.*has 100"):
        StreamBatches(toks, batch_size=2, seq_len=32, world_size=2)
    ok = StreamBatches(np.arange(132) % 7, batch_size=2, seq_len=32, world_size=2)  # just enough
    assert ok.epoch_steps(0) == 1
    with pytest.raises(ValueError, match="rank"):
        StreamBatches(toks, 1, 4, rank=2, world_size=2)
    with pytest.raises(ValueError, match="batch_size"):
        StreamBatches(toks, 0, 4)
    with pytest.raises(ValueError, match="seq_len"):
        StreamBatches(toks, 1, 0)
    with pytest.raises(ValueError, match="step"):
        StreamBatches(toks, 1, 4).batch(-1)
    with pytest.raises(ValueError, match="1-D"):
        StreamBatches(toks.reshape(10, 10), 1, 4)


@pytest.mark.parametrize(
    "n,batch_size,world_size,seq_len",
    [
        (1_000, 4, 1, 25),  # divides
        (1_001, 4, 1, 25),  # 1000 targets: divides
        (997, 3, 2, 16),
        (4_099, 5, 3, 33),
        (50, 4, 4, 7),  # 49 targets over 16 streams
        (6, 4, 2, 8),  # fewer targets than streams: empty rows
        (2, 1, 3, 5),  # one target
        (503, 1, 1, 1),
    ],
)
def test_eval_coverage_exact(n, batch_size, world_size, seq_len):
    toks = np.arange(n, dtype=np.int64)
    counts = np.zeros(n, dtype=np.int64)
    n_batches = eval_num_batches(n, batch_size, seq_len, world_size)
    for r in range(world_size):
        batches = list(eval_batches(toks, batch_size, seq_len, rank=r, world_size=world_size))
        assert len(batches) == n_batches  # every rank the same count: no collective hangs
        row_vals = [[] for _ in range(batch_size)]
        row_masks = [[] for _ in range(batch_size)]
        for x, y, m in batches:
            assert x.shape == y.shape == m.shape == (batch_size, seq_len)
            assert x.dtype == y.dtype == torch.int64 and m.dtype == torch.bool
            assert torch.equal(y[m], x[m] + 1)  # target follows its input
            assert int(x[~m].abs().sum()) == 0 and int(y[~m].abs().sum()) == 0
            np.add.at(counts, y[m].numpy(), 1)
            for i in range(batch_size):
                row_vals[i].append(y[i].numpy())
                row_masks[i].append(m[i].numpy())
        for i in range(batch_size):
            vals, mask = np.concatenate(row_vals[i]), np.concatenate(row_masks[i])
            k = int(mask.sum())
            assert mask[:k].all() and not mask[k:].any()  # only the tail is padded
            assert np.array_equal(np.diff(vals[:k]), np.ones(max(k - 1, 0)))  # contiguous row
    assert counts[0] == 0 and (counts[1:] == 1).all()


def test_eval_real_text(text):
    v = Vocab.build("byte", text.encode())
    ids = v.encode(text.encode())[:7_777]
    total = 0
    xs = []
    for x, _y, m in eval_batches(ids, batch_size=4, seq_len=100):
        total += int(m.sum())
        xs.append(x[2])
    assert total == ids.size - 1
    row = torch.cat(xs).numpy()
    # row 2 holds a contiguous slice of the text
    L = (ids.size - 1) // 4
    start = 2 * L + min(2, (ids.size - 1) % 4)
    assert np.array_equal(row[:L], ids[start : start + L])
    with pytest.raises(ValueError, match="at least 2 tokens"):
        list(eval_batches(ids[:1], 1, 4))
