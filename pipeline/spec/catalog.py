"""The configs and dataset cards that ship with the package, by name, from any directory:
`allattn-pipe run enwik8_large` finds configs/enwik8_large.yaml (`find_config`), what
`allattn-pipe list` prints (`listing`), and the file `allattn-pipe copy` writes
(`resolved_copy`). A config's name is its path under configs/ without `.yaml`
(`enwik8_large`, `ablations/text8_n0`); a card's is its file's stem. Where the folders are
(the wheel's copy or the checkout's): `pipeline.resources`.

Nothing here imports torch: every command resolves its CONFIG argument first.
"""

from __future__ import annotations

import difflib
import os
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

import yaml

from pipeline.errors import shown
from pipeline.resources import project_dir
from pipeline.spec.yaml_reading import SpecError, load_with_extends

SUFFIXES = (".yaml", ".yml")
NEAR = 3  # near names an unknown one is told
DESCRIPTION_WIDTH = 90
HEADER_WIDTH = 95


def configs() -> dict[str, Path]:
    """Every config of the package by name, bases included."""
    root = project_dir("configs")
    return {p.relative_to(root).with_suffix("").as_posix(): p for p in sorted(root.rglob("*.yaml"))}


def cards() -> dict[str, Path]:
    """Every dataset card of the package by name."""
    return {p.stem: p for p in sorted(project_dir("datasets").glob("*.yaml"))}


# ---------------------------------------------------------------- CONFIG: a path or a name


def _is_file(path: str) -> bool:
    try:
        return os.path.isfile(path)
    except (OSError, ValueError):  # a NUL byte: FilePath refuses it in its own words
        return False


def _exists(path: str) -> bool:
    try:
        return os.path.lexists(path)
    except (OSError, ValueError):
        return False


@dataclass(frozen=True)
class Found:
    """What a CONFIG argument names: `path` to load, and `note`, the one line that says which
    was taken where the argument could mean a file here or a config of the package."""

    path: str
    note: str | None = None


def find_config(given: str) -> Found:
    """The config file `given` names: a file at that path wins; else the package's config of
    that name; else a one-line SpecError with the near names. A path that exists but is no
    file (a directory) is left to the caller to refuse, unless it is also a config's name."""
    known = configs()
    packaged = known.get(given)
    if _is_file(given):
        if packaged is None:
            return Found(given)
        return Found(
            given,
            f"{shown(given)}: the file here, not the package's config of that name ({packaged})",
        )
    if packaged is not None:
        here = [h for h in (given + s for s in SUFFIXES) if _is_file(h)]
        note = None
        if here:
            note = (
                f"{given}: the package's config ({packaged}), not {shown(here[0])} here "
                f"(give ./{shown(here[0])} to use that one)"
            )
        return Found(str(packaged), note)
    if _exists(given):
        return Found(given)  # a directory, a FIFO: the caller says what is wrong with it
    near = near_names(given, known)
    hint = f"; near it: {', '.join(near)}" if near else ""
    raise SpecError(
        f"{shown(given)}: no such file, nor a config of the package by that name{hint} "
        f"(`allattn-pipe list` names them all)"
    )


def config_file(given: str) -> str:
    """The file to load for `given` without a word to say: the package's config where `given`
    is its name and no file (a launched rank: the run that started it has said which), else
    `given` itself, whose loading says what is wrong with it."""
    packaged = configs().get(given)
    return str(packaged) if packaged is not None and not _is_file(given) else given


def near_names(given: str, known: dict[str, Path]) -> list[str]:
    """The names of `known` closest to `given`, read as a name: without a leading `configs/`
    or `./` and a `.yaml` ending, and by its last part too (`text8_n0` for ablations/)."""
    text = given.strip().removeprefix("./").removeprefix("configs/")
    for suffix in SUFFIXES:
        text = text.removesuffix(suffix)
    by_last = {name.rpartition("/")[2]: name for name in known}
    found = [by_last[text]] if text in by_last else []  # `text8_n0` for ablations/text8_n0
    found += difflib.get_close_matches(text, list(known), n=NEAR, cutoff=0.6)
    found += [by_last[n] for n in difflib.get_close_matches(text, list(by_last), n=NEAR)]
    return list(dict.fromkeys(found))[:NEAR]


# ---------------------------------------------------------------- list


@dataclass(frozen=True)
class Entry:
    name: str
    description: str


def _own_keys(path: Path) -> dict:
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return {}
    return data if isinstance(data, dict) else {}


def config_description(path: Path) -> str:
    """A config's first sentence, from the first paragraph of the comment above its first key,
    in one short line: where it is too long, up to its first clause (`...table 1):`)."""
    lines = []
    for line in path.read_text(encoding="utf-8").splitlines():
        text = line.lstrip("#")
        if not line.startswith("#") or not text.strip() or text.startswith("   "):
            break  # the first key, a blank comment line, or an indented example command
        lines.append(text.strip())
    # the pointers into the docs and the code say nothing in a one-line listing
    text = re.sub(r"\s*\((?:docs|pipeline)/[^)]*\)", "", " ".join(lines))
    sentence = _clause(text, ".").rstrip(":;, ")
    if len(sentence) > DESCRIPTION_WIDTH:
        sentence = _clause(sentence, ".:;")
    return _short(sentence)


def _clause(text: str, ends: str) -> str:
    """`text` up to its first character of `ends` that closes a clause, outside parentheses
    (where `et al.` and `table 1:` sit): followed by a space, and a full stop by a capital
    (not `eq. 13`)."""
    depth = 0
    for i, ch in enumerate(text):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        after = text[i + 1 : i + 3]
        if depth or ch not in ends or after[:1] not in ("", " "):
            continue
        if ch != "." or after[1:].isupper() or not after:
            return text[:i]
    return text


def _short(text: str) -> str:
    text = re.sub(r"\s+", " ", text).strip()
    if len(text) <= DESCRIPTION_WIDTH:
        return text
    return text[: DESCRIPTION_WIDTH - 3].rsplit(" ", 1)[0].rstrip(",;:") + "..."


def listing() -> tuple[list[Entry], list[Entry]]:
    """The package's dataset cards and its runnable configs (those with a name of their own;
    the bases under configs/base/ are read through `extends`), each with one line."""
    card_entries = []
    for name, path in cards().items():
        description = _own_keys(path).get("description")
        card_entries.append(Entry(name, _short(str(description)) if description else ""))
    config_entries = [
        Entry(name, config_description(path))
        for name, path in configs().items()
        if "name" in _own_keys(path)
    ]
    return card_entries, config_entries


# ---------------------------------------------------------------- copy


def extends_chain(path: Path) -> list[Path]:
    """The files `path` extends, through their own `extends`, in the order they merge (the
    deepest first), each once. The loader has read them already: errors are its own."""
    found: list[Path] = []

    def visit(file: Path) -> None:
        parents = _own_keys(file).get("extends", [])
        for parent in [parents] if isinstance(parents, str) else parents:
            target = (file.parent / parent).resolve()
            visit(target)
            if target not in found:
                found.append(target)

    visit(path.resolve())
    return found


def _leading_comment(path: Path) -> list[str]:
    lines = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.startswith("#"):
            break
        lines.append(line)
    return lines


def resolved_copy(path: Path, written_as: str, version: str) -> str:
    """The text `allattn-pipe copy` writes to `written_as` for the config at `path`: one file
    with every key the config and its `extends` set, merged as the loader merges them, under
    a header saying where it came from, then the config's own comment. A dataset card stays a
    name: the package's cards are found from any directory. A base (no name of its own) is
    refused with the loader's line, which names configs that extend it."""
    from pipeline.spec.loading import load_spec

    data = load_with_extends(path, {})
    # A base may set keys that this config switches off (model.attn_double_scale under a
    # conv mixer): accepted from a base, refused in the config's own file, so left out.
    left_out = [
        (".".join(key), why) for key, why in load_spec(path).inert_keys() if _drop(data, key)
    ]
    ordered = {k: data[k] for k in ("name", "dataset") if k in data}
    ordered.update({k: v for k, v in data.items() if k not in ordered})
    # nearest first, as a reader follows them from the config
    bases = [os.path.relpath(p, path.resolve().parent) for p in reversed(extends_chain(path))]
    name = next((n for n, p in configs().items() if p == path.resolve()), None)
    what = f"the package's config {name}" if name else f"the config {path}"
    merged = f", with its extends ({', '.join(bases)}) merged in" if bases else ""
    header = _comment(
        f"Written by `allattn-pipe copy` (allattn-pipe {version}) from {what}{merged}: every "
        f"key it sets is here; `allattn-pipe show` adds the defaults. Run it with "
        f"`allattn-pipe run {written_as}`; change `name` to keep its runs apart from the "
        f"original's (the workspace runs/NAME and the MLflow experiment NAME)."
    )
    if left_out:
        header += _comment(
            "Left out, as they do nothing here: "
            + "; ".join(f"{key} ({why})" for key, why in left_out)
            + "."
        )
    own = _leading_comment(path)
    body = yaml.safe_dump(ordered, sort_keys=False, allow_unicode=True, width=100)
    return "\n".join([*header, *(["#", *own] if own else [])]) + "\n" + body


def _drop(data: dict, key: tuple[str, ...]) -> bool:
    """Remove the key path `key` from `data`; whether it was there."""
    node: object = data
    for part in key[:-1]:
        node = node.get(part) if isinstance(node, dict) else None
    if not isinstance(node, dict) or key[-1] not in node:
        return False
    del node[key[-1]]
    return True


def _comment(text: str) -> list[str]:
    return textwrap.wrap(
        text,
        width=HEADER_WIDTH,
        initial_indent="# ",
        subsequent_indent="# ",
        break_on_hyphens=False,
    )
