"""Reading a spec's YAML: every key with the file and line it came from, `extends` merged in
order (the file itself last), dataset cards named by string, and `--set` overrides.

The YAML is read with PyYAML's safe loader and a builder that refuses what PyYAML would
construct badly (tags on collections, duplicate keys, absurd sizes), so a mistake is one
located error rather than a silently different spec.
"""

from __future__ import annotations

import difflib
import os
import re
from pathlib import Path
from typing import Any

import yaml

from pipeline.errors import PipelineError, Preempted
from pipeline.errors import shown as _shown
from pipeline.fsutil import open_regular_fd
from pipeline.redact import mask_text
from pipeline.resources import project_dir

PROJECT_ROOT = Path(__file__).resolve().parents[2]


class SpecError(PipelineError):
    """A mistake in the user's spec: printed without a traceback."""


# ---------------------------------------------------------------- YAML with line numbers


class Where(str):
    """Where a value came from: 'file:line' or '--set key=value'."""


# A spec is a few levels deep and has hundreds of values. The bounds stop what a file can do
# to the loader: nesting that would exhaust Python's stack, an alias inside itself, and
# aliases of aliases that expand a few lines into billions of values.
MAX_DEPTH = 64
MAX_VALUES = 10_000
MAX_SPEC_BYTES = 1 << 20
# the tags a mapping or a list has when it is written without one
COLLECTION_TAGS = ("tag:yaml.org,2002:map", "tag:yaml.org,2002:seq")


def _line_loader():
    class Loader(yaml.SafeLoader):
        depth = 0

        def compose_node(self, parent, index):
            # PyYAML composes nested collections by recursion
            self.depth += 1
            try:
                if self.depth > MAX_DEPTH:
                    raise yaml.composer.ComposerError(
                        None,
                        None,
                        f"nested more than {MAX_DEPTH} levels deep",
                        self.peek_event().start_mark,
                    )
                return super().compose_node(parent, index)
            finally:
                self.depth -= 1

    # YAML 1.1 reads 1e-7 as a string; researchers write learning rates that way.
    Loader.add_implicit_resolver(
        "tag:yaml.org,2002:float",
        re.compile(r"^[-+]?(\d[\d_]*)?\.?\d*[eE][-+]?\d+$"),
        list("-+0123456789."),
    )
    return Loader


_Loader = _line_loader()


class _Builder:
    """Python data from a composed YAML node, recording each key path's origin in `where`.

    An alias is the node it names, so the node graph can be cyclic or expand exponentially:
    the depth and the number of values built are bounded."""

    def __init__(self, origin: str, where: dict):
        self.origin, self.where, self.values = origin, where, 0
        self.scalars = _Loader("")

    def place(self, node) -> Where:
        if self.origin.startswith("--set "):
            return Where(self.origin)
        return Where(f"{self.origin}:{node.start_mark.line + 1}")

    def build(self, node, path: tuple):
        self.values += 1
        if self.values > MAX_VALUES:
            raise SpecError(
                f"{self.place(node)}: more than {MAX_VALUES:,} values once YAML "
                f"aliases are expanded; a spec has hundreds"
            )
        if len(path) > MAX_DEPTH:
            raise SpecError(
                f"{self.place(node)}: nested more than {MAX_DEPTH} levels deep "
                f"(an alias inside its own anchor?)"
            )
        self.where[path] = self.place(node)
        if not isinstance(node, yaml.ScalarNode) and node.tag not in COLLECTION_TAGS:
            # !!set {a, b}, !!str [1], !!python/object:... {k: v} would otherwise be read as
            # the plain mapping or list under the tag, and the tag silently dropped
            what = "a mapping" if isinstance(node, yaml.MappingNode) else "a list"
            raise SpecError(
                f"{self.place(node)}: {dotted_path(path)}: the tag "
                f"{_shown(_tag_name(node.tag))} on {what} is not supported; a "
                f"spec's mappings and lists are plain ones"
            )
        if isinstance(node, yaml.MappingNode):
            return self._mapping(node, path)
        if isinstance(node, yaml.SequenceNode):
            return [self.build(item, path + (i,)) for i, item in enumerate(node.value)]
        try:
            return self.scalars.construct_object(node, deep=True)
        except yaml.constructor.ConstructorError as e:  # a tag the safe loader does not know
            raise SpecError(f"{self.place(node)}: {dotted_path(path)}: {e.problem}") from None
        # PyYAML's constructors assume text their tag's pattern matched: on other text they
        # fail with whatever their parsing hits (!!int abc: ValueError, !!bool maybe:
        # KeyError, !!timestamp notadate: AttributeError, !!int '': IndexError)
        except Exception:
            raise SpecError(
                f"{self.place(node)}: {dotted_path(path)}: {short_repr(node.value)} is not "
                f"a valid {_tag_name(node.tag)}"
            ) from None

    def _mapping(self, node, path: tuple) -> dict:
        out = {}
        for key_node, value_node in node.value:
            at = self.place(key_node)
            if key_node.tag == "tag:yaml.org,2002:merge":
                raise SpecError(
                    f"{at}: {dotted_path(path)}: merge keys (<<) are not supported; "
                    f"share settings between files with `extends`"
                )
            if not isinstance(key_node, yaml.ScalarNode):
                found = "a list" if isinstance(key_node, yaml.SequenceNode) else "a mapping"
                raise SpecError(f"{at}: {dotted_path(path)}: a key must be a name, found {found}")
            key = key_node.value
            if key in out:
                raise SpecError(f"{at}: {dotted_path(path + (key,))}: key given twice")
            out[key] = self.build(value_node, path + (key,))
            self.where[path + (key,)] = at
        return out


def _tag_name(tag: str) -> str:
    standard = "tag:yaml.org,2002:"
    return "!!" + tag[len(standard) :] if tag.startswith(standard) else tag


def _load_yaml(path: Path, where: dict, prefix: tuple = ()) -> Any:
    name = _shown(path)  # as given on the command line, where it may hold a newline
    try:
        # a device or a pipe (/dev/zero, /dev/stdin) never ends, and a FIFO blocks its
        # opener: only regular files, opened without waiting, read no further than a spec
        # can be long
        try:
            fd = open_regular_fd(path, "spec")
        except PipelineError as e:
            if isinstance(e, Preempted):  # a signal, not the file
                raise
            raise SpecError(f"{name}: not a file") from None
        with os.fdopen(fd, "rb") as f:
            data = f.read(MAX_SPEC_BYTES + 1)
        if len(data) > MAX_SPEC_BYTES:
            raise SpecError(f"{name}: over {MAX_SPEC_BYTES // 2**20} MiB; a spec is a few KiB")
        text = data.decode("utf-8")
    except FileNotFoundError:
        raise SpecError(f"{name}: no such file") from None
    except OSError as e:
        raise SpecError(f"{name}: cannot read: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise SpecError(
            f"{name}: not UTF-8 text: byte 0x{e.object[e.start]:02x} at offset {e.start}"
        ) from None
    try:
        node = yaml.compose(text, Loader=_Loader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f":{mark.line + 1}" if mark else ""
        raise SpecError(f"{name}{line}: not valid YAML: {_yaml_problem(e)}") from None
    if node is None:
        return {}
    return _Builder(name, where).build(node, prefix)


def read_yaml(path: Path) -> Any:
    """The data in the YAML file `path`, read as a spec file is (a regular file, bounded in
    size, nesting and values); SpecError, one line, for anything else."""
    return _load_yaml(path, {})


def _yaml_problem(e: yaml.YAMLError) -> str:
    # a ReaderError (a control character) has a reason instead of a problem
    return getattr(e, "problem", None) or getattr(e, "reason", None) or str(e).splitlines()[0]


def dotted_path(path: tuple) -> str:
    """A key path as the user writes it: ('train', 'optimizer', 'lr') -> 'train.optimizer.lr'."""
    return ".".join(_shown(p) for p in path) or "(top level)"


def _merge(base: dict, top: dict) -> dict:
    """Deep merge: mappings merge key by key, anything else in `top` replaces."""
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def load_with_extends(path: Path, where: dict, chain: tuple[Path, ...] = ()) -> dict:
    """The spec file merged over its `extends` (in order); each key's origin goes in `where`."""
    if path.resolve() in chain:
        cycle = " -> ".join(str(p) for p in chain + (path.resolve(),))
        raise SpecError(f"{_shown(path)}: `extends` forms a cycle: {cycle}")
    own_where: dict = {}
    data = _load_yaml(path, own_where)
    if not isinstance(data, dict):
        raise SpecError(
            f"{_shown(path)}:1: a pipeline spec must be a mapping of keys, "
            f"found {type_in_words(data)}"
        )
    extends = data.pop("extends", [])
    if isinstance(extends, str):
        extends = [extends]
    if not isinstance(extends, list) or not all(isinstance(e, str) for e in extends):
        raise SpecError(
            f"{own_where[('extends',)]}: extends: expected a list of file paths, found {extends!r}"
        )
    merged: dict = {}
    for i, parent in enumerate(extends):
        parent_path = path.parent / parent
        at = own_where.get(("extends", i), own_where.get(("extends",)))  # `extends: FILE`
        if not _is_file(parent_path, at):
            raise SpecError(f"{at}: extends: no such file {_shown(parent_path)}")
        merged = _merge(merged, load_with_extends(parent_path, where, chain + (path.resolve(),)))
    # The file's own keys win, and so do their locations.
    where.update({k: v for k, v in own_where.items() if k and k[0] != "extends"})
    return _merge(merged, data)


def _is_file(path: Path, at: str | None) -> bool:
    try:
        return path.is_file()
    except OSError as e:  # a name too long for the filesystem
        raise SpecError(f"{at}: cannot read {short_repr(str(path))}: {e.strerror}") from None


# ---------------------------------------------------------------- dataset cards

# a card is a file datasets/NAME.yaml; nothing else (a path, a name too long for a file) is
CARD_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}")


def dataset_card_dirs(spec_path: Path) -> list[Path]:
    """Where a card named by string is looked for: a datasets/ folder beside the spec's
    folder (a project laid out as configs/ and datasets/), then the package's cards (the
    installed wheel's copy, or the checkout's datasets/: pipeline.resources)."""
    dirs = [spec_path.resolve().parent.parent / "datasets", project_dir("datasets")]
    return list(dict.fromkeys(dirs))


def resolve_dataset_card(name: str, spec_path: Path, where: dict, at: str) -> dict:
    """The contents of the dataset card `name` (datasets/NAME.yaml beside the spec, then the
    package's); its keys' origins go in `where` under `dataset`."""
    if not CARD_NAME.fullmatch(name):
        raise SpecError(
            f"{at}: dataset: {short_repr(name)} is not a dataset card's name (letters, "
            f"digits, _ . -, at most 100 characters) nor a mapping"
        )
    dirs = dataset_card_dirs(spec_path)
    for d in dirs:
        card = d / f"{name}.yaml"
        if card.exists():
            card_where: dict = {}
            data = _load_yaml(card, card_where, prefix=("dataset",))
            if not isinstance(data, dict):
                raise SpecError(f"{card}:1: a dataset card must be a mapping")
            # the card's keys now live under `dataset`, except the `dataset` key itself
            where.update({k: v for k, v in card_where.items() if len(k) > 1})
            return data
    known = sorted({p.stem for d in dirs if d.is_dir() for p in d.glob("*.yaml")})
    hint = difflib.get_close_matches(name, known, n=1)
    suggest = f" (did you mean '{hint[0]}'?)" if hint else ""
    raise SpecError(
        f"{at}: dataset: no dataset card named '{_shown(name)}'{suggest}; "
        f"known cards: {', '.join(known) or 'none'}"
    )


# ---------------------------------------------------------------- --set overrides


def _set_origin(text: str) -> str:
    # an error is one line, even for an override with a newline in it
    return "--set " + _shown(text)


def parse_override(text: str) -> tuple[tuple[str, ...], Any]:
    if "=" not in text:
        raise SpecError(
            f"{_set_origin(text)}: expected KEY=VALUE, for example --set train.optimizer.lr=0.05"
        )
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise SpecError(f"{_set_origin(text)}: '{_shown(key)}' is not a dotted key path")
    path = tuple(key.split("."))
    if not raw.strip():
        return path, ""
    try:
        node = yaml.compose(raw, Loader=_Loader)
    except yaml.YAMLError:
        return path, raw  # not YAML: take the text as a string
    return path, None if node is None else _Builder(_set_origin(text), {}).build(node, path)


def apply_override(data: dict, path: tuple, value, where: dict, text: str, spec_path: Path) -> None:
    """Set one parsed `--set` override in `data`; its origin in `where` is the override."""
    if path[0] == "dataset" and len(path) > 1 and isinstance(data.get("dataset"), str):
        data["dataset"] = resolve_dataset_card(
            data["dataset"], spec_path, where, where.get(("dataset",), _shown(spec_path))
        )
    node = data
    for i, part in enumerate(path[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        elif not isinstance(child, dict):
            raise SpecError(
                f"{_set_origin(text)}: {dotted_path(path[: i + 1])} is {type_in_words(child)}, "
                f"not a mapping, so it has no key '{path[i + 1]}'"
            )
        node = child
    node[path[-1]] = value
    for k in [k for k in where if k[: len(path)] == path]:
        del where[k]
    where[path] = Where(_set_origin(text))


def type_in_words(value) -> str:
    """A value's type as an error message says it: 'a mapping', 'an integer', 'null'."""
    return {
        dict: "a mapping",
        list: "a list",
        str: "a string",
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        type(None): "null",
    }.get(type(value), type(value).__name__)


def short_repr(value) -> str:
    """repr(value), cut to 60 characters for an error message; a URL's credentials in it
    masked first (a value refused for its scheme or its port still holds its password)."""
    text = repr(mask_text(value)) if isinstance(value, str) else mask_text(repr(value))
    return text if len(text) <= 60 else text[:57] + "..."
