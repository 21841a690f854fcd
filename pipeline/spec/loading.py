"""`load_spec`: a config file, its `extends`, its dataset card, `--smoke` and the `--set`
overrides merged, validated and checked for keys that do nothing, in that order."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from pipeline.errors import shown
from pipeline.spec.base_configs import base_config_problem
from pipeline.spec.schema import Spec
from pipeline.spec.smoke import BUILTIN_CARD, smoke_data
from pipeline.spec.validation import InertKeysError, refuse_inert_keys, validate_spec
from pipeline.spec.yaml_reading import (
    SpecError,
    Where,
    apply_override,
    load_with_extends,
    parse_override,
    resolve_dataset_card,
)


def load_spec(
    path: str | Path,
    overrides: Sequence[str] = (),
    smoke: bool = False,
    log: Callable[[str], None] | None = None,
    strict: bool = False,
) -> Spec:
    """Read, merge, override and validate a pipeline spec; SpecError on any mistake.
    `smoke`: the config shrunk to a tiny model and a few steps (pipeline.spec.smoke), before
    the other `--set` overrides; `log` is told what it put in place of a downloaded dataset.
    An override `~KEY` removes KEY (it takes its default): how a sweep point drops a key
    that does nothing there. A key the file writes that only a --set switches off (the
    file's n_heads under --set model.mixer=conv) is dropped so, and `log` told; `strict`
    refuses it as any other key that does nothing (a sweep drops such keys itself)."""
    try:
        return _load_spec(path, overrides, smoke, log)
    except InertKeysError as e:
        if strict or not any(not text.startswith("~") for text in overrides):
            raise
        # the file's keys that act in the file on its own: the --set switched them off
        alone = inert_on_its_own(path, smoke)
        if alone is ALL:
            raise
        kept = [k for k in e.keys if k.origin.startswith("--set ") or k.key in alone]
        if kept:
            raise InertKeysError(kept) from None
        # no `log`: what it had to say, the first load said
        spec = _load_spec(path, [*overrides, *(f"~{k.key}" for k in e.keys)], smoke, None)
        if log is not None:
            for k in e.keys:
                log(f"{k.origin}: {k.key}: dropped, it does nothing with these --set ({k.why})")
        return spec


ALL = frozenset({"*"})
"""`inert_on_its_own` where the file does not load without its --set: every key counts."""


def inert_on_its_own(path: str | Path, smoke: bool = False) -> frozenset[str]:
    """The dotted keys that do nothing in the file `path` itself, without --set (`ALL` where
    it does not load on its own, so that nothing is taken for a --set's doing)."""
    try:
        _load_spec(path, (), smoke, None)
    except InertKeysError as e:
        return frozenset(k.key for k in e.keys)
    except SpecError:
        return ALL
    return frozenset()


def _load_spec(path, overrides, smoke, log) -> Spec:
    path = Path(path)
    origin = shown(path)  # where an error without a line of its own points
    where: dict = {}
    data = load_with_extends(path, where)
    removals = [text for text in overrides if text.startswith("~")]
    parsed = [(parse_override(text), text) for text in overrides if not text.startswith("~")]
    for (key, value), text in parsed:
        if key == ("dataset",):
            apply_override(data, key, value, where, text, path)
    if isinstance(data.get("dataset"), str):
        data["dataset"] = resolve_dataset_card(
            data["dataset"], path, where, where.get(("dataset",), origin)
        )
    if smoke:
        keep = any(key[0] == "dataset" for (key, _), _ in parsed)
        data = apply_smoke(data, path, where, keep, log)
    for (key, value), text in parsed:
        if key != ("dataset",):
            apply_override(data, key, value, where, text, path)
    if isinstance(data.get("dataset"), str):  # --set dataset=NAME
        data["dataset"] = resolve_dataset_card(
            data["dataset"], path, where, where.get(("dataset",), origin)
        )
    for text in removals:  # after every --set: `~KEY` removes KEY whatever set it
        remove_key(data, where, text)
    if "name" not in data and (problem := base_config_problem(path, origin)):
        # only a config refused anyway is compared with the files near it
        raise SpecError(problem)
    spec = validate_spec(data, where, origin)
    spec._source = str(path)
    refuse_inert_keys(spec, where, origin)
    return spec


def apply_smoke(data: dict, path: Path, where: dict, keep_dataset: bool, log) -> dict:
    """`smoke_data` on the merged data; the keys it set point at --smoke in `where`."""
    builtin = resolve_dataset_card(BUILTIN_CARD, path, {}, "--smoke")
    result = smoke_data(data, builtin, keep_dataset)
    for changed in result.changed:
        for k in [k for k in where if k[: len(changed)] == changed]:
            del where[k]
        where[changed] = Where("--smoke")
    if result.note and log:
        log(result.note)
    return result.data


def remove_key(data: dict, where: dict, text: str) -> None:
    """Apply the override `~KEY`: KEY out of the merged `data` (and its origins out of
    `where`); SpecError where KEY is not a key path or is not set."""
    key = text[1:].strip()
    path = tuple(key.split("."))
    if not key or not all(path):
        raise SpecError(f"--set {shown(text)}: '{shown(key)}' is not a dotted key path")
    node: dict | None = data
    for part in path[:-1]:
        node = node.get(part) if isinstance(node, dict) else None
    if not isinstance(node, dict) or path[-1] not in node:
        raise SpecError(
            f"--set {shown(text)}: {shown(key)} is not set in the config, so there is "
            f"nothing to remove"
        )
    del node[path[-1]]
    for k in [k for k in where if k[: len(path)] == path]:
        del where[k]
