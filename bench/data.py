"""Data throughput: the preprocess stage on an enwik8-sized byte stream, and the LM loader.

    .venv/bin/python -m bench.data [--mb 100] [--steps 200]

1. preprocess: 100 MB of real text (Tiny Shakespeare repeated, from ../shared/data, built in a
   temporary directory and deleted afterwards) through `stages.preprocess.preprocess` with the
   enwik8 card (byte level, tail split 5M / 5M): read and checksum, vocabulary, ids, shards,
   manifest. With WikiText-2 present, also the word-level path on its train file repeated.
2. loader: `pipeline.data.StreamBatches.batch(step)` at 64 x 512 (the paper's batch) on the
   train split's ids, in tokens per second.

Prints a table; asserts nothing.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from pipeline.data import StreamBatches
from pipeline.data.manifest import load_split
from pipeline.spec import load_spec
from stages.preprocess import preprocess

ROOT = Path(__file__).resolve().parent.parent

SHARED = ROOT.parent / "shared" / "data"


def fake_download(root: Path, role: str, name: str, data: bytes) -> Path:
    """A download stage output in its published layout, without the download."""
    (root / "files").mkdir(parents=True)
    (root / "files" / name).write_bytes(data)
    sha = hashlib.sha256(data).hexdigest()
    (root / "download.json").write_text(
        json.dumps(
            {
                "url": f"file:///{name}",
                "sha256": sha,
                "files": {role: {"path": f"files/{name}", "sha256": sha, "bytes": len(data)}},
            }
        )
    )
    return root


def repeated(path: Path, n_bytes: int, opener=open) -> bytes:
    with opener(path, "rb") as f:
        text = f.read()
    return (text * (n_bytes // len(text) + 1))[:n_bytes]


def time_preprocess(tmp: Path, card: str, data: bytes, role: str, sets: list[str]):
    cfg = ROOT / "configs" / "quickstart.yaml"
    ds = load_spec(cfg, [f"dataset={card}", *sets]).dataset
    dl = fake_download(tmp / f"dl-{card}", role, card, data)
    out = tmp / f"pp-{card}"
    t0 = time.perf_counter()
    manifest = preprocess(ds, dl, out, log=lambda _: None)
    return time.perf_counter() - t0, manifest, out


def wikitext_rows(tmp: Path) -> list[tuple[str, float, str]]:
    """The word-level path on WikiText-2's train file repeated, where the shared copy is."""
    wt2 = SHARED / "wikitext-2" / "wiki.train.tokens.gz"
    if not wt2.is_file():
        return []
    text = repeated(wt2, 54_000_000, opener=gzip.open)  # ~10M tokens, whole lines
    text = text[: text.rindex(b"\n") + 1]
    cfg_sets = [
        "dataset.split={kind: tail, valid: 1000, test: 1000}",
        "dataset.files={}",
        "dataset.archive=none",
        "dataset.vocab_size=null",
    ]
    secs_w, m_w, _ = time_preprocess(tmp, "wikitext2", text, "all", cfg_sets)
    toks = sum(s["tokens"] for s in m_w["splits"].values())
    rate = f"{toks / secs_w / 1e6:.2f} M tokens/s; vocab {m_w['vocab_size']:,}"
    return [(f"preprocess word, WikiText-2 train x5 ({len(text) / 1e6:.0f} MB)", secs_w, rate)]


def loader_row(out: Path, args) -> tuple[str, float, str]:
    ids = load_split(out, "train")
    sb = StreamBatches(ids, batch_size=args.batch, seq_len=args.seq)
    sb.batch(0)
    steps = min(args.steps, sb.epoch_steps(0))
    t0 = time.perf_counter()
    for k in range(steps):
        sb.batch(k)
    secs_l = time.perf_counter() - t0
    tok = steps * args.batch * args.seq
    return (
        f"loader StreamBatches {args.batch} x {args.seq}, {steps} steps",
        secs_l,
        f"{tok / secs_l / 1e6:.1f} M tokens/s ({secs_l / steps * 1e3:.2f} ms/step)",
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=100.0, help="size of the byte-level input")
    ap.add_argument("--steps", type=int, default=2000, help="loader steps to time")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seq", type=int, default=512)
    args = ap.parse_args()

    shakespeare = SHARED / "tinyshakespeare" / "input.txt"
    if not shakespeare.is_file():
        sys.exit(f"{shakespeare} is missing: the benchmark builds its input from it")
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-data-") as tmp:
        tmp = Path(tmp)
        n = int(args.mb * 1e6)
        data = repeated(shakespeare, n)
        secs, manifest, out = time_preprocess(tmp, "enwik8", data, "all", [])
        del data
        n_shards = sum(len(s["shards"]) for s in manifest["splits"].values())
        rows.append(
            (
                f"preprocess byte, enwik8 card ({n / 1e6:.0f} MB)",
                secs,
                f"{n / 1e6 / secs:.1f} MB/s; vocab {manifest['vocab_size']}, {n_shards} shards",
            )
        )

        rows += wikitext_rows(tmp)
        rows.append(loader_row(out, args))

    print(f"cpus: {os.cpu_count()}  (python {sys.version.split()[0]})")
    w = max(len(r[0]) for r in rows)
    print(f"{'what':<{w}}  {'seconds':>8}  rate")
    for what, secs, rate in rows:
        print(f"{what:<{w}}  {secs:>8.2f}  {rate}")


if __name__ == "__main__":
    main()
