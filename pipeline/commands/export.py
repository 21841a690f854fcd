"""`allattn-pipe export`: a trained model as plain files, and the one call that loads them.

    <DIR>/model.safetensors   the weights (tied tensors stored once)
    <DIR>/config.json         {"kind", "model": the model section, "vocab_size", "source"}
    <DIR>/vocab.json          the preprocess stage's vocabulary (its manifest's "vocab")
    <DIR>/tokenizer.model     the sentencepiece model, for a sentencepiece vocabulary

`--format hf` writes a folder transformers loads without this package instead
(pipeline.commands.hf_export). The native format's loading needs torch, safetensors and this
package's models, not DeepSpeed, MLflow or YAML:

    from pipeline.commands.export import load_exported
    model, tokenizer = load_exported("DIR")     # an eval-mode SequenceModel, on the CPU
    out = model(tokens, None, model.init_state(tokens.shape[0]))   # ModelOutput
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
from dataclasses import asdict
from pathlib import Path

from pipeline.cluster.signals import HoldSignals
from pipeline.commands.export_dirs import (
    LOCK,
    make_claimed,
    partial_name,
    release,
    remove_abandoned,
    take_abandoned,
)
from pipeline.commands.trained_weights import trained_model
from pipeline.errors import PipelineError, shown, write_cause, write_hint

WEIGHTS, CONFIG, VOCAB, SP_MODEL = (
    "model.safetensors",
    "config.json",
    "vocab.json",
    "tokenizer.model",
)
# The ownership marker: written into every export directory, it proves that the directory is
# an earlier export, the only kind of directory `export --out` replaces.
MARKER = ".allattn-export"
MARKER_TEXT = '{"kind": "export", "format": 1}\n'
FILES = (WEIGHTS, CONFIG, VOCAB, SP_MODEL, MARKER)
# An export into an existing directory is written inside it: into a private directory of
# this name (and mkdtemp's suffix) first, its files then renamed into place.
STAGING = ".allattn-export-staging"
_STAGING_NAME = re.compile(re.escape(STAGING) + r"\.[A-Za-z0-9_]+\.tmp")


def marker_text(more_files, complete: bool = True) -> str:
    """The marker; one that lists `more_files` (a Hugging Face folder's code and README) lets
    a later export replace those too. `complete=False`: the marker of an export whose files
    are being renamed into an existing directory (`load_exported` refuses it), listing every
    file the directory may hold meanwhile, so that exporting again replaces them."""
    if not more_files and complete:
        return MARKER_TEXT
    fields: dict = {"kind": "export", "format": 1}
    if more_files:
        fields["files"] = sorted(more_files)
    if not complete:
        fields["complete"] = False
    return json.dumps(fields) + "\n"


def export_files(directory: Path) -> set[str]:
    """The names an export directory may hold: FILES and the plain file names its marker
    lists (a name with a path in it is never one)."""
    names = set(FILES)
    try:
        listed = json.loads((directory / MARKER).read_text()).get("files", [])
    except (OSError, ValueError, AttributeError):
        return names
    if isinstance(listed, list):
        names.update(
            n for n in listed if isinstance(n, str) and n not in ("", ".", "..") and "/" not in n
        )
    return names


FORMATS = ("native", "hf")


def export(spec, out: Path, which: str = "latest", log=print, fmt: str = "native") -> str:
    """Write the export files into `out`. `out` is resolved first (`~`, `..`, symlinks, a
    trailing `/.`); it may be new, an empty directory, or an earlier export (its marker file
    says so, and it holds nothing but export files); anything else is refused, naming the
    path. A new `out` is built in a private temporary directory beside it and renamed into
    place. An existing one is written inside (`_publish_inside`): it keeps its inode, mode,
    owner and group (a team's setgid directory stays the team's), and a half-written export
    in it never looks complete. Returns the checkpoint exported (as config.json records it).
    `fmt`: native (the files above) or hf (a Hugging Face folder, pipeline.commands.hf_export)."""
    from safetensors import SafetensorError
    from safetensors.torch import save_model

    from pipeline.data.manifest import load_manifest
    from pipeline.fsutil import public_mode, real_destination, writable_dir

    given = out
    out = real_destination(out)
    if any(len(os.fsencode(part)) > 255 for part in out.parts):
        raise PipelineError(
            f"--out {shown(given)}: a name in it is longer than a file name can be (255 bytes)"
        )
    check_replaceable(out, given)
    hf_names: list[str] = []
    if fmt == "hf":
        from pipeline.commands.hf_export import hf_file_names, hf_refusal

        if why := hf_refusal(spec):
            raise PipelineError(why)
        hf_names = hf_file_names(spec)
    elif fmt != "native":
        raise PipelineError(f"--format {fmt}: expected one of {', '.join(FORMATS)}")
    model, preprocess, checkpoint = trained_model(spec, which, log)
    manifest = load_manifest(preprocess)
    vocab = manifest["vocab"]
    in_place = out.is_dir()  # an empty directory or an earlier export: kept, written inside
    if in_place:
        _remove_staging(out)  # what an export killed while writing here left
    remove_abandoned(out.parent, lambda d: _remove_export(d, _listed(d)))  # and beside it
    writable_dir(out if in_place else out.parent, "--out")
    try:
        tmp, lock = (
            make_claimed(out, STAGING.removeprefix("."))
            if in_place
            else make_claimed(out.parent, partial_name(out.name))
        )
    except OSError as e:
        raise PipelineError(
            f"--out {shown(given)}: cannot write there: {e.strerror or e}"
        ) from None
    try:
        if fmt == "hf":
            from pipeline.commands.hf_export import write_hf_files

            write_hf_files(tmp, spec, model, vocab, manifest["vocab_size"], checkpoint)
        else:  # the weights, and this package's own config (load_exported reads it)
            try:
                save_model(model, str(tmp / WEIGHTS))
            except SafetensorError as e:
                raise _os_error(e, tmp / WEIGHTS) from None
            (tmp / CONFIG).write_text(
                json.dumps(
                    {
                        "kind": spec.model_kind,
                        "model": asdict(spec.model_params),
                        "vocab_size": manifest["vocab_size"],
                        "source": {"spec": spec.source, "checkpoint": checkpoint},
                    },
                    indent=2,
                )
                + "\n"
            )
            (tmp / VOCAB).write_text(json.dumps(vocab, indent=1) + "\n")
        if vocab["kind"] == "sentencepiece":
            shutil.copy2(preprocess / "shards" / vocab["model"], tmp / SP_MODEL)
        (tmp / MARKER).write_text(marker_text(hf_names))
        # built private (mkdtemp's 0700; safetensors writes 0600), published with the modes
        # the umask asks for: the directory is there to be shared
        for path in tmp.iterdir():
            os.chmod(path, public_mode(), follow_symlinks=False)
        if in_place:
            with HoldSignals():  # a signal waits for the renames: never half an export
                _publish_inside(tmp, out, given, hf_names)
        else:
            # a setgid parent's bit, which new directories inherit, is kept
            setgid = tmp.stat().st_mode & stat.S_ISGID
            os.chmod(tmp, public_mode(directory=True) | setgid)
            (tmp / LOCK).unlink()  # not published; the descriptor keeps the lock meanwhile
            _replace(tmp, out, given)
    except OSError as e:
        cause = write_cause(e)
        if cause:  # the export is published whole or not at all: an earlier one stays
            raise PipelineError(
                f"--out {shown(given)}: cannot write the export: {cause} ({e.strerror}); "
                f"what was there before is as it was: {write_hint(e)} and run again"
            ) from None
        raise PipelineError(
            f"--out {shown(given)}: cannot write the export: {e.strerror or e}"
        ) from None
    finally:
        # ours (mkdtemp): gone once renamed, else half-written (a signal's Interrupted too)
        _remove_export(tmp, [*hf_names, LOCK])
        release(lock)
    if fmt == "hf":
        log(
            f"{out}: {checkpoint} exported in Hugging Face format ({len(hf_names)} files; "
            f"AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True) loads it)"
        )
    else:
        log(f"{out}: {checkpoint} exported ({WEIGHTS}, {CONFIG}, {VOCAB})")
    return checkpoint


def check_replaceable(out: Path, given) -> None:
    """Refuse (one line naming the path) a destination that is not new, not an empty
    directory and not an earlier export: `export` never replaces what it did not write."""
    where = shown(given) if str(given) == str(out) else f"{shown(given)} ({shown(out)})"
    if not os.path.lexists(out):
        return
    if not out.is_dir():
        raise PipelineError(
            f"--out {where}: exists and is not a directory; name a new "
            f"directory or an earlier export's"
        )
    try:
        # an export's staging directory (one writing here now, or killed while it did)
        entries = sorted(p.name for p in out.iterdir() if not _is_staging(p))
    except OSError as e:
        raise PipelineError(f"--out {where}: cannot read it: {e.strerror or e}") from None
    if not entries:
        return
    if MARKER not in entries or not _is_marker(out / MARKER):
        raise PipelineError(
            f"--out {where}: exists and holds other files, and is not an "
            f"earlier export (no {MARKER} file in it); name a new directory "
            f"or an earlier export's"
        )
    allowed = export_files(out)
    for name in entries:
        path = out / name
        if name not in allowed or path.is_symlink() or not path.is_file():
            raise PipelineError(
                f"--out {where}: an earlier export, but {shown(path)} is not "
                f"one of its files; move it away or name another directory"
            )


def _is_marker(path: Path) -> bool:
    try:
        return (
            not path.is_symlink()
            and path.is_file()
            and path.stat().st_size < 1024
            and json.loads(path.read_text()).get("kind") == "export"
        )
    except (OSError, ValueError, AttributeError):
        return False


def _is_staging(path: Path) -> bool:
    return bool(_STAGING_NAME.fullmatch(path.name)) and path.is_dir() and not path.is_symlink()


def _remove_staging(out: Path) -> None:
    """Remove the staging directories an export killed while writing into `out` left (those
    no live export holds, pipeline.commands.export_dirs): only their export files, then each
    directory if that emptied it."""
    try:
        entries = list(out.iterdir())
    except OSError:
        return  # refused in one line by the writes that follow
    for path in entries:
        if _is_staging(path) and (lock := take_abandoned(path)) is not None:
            try:
                _remove_export(path, _listed(path))
            finally:
                release(lock)


def _listed(directory: Path) -> set[str]:
    """Every plain file name in `directory` (a staging directory of ours: all of them are
    export files, the Hugging Face folder's code among them)."""
    try:
        return {p.name for p in directory.iterdir() if p.is_file() and not p.is_symlink()}
    except OSError:
        return set()


def _replace(tmp: Path, out: Path, given) -> None:
    """Rename `tmp` to a new `out` (checked again now: still nothing there)."""
    check_replaceable(out, given)
    if os.path.lexists(out):
        raise PipelineError(
            f"--out {shown(given)}: appeared while the export was being written (another "
            f"export to it at once?); nothing was replaced: export again"
        )
    tmp.rename(out)


def _publish_inside(tmp: Path, out: Path, given, more_files: list[str]) -> None:
    """Move the files built in `tmp` (a staging directory inside `out`) into the existing
    directory `out`, which keeps its inode and attributes; the files' group is `out`'s where
    it is a setgid directory, as they were made inside it. Each file is renamed into place,
    so a reader never sees one half-written; the export as a whole: first the marker says
    the export is incomplete (`load_exported` refuses it) and the earlier config.json is
    removed (no loader takes a folder without one), then the other files, then config.json,
    then the complete marker. An export killed on the way leaves a directory that loads
    nowhere and that exporting again replaces."""
    check_replaceable(out, given)  # again: nothing else moved in meanwhile
    new = sorted(p.name for p in tmp.iterdir() if p.name not in (MARKER, LOCK))
    earlier = [n for n in export_files(out) if n != MARKER and os.path.lexists(out / n)]
    listed = (set(earlier) | set(new)) - set(FILES)
    _write_marker(tmp / MARKER, marker_text(listed, complete=False))
    os.replace(tmp / MARKER, out / MARKER)
    try:
        (out / CONFIG).unlink()
    except FileNotFoundError:
        pass
    for name in new:
        if name != CONFIG:
            os.replace(tmp / name, out / name)
    for name in earlier:
        if name not in new:  # an earlier export's file this one has not (an HF folder's code)
            (out / name).unlink(missing_ok=True)
    os.replace(tmp / CONFIG, out / CONFIG)
    _write_marker(tmp / MARKER, marker_text(more_files))
    os.replace(tmp / MARKER, out / MARKER)


def _os_error(error: Exception, path: Path) -> Exception:
    """safetensors' writer reports a failed write (a full disk, a file past `ulimit -f`) only
    in its text, "I/O error: File too large (os error 27)": the OSError it stands for, so that
    it is worded as every other failed write; any other error as it is."""
    found = re.search(r"\(os error (\d+)\)", str(error))
    if not found:
        return error
    number = int(found.group(1))
    return OSError(number, os.strerror(number), str(path))


def _write_marker(path: Path, text: str) -> None:
    from pipeline.fsutil import public_mode

    path.write_text(text)
    os.chmod(path, public_mode())


def _remove_export(directory: Path, more_files=()) -> None:
    """Remove a directory of export files this process made or checked: only the files it
    can hold, then the directory itself, which fails (and is left) if anything else is in it."""
    if not directory.is_dir() or directory.is_symlink():
        return
    for name in sorted(export_files(directory).union(more_files)):
        try:
            (directory / name).unlink()
        except (FileNotFoundError, IsADirectoryError):
            pass
    try:
        directory.rmdir()
    except OSError:
        pass


def load_exported(directory, device="cpu"):
    """(model, tokenizer) from an export directory: the plain torch model in eval mode with
    the exported weights, and the vocabulary (a Vocab, WordVocab or SentencePieceTokenizer)."""
    from safetensors.torch import load_model

    from pipeline.data.sentencepiece_tokenizer import SentencePieceTokenizer
    from pipeline.data.vocab import vocab_from_json
    from pipeline.fsutil import read_text, refuse_special
    from pipeline.models import build_model

    directory = Path(directory)
    try:
        marker = json.loads(read_text(directory / MARKER, "export file"))
    except (FileNotFoundError, ValueError):
        marker = {}
    if isinstance(marker, dict) and marker.get("complete") is False:
        raise PipelineError(
            f"{directory}: an export still being written, or killed while it was (its "
            f"{MARKER} says so); export it again"
        )
    config = json.loads(read_text(directory / CONFIG, "export file"))
    model = build_model(config["kind"], config["model"], config["vocab_size"])
    refuse_special(directory / WEIGHTS, "export file")  # a FIFO would block safetensors
    load_model(model, str(directory / WEIGHTS), strict=True, device=str(device))
    vocab = json.loads(read_text(directory / VOCAB, "export file"))
    tokenizer = (
        SentencePieceTokenizer.load(directory / SP_MODEL)
        if vocab["kind"] == "sentencepiece"
        else vocab_from_json(vocab)
    )
    return model.to(device).eval(), tokenizer
