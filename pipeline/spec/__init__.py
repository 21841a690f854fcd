"""The experiment spec: YAML in, a validated, fully resolved `Spec` out.

Resolution order: the file and its `extends` (merged in order, the file itself last), a
dataset card named by string replaced by the card's contents, then `--set` overrides.
Every key remembers the file and line it came from, so a validation error can point at it.
"""

from __future__ import annotations

import difflib
import functools
import re
import typing
from dataclasses import MISSING, asdict, fields, is_dataclass
from pathlib import Path
from typing import Any

import pydantic
import yaml
from pydantic import BaseModel, ConfigDict

from pipeline.errors import PipelineError
from pipeline.errors import shown as _shown
from pipeline.models import MODELS
from pipeline.spec.schema import VOCAB_LIMIT, Spec

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
                        None, None, f"nested more than {MAX_DEPTH} levels deep",
                        self.peek_event().start_mark)
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
            raise SpecError(f"{self.place(node)}: more than {MAX_VALUES:,} values once YAML "
                            f"aliases are expanded; a spec has hundreds")
        if len(path) > MAX_DEPTH:
            raise SpecError(f"{self.place(node)}: nested more than {MAX_DEPTH} levels deep "
                            f"(an alias inside its own anchor?)")
        self.where[path] = self.place(node)
        if not isinstance(node, yaml.ScalarNode) and node.tag not in COLLECTION_TAGS:
            # !!set {a, b}, !!str [1], !!python/object:... {k: v} would otherwise be read as
            # the plain mapping or list under the tag, and the tag silently dropped
            what = "a mapping" if isinstance(node, yaml.MappingNode) else "a list"
            raise SpecError(f"{self.place(node)}: {_dotted(path)}: the tag "
                            f"{_shown(_tag_name(node.tag))} on {what} is not supported; a "
                            f"spec's mappings and lists are plain ones")
        if isinstance(node, yaml.MappingNode):
            return self._mapping(node, path)
        if isinstance(node, yaml.SequenceNode):
            return [self.build(item, path + (i,)) for i, item in enumerate(node.value)]
        try:
            return self.scalars.construct_object(node, deep=True)
        except yaml.constructor.ConstructorError as e:   # a tag the safe loader does not know
            raise SpecError(f"{self.place(node)}: {_dotted(path)}: {e.problem}") from None
        # PyYAML's constructors assume text their tag's pattern matched: on other text they
        # fail with whatever their parsing hits (!!int abc: ValueError, !!bool maybe:
        # KeyError, !!timestamp notadate: AttributeError, !!int '': IndexError)
        except Exception:
            raise SpecError(f"{self.place(node)}: {_dotted(path)}: {_show(node.value)} is not "
                            f"a valid {_tag_name(node.tag)}") from None

    def _mapping(self, node, path: tuple) -> dict:
        out = {}
        for key_node, value_node in node.value:
            at = self.place(key_node)
            if key_node.tag == "tag:yaml.org,2002:merge":
                raise SpecError(f"{at}: {_dotted(path)}: merge keys (<<) are not supported; "
                                f"share settings between files with `extends`")
            if not isinstance(key_node, yaml.ScalarNode):
                found = "a list" if isinstance(key_node, yaml.SequenceNode) else "a mapping"
                raise SpecError(f"{at}: {_dotted(path)}: a key must be a name, found {found}")
            key = key_node.value
            if key in out:
                raise SpecError(f"{at}: {_dotted(path + (key,))}: key given twice")
            out[key] = self.build(value_node, path + (key,))
            self.where[path + (key,)] = at
        return out


def _tag_name(tag: str) -> str:
    standard = "tag:yaml.org,2002:"
    return "!!" + tag[len(standard):] if tag.startswith(standard) else tag


def _load_yaml(path: Path, where: dict, prefix: tuple = ()) -> Any:
    name = _shown(path)   # as given on the command line, where it may hold a newline
    try:
        # a device or a pipe (/dev/zero, /dev/stdin) never ends: only regular files, read
        # no further than a spec can be long
        if path.exists() and not path.is_file():
            raise SpecError(f"{name}: not a file")
        with path.open("rb") as f:
            data = f.read(MAX_SPEC_BYTES + 1)
        if len(data) > MAX_SPEC_BYTES:
            raise SpecError(f"{name}: over {MAX_SPEC_BYTES // 2**20} MiB; a spec is a few KiB")
        text = data.decode("utf-8")
    except FileNotFoundError:
        raise SpecError(f"{name}: no such file") from None
    except OSError as e:
        raise SpecError(f"{name}: cannot read: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise SpecError(f"{name}: not UTF-8 text: byte 0x{e.object[e.start]:02x} at offset "
                        f"{e.start}") from None
    try:
        node = yaml.compose(text, Loader=_Loader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f":{mark.line + 1}" if mark else ""
        raise SpecError(f"{name}{line}: not valid YAML: {_yaml_problem(e)}") from None
    if node is None:
        return {}
    return _Builder(name, where).build(node, prefix)


def _yaml_problem(e: yaml.YAMLError) -> str:
    # a ReaderError (a control character) has a reason instead of a problem
    return getattr(e, "problem", None) or getattr(e, "reason", None) or str(e).splitlines()[0]


def _dotted(path: tuple) -> str:
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


def _load_with_extends(path: Path, where: dict, chain: tuple[Path, ...] = ()) -> dict:
    if path.resolve() in chain:
        cycle = " -> ".join(str(p) for p in chain + (path.resolve(),))
        raise SpecError(f"{_shown(path)}: `extends` forms a cycle: {cycle}")
    own_where: dict = {}
    data = _load_yaml(path, own_where)
    if not isinstance(data, dict):
        raise SpecError(f"{_shown(path)}:1: a pipeline spec must be a mapping of keys, "
                        f"found {_kind(data)}")
    extends = data.pop("extends", [])
    if isinstance(extends, str):
        extends = [extends]
    if not isinstance(extends, list) or not all(isinstance(e, str) for e in extends):
        raise SpecError(f"{own_where[('extends',)]}: extends: expected a list of file paths, "
                        f"found {extends!r}")
    merged: dict = {}
    for i, parent in enumerate(extends):
        parent_path = (path.parent / parent)
        at = own_where.get(("extends", i), own_where.get(("extends",)))  # `extends: FILE`
        if not _is_file(parent_path, at):
            raise SpecError(f"{at}: extends: no such file {_shown(parent_path)}")
        merged = _merge(merged, _load_with_extends(parent_path, where, chain + (path.resolve(),)))
    # The file's own keys win, and so do their locations.
    where.update({k: v for k, v in own_where.items() if k and k[0] != "extends"})
    return _merge(merged, data)


def _is_file(path: Path, at: str) -> bool:
    try:
        return path.is_file()
    except OSError as e:   # a name too long for the filesystem
        raise SpecError(f"{at}: cannot read {_show(str(path))}: {e.strerror}") from None


# ---------------------------------------------------------------- dataset cards

# a card is a file datasets/NAME.yaml; nothing else (a path, a name too long for a file) is
CARD_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}")


def dataset_card_dirs(spec_path: Path) -> list[Path]:
    dirs = [spec_path.resolve().parent.parent / "datasets", PROJECT_ROOT / "datasets"]
    return list(dict.fromkeys(dirs))


def _resolve_card(name: str, spec_path: Path, where: dict, at: str) -> dict:
    if not CARD_NAME.fullmatch(name):
        raise SpecError(f"{at}: dataset: {_show(name)} is not a dataset card's name (letters, "
                        f"digits, _ . -, at most 100 characters) nor a mapping")
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
    raise SpecError(f"{at}: dataset: no dataset card named '{_shown(name)}'{suggest}; "
                    f"known cards: {', '.join(known) or 'none'}")


# ---------------------------------------------------------------- --set overrides

def _set_origin(text: str) -> str:
    # an error is one line, even for an override with a newline in it
    return "--set " + _shown(text)


def parse_override(text: str) -> tuple[tuple[str, ...], Any]:
    if "=" not in text:
        raise SpecError(f"{_set_origin(text)}: expected KEY=VALUE, for example "
                        f"--set train.lr=0.05")
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


def _apply_override(data: dict, path: tuple, value, where: dict, text: str,
                    spec_path: Path) -> None:
    if path[0] == "dataset" and len(path) > 1 and isinstance(data.get("dataset"), str):
        data["dataset"] = _resolve_card(data["dataset"], spec_path, where,
                                        where.get(("dataset",), _shown(spec_path)))
    node = data
    for i, part in enumerate(path[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        elif not isinstance(child, dict):
            raise SpecError(f"{_set_origin(text)}: {_dotted(path[:i + 1])} is {_kind(child)}, "
                            f"not a mapping, so it has no key '{path[i + 1]}'")
        node = child
    node[path[-1]] = value
    for k in [k for k in where if k[:len(path)] == path]:
        del where[k]
    where[path] = Where(_set_origin(text))


# ---------------------------------------------------------------- validation errors

def _kind(value) -> str:
    return {dict: "a mapping", list: "a list", str: "a string", bool: "a boolean",
            int: "an integer", float: "a number", type(None): "null"}.get(type(value),
                                                                        type(value).__name__)


def _show(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _locate(where: dict, loc: tuple, fallback: str) -> str:
    for n in range(len(loc), -1, -1):
        if loc[:n] in where:
            return where[loc[:n]]
    return fallback


def _schema_keys(schema, loc: tuple) -> list[str]:
    """The valid keys of the mapping at `loc` (for 'did you mean ...')."""
    for part in loc:
        if isinstance(part, int):
            continue
        if isinstance(schema, type) and issubclass(schema, BaseModel):
            field = schema.model_fields.get(part)
            schema = _inner_type(field.annotation) if field else None
        elif is_dataclass(schema):
            schema = typing.get_type_hints(schema).get(part)
            schema = _inner_type(schema) if schema else None
        else:
            return []
    if isinstance(schema, type) and issubclass(schema, BaseModel):
        return list(schema.model_fields)
    if is_dataclass(schema):
        return [f.name for f in fields(schema)]
    return []


def _inner_type(annotation):
    for arg in getattr(annotation, "__args__", ()) or ():
        if isinstance(arg, type) and (issubclass(arg, BaseModel) or is_dataclass(arg)):
            return arg
    return annotation


def _describe(err: dict, where: dict, fallback: str, schema, loc_prefix: tuple = ()) -> str:
    loc = loc_prefix + tuple(err["loc"])
    place = _locate(where, loc, fallback)
    kind = err["type"]
    if kind == "extra_forbidden":
        key = loc[-1]
        valid = _schema_keys(schema, tuple(err["loc"])[:-1])
        close = difflib.get_close_matches(str(key), valid, n=1, cutoff=0.6)
        hint = f" (did you mean '{close[0]}'?)" if close else (
            f" (valid keys: {', '.join(valid)})" if valid else "")
        return f"{place}: {_dotted(loc)}: unknown key '{_shown(key)}'{hint}"
    if kind == "missing":
        return f"{place}: {_dotted(loc)}: required key is missing"
    msg = err["msg"]
    if msg.startswith("Input should be "):
        msg = "expected " + msg[len("Input should be "):]
    elif msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    else:
        msg = msg[0].lower() + msg[1:]
    found = err.get("input")
    return f"{place}: {_dotted(loc)}: {msg}; found {_show(found)} ({_kind(found)})"


def _validate(data: dict, where: dict, origin: str) -> Spec:
    errors: list[str] = []
    try:
        spec = Spec.model_validate(data)
    except pydantic.ValidationError as e:
        spec = None
        errors += [_describe(err, where, origin, Spec) for err in e.errors()]

    model = data.get("model")
    params = None
    if isinstance(model, dict):
        kind = model.get("kind")
        if not isinstance(kind, str) or kind not in MODELS:
            close = difflib.get_close_matches(kind, list(MODELS), n=1) \
                if isinstance(kind, str) else []
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            at = _locate(where, ("model", "kind"), origin)
            what = ("required key is missing" if kind is None else
                    f"unknown model kind '{kind}'" if isinstance(kind, str) else
                    f"expected the name of a model kind, found {_show(kind)} ({_kind(kind)})")
            errors.append(f"{at}: model.kind: {what}{hint}; known: {', '.join(MODELS)}")
        else:
            cfg_cls = MODELS[kind][0]
            rest = {k: v for k, v in model.items() if k != "kind"}
            try:
                checked = _strict_schema(cfg_cls).model_validate(rest)
                params = cfg_cls(**checked.model_dump())  # nested mappings as dicts
            except pydantic.ValidationError as e:
                errors += [_describe(err, where, origin, cfg_cls, ("model",))
                           for err in e.errors()]
            except ValueError as e:   # the config's own cross-field checks
                errors.append(f"{_locate(where, ('model',), origin)}: model: {e}")

    if spec is not None and not errors:
        errors += _check_stages(spec, where, origin)
        if spec.train and spec.train.deepspeed.zero_stage == 3 and \
                getattr(params, "adaptive_span", False):
            errors.append(
                f"{_locate(where, ('train', 'deepspeed', 'zero_stage'), origin)}: "
                f"train.deepspeed.zero_stage: ZeRO stage 3 partitions every parameter "
                f"between forward passes, but an adaptive-span model reads its span "
                f"parameters outside forward (to size its cache and clamp them): use "
                f"zero_stage 1 or 2, or model.adaptive_span: false")
    if errors:
        raise SpecError("\n".join(errors))
    spec._model_params = params
    return spec


# Upper bounds on model sizes (by config field name), with what the paper uses: far above any
# model this pipeline trains, low enough that no tensor size overflows and that `show` builds
# the model on the meta device (no memory) in a moment.
MODEL_LIMITS = {
    "d_model": (1 << 16, "512 and 768"),
    "n_layers": (256, "up to 36"),
    "n_persistent": (1 << 20, "up to 2,048"),
    "ff_dim": (1 << 20, "up to 4,096"),
    "max_span": (1 << 20, "up to 8,192"),
    "span_ramp": (1 << 20, "32"),
    "adaptive_div": (1 << 10, "4"),
    "kernel_size": (1 << 12, "20"),
    "n_heads": (1 << 12, "8"),
    "head_dim": (1 << 12, "64"),
    "adaptive_cutoffs": (VOCAB_LIMIT, "up to 200,000"),
}


def _at_most(name: str):
    limit, paper = MODEL_LIMITS[name]

    def check(value):
        if any(v > limit for v in (value if isinstance(value, list) else [value])):
            raise ValueError(f"at most {limit:,} (the paper's models use {paper})")
        return value
    return pydantic.AfterValidator(check)


@functools.cache
def _strict_schema(cfg_cls) -> type[BaseModel]:
    """A strict pydantic model with the fields of a model's config dataclass: the models
    stay plain dataclasses, the spec still refuses unknown keys, wrong types, infinities and
    sizes above MODEL_LIMITS. A field whose type is itself a dataclass (model.attention) is
    checked the same way."""
    hints = {name: _strict_schema(t) if is_dataclass(t) else
             typing.Annotated[t, _at_most(name)] if name in MODEL_LIMITS else t
             for name, t in typing.get_type_hints(cfg_cls).items()}
    return pydantic.create_model(
        cfg_cls.__name__, __config__=ConfigDict(extra="forbid", strict=True,
                                                allow_inf_nan=False),
        **{f.name: (hints[f.name], _default(f)) for f in fields(cfg_cls)})


def _default(f):
    value = f.default if f.default is not MISSING else (
        f.default_factory() if f.default_factory is not MISSING else ...)
    return _strict_schema(type(value))(**asdict(value)) if is_dataclass(value) else value


def _check_stages(spec: Spec, where: dict, origin: str) -> list[str]:
    from stages import STAGES

    errors = []
    at = _locate(where, ("stages",), origin)
    seen: list[str] = []
    for name in spec.stages:
        if name in seen:
            errors.append(f"{at}: stages: '{name}' is listed twice")
        stage = STAGES[name]
        for needed in stage.inputs:
            options = needed if isinstance(needed, tuple) else (needed,)
            if not any(o in seen for o in options):
                errors.append(f"{at}: stages: '{name}' reads the output of "
                              f"{' or '.join(repr(o) for o in options)}, which must come "
                              f"before it in the list")
        section = stage.section_key
        if section and getattr(spec, section) is None:
            errors.append(f"{at}: stages: '{name}' needs a `{section}:` section")
        seen.append(name)
    if "train" in spec.stages and spec.train:
        errors += [f"{_locate(where, ('train', key), origin)}: train.{key}: required key is "
                   f"missing" for key in ("steps", "seq_len") if getattr(spec.train, key) is None]
    if "curriculum" in spec.stages:
        generator = spec.dataset.generator
        if generator is None or generator.algorithmic is None:
            errors.append(f"{_locate(where, ('dataset',), origin)}: dataset: the curriculum "
                          f"stage trains on an algorithmic task (dataset.generator.algorithmic, "
                          f"e.g. dataset: reverse_algorithmic); '{spec.dataset.name}' is not one")
        if spec.train and spec.train.optimizer.type != "adam":
            errors.append(f"{_locate(where, ('train', 'optimizer', 'type'), origin)}: "
                          f"train.optimizer.type: the curriculum trains with adam (the paper's "
                          f"tasks); found {spec.train.optimizer.type}")
    return errors


# ---------------------------------------------------------------- entry point

def load_spec(path: str | Path, overrides: list[str] = ()) -> Spec:
    """Read, merge, override and validate a pipeline spec; SpecError on any mistake."""
    path = Path(path)
    origin = _shown(path)   # where an error without a line of its own points
    where: dict = {}
    data = _load_with_extends(path, where)
    parsed = [(parse_override(text), text) for text in overrides]
    for (key, value), text in parsed:
        if key == ("dataset",):
            _apply_override(data, key, value, where, text, path)
    if isinstance(data.get("dataset"), str):
        data["dataset"] = _resolve_card(data["dataset"], path, where,
                                        where.get(("dataset",), origin))
    for (key, value), text in parsed:
        if key != ("dataset",):
            _apply_override(data, key, value, where, text, path)
    if isinstance(data.get("dataset"), str):  # --set dataset=NAME
        data["dataset"] = _resolve_card(data["dataset"], path, where,
                                        where.get(("dataset",), origin))
    spec = _validate(data, where, origin)
    spec._source = str(path)
    _refuse_inert_keys(spec, where, origin)
    return spec


def _refuse_inert_keys(spec: Spec, where: dict, top: str) -> None:
    """Every key acts or is refused: one that does nothing under the other settings is an
    error where the user wrote it (this file, or --set). From an `extends` base it is
    accepted: a shared base sets what some of its variants switch off."""
    errors = []
    for key, why in spec.inert_keys():
        origin = where.get(key)
        if origin and (origin.startswith("--set ") or origin.rsplit(":", 1)[0] == top):
            errors.append(f"{origin}: {_dotted(key)}: does nothing here ({why}); remove it")
    if errors:
        raise SpecError("\n".join(errors))
