"""The path fuzzer's dataset cases (quality/fuzzers/path_fuzz.py): dataset-card file paths and
archive member names, fetched from a file:// source in the sandbox by `run --only download`
on the sandbox's world.

Card paths (`dataset.files.ROLE.path`): `..`, absolute paths, `a/../../b`, `~`, backslashes,
a trailing slash, paths into the victim directory and into the workspace's other stages.
Archive members (zip): the same shapes, names like the extractor's own temporary files (its
old fixed `.NAME.part`, and the mkstemp form: `.NAME.`, eight random characters, `.part`)
beside NAME itself, `__MACOSX/` junk, duplicates, and symbolic-link members (a unix mode in
the zip entry) that point outside. A gz archive gets a stored file name (FNAME) with the same
shapes. (The cards take none, gz and zip; no tar.)

What the command owns here is the download stage's directory, the download cache and the
tracking store: a member that lands in another stage's directory, beside the sandbox or in
the victim directory is a change outside, as is a symlink made anywhere. After exit 0 every
file download.json lists must be there with its recorded sha256.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import stat
import warnings
import zipfile
from pathlib import Path

from hypothesis import strategies as st

from quality.fuzzers.fuzz_kit import Case

BODY = b"".join(b"line %d of an archived file\n" % i for i in range(50))
NAMES = [
    "train.txt",
    "a/train.txt",
    ".train.txt.part",
    ".train.txt.a1b2c3d4.part",
    "..train.txt.part",
    "../train.txt",
    "../../train/stage.json",
    "../../../../victim/thesis.tex",
    "a/../../b.txt",
    "/{sandbox}/victim/thesis.tex",
    "/etc/hosts",
    "..",
    ".",
    "a/",
    "a\\..\\..\\b.txt",
    "~/x.txt",
    "__MACOSX/._train.txt",
    "files/../x.txt",
    "é☃.txt",
    "x" * 300,
]
LINK_TARGETS = ["../../../../victim/thesis.tex", "/{sandbox}/victim", "../../train"]


def _name(text: str, sandbox: Path) -> str:
    return text.replace("/{sandbox}", str(sandbox))


def make_zip(path: Path, members: list[tuple[str, bytes, bool]]) -> None:
    """members: (name, bytes, a symlink whose target is the bytes)."""
    with warnings.catch_warnings(), zipfile.ZipFile(path, "w") as z:
        warnings.simplefilter("ignore")  # duplicate names are drawn on purpose
        for name, data, link in members:
            info = zipfile.ZipInfo(name)
            if link:
                info.create_system = 3  # unix: external_attr holds the mode
                info.external_attr = (stat.S_IFLNK | 0o777) << 16
            z.writestr(info, data)


def make_gz(path: Path, stored_name: str) -> None:
    raw = io.BytesIO()
    with gzip.GzipFile(filename=stored_name, mode="wb", fileobj=raw, mtime=0) as g:
        g.write(BODY)
    path.write_bytes(raw.getvalue())


def draw_dataset_case(draw, sandbox: Path):
    """A path_fuzz.Case: `run --only download` of a drawn archive or card path."""

    names = st.sampled_from(NAMES).map(lambda n: _name(n, sandbox))
    src = sandbox / "src"
    src.mkdir(exist_ok=True)
    kind = draw(st.sampled_from(["zip", "zip", "zip", "gz", "none"]))
    sets = []
    if kind == "zip":
        members = [(draw(names), BODY, False) for _ in range(draw(st.integers(1, 4)))]
        if draw(st.booleans()):
            members.insert(draw(st.integers(0, len(members))), ("train.txt", BODY, False))
        if draw(st.integers(0, 2)) == 0:
            target = _name(draw(st.sampled_from(LINK_TARGETS)), sandbox).encode()
            members.append((draw(names), target, True))
        make_zip(src / "data.zip", members)
        url = f"file://{src / 'data.zip'}"
        if draw(st.booleans()):  # the card names one member
            sets.append(f"dataset.files={{all: {{path: '{draw(names)}'}}}}")
    elif kind == "gz":
        make_gz(src / "data.txt.gz", draw(names))
        url = f"file://{src / 'data.txt.gz'}"
        if draw(st.booleans()):
            sets.append(f"dataset.files={{all: {{path: '{draw(names)}'}}}}")
    else:
        (src / "data.txt").write_bytes(BODY)
        url = f"file://{src / 'data.txt'}"
        sets.append(f"dataset.files={{all: {{path: '{draw(names)}'}}}}")
    sets += [f"dataset.url={url}", f"dataset.archive={kind}"]
    tiny = str(sandbox / "world" / "tiny.yaml")
    args = ["run", tiny, "--only", "download", *[a for s in sets for a in ("--set", s)]]
    runs = sandbox / "world" / "runs"
    owned = [
        str(runs / "tiny" / "download"),
        str(runs / "tiny" / "download.partial"),
        str(runs / "tiny" / ".lock"),
        str(runs / "mlartifacts"),
        str(runs / "cache"),
        *(str(runs / n) for n in ("mlflow.db", ".mlflow.db.lock", "mlflow.db-journal")),
    ]
    return Case(
        f"download {kind}", args, owned, world_owned=False, verify=lambda: _as_recorded(runs)
    )


def _as_recorded(runs: Path) -> str | None:
    """Every file download.json lists is there with the sha256 it records (a member named
    like another's temporary file must not replace or remove it)."""
    stage = runs / "tiny" / "download"
    record = json.loads((stage / "download.json").read_text())
    for role, f in record["files"].items():
        path = stage / f["path"]
        if not path.is_file() or hashlib.sha256(path.read_bytes()).hexdigest() != f["sha256"]:
            return f"not as recorded: download.json's {role} {f['path']} is missing or differs"
    return None
