"""download: get the dataset's source onto the machine, verify it, extract its files.

Sources: `builtin://NAME` (built here with no network, once per machine and then read from
the user's cache: `pipeline.data.corpus.cached`), `file:///path` (a local mirror, read in
place) and `http(s)://...` (resumable, cached by sha256 in `workspace.cache`). The work is
in `pipeline.data.fetch`; this stage decides names and writes the record.

Outputs, in the stage's directory:
    files/<name>      each extracted file
    download.json     {"url", "sha256": of the fetched file (or the built-in bytes),
                       "files": {role: {"path": "files/<name>", "sha256", "bytes"}}}
Roles are the keys of `dataset.files`; without any: "all" for a plain, gz or built-in
source, and one per regular member of a zip (role = the member's base name). A generated
dataset (`dataset.generator`) has nothing to fetch: the stage says so and writes nothing.
"""

from __future__ import annotations

import hashlib
import io
import shutil
import urllib.parse
from pathlib import PurePosixPath

from pipeline.data import extract, fetch
from pipeline.errors import PipelineError, shown
from pipeline.fsutil import atomic_write_json
from pipeline.redact import mask
from stages.base import Stage, StageContext


def _builtin(ds, files_dir, log) -> tuple[str, dict]:
    from pipeline.data.corpus import cached

    name = ds.url.split("://", 1)[1]
    if "?" in name or "#" in name:  # nothing reads one, and it could hold a secret
        raise PipelineError(
            f"dataset.url {ds.url}: a built-in corpus takes no query or fragment: "
            f"builtin://{name.split('?')[0].split('#')[0]}"
        )
    if ds.archive != "none":
        raise PipelineError(
            f"dataset.url {ds.url}: a built-in corpus is plain text; "
            f"dataset.archive must be none, not {ds.archive}"
        )
    role, spec = next(iter(ds.files.items())) if ds.files else ("all", None)
    text = str(spec.path) if spec and spec.path else ""
    given = PurePosixPath(text.replace("\\", "/")) if text else None
    # the name the one file gets in files/, checked before the corpus is built: a name,
    # never a way out of it (`x/..` would be files/.. itself, the stage's directory)
    if given is not None and (given.is_absolute() or ".." in given.parts or not given.name):
        raise PipelineError(
            f"dataset.url {ds.url}: dataset.files.{role}.path '{shown(text)}' names a "
            f"parent directory or an absolute path; give a file name, e.g. {name}.txt"
        )
    try:
        data = cached(name, log)  # built once per machine, then reused by every workspace
    except ValueError as e:
        raise PipelineError(f"dataset.url {ds.url}: {e}") from None
    sha = hashlib.sha256(data).hexdigest()
    if ds.sha256 and sha != ds.sha256.lower():
        raise PipelineError(
            f"dataset.url {ds.url}: sha256 mismatch: expected "
            f"{ds.sha256.lower()}, found {sha} (the corpus depends on the "
            f"Python version)"
        )
    if len(ds.files) > 1:
        raise PipelineError(
            f"dataset.url {ds.url}: a built-in corpus is a single file; "
            f"dataset.files names {len(ds.files)} ({', '.join(ds.files)})"
        )
    target = files_dir / ((given.name if given else "") or f"{name}.txt")
    extracted = extract.write_verified(
        io.BytesIO(data),
        target,
        label=ds.url,
        size=len(data),
        role=role,
        sha256=spec.sha256 if spec else None,
        md5=spec.md5 if spec else None,
    )
    return sha, {role: extracted}


def run(ctx: StageContext) -> dict:
    ds = ctx.spec.dataset
    if ds.generator is not None:
        # nothing to fetch: kept a no-op so that one stage list serves every card
        ctx.log(
            f"dataset '{ds.name}' is generated ({ds.generator.task}), not downloaded: "
            f"nothing to fetch"
        )
        return {"generated": ds.generator.task}
    files_dir = ctx.out_dir / "files"
    if files_dir.exists():  # left by an interrupted attempt
        shutil.rmtree(files_dir)
    files_dir.mkdir(parents=True)
    cached = False
    if urllib.parse.urlparse(ds.url).scheme == "builtin":
        sha, extracted = _builtin(ds, files_dir, ctx.log)
    else:
        checked = any(f.sha256 or f.md5 for f in ds.files.values())
        hint = (
            "; if this is a repacked mirror of the same files, --set "
            "dataset.sha256={found} accepts it (dataset.files still checks each file)"
            if checked
            else ""
        )
        fetched = fetch.fetch(
            ds.url, fetch.cache_dir(ctx.spec), sha256=ds.sha256, log=ctx.log, mismatch_hint=hint
        )
        sha, cached = fetched.sha256, fetched.cached
        if not ds.sha256:
            ctx.log(f"note: no dataset.sha256 to check {ds.url} against; it is {sha}")
        extracted = extract.extract(
            fetched.path,
            ds.archive,
            files_dir,
            ds.files,
            name=fetch.file_name(ds.url, ds.archive),
            label=ds.url,
            log=ctx.log,
        )

    info = {
        "url": mask(ds.url),  # a record: the URL's credentials masked
        "sha256": sha,
        "files": {
            role: {"path": f"files/{e.path.name}", "sha256": e.sha256, "bytes": e.bytes}
            for role, e in extracted.items()
        },
    }
    atomic_write_json(ctx.out_dir / "download.json", info)
    size = sum(e.bytes for e in {e.path: e for e in extracted.values()}.values())
    ctx.log(f"{len(extracted)} file(s), {size:,} bytes; source sha256 {sha[:16]}…")
    ctx.tracker.log_metrics({"bytes": size}, step=0)
    ctx.tracker.set_tags({"sha256": sha})
    ctx.tracker.log_artifact(ctx.out_dir / "download.json")
    return {
        "sha256": sha,
        "bytes": size,
        "cached": cached,
        "files": {role: e.path.name for role, e in extracted.items()},
    }


def config(spec) -> dict:
    ds = spec.dataset
    out = ds.model_dump(include={"name", "url", "sha256", "archive", "files"})
    # a local file without a sha256 is pinned by its content: replaced in place, it is new data
    if ds.url and not ds.sha256 and (local := fetch.local_source_identity(ds.url)):
        out["local_source"] = local
    return out


STAGE = Stage(
    name="download",
    summary="Fetch the dataset (builtin://, file://, http(s)://; cached, resumable), "
    "check sha256, extract.",
    inputs=(),
    section_key=None,
    config=config,
    run=run,
)
