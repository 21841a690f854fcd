"""Files in shareable places (a workspace, the download cache, an --out directory): a symlink
planted at a name the pipeline writes is refused in one line and the file it names is left
alone; a FIFO at a name it reads is refused at once instead of blocking; what is published
has the modes the umask asks for (0666 / 0777 & ~umask); an archive member or a built-in
corpus's file name never reaches past, or clobbers, what the extractor owns."""

from __future__ import annotations

import contextlib
import os
import stat
import threading
import zipfile
from pathlib import Path

import pytest
from click.testing import CliRunner

from pipeline.commands.cli import main
from pipeline.errors import PipelineError
from pipeline.spec import load_spec
from pipeline.tracking.tracker import NullTracker
from pipeline.workspace.lock import WorkspaceLock, lock_is_free
from pipeline.workspace.runner import Runner
from tests.fixtures.download_server import config, listing, make_zip, payload, run_download, sha
from tests.fixtures.stand_in_stages import run

ROOT = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.usefixtures("offline_and_fast")
VICTIM = "not yours: thesis chapter 3\n"


@pytest.fixture
def victim(tmp_path) -> Path:
    path = tmp_path / "victim" / "thesis.tex"
    path.parent.mkdir()
    path.write_text(VICTIM)
    return path


def within(seconds: float, fn, fifo: Path | None = None):
    """fn() in a thread; a hang past `seconds` fails the test (and is ended by opening the
    FIFO's other end, so no thread stays blocked on it)."""
    out: dict = {}

    def target():
        try:
            out["value"] = fn()
        except BaseException as e:  # handed to the test
            out["error"] = e

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        if fifo is not None:  # unblock a reader or a writer waiting on the FIFO
            with contextlib.suppress(OSError):
                fd = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)
                os.close(fd)
        pytest.fail(f"blocked for over {seconds}s")
    if "error" in out:
        raise out["error"]
    return out.get("value")


@contextlib.contextmanager
def umask(mask: int):
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


# ---------------------------------------------------------------- the workspace lock


def test_a_link_planted_at_the_workspace_lock_is_refused_and_its_target_untouched(
    cfg,
    calls,
    victim,
):
    ws = load_spec(cfg).workspace_dir
    ws.mkdir(parents=True)
    (ws / ".lock").symlink_to(victim)
    with pytest.raises(PipelineError) as e:
        run(cfg)
    assert str(e.value) == (
        f"workspace lock file {ws / '.lock'} is a symbolic link; refusing to write through it"
    )
    assert victim.read_text() == VICTIM
    assert calls == []


def test_a_dangling_link_at_the_workspace_lock_creates_nothing(cfg, calls, tmp_path):
    ws = load_spec(cfg).workspace_dir
    ws.mkdir(parents=True)
    (ws / ".lock").symlink_to(tmp_path / "made-by-them")
    with pytest.raises(PipelineError, match="is a symbolic link; refusing to write through it"):
        run(cfg)
    assert not (tmp_path / "made-by-them").exists()


def test_a_link_planted_at_a_stage_directory_is_refused_and_its_target_untouched(
    cfg,
    calls,
    victim,
):
    ws = load_spec(cfg).workspace_dir
    ws.mkdir(parents=True)
    (ws / "download.partial").symlink_to(victim.parent)
    with pytest.raises(PipelineError) as e:
        run(cfg)
    assert str(e.value) == (
        f"stage directory {ws / 'download.partial'} is a symbolic link; refusing to write "
        f"through it"
    )
    assert sorted(p.name for p in victim.parent.iterdir()) == ["thesis.tex"]
    assert victim.read_text() == VICTIM and calls == []


def test_a_fifo_at_the_workspace_lock_is_refused_not_waited_on(tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    fifo = ws / ".lock"
    os.mkfifo(fifo)
    refusal = f"workspace lock file {fifo} is a FIFO, not a regular file"
    with pytest.raises(PipelineError) as e:
        within(5, lambda: lock_is_free(ws), fifo)  # what compare asks
    assert str(e.value) == refusal
    with pytest.raises(PipelineError) as e:
        within(5, lambda: WorkspaceLock(ws).__enter__(), fifo)
    assert str(e.value) == refusal


# ---------------------------------------------------------------- the download cache


def test_a_link_planted_at_a_partial_download_is_refused_and_its_target_untouched(
    server,
    tmp_path,
    victim,
):
    data = payload(60_000)
    server.files["d.bin"] = data
    spec = config(tmp_path, {"url": server.url("d.bin"), "sha256": sha(data)})
    downloads = tmp_path / "runs" / "cache" / "downloads"
    downloads.mkdir(parents=True)
    part = downloads / f"{sha(data)}.part"
    part.symlink_to(victim)
    with pytest.raises(PipelineError) as e:
        run_download(spec)
    assert str(e.value) == (
        f"partial download {part} is a symbolic link; refusing to write through it"
    )
    assert victim.read_text() == VICTIM
    assert not (downloads / sha(data)).exists()


def test_a_link_planted_at_the_download_lock_creates_nothing(server, tmp_path):
    data = payload(10_000)
    server.files["d.bin"] = data
    spec = config(tmp_path, {"url": server.url("d.bin"), "sha256": sha(data)})
    downloads = tmp_path / "runs" / "cache" / "downloads"
    downloads.mkdir(parents=True)
    lock = downloads / f"{sha(data)}.lock"
    lock.symlink_to(tmp_path / "made-by-them")
    with pytest.raises(PipelineError) as e:
        run_download(spec)
    assert str(e.value) == (
        f"download lock file {lock} is a symbolic link; refusing to write through it"
    )
    assert not (tmp_path / "made-by-them").exists()


# ---------------------------------------------------------------- pictures (--plot)


def test_a_picture_replaces_a_link_at_its_name_and_never_writes_through_one(tmp_path, victim):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from pipeline.training.head_maps import save

    out = tmp_path / "plots"
    out.mkdir()
    # the names a picture's writer used to open by name: the picture and a fixed temporary
    (out / "curves.png").symlink_to(victim)
    (out / ".curves.png.tmp").symlink_to(tmp_path / "made-by-them")
    fig = plt.figure(figsize=(1, 1))
    with umask(0o022):
        save(fig, out / "curves.png")
    assert victim.read_text() == VICTIM
    assert not (tmp_path / "made-by-them").exists()
    picture = out / "curves.png"
    assert not picture.is_symlink() and picture.read_bytes().startswith(b"\x89PNG")
    assert mode(picture) == 0o644


# ---------------------------------------------------------------- readers and FIFOs


def test_a_fifo_as_the_manifest_is_refused_not_waited_on(tmp_path):
    from pipeline.data.manifest import load_manifest

    fifo = tmp_path / "manifest.json"
    os.mkfifo(fifo)
    with pytest.raises(PipelineError) as e:
        within(5, lambda: load_manifest(tmp_path), fifo)
    assert str(e.value) == f"manifest {fifo} is a FIFO, not a regular file"


def test_a_fifo_in_a_checkpoint_is_refused_not_waited_on(tmp_path):
    from pipeline.training.checkpoint_dirs import read_checkpoint_file, read_pointer

    ckpt = tmp_path / "checkpoints" / "step-00000004"
    ckpt.mkdir(parents=True)
    (ckpt / "mp_rank_00_model_states.pt").unlink(missing_ok=True)
    os.mkfifo(ckpt / "mp_rank_00_model_states.pt")
    with pytest.raises(PipelineError) as e:
        within(5, lambda: read_checkpoint_file(ckpt / "mp_rank_00_model_states.pt"))
    assert str(e.value) == (
        f"checkpoint file {ckpt / 'mp_rank_00_model_states.pt'} is a FIFO, not a regular file"
    )
    pointer = tmp_path / "checkpoints" / "latest"
    os.mkfifo(pointer)
    with pytest.raises(PipelineError) as e:
        within(5, lambda: read_pointer(pointer), pointer)
    assert str(e.value) == f"checkpoint pointer {pointer} is a FIFO, not a regular file"


def test_a_fifo_as_the_config_is_one_line_not_a_hang(tmp_path):
    fifo = tmp_path / "pipe.yaml"
    os.mkfifo(fifo)
    result = within(10, lambda: CliRunner().invoke(main, ["validate", str(fifo)]), fifo)
    assert result.exit_code == 2
    assert len(result.output.splitlines()) == 1 and str(fifo) in result.output


# ---------------------------------------------------------------- modes follow the umask


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    """A tiny pipeline (a small file:// corpus, a few steps, no tracking) run end to end
    under umask 022; its config."""
    root = tmp_path_factory.mktemp("umask")
    corpus = root / "corpus.txt"
    corpus.write_bytes((ROOT / "README.md").read_bytes() * 2)
    path = root / "tiny.yaml"
    path.write_text(f"""\
extends: [{ROOT / "configs" / "quickstart.yaml"}]
name: tiny
model: {{d_model: 16, n_layers: 1, n_heads: 2, n_persistent: 4, max_span: 16}}
train: {{steps: 2, batch_size: 2, seq_len: 16, log_every: 2, eval_every: 0,
        checkpoint_every: 2, optimizer: {{lr: 0.01, warmup_steps: 1}}}}
evaluate: {{batch_size: 2, seq_len: 16, splits: [valid]}}
tracking: {{enabled: false}}
workspace: {{root: {root / "runs"}}}
stages: [download, preprocess, train, evaluate]
""")
    with umask(0o022):
        Runner(load_spec(path, world_set(path)), log=lambda m: None).run(NullTracker())
    return path


def world_set(path: Path) -> list[str]:
    """The world's override: its small corpus for the built-in one."""
    return [f"dataset.url={(path.parent / 'corpus.txt').as_uri()}"]


def test_under_umask_022_everything_published_is_0644_and_directories_0755(world):
    ws = load_spec(world, world_set(world)).workspace_dir
    published = [
        ws / "download" / "download.json",
        ws / "download" / "stage.json",
        *(ws / "download" / "files").iterdir(),
        ws / "preprocess" / "manifest.json",
        ws / "preprocess" / "stage.json",
        *(ws / "preprocess" / "shards").iterdir(),
        ws / "train" / "stage.json",
        ws / "train" / "checkpoints" / "latest",
        ws / "evaluate" / "results.json",
        ws / "evaluate" / "stage.json",
    ]
    assert {str(p): oct(mode(p)) for p in published} == {str(p): "0o644" for p in published}
    for d in (ws / "download", ws / "preprocess" / "shards", ws / "train" / "checkpoints"):
        assert mode(d) == 0o755, d


@pytest.mark.parametrize(
    "mask, file_mode, dir_mode", [(0o022, 0o644, 0o755), (0o077, 0o600, 0o700)]
)
def test_an_export_follows_the_umask(world, tmp_path, mask, file_mode, dir_mode):
    out = tmp_path / "export"
    with umask(mask):
        result = CliRunner().invoke(
            main, ["export", str(world), "--set", *world_set(world), "--out", str(out)]
        )
    assert result.exit_code == 0, result.output
    assert mode(out) == dir_mode
    files = sorted(out.iterdir())
    assert files and {p.name: oct(mode(p)) for p in files} == {
        p.name: oct(file_mode) for p in files
    }


def test_under_umask_077_published_files_stay_0600(tmp_path):
    from pipeline.fsutil import atomic_write_json

    with umask(0o077):
        atomic_write_json(tmp_path / "results.json", {"bpc": 1.0})
    assert mode(tmp_path / "results.json") == 0o600


def test_the_tracking_backlog_is_private_whatever_the_umask(tmp_path):
    from pipeline.tracking.backlog import append_records

    with umask(0o022):
        append_records(tmp_path / "tracking-backlog.jsonl", [{"op": "end", "key": "k"}])
    assert mode(tmp_path / "tracking-backlog.jsonl") == 0o600


# ---------------------------------------------------------------- names in cards and archives


@pytest.mark.parametrize("path", ["../escaped.txt", "x/..", "/tmp/abs.txt", "a/../../b.txt"])
def test_a_built_in_corpus_file_path_naming_a_parent_or_an_absolute_path_is_refused(tmp_path, path):
    spec = config(tmp_path, {"url": "builtin://python-docs", "files": {"all": {"path": path}}})
    with pytest.raises(PipelineError) as e:
        run_download(spec)
    assert str(e.value) == (
        f"dataset.url builtin://python-docs: dataset.files.all.path '{path}' names a parent "
        f"directory or an absolute path; give a file name, e.g. python-docs.txt"
    )
    out = load_spec(spec, []).workspace_dir
    assert sorted(p.name for p in out.iterdir()) == ["download.partial"]
    assert listing(out / "download.partial") == ["files"]
    assert listing(out / "download.partial" / "files") == []


@pytest.mark.parametrize("first", ["member", "temporary"])
def test_an_archive_member_named_like_the_extractors_temporary_is_extracted_intact(tmp_path, first):
    members = {"a.txt": b"the member\n" * 100, ".a.txt.part": b"named like a temporary\n" * 50}
    if first == "temporary":
        members = dict(reversed(list(members.items())))
    src = tmp_path / "data.zip"
    src.write_bytes(make_zip(members))
    out, _, _ = run_download(config(tmp_path, {"url": src.as_uri(), "archive": "zip"}))
    files = out / "files"
    assert listing(files) == [".a.txt.part", "a.txt"]  # no temporary left
    for name, data in members.items():
        assert (files / name).read_bytes() == data
    with zipfile.ZipFile(src) as z:
        assert sorted(z.namelist()) == sorted(members)


def test_a_fifo_at_the_tracking_backlog_is_named_as_unread_not_as_records(tmp_path):
    """A FIFO planted at the backlog is left unread, and the warning says so, rather than
    telling the user it holds records an earlier run could not send."""
    from types import SimpleNamespace

    from pipeline.tracking.tracker import BACKLOG, MlflowTracker

    os.mkfifo(tmp_path / BACKLOG)
    said: list[str] = []
    tracker = MlflowTracker(f"sqlite:///{tmp_path / 'mlflow.db'}", warn=said.append)
    spec = SimpleNamespace(workspace_dir=tmp_path, source="x.yaml")
    within(10, lambda: tracker._replay_backlog(spec), tmp_path / BACKLOG)
    assert len(said) == 1, said
    assert "tracking backlog was left unread" in said[0] and "FIFO" in said[0], said
    assert stat.S_ISFIFO(os.lstat(tmp_path / BACKLOG).st_mode)
