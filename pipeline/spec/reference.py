"""The configuration reference, docs/reference.md, generated from the schema itself.

Every key a spec accepts comes from the classes that validate it: the pydantic sections in
pipeline/spec/ (schema.py, dataset_schema.py, training_schema.py: type, default, constraints,
`Field(description=...)`, a section's class docstring) and each model family's config
dataclass (type, default, the attribute docstring under each field, the size limits of
`MODEL_LIMITS`). What a model config's `__post_init__` checks cannot be read from it:
`MODEL_CHECKS` below states it, and tests/unit/spec/test_reference.py
proves every entry against the dataclass, so neither can drift from the other.

    python -m pipeline.spec.reference            # the page on stdout
    python -m pipeline.spec.reference --write    # into docs/reference.md
    python -m pipeline.spec.reference --check    # exit 1 if docs/reference.md is stale
"""

from __future__ import annotations

import ast
import inspect
import json
import re
import sys
import textwrap
import typing
from dataclasses import MISSING, dataclass, fields, is_dataclass
from pathlib import Path
from types import NoneType, UnionType
from typing import Annotated, Any, Literal, Union

import annotated_types
from pydantic import AfterValidator, BaseModel
from pydantic.fields import FieldInfo

from pipeline.models import MODELS
from pipeline.models.active_memory import CONV_ACTIVATIONS, GATES, MIXERS, ActiveMemoryConfig
from pipeline.models.allattn.config import (
    ATTENTION_IMPL_NAMES,
    FF_KINDS,
    PERSISTENT_MODES,
    AllAttnConfig,
    AttentionConfig,
)
from pipeline.models.infinity_former import InfinityFormerConfig
from pipeline.plugins import MODEL_GROUP, PROJECT, STAGE_GROUP, providers
from pipeline.spec import PROJECT_ROOT, load_spec
from pipeline.spec.schema import Spec
from pipeline.spec.section_base import TASK_SYMBOLS_LIMIT, check_task_symbols
from pipeline.spec.validation import MODEL_LIMITS

# how this module is run, for the messages that say how to regenerate the page
MODULE = __spec__.name if __spec__ is not None else __name__
REGENERATE = f"python -m {MODULE} --write"
PAGE = Path("docs") / "reference.md"  # relative to the project root


# ---------------------------------------------------------------- what __post_init__ checks


@dataclass(frozen=True)
class Check:
    """A model config field's allowed values as its dataclass's `__post_init__` enforces them
    (bounds inclusive unless `*_open`; `items`: the bounds apply to each list item). `note`:
    a rule that involves other fields, in words."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    choices: tuple = ()
    items: bool = False
    note: str = ""


_DROPOUT = Check(low=0, high=1, high_open=True)

MODEL_CHECKS: dict[type, dict[str, Check]] = {
    AttentionConfig: {"impl": Check(choices=ATTENTION_IMPL_NAMES)},
    AllAttnConfig: {
        "d_model": Check(low=1, note="a multiple of n_heads"),
        "n_layers": Check(low=1),
        "n_heads": Check(low=1, note="even with persistent_mode head_split"),
        "n_persistent": Check(low=0, note="more than 0 unless persistent_mode is all_attn"),
        "persistent_mode": Check(choices=PERSISTENT_MODES),
        "ff_dim": Check(low=0, note="more than 0 for ff_kind ff_attn and softmax"),
        "ff_kind": Check(choices=FF_KINDS),
        "max_span": Check(low=1),
        "span_ramp": Check(low=1),
        "span_init": Check(low=0, high=1),
        "span_loss_coef": Check(low=0),
        "attn_dropout": _DROPOUT,
        "emb_dropout": _DROPOUT,
        "out_dropout": _DROPOUT,
        "adaptive_cutoffs": Check(
            low=0, low_open=True, items=True, note="a non-empty, increasing list"
        ),
        "adaptive_div": Check(
            low=1,
            note="with adaptive_io, d_model // adaptive_div ** "
            "len(adaptive_cutoffs) must be at least 1",
        ),
    },
    ActiveMemoryConfig: {
        "mixer": Check(choices=MIXERS),
        "d_model": Check(low=1),
        "n_layers": Check(low=1),
        "ff_dim": Check(low=1),
        "kernel_size": Check(low=1),
        "n_heads": Check(low=1),
        "head_dim": Check(low=1),
        "dropout": _DROPOUT,
        "conv_activation": Check(choices=CONV_ACTIVATIONS),
        "cgru_gate": Check(choices=GATES),
    },
    InfinityFormerConfig: {
        "d_model": Check(low=1, note="a multiple of n_heads"),
        "n_layers": Check(low=1),
        "n_heads": Check(low=1),
        "ff_dim": Check(low=1),
        "dropout": _DROPOUT,
        "attn_dropout": _DROPOUT,
        "mem_len": Check(low=1),
        "n_basis": Check(
            low=1,
            note="a multiple of len(basis_widths), with at least 2 "
            "centres (n_basis / len(basis_widths))",
        ),
        "basis_widths": Check(low=0, low_open=True, items=True, note="a non-empty list"),
        "ridge_penalty": Check(low=0, low_open=True),
        "n_samples": Check(low=1),
        "tau": Check(low=0, high=1, low_open=True, high_open=True),
        "sticky_bins": Check(low=1),
        "sigma_0": Check(low=0, low_open=True),
        "kl_weight": Check(low=0),
    },
}


# ---------------------------------------------------------------- the page's content


@dataclass
class Entry:
    """One key of the spec as the page shows it."""

    key: str  # dotted path; `*` stands for a name the user chooses
    type: str
    default: str  # the default as JSON, or words where there is no value
    allowed: str  # "" when the type says it all
    description: str
    owner: str  # Class.field (or what defines the key)
    source: str  # the file that defines it, relative to the project root
    kind: str | None = None  # the model kind, for model.* keys
    section: bool = False  # its value is a mapping of keys of its own
    is_value: bool = True  # `default` is JSON (else words: required, optional, ...)
    note: str = ""  # after the default: when it holds

    @property
    def anchor(self) -> str:
        return self.key if self.kind is None else f"{self.key}@{self.kind}"


@dataclass
class Section:
    title: str
    anchor: str
    depth: int
    entry: Entry | None  # the section's own key (None: the top level)
    rows: list[Entry]  # its keys, subsections included (the summary table)
    entries: list[Entry]  # its keys described here (subsections have their own)
    extra: str = ""  # Markdown after the entries (the model kinds' index)


def _source(obj) -> str:
    """The file defining `obj`, relative to the project root; a plugin's, as its module."""
    path = Path(inspect.getsourcefile(obj) or inspect.getfile(obj)).resolve()
    if not path.is_relative_to(PROJECT_ROOT):
        return f"{obj.__module__} ({path.name})"
    return path.relative_to(PROJECT_ROOT).as_posix()


def _plugin(group: str, name: str) -> str:
    """ "from the installed distribution `X`" for a plugin's kind; "" for a built-in."""
    dist = providers.get(group, {}).get(name, PROJECT)
    return "" if dist == PROJECT else f"from the installed distribution `{dist}`"


def _prose(text: str | None) -> str:
    """A docstring or description as Markdown: paragraphs kept, lines joined, RST literals
    as code spans."""
    if not text:
        return ""
    paragraphs = re.split(r"\n\s*\n", inspect.cleandoc(text))
    return "\n\n".join(_md(" ".join(p.split()).replace("``", "`")) for p in paragraphs)


def _sentence(text: str, capital: bool = False) -> str:
    """A description as a sentence: a full stop at the end; `capital`: a leading plain word
    capitalised (the schema's descriptions start in lower case; not a name such as
    `per_param:` or `builtin://`)."""
    text = text.strip()
    if capital and re.match(r"[a-z][a-z'-]* ", text):
        text = text[0].upper() + text[1:]
    return text if not text or text[-1] in ".!?" else text + "."


def _attribute_docs(cls) -> dict[str, str]:
    """The string literal under each field of a dataclass (its attribute docstring)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    class_def = tree.body[0]
    assert isinstance(class_def, ast.ClassDef)
    body = class_def.body
    docs = {}
    for node, after in zip(body, body[1:], strict=False):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = after.value.value
    return docs


def _number(value) -> str:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, int):
        if value >= 2**16 and value & (value - 1) == 0:
            return f"2^{value.bit_length() - 1}"
        if value >= 10**6 and str(value).rstrip("0") == "1":
            return f"10^{len(str(value)) - 1}"
        return f"{value:,}"
    return repr(value)


def _range(low, high, low_open=False, high_open=False, what="value") -> str:
    if low is None and high is None:
        return ""
    if low is None:
        return f"{what} {'<' if high_open else '≤'} {_number(high)}"
    if high is None:
        return f"{what} {'>' if low_open else '≥'} {_number(low)}"
    return (
        f"{_number(low)} {'<' if low_open else '≤'} {what} "
        f"{'<' if high_open else '≤'} {_number(high)}"
    )


def _choices(values) -> str:
    return "one of " + ", ".join(
        f"`{_json(v)}`" if not isinstance(v, str) else f"`{v}`" for v in values
    )


def _json(value) -> str:
    return json.dumps(value, ensure_ascii=False)


@dataclass
class _Constraints:
    low: Any = None  # a bound as the schema wrote it (an int stays an int in the docs)
    high: Any = None
    low_open: bool = False
    high_open: bool = False
    min_len: int | None = None
    max_len: int | None = None
    pattern: str | None = None

    def read(self, metadata) -> _Constraints:
        for m in metadata:
            if isinstance(m, annotated_types.Gt):
                self.low, self.low_open = m.gt, True
            elif isinstance(m, annotated_types.Ge):
                self.low, self.low_open = m.ge, False
            elif isinstance(m, annotated_types.Lt):
                self.high, self.high_open = m.lt, True
            elif isinstance(m, annotated_types.Le):
                self.high, self.high_open = m.le, False
            elif isinstance(m, annotated_types.MinLen):
                self.min_len = m.min_length
            elif isinstance(m, annotated_types.MaxLen):
                self.max_len = m.max_length
            elif getattr(m, "pattern", None) is not None:
                self.pattern = m.pattern
            elif isinstance(m, AfterValidator) and m.func is check_task_symbols:
                self.high, self.high_open = TASK_SYMBOLS_LIMIT, False
            elif isinstance(m, FieldInfo):
                self.read(m.metadata)
            else:
                raise TypeError(
                    f"{MODULE} cannot describe the constraint {m!r}: teach "
                    f"_Constraints.read what it allows"
                )
        return self

    def words(self, what: str, text: bool) -> list[str]:
        out = []
        if rng := _range(self.low, self.high, self.low_open, self.high_open, what):
            out.append(rng)
        if self.min_len is not None or self.max_len is not None:
            unit = "characters" if text else "items"
            if self.min_len == self.max_len:
                out.append(f"exactly {self.min_len} {unit}")
            elif self.max_len is None:
                out.append(f"at least {self.min_len} {unit[:-1] if self.min_len == 1 else unit}")
            elif self.min_len is None:
                out.append(f"at most {self.max_len} {unit}")
            else:
                out.append(f"{self.min_len} to {self.max_len} {unit}")
        if self.pattern:
            out.append(f"matches `{self.pattern}`")
        return out


_SCALARS = {int: "int", float: "float", bool: "bool", str: "string"}


@dataclass
class _Type:
    text: str
    allowed: list[str]
    section: type | None = None  # a pydantic section or a config dataclass
    per_name: type | None = None  # a mapping of user-chosen names to this section


def _strip(annotation) -> tuple[Any, list]:
    """An Annotated type's inner type and its metadata."""
    if typing.get_origin(annotation) is Annotated:
        inner, *meta = typing.get_args(annotation)
        return inner, meta
    return annotation, []


def _is_section(tp) -> bool:
    return isinstance(tp, type) and (issubclass(tp, BaseModel) or is_dataclass(tp))


def _type(annotation, metadata=()) -> _Type:
    """What a field's annotation (and its pydantic metadata) allows, in words."""
    annotation, meta = _strip(annotation)
    metadata = [*metadata, *meta]
    if typing.get_origin(annotation) in (Union, UnionType):
        members = [a for a in typing.get_args(annotation) if a is not NoneType]
        nullable = len(members) < len(typing.get_args(annotation))
        parts = [_type(a, metadata if len(members) == 1 else ()) for a in members]
        if len(parts) == 1 and parts[0].section is not None:
            return parts[0]
        texts = [p.text for p in parts] + (["null"] if nullable else [])
        allowed = [w for p in parts for w in p.allowed]
        return _Type(
            " or ".join(texts), [" or ".join(allowed)] if len(parts) > 1 and allowed else allowed
        )
    if _is_section(annotation):
        return _Type("mapping", [], section=annotation)
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Literal:
        kinds = {type(a) for a in args}
        text = "string" if kinds == {str} else _SCALARS.get(kinds.pop(), "value")
        if len(args) == 1:  # one value, as in `int | Literal["all"]`
            return _Type(f"`{_json(args[0])}`", [f"`{args[0]}`"])
        return _Type(text, [_choices(args)])
    if origin is list:
        item = _type(args[0])
        own = _Constraints().read(metadata).words("value", text=False)
        allowed = own + [f"each {w}" for w in item.allowed]
        return _Type(f"list of {item.text}", allowed)
    if origin is dict:
        key, value = _type(args[0]), _type(args[1])
        own = _Constraints().read(metadata).words("value", text=False)
        if value.section is not None:
            return _Type("mapping of names to mappings", own, per_name=value.section)
        keys = [f"keys: {k.removeprefix('one of ')}" for k in key.allowed]
        return _Type(f"mapping of {key.text} to {value.text}", keys + own)
    if annotation is Any:
        return _Type("any", [])
    scalar = _SCALARS.get(annotation)
    if scalar is None:
        raise TypeError(f"{MODULE} cannot describe the type {annotation!r}")
    return _Type(scalar, _Constraints().read(metadata).words("value", text=annotation is str))


# ---------------------------------------------------------------- walking the schema


def _pydantic_sections(
    cls: type[BaseModel],
    prefix: str,
    default,
    depth: int,
    entry: Entry | None,
    title: str = "",
    anchor: str = "",
) -> list[Section]:
    """The section of `cls` at `prefix` and its subsections, depth first. `default`: the
    instance the section is when it is left out (its fields' defaults come from it)."""
    rows, entries, subsections = [], [], []
    for name, info in cls.model_fields.items():
        key, tp = f"{prefix}{name}", _type(info.annotation, info.metadata)
        owner, source = f"{cls.__name__}.{name}", _source(cls)
        description = _sentence(_prose(info.description), capital=True)
        if cls is Spec and name == "model":
            row = Entry(
                key,
                "mapping",
                "required",
                "",
                _join(description, LOADER_NOTES[key]),
                owner,
                source,
                section=True,
                is_value=False,
            )
            rows.append(row)
            subsections += _model_kind_sections(row, depth + 1)
            continue
        sub = tp.section or tp.per_name
        if sub is None:
            value, is_value = _default(info, default, name)
            row = Entry(
                key,
                tp.text,
                value,
                "; ".join(tp.allowed),
                _join(description, LOADER_NOTES.get(key, "")),
                owner,
                source,
                is_value=is_value,
            )
            if default is not None and info.is_required():
                row.note = f" when `{prefix.rstrip('.')}` is left out; required in it"
            rows.append(row)
            entries.append(row)
            continue
        section_value = None if info.is_required() else info.get_default(call_default_factory=True)
        if default is not None:
            section_value = getattr(default, name)
        doc = _join(
            description,
            _prose(sub.__doc__) if tp.per_name is None else "",
            LOADER_NOTES.get(key, ""),
        )
        if tp.per_name is not None:  # a mapping of names the user chooses to sections
            text, is_value = _value_or("required", section_value)
            row = Entry(
                key, tp.text, text, "; ".join(tp.allowed), doc, owner, source, is_value=is_value
            )
            rows.append(row)
            entries.append(row)
            item = Entry(
                f"{key}.*",
                "mapping",
                "",
                "",
                _prose(sub.__doc__),
                sub.__name__,
                _source(sub),
                section=True,
                is_value=False,
            )
            subsections += _pydantic_sections(sub, f"{key}.*.", None, depth + 1, item)
            continue
        words = (
            "required"
            if info.is_required()
            else "none: the section is optional"
            if section_value is None
            else "every key at its default"
        )
        row = Entry(
            key,
            LOADER_TYPES.get(key, "mapping"),
            words,
            "",
            doc,
            owner,
            source,
            section=True,
            is_value=False,
        )
        rows.append(row)
        subsections += _pydantic_sections(sub, f"{key}.", section_value, depth + 1, row)
    path = prefix.rstrip(".")
    section = Section(title or f"`{path}`", anchor or path, depth, entry, rows, entries)
    return [section, *subsections]


def _join(*parts: str) -> str:
    return "\n\n".join(p for p in parts if p)


def _value_or(words: str, value) -> tuple[str, bool]:
    return (words, False) if value is None else (_json(value), True)


def _default(info: FieldInfo, section_default, name: str) -> tuple[str, bool]:
    """A field's default (JSON, True) or "required" (False). Inside a section that is
    itself defaulted, the section's default instance holds the value."""
    if section_default is not None:
        return _json(getattr(section_default, name)), True
    if info.is_required():
        return "required", False
    return _json(info.get_default(call_default_factory=True)), True


def _model_sections(
    kind: str, cfg_cls, prefix: str, depth: int, entry: Entry | None
) -> list[Section]:
    """A model kind's config dataclass at `prefix` as a section, nested config dataclasses
    (model.attention) as subsections."""
    hints = typing.get_type_hints(cfg_cls)
    docs = _attribute_docs(cfg_cls)
    checks = MODEL_CHECKS.get(cfg_cls, {})
    rows, entries, subsections = [], [], []
    for f in fields(cfg_cls):
        key, tp = f"{prefix}{f.name}", _type(hints[f.name])
        owner, source = f"{cfg_cls.__name__}.{f.name}", _source(cfg_cls)
        if tp.section is not None:
            doc = "\n\n".join(
                d for d in (_sentence(_prose(docs.get(f.name))), _prose(tp.section.__doc__)) if d
            )
            row = Entry(
                key,
                "mapping",
                "every key at its default",
                "",
                doc,
                owner,
                source,
                kind=kind,
                section=True,
                is_value=False,
            )
            rows.append(row)
            subsections += _model_sections(kind, tp.section, f"{key}.", depth + 1, row)
            continue
        factory: Any = f.default_factory
        value = f.default if f.default is not MISSING else factory()
        row = Entry(
            key,
            tp.text,
            _json(value),
            _model_allowed(f.name, checks.get(f.name), tp),
            _sentence(_prose(docs.get(f.name))),
            owner,
            source,
            kind=kind,
        )
        rows.append(row)
        entries.append(row)
    path = prefix.rstrip(".")
    section = Section(f"`{path}` (kind `{kind}`)", f"{path}@{kind}", depth, entry, rows, entries)
    return [section, *subsections]


def _model_allowed(name: str, check: Check | None, tp: _Type) -> str:
    check = check or Check()
    words = [_choices(check.choices)] if check.choices else []
    high, high_open = check.high, check.high_open
    limit = MODEL_LIMITS.get(name)
    if limit is not None and (high is None or limit[0] < high):
        high, high_open = limit[0], False
    if rng := _range(check.low, high, check.low_open, high_open):
        words.append(f"each {rng}" if check.items or tp.text.startswith("list") else rng)
    if check.note:
        words.append(check.note)
    if limit is not None:  # its note names one paper's sizes; the field's doc has them
        words.append("the upper bound is a size limit far above the papers' models")
    return "; ".join(words)


# ---------------------------------------------------------------- what the loader adds

LOADER_TYPES = {"dataset": "mapping, or string (a card's name)"}

LOADER_NOTES = {
    "dataset": "Give the card inline, as a mapping, or by name: `dataset: enwik8` reads "
    "`datasets/enwik8.yaml` (from a `datasets/` folder beside the spec's own "
    "folder, else the project's). `--set dataset.KEY=VALUE` changes one value of "
    "the named card; `--set dataset=NAME` takes another card.",
    "model": "The keys besides `model.kind` depend on the kind: each kind has its own "
    "section below, and the [index of model keys](#model) gives every key's default "
    "per kind.",
}


def _extends_entry() -> Entry:
    return Entry(
        "extends",
        "string or list of string",
        "none",
        "",
        "Spec files this one builds on, as paths relative to this file (each may extend "
        "others; a cycle is an error). They are merged in order and this file on top: "
        "mappings merge key by key, any other value, a list included, is replaced. A key "
        "that does nothing under the merged settings is refused where it is written (this "
        "file, or `--set`) and accepted when a base sets it, so a shared base may set what a "
        "variant switches off.",
        "load_spec",
        _source(load_spec),
        is_value=False,
    )


def _stage_notes() -> str:
    """Each stage kind, what it reads and which section it needs (the stages package's
    declarations, which the spec checks)."""
    from stages import STAGES

    lines = []
    for name, stage in STAGES.items():
        needs = [set(need) if isinstance(need, tuple) else {need} for need in stage.inputs]
        # a need that another implies (any of a superset of its stages) goes without saying
        needs = [n for n in needs if not any(m < n for m in needs)]
        reads = [" or ".join(f"`{o}`" for o in sorted(n, key=list(STAGES).index)) for n in needs]
        joint = ", and " if any(len(n) > 1 for n in needs) else " and "
        after = f" Comes after {joint.join(reads)}." if reads else ""
        section = f" Needs the `{stage.section_key}` section." if stage.section_key else ""
        plugin = f" ({origin})" if (origin := _plugin(STAGE_GROUP, name)) else ""
        lines.append(f"- `{name}`{plugin}: {_md(stage.summary)}{after}{section}")
    return "\n".join(lines)


def _stage_choices() -> str:
    """The registered stage kinds (plugins included), which validation checks `stages` by."""
    from stages import STAGES

    return f"each {_choices(STAGES)}"


def _model_kind_sections(model_row: Entry, depth: int) -> list[Section]:
    """`model`: its kind, an index of every kind's keys, and one section per kind."""
    import pipeline.models as registry

    labels = []
    for name, (cfg, _) in MODELS.items():
        origin = _plugin(MODEL_GROUP, name)
        labels.append(f"`{name}` ({cfg.__name__}{', ' + origin if origin else ''})")
    kinds = ", ".join(labels)
    kind = Entry(
        "model.kind",
        "string",
        "required",
        _choices(MODELS),
        f"The model family: {kinds}. The other `model.*` keys are the fields of its "
        f"config dataclass.",
        "MODELS",
        _source(registry),
        is_value=False,
    )
    per_kind = []
    for name, (cfg_cls, _) in MODELS.items():
        entry = Entry(
            "model",
            "mapping",
            "",
            "",
            _prose(cfg_cls.__doc__),
            cfg_cls.__name__,
            _source(cfg_cls),
            kind=name,
            section=True,
            is_value=False,
        )
        per_kind += _model_sections(name, cfg_cls, "model.", depth + 1, entry)
    main = Section(
        "`model`", "model", depth, model_row, [kind], [kind], extra=_model_index(per_kind)
    )
    return [main, *per_kind]


def _model_index(per_kind: list[Section]) -> str:
    """A table of every model key with each kind's default, linking to its entry."""
    by_key: dict[str, dict[str, Entry]] = {}
    for section in per_kind:
        for row in section.rows:
            assert row.kind is not None  # a model section's rows name their kind
            by_key.setdefault(row.key, {})[row.kind] = row
    lines = [
        "#### Model keys by kind",
        "",
        "Each key's default per kind; a link leads to the key's entry, — means the kind "
        "has no such key.",
        "",
        "| Key | " + " | ".join(f"`{k}`" for k in MODELS) + " |",
        "|---|" + "---|" * len(MODELS),
    ]
    for key, kinds in by_key.items():
        cells = []
        for name in MODELS:
            e = kinds.get(name)
            cells.append("—" if e is None else f"[{_cell_default(e) or 'mapping'}](#{e.anchor})")
        lines.append(f'| <a id="{key}"></a>`{key}` | ' + " | ".join(cells) + " |")
    return "\n".join(lines)


# ---------------------------------------------------------------- the page


def sections() -> list[Section]:
    """The page's sections in order: the top level, then each section of the spec, depth
    first."""
    out = _pydantic_sections(Spec, "", None, -1, None, title="Top level", anchor="top")
    top = out[0]
    top.depth = 0
    extends = _extends_entry()
    top.rows.insert(1, extends)
    top.entries.insert(1, extends)
    stages = next(e for e in top.entries if e.key == "stages")
    stages.description = _join(stages.description, _stage_notes())
    stages.allowed = "; ".join(filter(None, [stages.allowed, _stage_choices()]))
    anchors = [s.anchor for s in out] + [e.anchor for s in out for e in s.entries]
    duplicated = sorted({a for a in anchors if anchors.count(a) > 1})
    if duplicated:
        raise RuntimeError(f"anchors used twice: {', '.join(duplicated)}")
    return out


def keys() -> list[Entry]:
    """Every key the page documents: each section's own key and the keys it describes."""
    out = []
    for section in sections():
        if section.entry is not None:
            out.append(section.entry)
        out += section.entries
    return out


def _md(text: str) -> str:
    """Text as Markdown that shows it as written: outside code spans, what would turn into
    HTML or emphasis is escaped."""
    parts = text.split("`")
    for i in range(0, len(parts), 2):
        parts[i] = (
            parts[i]
            .replace("&", "&amp;")
            .replace("<", "&lt;")
            .replace(">", "&gt;")
            .replace("*", r"\*")
        )
    return "`".join(parts)


def _cell(text: str) -> str:
    return text.replace("|", r"\|")


def _cell_default(e: Entry) -> str:
    return f"`{e.default}`" if e.is_value else e.default


def _facts(e: Entry) -> list[str]:
    out = [f"- Type: {e.type}"]
    if e.default:
        out.append(f"- Default: {_cell_default(e)}{e.note}")
    if e.allowed:
        out.append(f"- Allowed: {e.allowed}")
    out.append(f"- Defined by: `{e.owner}` in `{e.source}`")
    return out


def _heading(e: Entry) -> str:
    kind = f" (kind `{e.kind}`)" if e.kind else ""
    return f'### <a id="{e.anchor}"></a>`{e.key}`{kind}'


def _render_section(s: Section) -> list[str]:
    out = [f'## <a id="{s.anchor}"></a>{s.title}', ""]
    if s.entry is not None:
        if s.entry.description:
            out += [s.entry.description, ""]
        out += _facts(s.entry) + [""]
    if s.rows:
        out += ["| Key | Type | Default |", "|---|---|---|"]
        out += [
            f"| [`{r.key}`](#{r.anchor}) | {_cell(r.type)} | {_cell(_cell_default(r))} |"
            for r in s.rows
        ]
        out.append("")
    for e in s.entries:
        out += [_heading(e), ""]
        if e.description:
            out += [e.description, ""]
        out += _facts(e) + [""]
    if s.extra:
        out += [s.extra, ""]
    return out


INTRO = f"""\
<!-- Generated from the schema (the spec's pydantic sections and the model config
dataclasses in pipeline/models/) by
    {REGENERATE}
Do not edit: change the descriptions there and regenerate; tests/unit/spec/test_reference.py fails
while this page is stale. -->

# Configuration reference

Every key a pipeline spec accepts: its type, its default, the values it allows, what it
does, and the class that defines it. The page is generated from the classes that validate a
spec, so its keys are exactly those `allattn-pipe validate` accepts.

## Reading a key

- A dotted key is a path through the YAML mappings: `train.optimizer.lr` is `lr` inside
  `optimizer` inside `train`:

  ```yaml
  train:
    optimizer:
      lr: 0.07
  ```

- `--set KEY=VALUE` sets any key from the command line, after everything else; the value is
  read as YAML: `allattn-pipe run CFG --set train.optimizer.lr=0.05 --set
  evaluate.splits=[test]`.
- `extends: [base.yaml]` merges other spec files under this one (see [`extends`](#extends));
  `dataset: NAME` reads the dataset card `datasets/NAME.yaml`, whose keys are the `dataset.*`
  keys.
- Validation is strict: an unknown key or a wrong type is an error naming the file and line
  (a quoted `"4"` is not an int; an int is accepted where a float is expected), and so are
  `.inf` and `.nan`, and a number training's dtype cannot hold: beyond float32's (and
  bf16's) range, about 3.4e38, a positive one below its smallest, 1.4e-45 (with
  `train.deepspeed.fp16`, a `model.*` number beyond 65504), and an lr that
  `finetune.lr_divisor` takes there. A key that does nothing under the other settings
  (`betas` with `adagrad`, say) is refused where it is written.
- `*` in a key stands for a name you choose (a file's role under `dataset.files`).
- The `model.*` keys depend on `model.kind`: each kind has a section of its own, and
  [the model keys by kind](#model) give each kind's default at a glance.
- Default is the value a key takes when it is left out; `allattn-pipe show CFG` prints a
  spec with every default filled in. Defined by names the class and field (or function)
  that declares the key, and its file.
"""


def render() -> str:
    """The reference page (Markdown)."""
    secs = sections()
    toc = ["## Sections", ""] + ["  " * s.depth + f"- [{s.title}](#{s.anchor})" for s in secs]
    body = [line for s in secs for line in _render_section(s)]
    return "\n".join([INTRO, *toc, "", *body]).rstrip() + "\n"


def page_path() -> Path:
    """Where the page lives: docs/reference.md in the project."""
    return PROJECT_ROOT / PAGE


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.split("\n")[0])
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--write", action="store_true", help=f"write {PAGE.as_posix()}")
    group.add_argument(
        "--check",
        action="store_true",
        help=f"exit 1 if {PAGE.as_posix()} differs from the schema's page",
    )
    args = parser.parse_args(argv)
    page, path = render(), page_path()
    if args.write:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(page, encoding="utf-8")
        print(f"wrote {PAGE.as_posix()} ({len(keys())} keys)", file=sys.stderr)
    elif args.check:
        current = path.read_text(encoding="utf-8") if path.is_file() else None
        if current != page:
            print(f"{PAGE.as_posix()} is stale: regenerate it with `{REGENERATE}`", file=sys.stderr)
            return 1
    else:
        sys.stdout.write(page)
    return 0


if __name__ == "__main__":
    sys.exit(main())
