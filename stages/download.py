"""download: fetch the dataset's source, verify its sha256, extract it.

Outputs: `files/` (the extracted data files) and `download.json` (url, sha256 of the
fetched file and of each extracted file). Sources: `builtin://NAME` (built on this machine,
no network), `file:///path` (a local mirror) and `http(s)://...`.
"""

from __future__ import annotations

import gzip
import hashlib
import shutil
import urllib.error
import urllib.parse
import urllib.request
import zipfile
from pathlib import Path

from pipeline.errors import PipelineError
from pipeline.fsutil import atomic_write_bytes, atomic_write_json, sha256_file
from stages import Stage, StageContext

CHUNK = 1 << 20


def _fetch(url: str, dest: Path, log) -> None:
    parsed = urllib.parse.urlparse(url)
    if parsed.scheme == "file":
        src = Path(urllib.request.url2pathname(parsed.path))
        if not src.is_file():
            raise PipelineError(f"dataset.url {url}: no such file {src}")
        shutil.copyfile(src, dest)
        return
    if parsed.scheme not in ("http", "https"):
        raise PipelineError(f"dataset.url {url}: unsupported scheme '{parsed.scheme}' "
                            f"(use builtin://, file:// or http(s)://)")
    log(f"fetching {url}")
    try:
        with urllib.request.urlopen(url, timeout=60) as response, open(dest, "wb") as out:
            while block := response.read(CHUNK):
                out.write(block)
    except urllib.error.HTTPError as e:
        raise PipelineError(f"dataset.url {url}: HTTP {e.code} {e.reason}") from None
    except (urllib.error.URLError, TimeoutError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise PipelineError(f"dataset.url {url}: cannot download ({reason}); on a machine "
                            f"without internet, point --set dataset.url=file:///... at a "
                            f"local copy") from None


def _extract(archive: str, src: Path, member: str | None, files: Path) -> None:
    if archive == "none":
        shutil.copyfile(src, files / (member or "data"))
    elif archive == "gz":
        try:
            with gzip.open(src, "rb") as f, open(files / (member or "data"), "wb") as out:
                shutil.copyfileobj(f, out, CHUNK)
        except (OSError, EOFError) as e:
            raise PipelineError(f"downloaded file is not a valid gzip archive: {e}") from None
    elif archive == "zip":
        try:
            with zipfile.ZipFile(src) as z:
                names = [n for n in z.namelist() if not n.endswith("/")]
                if member is not None and member not in names:
                    raise PipelineError(f"dataset.member '{member}' is not in the zip archive "
                                        f"(it holds {', '.join(names[:10])})")
                for name in [member] if member else names:
                    target = files / Path(name).name
                    with z.open(name) as f, open(target, "wb") as out:
                        shutil.copyfileobj(f, out, CHUNK)
        except zipfile.BadZipFile as e:
            raise PipelineError(f"downloaded file is not a valid zip archive: {e}") from None


def run(ctx: StageContext) -> dict:
    ds = ctx.spec.dataset
    files = ctx.out_dir / "files"
    if files.exists():
        shutil.rmtree(files)
    files.mkdir()
    scheme = urllib.parse.urlparse(ds.url).scheme
    if scheme == "builtin":
        from pipeline.data.corpus import build

        name = ds.url.split("://", 1)[1]
        ctx.log(f"building the built-in corpus '{name}' (no network)")
        try:
            data = build(name)
        except ValueError as e:
            raise PipelineError(f"dataset.url {ds.url}: {e}") from None
        fetched_sha = hashlib.sha256(data).hexdigest()
        atomic_write_bytes(files / (ds.member or f"{name}.txt"), data)
    else:
        fetched = ctx.out_dir / "fetched.tmp"
        _fetch(ds.url, fetched, ctx.log)
        fetched_sha = sha256_file(fetched)
        if ds.sha256 and fetched_sha != ds.sha256.lower():
            fetched.unlink()
            raise PipelineError(f"dataset.url {ds.url}: sha256 mismatch: the card expects "
                                f"{ds.sha256}, the file has {fetched_sha}")
        if not ds.sha256 and scheme != "file":
            ctx.log(f"warning: no dataset.sha256 to check; the file has {fetched_sha}")
        _extract(ds.archive, fetched, ds.member, files)
        fetched.unlink()
    extracted = {p.name: sha256_file(p) for p in sorted(files.iterdir())}
    info = {"url": ds.url, "sha256": fetched_sha, "files": extracted}
    atomic_write_json(ctx.out_dir / "download.json", info)
    size = sum(p.stat().st_size for p in files.iterdir())
    ctx.log(f"{len(extracted)} file(s), {size:,} bytes, sha256 {fetched_sha[:16]}…")
    ctx.tracker.log_metrics({"bytes": size}, step=0)
    ctx.tracker.set_tags({"sha256": fetched_sha})
    return {"sha256": fetched_sha, "bytes": size, "files": list(extracted)}


STAGE = Stage(
    name="download",
    summary="Fetch the dataset (builtin://, file://, http(s)://), check sha256, extract.",
    inputs=(),
    section_key=None,
    config=lambda spec: spec.dataset.model_dump(
        include={"name", "url", "sha256", "archive", "member"}),
    run=run,
)
