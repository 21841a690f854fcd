"""The checkpoint directory's conventions, readable without a DeepSpeed engine.

    <root>/step-N/       one complete checkpoint (DeepSpeed's files + trainer-rank<r>.pt),
                         with checksums.json (sha256 and size of every other file) written last
    <root>/tmp-step-N/   one being written; renamed to step-N when every rank is done
    <root>/latest        names the newest complete checkpoint (a hint: loading scans step-*)
    <root>/best          names the one with the best validation so far

A checkpoint is trusted only when every file matches checksums.json; loading takes the newest
intact one and says in one line which newer ones it passed over and why.
"""

from __future__ import annotations

import enum
import errno
import hashlib
import json
import pickle
import random
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from pipeline.errors import WRITE_FAILURES, PipelineError
from pipeline.fsutil import (
    atomic_write_json,
    file_checksum,
    file_mismatch,
    read_text,
    refuse_special,
)

CHECKPOINTS = "checkpoints"
"""The folder of a training stage's outputs that holds its checkpoints: `<stage>/checkpoints/`
is the <root> above (train, finetune, curriculum; what evaluate, sample and export read)."""
CHECKSUMS = "checksums.json"
WEIGHTS = "weights"
"""The key of evaluate's results.json, and the tag of its MLflow run, that holds the id of the
weights scored (`weights_id`); a training stage's run tags so the weights it ended with."""
BEST_WEIGHTS = "weights.best"
"""A training stage's MLflow tag: the id of the checkpoint its validations marked best."""
HASH_BLOCK = 4 << 20  # bytes read at a time: a 114M-parameter model's checkpoint is ~2 GB


# The types other than tensors and plain containers that the files this pipeline writes hold:
# NumPy's random state in trainer-rank<r>.pt (an array of its dtype).
CHECKPOINT_TYPES = [np.ndarray(0).__reduce__()[0], np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def enum_member(cls, name: str):
    """What a pickle's ``getattr(cls, name)`` is allowed to build: a member of an enum the
    reader allows (CPython 3.11.0-3.11.4 pickle an enum member so, by name: DeepSpeed's
    ZeroStageEnum in the optimizer files written there; other versions pickle it by value,
    which needs no getattr). Anything else, a method or an attribute, is refused."""
    if isinstance(cls, enum.EnumMeta) and isinstance(name, str) and name in cls.__members__:
        return cls[name]
    raise pickle.UnpicklingError(
        f"getattr({getattr(cls, '__name__', type(cls).__name__)}, {name!r})"
    )


def read_checkpoint_file(path: Path, **load_args):
    """A checkpoint file, unpickled by torch's weights-only reader with only CHECKPOINT_TYPES
    (and DeepSpeed's optimizer types, in its optimizer files) allowed besides, and getattr
    only as `enum_member`: a file whose pickle would build anything else (run code) is
    refused in one line naming it, before anything in it is built."""
    from pipeline.training.engine import optimizer_file_types

    allowed = CHECKPOINT_TYPES + (
        optimizer_file_types() if Path(path).name.endswith("optim_states.pt") else []
    )
    refuse_special(path, "checkpoint file")  # torch.load would block on a FIFO
    try:
        with torch.serialization.safe_globals([*allowed, (enum_member, "builtins.getattr")]):
            return torch.load(path, map_location="cpu", weights_only=True, **load_args)
    except pickle.UnpicklingError as e:
        found = re.search(r"Unsupported global: GLOBAL (\S+)|(getattr\(.*?\))", str(e))
        what = (
            f"it would build {found.group(1) or found.group(2)}"
            if found
            else "its pickle is not one"
        )
        raise PipelineError(
            f"{path}: refused, not a checkpoint this pipeline writes ({what}); "
            f"a checkpoint can run code when loaded, so only tensors and plain "
            f"values are read"
        ) from None
    except (RuntimeError, EOFError) as e:
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise PipelineError(f"{path}: not a readable checkpoint file ({why})") from None


def rng_state() -> dict:
    state = {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def read_pointer(pointer: Path) -> str | None:
    """The checkpoint tag a pointer file (`latest`, `best`) names, if that checkpoint exists."""
    if not pointer.exists():
        return None
    tag = read_text(pointer, "checkpoint pointer").strip()
    return tag if (pointer.parent / tag).is_dir() else None


def step_of(tag: str) -> int:
    """The step a checkpoint tag (`step-N`, or its directory's name) names."""
    return int(tag.removeprefix("step-"))


def not_a_trainer_checkpoint(ckpt: Path) -> str:
    """Why checkpoint directory `ckpt` cannot be resumed or read: it was not written by the
    trainer (pipeline.training.engine_checkpoints): the curriculum stage's own format from before
    it trained through the trainer, or another program's."""
    if (ckpt / "state.pt").exists():
        return (
            f"checkpoint {ckpt}: a curriculum checkpoint of the old format (state.pt), "
            f"which this version cannot read: train the curriculum again "
            f"(allattn-pipe run CONFIG --force curriculum)"
        )
    held = ", ".join(sorted(p.name for p in ckpt.iterdir())[:4]) or "nothing"
    return f"checkpoint {ckpt}: not a checkpoint of the trainer (no model states; it holds {held})"


def load_model_weights(
    model: torch.nn.Module,
    root: Path,
    log: Callable[[str], None],
    tag: str | None = None,
    model_section: dict | None = None,
) -> str:
    """Load the module weights of checkpoint `tag` under `root`, verified, or of the newest
    intact one (no engine needed); returns its tag. Weights that do not fit the model are one
    line naming the first keys or shapes that differ, and the config that wrote them (and
    where its model section differs from `model_section`, the model's config)."""
    if tag is not None:
        if (why := damage(Path(root) / tag)) is not None:
            raise PipelineError(f"checkpoint {Path(root) / tag}: {why}")
    else:
        tag = newest_intact(root, log)
    if tag is None:
        raise PipelineError(f"no checkpoint under {root}")
    ckpt = Path(root) / tag
    path = ckpt / "mp_rank_00_model_states.pt"
    if path.exists():
        weights = read_checkpoint_file(path)["module"]
    elif not list(ckpt.glob("*model_states.pt")):
        raise PipelineError(not_a_trainer_checkpoint(ckpt))
    else:  # ZeRO 3 saves each rank's shard only: assemble the fp32 weights from the shards
        from pipeline.training.engine import zero3_fp32_weights

        # DeepSpeed unpickles them without restriction: each is read safely first
        for shard in sorted(ckpt.glob("*.pt")):
            read_checkpoint_file(shard, mmap=True)
        weights = zero3_fp32_weights(root, tag)
    if misfit := _misfit(model.state_dict(), weights):
        raise PipelineError(
            f"checkpoint {ckpt} does not fit the config's model: {misfit}"
            f"{_made_by(ckpt, model_section)}"
        )
    model.load_state_dict(weights)
    return tag


def _misfit(own: dict, saved: dict) -> str:
    """The first differences between a model's state dict and a checkpoint's, or ''."""
    found = [
        f"{k} has shape {list(saved[k].shape)} there, {list(v.shape)} here"
        for k, v in own.items()
        if k in saved and saved[k].shape != v.shape
    ][:2]
    found += [f"{k} is missing there" for k in own if k not in saved][:1]
    found += [f"{k} is not in this model" for k in saved if k not in own][:1]
    return "; ".join(found)


def _made_by(ckpt: Path, model_section: dict | None) -> str:
    """Which config wrote checkpoint `ckpt` (<stage>/checkpoints/step-N): its stage's record
    of the model section, and where that differs from `model_section`."""
    record = ckpt.parent.parent / "stage.json"
    try:
        theirs = json.loads(read_text(record, "stage record"))["config"]["model"]
    except (OSError, ValueError, KeyError, TypeError, PipelineError):
        return ""
    # settings only: a stage's record leaves defaults out of nested sections
    differ = [
        f"model.{k}: {theirs[k]!r} there, {v!r} here"
        for k, v in (model_section or {}).items()
        if k in theirs and not isinstance(v, dict) and theirs[k] != v
    ]
    return f"; it was written with the model section recorded in {record}" + (
        f" ({', '.join(differ[:3])})" if differ else ""
    )


def write_checksums(path: Path) -> int:
    """Record the sha256 and size of every file of the checkpoint directory `path`; written
    last, it is what makes the checkpoint complete. Returns the checkpoint's size in bytes."""
    files = {
        f.relative_to(path).as_posix(): file_checksum(f, HASH_BLOCK)
        for f in sorted(p for p in path.rglob("*") if p.is_file())
    }
    atomic_write_json(path / CHECKSUMS, {"files": files})
    return sum(f["bytes"] for f in files.values())


def weights_id(path: Path) -> str | None:
    """The id of checkpoint directory `path` by its content, that a score names the weights it
    scored by: the sha256 (16 hex digits) of every file's sha256 by name, as its
    checksums.json lists them, so reading it costs one small file; a checkpoint written before
    checksums has its files hashed here. Any change to any file, the weights' first, changes
    it; a copy or a hard link of the checkpoint elsewhere has the same one. None when it
    cannot be read (no such checkpoint, its list unreadable): nothing is bound to it."""
    try:
        try:
            listed = json.loads(read_text(path / CHECKSUMS, "checkpoint checksums"))["files"]
            digests = {name: entry["sha256"] for name, entry in listed.items()}
        except FileNotFoundError:
            files = sorted(p for p in Path(path).rglob("*") if p.is_file())
            if not files:
                return None
            digests = {
                f.relative_to(path).as_posix(): file_checksum(f, HASH_BLOCK)["sha256"]
                for f in files
            }
    except (OSError, ValueError, KeyError, TypeError, AttributeError, PipelineError):
        return None
    blob = json.dumps(digests, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def damage(path: Path) -> str | None:
    """Why the checkpoint directory `path` cannot be trusted, or None when it can. One written
    before checksums were recorded is trusted if it holds the files of a complete one."""
    try:
        files = json.loads(read_text(path / CHECKSUMS, "checkpoint checksums"))["files"]
    except FileNotFoundError:
        present = [p for p in path.rglob("*") if p.is_file()]
        if not present:
            return "empty"
        if not (list(path.glob("*model_states.pt")) and list(path.glob("trainer-rank*.pt"))):
            return f"incomplete, no {CHECKSUMS}"
        return None
    except (OSError, ValueError, KeyError, TypeError):
        return f"{CHECKSUMS} is unreadable"
    for name, expected in files.items():
        if why := file_mismatch(path / name, name, expected, HASH_BLOCK):
            return why
    return None


def step_dirs(root: Path) -> list[Path]:
    """The `step-N` directories under `root`, newest first."""
    found = [
        p
        for p in Path(root).glob("step-*")
        if p.is_dir() and p.name.removeprefix("step-").isdigit()
    ]
    return sorted(found, key=lambda p: step_of(p.name), reverse=True)


def newest_intact(root: Path, log: Callable[[str], None]) -> str | None:
    """The tag of the newest intact checkpoint under `root`, found by verifying the `step-*`
    directories newest first (`latest` is only a hint); None when there is no checkpoint at
    all. Passing over damaged ones, or a `latest` that names a missing one, is said in one
    line; a checkpoint without checksums is used with a one-line warning. When there are
    checkpoints but none is intact: a PipelineError naming the directory."""
    root = Path(root)
    dirs = step_dirs(root)
    if not dirs:
        return None
    passed = []
    for path in dirs:
        why = damage(path)
        if why is None:
            break
        passed.append(f"damaged checkpoint {path.name} ({why})")
    else:
        raise PipelineError(
            f"no intact checkpoint under {root}: {'; '.join(passed)}; "
            f"run the stage that wrote them again with --force"
        )
    tag = path.name
    latest = root / "latest"
    hint = read_text(latest, "checkpoint pointer").strip() if latest.is_file() else None
    if hint and hint != tag and not (root / hint).is_dir():
        passed.insert(0, f"latest names {hint}, which does not exist")
    if passed:
        log(f"{root}: {'; '.join(passed)}; using {tag}, the newest intact checkpoint")
    if not (root / tag / CHECKSUMS).exists():
        log(
            f"checkpoint {root / tag} has no {CHECKSUMS} (it was written before checkpoints "
            f"carried checksums): it cannot be verified"
        )
    return tag


def checkpoint_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if n >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{n / 2**10:,.1f} KiB"


def has_room(root: Path, needed: int) -> bool:
    return shutil.disk_usage(root).free >= needed


def out_of_space(error: BaseException, root: Path, needed: int) -> bool:
    """Whether a failed checkpoint write ran out of space. An OSError says so itself; torch's
    zip writer only says its stream failed, so then the disk must be short of room too."""
    if isinstance(error, OSError):
        return error.errno in (errno.ENOSPC, errno.EDQUOT)
    return (
        isinstance(error, RuntimeError)
        and any(
            s in str(error) for s in ("iostream error", "PytorchStreamWriter", "inline_container")
        )
        and not has_room(root, needed)
    )


def too_large(error: BaseException, tmp: Path) -> bool:
    """Whether a failed checkpoint write made a file larger than the filesystem or `ulimit -f`
    allows (EFBIG). An OSError says so itself; torch's zip writer only says its stream
    failed, so then a file in `tmp` must have reached the limit: RLIMIT_FSIZE's (a write
    past it stops there) or FAT32's 4 GiB - 1."""
    if isinstance(error, OSError):
        return error.errno == errno.EFBIG
    if not isinstance(error, RuntimeError) or not any(
        s in str(error) for s in ("iostream error", "PytorchStreamWriter", "inline_container")
    ):
        return False
    import resource

    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    ceiling = min(2**32 - 1, limit) if limit != resource.RLIM_INFINITY else 2**32 - 1
    return any(f.is_file() and f.stat().st_size >= ceiling for f in Path(tmp).rglob("*"))


def file_too_large(path: Path) -> PipelineError:
    """The one-line error for a checkpoint `path` with a file past the filesystem's or
    `ulimit -f`'s largest file."""
    return PipelineError(
        f"checkpoint {path}: {WRITE_FAILURES[errno.EFBIG][0]} (File too large); the "
        f"checkpoints already there are as they were: {WRITE_FAILURES[errno.EFBIG][1]}, "
        f"and run again to resume from the newest one"
    )


def disk_full(path: Path, needed: int) -> PipelineError:
    """The one-line error for a checkpoint `path` of about `needed` bytes that does not fit."""
    free = shutil.disk_usage(path.parent).free
    return PipelineError(
        f"disk full: checkpoint {path} needs about {_size(needed)} but "
        f"{path.parent} has {_size(free)} free; free "
        f"{_size(max(needed - free, 1))} or more and run again to resume"
    )
