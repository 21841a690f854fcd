"""The configuration reference (docs/reference.md, pipeline/spec/reference.py): current, every
key described, every key the schema accepts present, and its facts right."""

from __future__ import annotations

import dataclasses
import difflib
import json
import re
import typing
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

from pipeline.models import MODELS
from pipeline.spec import load_spec
from pipeline.spec import reference as ref
from pipeline.spec.schema import Spec

ROOT = Path(__file__).resolve().parents[3]
PAGE = ROOT / ref.PAGE


@pytest.fixture(scope="module")
def page() -> str:
    return ref.render()


def facts(page: str) -> dict[str, dict[str, str]]:
    """anchor -> {"Type": ..., "Default": ..., "Allowed": ..., "Defined by": ...} as the page
    shows them under each key's heading."""
    out: dict[str, dict[str, str]] = {}
    current = None
    for line in page.splitlines():
        if m := re.match(r'#{2,3} <a id="([^"]+)"></a>', line):
            current = out.setdefault(m.group(1), {})
        elif current is not None and (
            m := re.match(
                r"- (Type|Default|Allowed|Defined by): "
                r"(.*)",
                line,
            )
        ):
            current[m.group(1)] = m.group(2)
    return out


def code_value(text: str):
    """The JSON value in a fact's first code span (a default), or None if it has none."""
    m = re.match(r"`([^`]*)`", text)
    return json.loads(m.group(1)) if m else None


# ---------------------------------------------------------------- (a) the page is current


def test_page_is_current(page):
    assert PAGE.is_file(), f"{ref.PAGE} is missing: generate it with `{ref.REGENERATE}`"
    current = PAGE.read_text(encoding="utf-8")
    if current != page:
        diff = "".join(
            list(
                difflib.unified_diff(
                    current.splitlines(True), page.splitlines(True), str(ref.PAGE), "render()", n=1
                )
            )[:40]
        )
        pytest.fail(
            f"{ref.PAGE} is stale (the schema or its descriptions changed): "
            f"regenerate it with `{ref.REGENERATE}`\n{diff}"
        )


# ---------------------------------------------------------------- (b) every key described


def test_every_key_has_a_description():
    missing = [e.anchor for e in ref.keys() if not e.description.strip()]
    assert not missing, (
        f"keys without a description: {', '.join(missing)}. Give each a "
        f"Field(description=...) in the spec's schema (a section: its class docstring), or, "
        f"for model keys, a docstring under the field in the model's config dataclass"
    )


# ---------------------------------------------------------------- (c) every key present


def _inner(annotation) -> list[tuple[type, bool]]:
    """The sections (pydantic models, dataclasses) an annotation holds, each with whether
    it is the value of a mapping of names (dict[str, Section])."""
    found = []
    if isinstance(annotation, type) and (
        issubclass(annotation, BaseModel) or dataclasses.is_dataclass(annotation)
    ):
        return [(annotation, False)]
    if typing.get_origin(annotation) is dict:
        return [(cls, True) for cls, _ in _inner(typing.get_args(annotation)[1])]
    for arg in typing.get_args(annotation):
        found += _inner(arg)
    return found


def schema_keys() -> set[str]:
    """Every key a spec accepts, as the page anchors it (model keys: `key@kind`, and `key`
    in the index), found by walking the schema: pydantic fields, and each model kind's config
    dataclass fields."""
    keys = {"extends", "model.kind"}

    def pydantic(cls, prefix):
        for name, info in cls.model_fields.items():
            keys.add(prefix + name)
            for sub, per_name in _inner(info.annotation):
                pydantic(sub, f"{prefix}{name}.{'*.' if per_name else ''}")

    def dataclass(cls, prefix, kind):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            keys.update({f"{prefix}{f.name}@{kind}", f"{prefix}{f.name}"})
            if dataclasses.is_dataclass(hints[f.name]):
                dataclass(hints[f.name], f"{prefix}{f.name}.", kind)

    pydantic(Spec, "")
    for kind, (cfg_cls, _) in MODELS.items():
        dataclass(cfg_cls, "model.", kind)
    return keys


def test_every_key_is_on_the_page(page):
    anchors = set(re.findall(r'<a id="([^"]+)"></a>', page))
    missing = sorted(schema_keys() - anchors)
    assert not missing, f"keys the schema accepts but {ref.PAGE} lacks: {', '.join(missing)}"
    assert len(schema_keys()) > 150  # the walk found the schema, not a fragment of it


def test_links_lead_somewhere(page):
    anchors = set(re.findall(r'<a id="([^"]+)"></a>', page))
    broken = sorted(set(re.findall(r"\]\(#([^)]+)\)", page)) - anchors)
    assert not broken, f"links to no anchor: {', '.join(broken)}"


def test_keys_are_anchored_once(page):
    anchors = re.findall(r'<a id="([^"]+)"></a>', page)
    assert len(anchors) == len(set(anchors)), sorted(a for a in anchors if anchors.count(a) > 1)


# ---------------------------------------------------------------- (d) the facts


def _flatten(data, prefix=""):
    """Every dotted key path a YAML mapping writes, intermediate ones included."""
    out = set()
    for key, value in data.items():
        out.add(prefix + key)
        if isinstance(value, dict):
            out |= _flatten(value, f"{prefix}{key}.")
    return out


def test_defaults_are_what_load_spec_gives(page):
    """Every key configs/quickstart.yaml (and its dataset card) leaves out shows as default
    the value load_spec resolves it to."""
    config = yaml.safe_load((ROOT / "configs" / "quickstart.yaml").read_text())
    card = yaml.safe_load((ROOT / "datasets" / f"{config['dataset']}.yaml").read_text())
    written = _flatten(config) | _flatten(card, "dataset.")
    spec = load_spec(ROOT / "configs" / "quickstart.yaml")
    resolved = spec.resolved()
    kind = spec.model_kind
    checked = []
    for anchor, shown in facts(page).items():
        key, _, at_kind = anchor.partition("@")
        if "Default" not in shown or "*" in key or (at_kind and at_kind != kind):
            continue
        if not shown["Default"].startswith("`") or key in written:
            continue
        node = resolved
        for part in key.split("."):
            if not isinstance(node, dict) or part not in node:
                break  # a key this spec's other settings make inert
            node = node[part]
        else:
            assert code_value(shown["Default"]) == node, (
                f"{anchor}: the page's default {shown['Default']} is not load_spec's {node!r}"
            )
            checked.append(key)
    assert len(checked) >= 30, checked
    assert {
        "train.optimizer.schedule",
        "train.keep_checkpoints",
        "evaluate.checkpoint",
        "tracking.enabled",
        "model.span_init",
        "model.attention.impl",
    } <= set(checked)


@pytest.mark.parametrize(
    "anchor, fact, shown",
    [
        ("train.optimizer.lr", "Default", "`0.07`"),
        ("train.optimizer.lr", "Allowed", "value > 0"),
        ("train.optimizer.type", "Allowed", "one of `adagrad`, `adam`"),
        ("train.batch_size", "Default", "required"),
        ("train.eval_batches", "Type", 'int or `"all"`'),
        ("train.eval_batches", "Allowed", "0 < value ≤ 10^12 or `all`"),
        ("train.launcher.master_port", "Allowed", "0 < value < 2^16"),
        (
            "train.launcher.nodes",
            "Defined by",
            "`LauncherSpec.nodes` in `pipeline/spec/training_schema.py`",
        ),
        ("tracking.uri", "Type", "string or null"),
        ("evaluate.splits", "Default", '`["valid", "test"]`'),
        ("dataset.generator.frequency_sort.vocab", "Allowed", "1 < value ≤ 16,777,214"),
        (
            "dataset.generator.frequency_sort.sequences.train",
            "Default",
            "`8000` when `dataset.generator.frequency_sort.sequences` is left out; required in it",
        ),
        (
            "paper.results",
            "Allowed",
            "keys: `valid_bpc`, `test_bpc`, `valid_ppl`, `test_ppl`, "
            "`test_paper_loss`; at least 1 item",
        ),
        ("model.kind", "Allowed", "one of `active_memory`, `allattn`, `infinity_former`"),
        ("model.attn_double_scale@active_memory", "Default", "`false`"),
        ("model.attn_dropout@allattn", "Allowed", "0 ≤ value < 1"),
        ("model.tau@infinity_former", "Allowed", "0 < value < 1"),
        (
            "model.attention.impl@allattn",
            "Allowed",
            "one of `reference`, `sdpa`, `flex`, `triton`, `auto`",
        ),
        ("model.adaptive_cutoffs@allattn", "Default", "`[20000, 40000, 200000]`"),
    ],
)
def test_known_facts(page, anchor, fact, shown):
    assert facts(page)[anchor][fact] == shown


def test_model_limits_are_shown(page):
    """MODEL_LIMITS bound a model size whatever the kind: d_model at most 2^16."""
    shown = facts(page)
    for kind in MODELS:
        assert "1 ≤ value ≤ 2^16" in shown[f"model.d_model@{kind}"]["Allowed"]
    assert "each 0 < value ≤ 2^24" in shown["model.adaptive_cutoffs@allattn"]["Allowed"]


# ---------------------------------------------------------------- MODEL_CHECKS vs __post_init__


def _model_fields():
    for _kind, (cfg_cls, _) in MODELS.items():
        stack = [cfg_cls]
        while stack:
            cls = stack.pop()
            hints = typing.get_type_hints(cls)
            for f in dataclasses.fields(cls):
                if dataclasses.is_dataclass(hints[f.name]):
                    stack.append(hints[f.name])
                else:
                    yield cls, f.name, hints[f.name]


def test_every_model_field_states_its_values():
    """A model field that is not a bool says in MODEL_CHECKS which values its config's
    __post_init__ takes (an empty Check() if it takes any)."""
    missing = sorted(
        f"{cls.__name__}.{name}"
        for cls, name, hint in _model_fields()
        if hint is not bool and name not in ref.MODEL_CHECKS.get(cls, {})
    )
    assert not missing, f"no MODEL_CHECKS entry in pipeline/spec/reference.py for: {missing}"


def _outside(check: ref.Check, is_int: bool) -> list:
    step = 1 if is_int else 0.5
    values = []
    if check.low is not None:
        values.append(check.low if check.low_open else check.low - step)
    if check.high is not None:
        values.append(check.high if check.high_open else check.high + step)
    return values


CHECKED = [
    (cls, name, check) for cls, checks in ref.MODEL_CHECKS.items() for name, check in checks.items()
]


@pytest.mark.parametrize(
    "cls, name, check", CHECKED, ids=[f"{c.__name__}.{n}" for c, n, _ in CHECKED]
)
def test_model_checks_are_what_the_config_refuses(cls, name, check):
    """Each MODEL_CHECKS bound and choice is one the config dataclass enforces: a value just
    outside is refused naming the field, and the default is inside."""
    hint = typing.get_type_hints(cls)[name]
    default = cls()
    value = getattr(default, name)
    is_list = typing.get_origin(hint) is list
    item = typing.get_args(hint)[0] if is_list else hint
    tried = []
    for bad in _outside(check, item is int):
        tried.append([bad] if is_list else bad)
    if check.choices:
        tried.append("no-such-choice")
        assert value in check.choices
    assert tried or check.note == "", f"{cls.__name__}.{name}: a Check that checks nothing"
    for bad in tried:
        with pytest.raises(ValueError, match=name):
            cls(**{name: bad})
    for v in value if is_list else [value]:
        if check.low is not None:
            assert v > check.low if check.low_open else v >= check.low
        if check.high is not None:
            assert v < check.high if check.high_open else v <= check.high


def test_choices_are_all_the_config_takes():
    """A choice field refuses a bogus value with a message listing exactly the choices."""
    for cls, name, check in CHECKED:
        if not check.choices:
            continue
        with pytest.raises(ValueError) as err:
            cls(**{name: "no-such-choice"})
        listed = re.search(r"one of (.*?);", str(err.value))
        assert listed and tuple(listed.group(1).split(", ")) == tuple(check.choices), (
            f"{cls.__name__}.{name}: {err.value}"
        )


# ---------------------------------------------------------------- the command


def test_check_command(tmp_path, monkeypatch, capsys):
    """--check passes on a current page and fails, naming the command, on a stale one."""
    monkeypatch.setattr(ref, "page_path", lambda: tmp_path / ref.PAGE)
    assert ref.main(["--write"]) == 0
    assert (tmp_path / ref.PAGE).read_text(encoding="utf-8") == ref.render()
    assert ref.main(["--check"]) == 0
    (tmp_path / ref.PAGE).write_text("old\n", encoding="utf-8")
    assert ref.main(["--check"]) == 1
    assert ref.REGENERATE in capsys.readouterr().err
