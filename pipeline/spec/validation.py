"""Checking a merged spec against the schema (pydantic sections, the models' config
dataclasses made strict), each error located at the file and line the key came from, with
the nearest valid key for a typo; then the checks across sections (stages, inert keys).
"""

from __future__ import annotations

import difflib
import functools
import re
import typing
from collections.abc import Mapping
from dataclasses import MISSING, asdict, dataclass, fields, is_dataclass
from typing import Any

import pydantic
from pydantic import BaseModel, ConfigDict

from pipeline.errors import shown as _shown
from pipeline.models import MODELS
from pipeline.ops import backend_cannot_train_on, backends_that_train_on
from pipeline.spec.schema import Spec
from pipeline.spec.section_base import VOCAB_LIMIT
from pipeline.spec.yaml_reading import SpecError, dotted_path, short_repr, type_in_words


def _locate(where: dict, loc: tuple, fallback: str) -> str:
    for n in range(len(loc), -1, -1):
        if loc[:n] in where:
            return where[loc[:n]]
    return fallback


def _blame(where: dict, loc: tuple, message: str, fallback: str) -> str:
    """Where an error at `loc` came from. A check across keys (a model's d_model and n_heads,
    an optimizer's type and clip) reports at their section, whose line is in the file even
    when a `--set` gave the faulty value: the `--set`s of the keys under `loc` that `message`
    names are its origin; a section's check that names none of its `--set`s is placed at the
    section "with" them (the values it checked include theirs)."""
    overrides = {
        key: origin
        for key, origin in where.items()
        if len(key) > len(loc) and key[: len(loc)] == loc and str(origin).startswith("--set ")
    }
    named = [
        origin
        for key, origin in overrides.items()
        if isinstance(key[-1], str) and re.search(rf"(?<!\w){re.escape(key[-1])}(?!\w)", message)
    ]
    if named:
        return ", ".join(dict.fromkeys(named))
    place = _locate(where, loc, fallback)
    if loc and overrides and not place.startswith("--set "):
        return f"{place} with {', '.join(dict.fromkeys(overrides.values()))}"
    return place


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


def _describe(
    err: Mapping[str, Any], where: dict, fallback: str, schema, loc_prefix: tuple = ()
) -> str:
    loc = loc_prefix + tuple(err["loc"])
    place = _blame(where, loc, err["msg"], fallback)
    kind = err["type"]
    if kind == "extra_forbidden":
        key = loc[-1]
        valid = _schema_keys(schema, tuple(err["loc"])[:-1])
        close = difflib.get_close_matches(str(key), valid, n=1, cutoff=0.6)
        hint = (
            f" (did you mean '{close[0]}'?)"
            if close
            else (f" (valid keys: {', '.join(valid)})" if valid else "")
        )
        return f"{place}: {dotted_path(loc)}: unknown key '{_shown(key)}'{hint}"
    if kind == "missing":
        return f"{place}: {dotted_path(loc)}: required key is missing"
    msg = err["msg"]
    if msg.startswith("Input should be "):
        msg = "expected " + msg[len("Input should be ") :]
    elif msg.startswith("Value error, "):
        msg = msg[len("Value error, ") :]
    else:
        msg = msg[0].lower() + msg[1:]
    found = err.get("input")
    if kind == "value_error" and isinstance(found, dict):
        return f"{place}: {dotted_path(loc)}: {msg}"  # a check across the section's keys
    return f"{place}: {dotted_path(loc)}: {msg}; found {short_repr(found)} ({type_in_words(found)})"


def validate_spec(data: dict, where: dict, origin: str) -> Spec:
    """The merged spec `data` as a `Spec`; SpecError listing every mistake, each at the file
    and line (from `where`) it was written, `origin` where a key has none."""
    errors: list[str] = []
    try:
        spec = Spec.model_validate(data)
    except pydantic.ValidationError as e:
        spec = None
        errors += [_describe(err, where, origin, Spec) for err in e.errors()]

    errors += _check_stage_names(data.get("stages"), where, origin)
    model = data.get("model")
    params = None
    if isinstance(model, dict):
        kind = model.get("kind")
        if not isinstance(kind, str) or kind not in MODELS:
            close = (
                difflib.get_close_matches(kind, list(MODELS), n=1) if isinstance(kind, str) else []
            )
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            at = _locate(where, ("model", "kind"), origin)
            what = (
                "required key is missing"
                if kind is None
                else f"unknown model kind '{kind}'"
                if isinstance(kind, str)
                else (
                    "expected the name of a model kind, "
                    f"found {short_repr(kind)} ({type_in_words(kind)})"
                )
            )
            errors.append(f"{at}: model.kind: {what}{hint}; known: {', '.join(MODELS)}")
        else:
            cfg_cls = MODELS[kind][0]
            rest = {k: v for k, v in model.items() if k != "kind"}
            try:
                checked = _strict_schema(cfg_cls).model_validate(rest)
                params = cfg_cls(**checked.model_dump())  # nested mappings as dicts
            except pydantic.ValidationError as e:
                errors += [_describe(err, where, origin, cfg_cls, ("model",)) for err in e.errors()]
            except ValueError as e:  # the config's own cross-field checks
                errors.append(f"{_blame(where, ('model',), str(e), origin)}: model: {e}")

    if spec is not None and not errors:
        errors += _check_stages(spec, where, origin)
        errors += _check_model_for_training(spec, params, where, origin)
        errors += _check_float_range(spec, params, where, origin)
        errors += check_warmup_fits_steps(spec, where, origin)
        if (
            spec.train
            and spec.train.deepspeed.zero_stage == 3
            and getattr(params, "adaptive_span", False)
        ):
            errors.append(
                f"{_locate(where, ('train', 'deepspeed', 'zero_stage'), origin)}: "
                f"train.deepspeed.zero_stage: ZeRO stage 3 partitions every parameter "
                f"between forward passes, but an adaptive-span model reads its span "
                f"parameters outside forward (to size its cache and clamp them): use "
                f"zero_stage 1 or 2, or model.adaptive_span: false"
            )
    if spec is not None and not errors:
        errors += _check_names(spec, where, origin)
        errors += _check_home(spec, where, origin)
    if errors:
        raise SpecError("\n".join(errors))
    assert spec is not None  # a spec pydantic refused left its errors above
    _normalise_paths(spec)
    spec._model_params = params
    return spec


def check_warmup_fits_steps(spec: Spec, where: dict, origin: str) -> list[str]:
    """A warm-up as long as training never reaches the lr it warms up to (and finetune then
    divides an lr that was never reached): refused, with the fix."""
    train = spec.train
    if not (train and train.steps and train.optimizer.warmup_steps >= train.steps):
        return []
    warmup = ("train", "optimizer", "warmup_steps")
    # blame the one given last on the command line, else the warm-up's line
    steps_at = where.get(("train", "steps"), "")
    at = steps_at if steps_at.startswith("--set ") else _locate(where, warmup, origin)
    return [
        f"{at}: train.optimizer.warmup_steps {train.optimizer.warmup_steps:,} is not below "
        f"train.steps {train.steps:,}: the lr would never reach train.optimizer.lr; make "
        f"warmup_steps smaller than train.steps (0: no warm-up) or train.steps larger"
    ]


# a name that becomes one path component: the rule `name` has in the schema
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]*")
NAME_MAX = 100


def _check_names(spec: Spec, where: dict, origin: str) -> list[str]:
    """tracking.experiment names the directory of the local store's artifacts
    (<workspace.root>/mlartifacts/<experiment>): it is held to `name`'s rule, so that `..`,
    `/any/dir` or a separator can never put them outside workspace.root."""
    experiment = spec.tracking.experiment
    if experiment is None or (
        NAME_PATTERN.fullmatch(experiment)
        and len(experiment) <= NAME_MAX
        and experiment not in (".", "..")
    ):
        return []
    at = _locate(where, ("tracking", "experiment"), origin)
    return [
        f"{at}: tracking.experiment: becomes a directory name under "
        f"{{workspace.root}}/mlartifacts, so it is held to the rule `name` has: letters, "
        f"digits, '_', '.', '+', '-', starting with a letter or digit, at most {NAME_MAX} "
        f"characters; found {short_repr(experiment)}"
    ]


def _check_home(spec: Spec, where: dict, origin: str) -> list[str]:
    """workspace.root and workspace.cache starting with a `~` that names no directory (a
    container's user with no HOME and no passwd entry): refused here, before `run` would make
    a directory named `~` or fail on it with a traceback."""
    from pipeline.fsutil import home_problem

    errors = []
    for key in ("root", "cache"):
        value = getattr(spec.workspace, key)
        if value is not None and (problem := home_problem(value)):
            at = _locate(where, ("workspace", key), origin)
            errors.append(f"{at}: workspace.{key}: {problem}; found {short_repr(value)}")
    return errors


def _normalise_paths(spec: Spec) -> None:
    """workspace.root and workspace.cache as every path the user gives is read
    (`fsutil.user_path`): `~` expanded, `..` resolved, so nothing is created beside them."""
    from pipeline.fsutil import user_path

    spec.workspace.root = str(user_path(spec.workspace.root))
    if spec.workspace.cache is not None:
        spec.workspace.cache = str(user_path(spec.workspace.cache))


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
def _strict_schema(cfg_cls: Any) -> type[BaseModel]:
    """A strict pydantic model with the fields of a model's config dataclass: the models
    stay plain dataclasses, the spec still refuses unknown keys, wrong types, infinities and
    sizes above MODEL_LIMITS. A field whose type is itself a dataclass (model.attention) is
    checked the same way."""
    hints = {
        name: _strict_schema(typing.cast(Any, t))
        if is_dataclass(t)
        else typing.Annotated[t, _at_most(name)]
        if name in MODEL_LIMITS
        else t
        for name, t in typing.get_type_hints(cfg_cls).items()
    }
    field_types: dict[str, Any] = {f.name: (hints[f.name], _default(f)) for f in fields(cfg_cls)}
    return pydantic.create_model(
        cfg_cls.__name__,
        __config__=ConfigDict(extra="forbid", strict=True, allow_inf_nan=False),
        **field_types,
    )


def _default(f) -> Any:
    value: Any = (
        f.default
        if f.default is not MISSING
        else (f.default_factory() if f.default_factory is not MISSING else ...)
    )
    if is_dataclass(value) and not isinstance(value, type):
        return _strict_schema(type(value))(**asdict(value))
    return value


def _check_model_for_training(spec: Spec, params, where: dict, origin: str) -> list[str]:
    """What the model would refuse only at its first training step or block, said here:
    the attention backend that cannot train with these settings, and the ∞-former's
    short-term memory shorter than a segment."""
    errors = []
    trains = bool({"train", "finetune"} & set(spec.stages)) and spec.train is not None
    impl = getattr(getattr(params, "attention", None), "impl", None)
    at_impl = _locate(where, ("model", "attention", "impl"), origin)
    if trains and impl == "sdpa" and getattr(params, "attn_dropout", 0) > 0:
        errors.append(
            f"{at_impl}: model.attention.impl: sdpa has no attention dropout (SDPA's "
            f"own drops weights before the span mask), and this model trains with attn_dropout "
            f"{params.attn_dropout}: use flex, reference or auto (or attn_dropout 0)"
        )
    train = spec.train
    if trains and train is not None and isinstance(impl, str) and train.device != "auto":
        # train.device auto: the train stage asks, on the device it resolves
        if why := backend_cannot_train_on(impl, train.device):
            errors.append(
                f"{at_impl}: model.attention.impl: {why} and train.device is {train.device}: "
                f"use {backends_that_train_on(train.device)} to train on {train.device.upper()}"
            )
    if getattr(params, "ltm", False) and hasattr(params, "mem_len"):
        segments: dict[str, int | None] = {}
        if trains and train is not None:
            segments |= {"train.seq_len": train.seq_len, "train.eval_seq_len": train.eval_seq_len}
        if "evaluate" in spec.stages:
            segments["evaluate.seq_len"] = spec.evaluate.seq_len
        for key, length in segments.items():
            if length and length > params.mem_len:
                errors.append(
                    f"{_locate(where, ('model', 'mem_len'), origin)}: model.mem_len "
                    f"{params.mem_len} is shorter than {key} {length}: with the long-term "
                    f"memory on, the states leaving the short-term memory in a segment wait "
                    f"in its mem_len extra rows; make mem_len at least {length}"
                )
    return errors


FLOAT32_MAX = 3.4028234663852886e38  # bf16 has float32's exponent: the same range
FLOAT32_TINIEST = 1.401298464324817e-45  # below half of it, a number rounds to 0
FLOAT16_MAX = 65504.0


def _floats(node, path: tuple):
    """(path, value) of every float in plain data (bools are ints, not floats)."""
    if isinstance(node, float):
        yield path, node
    elif isinstance(node, dict):
        for key, value in node.items():
            yield from _floats(value, (*path, key))
    elif isinstance(node, list | tuple):
        for i, value in enumerate(node):
            yield from _floats(value, (*path, i))


def _check_float_range(spec: Spec, params, where: dict, origin: str) -> list[str]:
    """The numbers training computes with, refused where its dtype cannot hold them: past
    float32's range (bf16's too) a learning rate or a coefficient becomes inf inside the
    optimizer or the model; a positive one below its smallest number becomes 0. Under fp16
    the model's own numbers multiply fp16 tensors, so they must fit fp16's 65504."""
    errors: list[str] = []
    model = asdict(params) if is_dataclass(params) and not isinstance(params, type) else {}
    data: dict[str, Any] = {"model": model}
    if spec.train is not None:
        data["train"] = spec.train.model_dump(mode="python")
    if spec.finetune is not None:
        data["finetune"] = spec.finetune.model_dump(mode="python")
    fp16 = spec.train is not None and spec.train.deepspeed.fp16
    found = list(_floats(data, ()))
    if spec.train is not None and spec.finetune is not None and "finetune" in spec.stages:
        # finetune trains at this lr: checked where the divisor is
        lr = spec.train.optimizer.lr / spec.finetune.lr_divisor
        found.append((("finetune", "lr_divisor"), lr))
    for loc, value in found:
        dtype, largest = (
            ("fp16", FLOAT16_MAX) if fp16 and loc[0] == "model" else ("float32", FLOAT32_MAX)
        )
        derived = loc == ("finetune", "lr_divisor") and value != data["finetune"]["lr_divisor"]
        if derived and errors:  # its own parts are refused already
            continue
        what = f"train.optimizer.lr / finetune.lr_divisor = {value:g}" if derived else None
        if abs(value) > largest:
            why = (
                f"beyond {dtype}'s range (at most {largest:g} in magnitude), the dtype "
                f"training computes in: it would be inf there"
            )
        elif 0 < abs(value) < FLOAT32_TINIEST / 2:
            why = (
                f"too small for float32 (its smallest positive number is "
                f"{FLOAT32_TINIEST:g}): it would be 0 there"
            )
        else:
            continue
        errors.append(
            f"{_locate(where, loc, origin)}: {dotted_path(loc)}: "
            f"{f'{what} is ' if what else ''}{why}"
            f"{'' if what else f'; found {short_repr(value)} ({type_in_words(value)})'}"
        )
    return errors


def _check_stage_names(names, where: dict, origin: str) -> list[str]:
    """Each name in `stages:` a registered stage kind (built-in or a plugin's); the list's
    own shape is the schema's to check."""
    from stages import STAGES

    if not isinstance(names, list):
        return []
    errors = []
    for i, name in enumerate(names):
        if not isinstance(name, str) or name in STAGES:
            continue
        close = difflib.get_close_matches(name, list(STAGES), n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        errors.append(
            f"{_locate(where, ('stages', i), origin)}: stages.{i}: unknown stage "
            f"kind '{_shown(name)}'{hint}; known: {', '.join(STAGES)}"
        )
    return errors


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
                errors.append(
                    f"{at}: stages: '{name}' reads the output of "
                    f"{' or '.join(repr(o) for o in options)}, which must come "
                    f"before it in the list"
                )
        section = stage.section_key
        if section and getattr(spec, section) is None:
            errors.append(f"{at}: stages: '{name}' needs a `{section}:` section")
        seen.append(name)
    if "train" in spec.stages and spec.train:
        errors += [
            f"{_locate(where, ('train', key), origin)}: train.{key}: required key is missing"
            for key in ("steps", "seq_len")
            if getattr(spec.train, key) is None
        ]
    if "curriculum" in spec.stages:
        generator = spec.dataset.generator
        if generator is None or generator.algorithmic is None:
            errors.append(
                f"{_locate(where, ('dataset',), origin)}: dataset: the curriculum "
                f"stage trains on an algorithmic task (dataset.generator.algorithmic, "
                f"e.g. dataset: reverse_algorithmic); '{spec.dataset.name}' is not one"
            )
        if spec.train and spec.train.optimizer.type != "adam":
            errors.append(
                f"{_locate(where, ('train', 'optimizer', 'type'), origin)}: "
                f"train.optimizer.type: the curriculum trains with adam (the paper's "
                f"tasks); found {spec.train.optimizer.type}"
            )
    return errors


@dataclass(frozen=True)
class InertKey:
    """A key the user wrote that does nothing under the spec's other settings."""

    key: str  # dotted: model.n_heads
    origin: str  # where it was written: FILE:LINE or --set KEY=VALUE
    why: str


# what a user can do instead of deleting the key: a base may set what its variants switch off
INERT_WAY_OUT = (
    "remove it, or move it into a base this config `extends` (where it is accepted); "
    "a sweep drops it at each point where it does nothing"
)


class InertKeysError(SpecError):
    """The keys, written in the config or by --set, that do nothing here (`keys`); a sweep
    drops them at the points where they do nothing (pipeline.commands.sweep)."""

    def __init__(self, keys: list[InertKey]):
        self.keys = keys
        super().__init__(
            "\n".join(
                f"{k.origin}: {k.key}: does nothing here ({k.why}); {INERT_WAY_OUT}" for k in keys
            )
        )


def refuse_inert_keys(spec: Spec, where: dict, top: str) -> None:
    """Every key acts or is refused: one that does nothing under the other settings is an
    error where the user wrote it (this file, or --set), and so is any key under it
    (`--set train.deepspeed.bf16=true` where train.deepspeed does nothing). From an `extends`
    base it is accepted: a shared base sets what some of its variants switch off."""

    def by_user(origin) -> bool:
        return bool(origin) and (
            str(origin).startswith("--set ") or str(origin).rsplit(":", 1)[0] == top
        )

    keys = []
    for key, why in spec.inert_keys():
        written = sorted(
            path for path, origin in where.items() if path[: len(key)] == key and by_user(origin)
        )
        # the outermost the user wrote: the section, else each key under it once
        for path in written:
            if not any(path[: len(other)] == other for other in written if other != path):
                keys.append(InertKey(dotted_path(path), str(where[path]), why))
    if keys:
        raise InertKeysError(keys)
