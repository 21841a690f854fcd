"""`export` and `sample` on a model the test trains (a tiny all-attention network, a few
steps on the built-in corpus, in process)."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest
import torch
from click.testing import CliRunner

from pipeline.commands.cli import main
from pipeline.spec import load_spec


def cli(*args) -> str:
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    return result.stdout


def test_an_export_loads_with_one_call_and_gives_the_checkpoints_logits(trained, tmp_path):
    from pipeline.commands.export import load_exported
    from pipeline.data.manifest import load_manifest, load_split
    from pipeline.training.checkpoint_dirs import load_model_weights

    out = tmp_path / "export"
    cli("export", trained, "--out", out)
    assert sorted(p.name for p in out.iterdir()) == [
        ".allattn-export",
        "config.json",
        "model.safetensors",
        "vocab.json",
    ]
    spec = load_spec(trained, [])
    preprocess = spec.workspace_dir / "preprocess"
    manifest = load_manifest(preprocess)
    assert json.loads((out / "vocab.json").read_text()) == manifest["vocab"]
    reference = spec.build_model(manifest["vocab_size"], "test")
    load_model_weights(reference, spec.workspace_dir / "train" / "checkpoints", print)
    reference.eval()

    model, tokenizer = load_exported(out)
    tokens = torch.as_tensor(load_split(preprocess, "valid")[:64].astype("int64")).view(2, 32)
    with torch.no_grad():
        first, again = reference(tokens), model(tokens)
        # and the next block through the state (the cache) each carried
        first_next = reference(tokens, None, first.state)
        again_next = model(tokens, None, again.state)
    assert torch.equal(first.logits, again.logits)
    assert torch.equal(first_next.logits, again_next.logits)
    assert tokenizer.to_json() == manifest["vocab"]


def test_export_refuses_a_directory_holding_other_files(trained, tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    result = CliRunner().invoke(main, ["export", str(trained), "--out", str(tmp_path)])
    assert result.exit_code == 2
    assert result.output == (
        f"error: --out {tmp_path}: exists and holds other files, and is "
        f"not an earlier export (no .allattn-export file in it); name a "
        f"new directory or an earlier export's\n"
    )
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_sample_continues_the_prompt_the_same_for_the_same_seed(trained):
    from pipeline.data.manifest import load_tokenizer

    args = ["sample", trained, "--prompt", "def ", "--tokens", 40, "--top-k", 10]
    first = cli(*args, "--seed", 3)
    again = cli(*args, "--seed", 3)
    other = cli(*args, "--seed", 4)
    assert first == again and first != other
    text = first.removesuffix("\n")
    assert text.startswith("def ") and len(text) == 4 + 40
    symbols = load_tokenizer(load_spec(trained, []).workspace_dir / "preprocess").symbols
    assert set(text.encode()) <= set(symbols)  # a byte vocabulary: its bytes


def test_sample_without_a_trained_model_is_one_line(tmp_path):
    cfg = tmp_path / "untrained.yaml"
    cfg.write_text(f"""\
name: untrained
dataset: python_docs
model: {{kind: allattn, d_model: 32, n_layers: 1, n_heads: 2, n_persistent: 4, max_span: 32}}
train: {{steps: 2, batch_size: 2, seq_len: 8}}
workspace: {{root: {tmp_path / "runs"}}}
stages: [download, preprocess, train]
""")
    result = CliRunner().invoke(main, ["sample", str(cfg), "--prompt", "x"])
    assert result.exit_code == 2
    assert result.output.startswith(
        f"error: {tmp_path / 'runs' / 'untrained' / 'preprocess'}/manifest.json: missing"
    )


class Planted:
    """Unpickled, it creates the file `path`: what a checkpoint from elsewhere could do."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


@pytest.mark.parametrize("command", ["sample", "export"])
def test_a_checkpoint_whose_pickle_would_run_code_is_refused(trained, tmp_path, command):
    from pipeline.training.checkpoint_dirs import write_checksums

    planted = tmp_path / "planted"
    ckpt = tmp_path / "shared" / "step-00000030"
    ckpt.mkdir(parents=True)
    torch.save({"module": Planted(planted)}, ckpt / "mp_rank_00_model_states.pt")
    torch.save({"step": 30}, ckpt / "trainer-rank0.pt")
    write_checksums(ckpt)  # intact as far as its checksums can tell
    args = {"sample": ["--prompt", "def "], "export": ["--out", tmp_path / "out"]}[command]
    result = CliRunner().invoke(
        main, [command, str(trained), "--checkpoint", str(ckpt), *map(str, args)]
    )
    assert result.exit_code == 2, result.output
    assert re.fullmatch(
        rf"error: {re.escape(str(ckpt / 'mp_rank_00_model_states.pt'))}: "
        rf"refused, not a checkpoint this pipeline writes \(it would build "
        rf"\S*open\); .*\n",
        result.output,
    ), result.output
    assert not planted.exists()
    assert not (tmp_path / "out").exists()


class BlockRecorder:
    """A stand-in model that records the length of every block it reads; its next token is
    always 0. It refuses to read more than `reads` blocks (a generator that ran on)."""

    def __init__(self, reads=10):
        self.blocks, self.reads = [], reads

    def init_state(self, batch, device=None):
        return []

    def __call__(self, x, y, state):
        self.blocks.append(x.shape[1])
        assert len(self.blocks) <= self.reads, "read on past the tokens taken"
        return SimpleNamespace(logits=torch.zeros(1, x.shape[1], 5), state=state)


def test_a_long_prompt_is_read_in_blocks_through_the_state():
    from pipeline.commands.sample import generate

    model = BlockRecorder()
    assert list(generate(model, list(range(100)), 3, temperature=0, block_len=32)) == [0] * 3
    assert model.blocks == [32, 32, 32, 4, 1, 1]


def test_tokens_come_out_as_they_are_generated():
    from pipeline.commands.sample import generate

    model = BlockRecorder()
    tokens = generate(model, [1], 10**9, temperature=0)
    assert [next(tokens) for _ in range(3)] == [0, 0, 0]
    assert model.blocks == [1, 1, 1]


@pytest.mark.parametrize(
    "option, value, error",
    [
        ("--temperature", "nan", "--temperature nan: expected a finite number >= 0"),
        ("--temperature", "inf", "--temperature inf: expected a finite number >= 0"),
        (
            "--tokens",
            "1000000000",
            "--tokens 1,000,000,000: at most 100,000, each a forward pass of the model",
        ),
    ],
)
def test_sample_refuses_what_it_cannot_do_in_one_line(trained, option, value, error, monkeypatch):
    import pipeline.commands.trained_weights

    def loaded_too_soon(*args):
        raise AssertionError("the model was loaded for a sample that cannot be made")

    if option == "--tokens":
        monkeypatch.setattr(pipeline.commands.trained_weights, "trained_model", loaded_too_soon)
    result = CliRunner().invoke(main, ["sample", str(trained), "--prompt", "def ", option, value])
    assert result.exit_code == 2, result.output
    assert result.output == f"error: {error}\n"


def test_export_to_a_place_it_cannot_write_is_one_line(trained, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("mine")
    result = CliRunner().invoke(main, ["export", str(trained), "--out", str(blocker / "export")])
    assert result.exit_code == 2, result.output
    assert result.output == f"error: --out {blocker}: cannot write there: Not a directory\n"
    assert blocker.read_text() == "mine"


def test_a_checkpoint_that_does_not_fit_the_config_names_the_difference(trained):
    ws = load_spec(trained, []).workspace_dir
    result = CliRunner().invoke(
        main,
        [
            "export",
            str(trained),
            "--set",
            "model.d_model=48",
            "--out",
            str(trained.parent / "never"),
        ],
    )
    assert result.exit_code == 2, result.output
    assert len(result.output.splitlines()) == 1
    assert result.output.startswith(f"error: checkpoint {ws / 'train' / 'checkpoints'}/step-")
    assert " does not fit the config's model: " in result.output
    assert "has shape [" in result.output and "32] there, [" in result.output
    assert result.output.endswith(
        f"; it was written with the model section recorded in "
        f"{ws / 'train' / 'stage.json'} (model.d_model: 32 there, "
        f"48 here)\n"
    )
    assert not (trained.parent / "never").exists()


def test_another_stage_kinds_checkpoint_is_one_line(trained, tmp_path):
    from pipeline.training.checkpoint_dirs import write_checksums

    def sample_from(ckpt) -> str:
        write_checksums(ckpt)
        result = CliRunner().invoke(
            main, ["sample", str(trained), "--prompt", "x", "--checkpoint", str(ckpt)]
        )
        assert result.exit_code == 2, result.output
        return result.output

    ckpt = tmp_path / "checkpoints" / "step-00000001"
    ckpt.mkdir(parents=True)
    (ckpt / "notes.txt").write_text("not weights\n")  # another program's directory
    assert sample_from(ckpt) == (
        f"error: checkpoint {ckpt}: not a checkpoint of the trainer "
        f"(no model states; it holds checksums.json, notes.txt)\n"
    )
    # the curriculum's own format from before it trained through the trainer
    ckpt = tmp_path / "curriculum" / "checkpoints" / "step-00000001"
    ckpt.mkdir(parents=True)
    torch.save({"model": {}, "epoch": 1}, ckpt / "state.pt")
    assert sample_from(ckpt) == (
        f"error: checkpoint {ckpt}: a curriculum checkpoint of the old format (state.pt), "
        f"which this version cannot read: train the curriculum again (allattn-pipe run "
        f"CONFIG --force curriculum)\n"
    )


def test_sample_on_a_task_config_says_what_it_needs():
    from pipeline.spec import PROJECT_ROOT

    cfg = PROJECT_ROOT / "configs" / "active_memory" / "sort.yaml"
    result = CliRunner().invoke(main, ["sample", str(cfg), "--prompt", "x"])
    assert result.exit_code == 2, result.output
    assert result.output == (
        f"error: {cfg}: sample and export need a language model that "
        f"preprocess and train made; this config's stages are "
        f"curriculum, evaluate\n"
    )


@pytest.mark.parametrize("command", ["export", "sample"])
def test_an_empty_checkpoint_is_one_line_not_the_current_directory(trained, tmp_path, command):
    """Found by the CLI fuzzer: `--checkpoint ''` was read as the current directory."""
    extra = ["--out", str(tmp_path / "out")] if command == "export" else ["--prompt", "x"]
    result = CliRunner().invoke(main, [command, str(trained), "--checkpoint", "", *extra])
    assert result.exit_code == 2, result.output
    assert result.output == (
        "error: --checkpoint is empty: give latest, best, or a checkpoint directory\n"
    )
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", ["export", "sample"])
def test_a_checkpoint_name_too_long_for_the_filesystem_is_one_line(trained, tmp_path, command):
    """Found by the CLI fuzzer: a 300-character --checkpoint raised OSError (File name too
    long) from the path checks, a traceback."""
    extra = ["--out", str(tmp_path / "out")] if command == "export" else ["--prompt", "x"]
    name = "x" * 300
    result = CliRunner().invoke(main, [command, str(trained), "--checkpoint", name, *extra])
    assert result.exit_code == 2, result.output
    assert result.output.startswith("error: --checkpoint xxxx")
    assert result.output.endswith(": File name too long\n")
    assert len(result.output.splitlines()) == 1
    assert not (tmp_path / "out").exists()


def _tree(root) -> dict:
    """Every path under `root` with its bytes (None for a directory)."""
    from pathlib import Path

    root = Path(root)
    return {
        str(p.relative_to(root)): None if p.is_dir() else p.read_bytes()
        for p in sorted(root.rglob("*"))
    }


def _refused(args, *names) -> str:
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    line = result.output.strip()
    assert line.startswith("error: ") and "\n" not in line, line
    for name in names:
        assert name in line, line
    return line


def test_export_through_a_missing_directory_and_dotdot_never_replaces_the_target(
    trained, tmp_path, monkeypatch
):
    # `typo` does not exist: before, the check looked at `typo/../victim` (absent), then
    # export made `typo` and replaced victim's files, exit 0
    monkeypatch.chdir(tmp_path)
    (tmp_path / "victim").mkdir()
    (tmp_path / "victim" / "thesis.tex").write_text("years of work")
    before = _tree(tmp_path)
    _refused(["export", trained, "--out", "typo/../victim"], "victim", "not an earlier export")
    assert _tree(tmp_path) == before


def test_export_to_the_parent_of_a_missing_directory_deletes_nothing(
    trained, tmp_path, monkeypatch
):
    # `g/..` is the current directory: before, every entry of it was deleted, then a traceback
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.bin").write_bytes(b"\0\1")
    before = _tree(tmp_path)
    _refused(["export", trained, "--out", "g/.."], "g/..")
    _refused(["export", trained, "--out", "./."])
    assert _tree(tmp_path) == before


def test_export_leaves_a_sibling_named_like_its_old_temporary_alone(trained, tmp_path):
    # before, `--out out` removed `.out.tmp/` whoever owned it
    (tmp_path / ".out.tmp").mkdir()
    (tmp_path / ".out.tmp" / "theirs.txt").write_text("someone else's")
    cli("export", trained, "--out", tmp_path / "out")
    assert (tmp_path / ".out.tmp" / "theirs.txt").read_text() == "someone else's"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".out.tmp", "out"]


@pytest.mark.parametrize("shape", ["names-only", "config-dir", "no-marker-export", "extra"])
def test_export_replaces_only_an_earlier_export_its_marker_proves(trained, tmp_path, shape):
    out = tmp_path / "out"
    if shape == "names-only":  # files merely named as an export's
        out.mkdir()
        for name in ("model.safetensors", "config.json", "vocab.json"):
            (out / name).write_text("not an export")
    elif shape == "config-dir":  # before: deleted recursively, files and all
        (out / "config.json").mkdir(parents=True)
        (out / "config.json" / "precious.txt").write_text("mine")
    else:
        cli("export", trained, "--out", out)
        if shape == "no-marker-export":
            (out / ".allattn-export").unlink()
        else:
            (out / "config.json").unlink()
            (out / "config.json").mkdir()
            (out / "config.json" / "precious.txt").write_text("mine")
    before = _tree(tmp_path)
    _refused(["export", trained, "--out", out], str(out))
    assert _tree(tmp_path) == before


def test_export_replaces_an_earlier_export_also_through_a_symlink(trained, tmp_path):
    out = tmp_path / "out"
    cli("export", trained, "--out", out)
    first = _tree(out)
    (tmp_path / "link").symlink_to(out)
    cli("export", trained, "--out", f"{tmp_path / 'link'}/.")
    assert _tree(out) == first  # the same checkpoint: the same files, marker included
    assert (tmp_path / "link").is_symlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "out"]


def _edited_vocabulary(trained, tmp_path):
    """A copy of the trained workspace whose preprocess vocabulary was edited after it was
    published (the manifest's own checksum rewritten to match, as the project's writer
    would): five bytes added to the byte vocabulary. Returns the copy's config."""
    import shutil

    from pipeline.data.manifest import write_manifest

    root = load_spec(trained, []).workspace.root
    shutil.copytree(root, tmp_path / "runs", symlinks=True)
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(trained.read_text().replace(str(root), str(tmp_path / "runs")))
    preprocess = load_spec(cfg, []).workspace_dir / "preprocess"
    manifest = json.loads((preprocess / "manifest.json").read_text())
    symbols = manifest["vocab"]["symbols"]
    symbols += [b for b in range(192, 256) if b not in symbols][:5]
    manifest["vocab"]["size"] = len(symbols)
    write_manifest(preprocess, manifest)
    return cfg


def test_sample_refuses_an_edited_vocabulary_in_one_line(trained, tmp_path):
    """Was a traceback (the vocabulary's own check, deep in loading the tokenizer)."""
    cfg = _edited_vocabulary(trained, tmp_path)
    _refused(["sample", cfg, "--prompt", "d\u00ff", "--tokens", "3"], "manifest.json", "run")


def test_export_refuses_an_edited_vocabulary_in_one_line_and_writes_nothing(trained, tmp_path):
    """Was an export (exit 0) of a vocabulary the model was not trained on."""
    cfg = _edited_vocabulary(trained, tmp_path)
    (tmp_path / "out").mkdir()
    _refused(["export", cfg, "--out", tmp_path / "out" / "model"], "manifest.json")
    assert list((tmp_path / "out").iterdir()) == []
