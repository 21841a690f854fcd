"""The planted-link fuzzer: at a path a command opens in a place that can be shared (the
workspace, the download cache, an --out / --output / --plot target, a config), something is
planted first, as anyone with write access to a group-writable runs/ directory could:

- a symlink to a victim file outside, or to a link to it (its bytes and mtime must not
  change),
- a symlink to a directory outside (nothing may appear in it), or to a FIFO outside,
- a FIFO or a socket (the command must not block on it: HANG_SECONDS is a hang),
- a dangling symlink into the victim directory (the file it names must not be created);
links with absolute or relative targets, and sometimes a second thing planted at another
of the world's paths.

Paths and the commands that open them: the workspace's `.lock` and the tracking store's
lock (`run`, `compare`), each stage's
records, outputs and checkpoint pointers (`run --only STAGE --force STAGE`; the download
stage from the local server, so through the download cache: the cached file, its `.part`
and `.lock`), the tracking backlog (`sync`), the default batch script and its logs
directory (`launch slurm`), the manifest and checkpoint files readers open (`sample`,
`export`), `export --out`, `compare --plot`, `launch slurm --output`, and the config read by
validate / show / run (itself, or a file it `extends`).

A case fails on a change to anything outside the copied world the command owns (the victim
included; `export --out` owns the directory its path resolves to, link followed, as the
docs say), on a traceback, a refusal that is not one line, or a hang. Used by
tests/system/commands/test_fuzz_classes.py and quality/fuzz.py --links N.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from hypothesis import strategies as st

from quality.fuzzers.cli_fuzz import World, copy_world
from quality.fuzzers.fuzz_kit import CORPUS_SHA256, Server, derandomized, invoke
from quality.fuzzers.path_fuzz import snapshot

KINDS = [
    "link to a file",
    "link to a link to a file",
    "link to a directory",
    "link to a fifo",
    "fifo",
    "socket",
    "dangling link",
]
DOWNLOAD = ["--only", "download", "--set", "dataset.url=http://{h}/corpus.txt"]
DOWNLOAD += ["--set", f"dataset.sha256={CORPUS_SHA256}"]
STEP = "step-00000006"
# (path planted, relative to the case's directory; the command, {t} the copied tiny.yaml,
# {d} the case's directory, {h} the local server)
TARGETS = [
    ("world/runs/tiny/.lock", ["run", "{t}"]),
    ("world/runs/.mlflow.db.lock", ["run", "{t}"]),
    ("world/runs/.mlflow.db.lock", ["compare", "tiny"]),
    ("world/runs/tiny/.lock", ["run", "{t}", "--only", "evaluate", "--force", "evaluate"]),
    ("world/runs/tiny/download/download.json", ["run", "{t}", *DOWNLOAD]),
    ("world/runs/tiny/download/stage.json", ["run", "{t}", *DOWNLOAD]),
    ("world/runs/cache/downloads/" + CORPUS_SHA256, ["run", "{t}", *DOWNLOAD]),
    ("world/runs/cache/downloads/" + CORPUS_SHA256 + ".part", ["run", "{t}", *DOWNLOAD]),
    ("world/runs/cache/downloads/" + CORPUS_SHA256 + ".lock", ["run", "{t}", *DOWNLOAD]),
    (
        "world/runs/tiny/evaluate/results.json",
        ["run", "{t}", "--only", "evaluate", "--force", "evaluate"],
    ),
    (
        "world/runs/tiny/evaluate/stage.json",
        ["run", "{t}", "--only", "evaluate", "--force", "evaluate"],
    ),
    (
        "world/runs/tiny/finetune/checkpoints/latest",
        ["run", "{t}", "--only", "finetune", "--force", "finetune"],
    ),
    (
        "world/runs/tiny/finetune/stage.json",
        ["run", "{t}", "--only", "finetune", "--force", "finetune"],
    ),
    (
        "world/runs/tiny/train/checkpoints/latest",
        ["run", "{t}", "--only", "train", "--force", "train"],
    ),
    (
        "world/runs/tiny/train/checkpoints/best",
        ["run", "{t}", "--only", "train", "--force", "train"],
    ),
    ("world/runs/tiny/train/spans.json", ["run", "{t}", "--only", "train", "--force", "train"]),
    ("world/runs/tiny/tracking-backlog.jsonl", ["sync", "{t}"]),
    ("world/runs/tiny/tracking-backlog.jsonl", ["run", "{t}"]),
    (
        "world/runs/tiny/slurm/tiny.sbatch",
        ["launch", "slurm", "{t}", "--nodes", "1", "--gpus-per-node", "1"],
    ),
    (
        "world/runs/tiny/slurm/logs",
        ["launch", "slurm", "{t}", "--nodes", "1", "--gpus-per-node", "1"],
    ),
    (
        "world/runs/tiny/preprocess/manifest.json",
        ["sample", "{t}", "--prompt", "def ", "--tokens", "2"],
    ),
    (
        f"world/runs/tiny/finetune/checkpoints/{STEP}/checksums.json",
        ["sample", "{t}", "--prompt", "a", "--tokens", "2"],
    ),
    (
        f"world/runs/tiny/finetune/checkpoints/{STEP}/mp_rank_00_model_states.pt",
        ["export", "{t}", "--out", "{d}/out"],
    ),
    ("world/runs/tiny/train/stage.json", ["run", "{t}", "--dry-run"]),
    ("out", ["export", "{t}", "--out", "{d}/out"]),
    ("out/model.safetensors", ["export", "{t}", "--out", "{d}/out"]),
    ("curves.png", ["compare", "tiny", "--plot", "{d}/curves.png"]),
    (
        "job.sbatch",
        [
            "launch",
            "slurm",
            "{t}",
            "--nodes",
            "1",
            "--gpus-per-node",
            "1",
            "--output",
            "{d}/job.sbatch",
        ],
    ),
    ("config.yaml", ["validate", "{d}/config.yaml"]),
    ("config.yaml", ["show", "{d}/config.yaml"]),
    ("config.yaml", ["run", "{d}/config.yaml", "--dry-run"]),
    ("base.yaml", ["validate", "{d}/child.yaml"]),
]


@dataclass
class Case:
    planted: str
    kind: str
    args: list[str]
    relative: bool = False  # the links' targets relative to their directory
    also: tuple[str, str] | None = None  # a second path planted, and what
    nonce: int = 0  # in the victim's bytes

    @property
    def command(self) -> str:
        where = self.planted.replace(CORPUS_SHA256, "<sha256>").replace("world/runs/", "runs/")
        return f"{' '.join(a for a in self.args[:2] if '/' not in a)} @ {where}"


@dataclass
class Outcome:
    command: str
    kind: str
    args: list[str]
    exit_code: int | None
    seconds: float
    problem: str | None
    said: str = ""


def draw_case(draw, tmp: Path, server: Server) -> Case:
    planted, args = draw(st.sampled_from(TARGETS))
    values = {"t": str(tmp / "world" / "tiny.yaml"), "d": str(tmp), "h": f"127.0.0.1:{server.port}"}
    case = Case(planted, draw(st.sampled_from(KINDS)), [a.format(**values) for a in args])
    case.relative = draw(st.booleans())
    # sometimes a second thing planted at another path the world holds
    if draw(st.integers(0, 2)) == 0:
        other = draw(st.sampled_from([p for p, _ in TARGETS if p.startswith("world/")]))
        if other != planted:
            case.also = (other, draw(st.sampled_from(KINDS)))
    case.nonce = draw(st.integers(0, 10**6))
    return case


def plant(case: Case, world: World, tmp: Path) -> None:
    """The case's directory: a copy of the world, a victim outside it, and the planted
    thing at the case's path (what was there is moved aside); maybe one more elsewhere."""
    copy_world(world, tmp / "world")
    victim = tmp / "victim"
    (victim / "dir").mkdir(parents=True)
    (victim / "thesis.tex").write_text(f"not yours {case.nonce}\n")
    (victim / "dir" / "notes.txt").write_text("not yours either\n")
    (victim / "link-to-thesis").symlink_to(victim / "thesis.tex")
    os.mkfifo(victim / "pipe")
    (tmp / "child.yaml").write_text(f"extends: [{tmp / 'base.yaml'}]\n")
    for planted, kind in [(case.planted, case.kind), *([case.also] if case.also else [])]:
        _plant(tmp / planted, kind, victim, case.relative)


def _plant(where: Path, kind: str, victim: Path, relative: bool) -> None:
    where.parent.mkdir(parents=True, exist_ok=True)
    if where.is_dir() and not where.is_symlink():
        os.rename(where, where.with_name(where.name + ".moved"))
    elif where.exists() or where.is_symlink():
        where.unlink()
    if kind == "fifo":
        os.mkfifo(where)
    elif kind == "socket":  # bound by its name from its directory: a socket path is short
        here = os.getcwd()
        os.chdir(where.parent)
        try:
            with socket.socket(socket.AF_UNIX) as sock:
                sock.bind(where.name)
        finally:
            os.chdir(here)
    else:
        target = {
            "link to a file": victim / "thesis.tex",
            "link to a link to a file": victim / "link-to-thesis",
            "link to a directory": victim / "dir",
            "link to a fifo": victim / "pipe",
            "dangling link": victim / "dir" / f"made-through-{where.name}",
        }[kind]
        where.symlink_to(os.path.relpath(target, where.parent) if relative else target)


def run_case(case: Case, world: World, tmp: Path) -> Outcome:
    plant(case, world, tmp)
    victim = tmp / "victim" / "thesis.tex"
    mtime = victim.stat().st_mtime_ns
    before = snapshot(tmp)
    inv = invoke(case.args, tmp / "world")
    after = snapshot(tmp)
    owned = str(tmp / "world") + "/"
    outputs = [str(tmp / p) for p in ("out", "curves.png", "job.sbatch")]
    # export --out names a directory, symlinks resolved (docs/running.md): where a link
    # there points is the export's, as in quality/fuzzers/path_fuzz.py; a file output
    # (--plot, --output) replaces a link, never writes through it
    outputs.append(os.path.realpath(tmp / "out"))
    changed = sorted(
        k
        for k in before.keys() | after.keys()
        if before.get(k) != after.get(k)
        and not k.startswith(owned)
        and not any(k == o or k.startswith(o + "/") for o in outputs)
    )
    if victim.stat().st_mtime_ns != mtime:
        changed.append(f"{victim} (mtime)")
    problem = inv.problem
    if changed:
        problem = f"changed outside: {changed[:4]}" + (f"; {problem}" if problem else "")
    said = (inv.stderr.strip().splitlines() or [""])[-1][:300]
    return Outcome(case.command, case.kind, case.args, inv.exit_code, inv.seconds, problem, said)


def fuzz_links(world: World, cases: int, on_outcome) -> None:
    """`cases` derandomized cases, each in a temporary directory of its own with a copy of
    `world`, against one local server."""
    import tempfile

    server = Server()
    try:

        def one(draw):
            with tempfile.TemporaryDirectory() as tmp:
                start = time.monotonic()
                case = draw_case(draw, Path(tmp).resolve(), server)
                outcome = run_case(case, world, Path(tmp).resolve())
                outcome.seconds = time.monotonic() - start
            on_outcome(outcome)

        derandomized(cases, one)
    finally:
        server.close()
