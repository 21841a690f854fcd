"""Damaged versions of the real configs, for the fuzzers (tests/system/spec/test_spec_fuzz.py,
tests/system/commands/test_cli_fuzz.py, quality/fuzz.py).

The mutations are the kinds of damage a spec meets: odd scalars and YAML tags in place of
values (the tag's text drawn at random, like everything else), huge and infinite numbers,
deep structures, aliases (recursive, exponential), complex and merge keys, bad bytes, odd
`extends` targets, damaged dataset cards (where the curriculum and the documents live) and
`--set` overrides.
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path

import yaml
from hypothesis import strategies as st

from pipeline.spec import load_spec

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted(p for p in (ROOT / "configs").rglob("*.yaml") if p.parent.name != "base")
CARDS = sorted((ROOT / "datasets").glob("*.yaml"))

ODD_VALUES = [
    None,
    True,
    False,
    0,
    -1,
    2**31,
    2**63,
    10**12,
    10**15,
    8 * 10**9,
    10**30,
    -(10**30),
    float("inf"),
    float("-inf"),
    float("nan"),
    1e-300,
    0.5,
    "",
    " ",
    "x" * 300,
    "a\x00b",
    "../../etc",
    "é☃",
    [],
    {},
    [None],
    {"kind": None},
    "allattn",
    "python_docs",
]

# YAML text put where a value was (flow style, so it fits on the value's line)
LAUGHS = (
    "["
    + ", ".join(
        [f"&l0 [{', '.join(['lol'] * 9)}]"]
        + [f"&l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, 10)]
    )
    + "]"
)
FIXED_RAW_VALUES = [
    "!!int abc",
    "!!bool maybe",
    "!!timestamp 2020-99-99",
    "!!merge x",
    "!!float abc",
    "!!binary '%%%'",
    "!!python/object:os.system x",
    "!!set {a, b}",
    "!!omap [a: 1]",
    "!!str [1]",
    "!<tag:yaml.org,2002:int> 1.5",
    "!custom x",
    "*undefined",
    "&a [*a]",
    "&a {k: *a}",
    LAUGHS,
    "[" * 3000 + "]" * 3000,
    "{a: " * 500 + "1" + "}" * 500,
    "{[1]: 2}",
    "{{a: 1}: 2}",
    "{<<: {a: 1}}",
    "9" * 5000,
    ".inf",
    "-.inf",
    ".nan",
    "1e999",
    "0x" + "f" * 40,
    "2020-01-01",
    "~",
    "'unterminated",
    "[1, 2",
    "{a: 1, a: 2}",
    '"\\0"',
    '"\\x07"',
    "|\n  text",
]
# every tag the safe loader knows, and some it does not
TAGS = [
    "!!int",
    "!!float",
    "!!bool",
    "!!null",
    "!!str",
    "!!timestamp",
    "!!binary",
    "!!merge",
    "!!set",
    "!!omap",
    "!!pairs",
    "!!seq",
    "!!map",
    "!!value",
    "!!yaml",
    "!!python/object:os.system",
    "!!python/name:os.system",
    "!!python/tuple",
    "!<tag:yaml.org,2002:int>",
    "!custom",
    "!",
    "!!",
]
# the tagged text: any characters (newlines, quotes, colons, control characters), and text
# near what each tag accepts (digits, dates, base64), so that some of it gets through
tag_text = (
    st.text(max_size=16)
    | st.text(alphabet="0123456789-+:.eETZ_ xob", max_size=24)
    | st.text(alphabet="ABCDEFGHabcdefgh0123456789+/= ", max_size=24)
    | st.sampled_from(
        [
            "",
            "1",
            "-0",
            "2020-02-30",
            "2020-01-01 25:00:00",
            "yes",
            "0b2",
            "0o9",
            "1:60",
            "=",
            "[1]",
            "{a: 1}",
            "[a: 1]",
        ]
    )
)
tagged = st.builds(lambda tag, text: f"{tag} {text}", st.sampled_from(TAGS), tag_text)
raw_values = st.sampled_from(FIXED_RAW_VALUES) | tagged
raw_keys = (
    st.sampled_from(
        [
            "[1]",
            "{a: 1}",
            "<<",
            "!!int abc",
            "*undefined",
            "'" + "k" * 300 + "'",
            "''",
            "? [1, 2]\n  ",
        ]
    )
    | tagged
)

SENTINEL = "FUZZ_SENTINEL_{}"


def paths_in(data, prefix=()):
    """Every key path of a YAML tree (mapping keys and list indices)."""
    items = (
        data.items()
        if isinstance(data, dict)
        else (enumerate(data) if isinstance(data, list) else ())
    )
    for key, value in items:
        yield prefix + (key,)
        yield from paths_in(value, prefix + (key,))


def nested(depth: int, leaf):
    for _ in range(depth):
        leaf = [leaf]
    return leaf


values = (
    st.sampled_from(ODD_VALUES)
    | st.integers()
    | st.floats()
    | st.text(max_size=12)
    | st.builds(nested, st.integers(1, 150), st.sampled_from(ODD_VALUES))
    | st.recursive(
        st.sampled_from(ODD_VALUES),
        lambda inner: (
            st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
        ),
        max_leaves=8,
    )
)


def value_at(data, path):
    for key in path:
        data = data[key]
    return data


def mutate(data: dict, draw, raws: dict, workdir: Path) -> None:
    """One change to `data`; YAML text that safe_dump cannot write goes through `raws`."""
    paths = list(paths_in(data))
    leaves = [p for p in paths if not isinstance(value_at(data, p), (dict, list))] or paths
    path = draw(st.sampled_from(leaves) | st.sampled_from(paths))
    parent = value_at(data, path[:-1])
    kind = draw(st.sampled_from(["value", "raw value", "raw key", "delete", "extends"]))
    if kind == "value":
        parent[path[-1]] = copy.deepcopy(draw(values))  # ODD_VALUES holds mutable ones
    elif kind == "raw value":
        token = SENTINEL.format(len(raws))
        raws[token] = draw(raw_values)
        parent[path[-1]] = token
    elif kind == "raw key" and isinstance(parent, dict):
        token = SENTINEL.format(len(raws))
        raws[token] = draw(raw_keys)
        parent[token] = parent.pop(path[-1])
    elif kind == "delete":
        del parent[path[-1]]
    else:
        bad_bytes = workdir / "bad_bytes.yaml"
        bad_bytes.write_bytes(b"name: \xff\xfe caf\xe9\n")
        data["extends"] = draw(
            st.sampled_from(
                [
                    None,
                    [None],
                    "",
                    ".",
                    "a" * 300,
                    "missing.yaml",
                    str(bad_bytes),
                    str(workdir / "cfg" / "spec.yaml"),
                    [str(bad_bytes)],
                    {"a": 1},
                    12,
                    [str(ROOT / "configs" / "base" / "char_small.yaml")],
                ]
            )
        )


def damage_bytes(text: bytes, draw) -> bytes:
    kind = draw(st.sampled_from(["none"] * 5 + ["insert", "truncate", "complex top key"]))
    if kind == "insert":
        at = draw(st.integers(0, len(text)))
        return text[:at] + draw(st.binary(min_size=1, max_size=3)) + text[at:]
    if kind == "truncate":
        return text[: draw(st.integers(0, len(text)))]
    if kind == "complex top key":
        return text + b"{[1]: 2}: 3\n"
    return text


def overrides_for(data: dict, draw) -> list[str]:
    out = []
    for _ in range(draw(st.integers(0, 2))):
        key = ".".join(str(k) for k in draw(st.sampled_from(list(paths_in(data)) or [("x",)])))
        value = draw(
            raw_values
            | st.sampled_from(["1e999", str(10**30), str(10**15), "", "x=y", "[", "null"])
        )
        out.append(f"{key}={value}")
    return out


@functools.cache
def starting_point(config: Path, resolved: bool) -> str:
    """The config as written (its `extends` made absolute, as the copy lives elsewhere), or
    as `show` resolves it: every setting in one file, so that every one gets mutated."""
    if resolved:
        return yaml.safe_dump(load_spec(config).resolved(), sort_keys=False)
    data = yaml.safe_load(config.read_text(encoding="utf-8"))
    extends = data.get("extends")
    if extends:
        data["extends"] = [
            str(config.parent / e) for e in ([extends] if isinstance(extends, str) else extends)
        ]
    return yaml.safe_dump(data, sort_keys=False)


def damaged_text(data: dict, draw, workdir: Path) -> bytes:
    """1 to 3 mutations of `data` (in place), as the bytes of a YAML file."""
    raws: dict[str, str] = {}
    for _ in range(draw(st.integers(1, 3))):
        if data:
            mutate(data, draw, raws, workdir)
    text = yaml.safe_dump(data, sort_keys=False, allow_unicode=True)
    for token, raw in raws.items():
        text = text.replace(token, raw)
    return damage_bytes(text.encode("utf-8"), draw)


def damaged_config(draw, workdir: Path) -> tuple[Path, list[str]]:
    """A damaged copy of a real config, workdir/cfg/spec.yaml, and `--set` overrides for it.
    A config that names a dataset card may get a damaged copy of the card beside it
    (workdir/datasets/, which the loader searches first)."""
    config = draw(st.sampled_from(CONFIGS))
    resolved = draw(st.booleans())
    spec = yaml.safe_load(starting_point(config, resolved))
    (workdir / "cfg").mkdir(parents=True, exist_ok=True)
    card_name = spec.get("dataset") if isinstance(spec.get("dataset"), str) else None
    if card_name and draw(st.integers(0, 3)) == 0:
        card = yaml.safe_load((ROOT / "datasets" / f"{card_name}.yaml").read_text("utf-8"))
        (workdir / "datasets").mkdir(exist_ok=True)
        (workdir / "datasets" / f"{card_name}.yaml").write_bytes(damaged_text(card, draw, workdir))
        text = yaml.safe_dump(spec, sort_keys=False).encode("utf-8")
    else:
        text = damaged_text(spec, draw, workdir)
    target = workdir / "cfg" / "spec.yaml"
    target.write_bytes(text)
    return target, overrides_for(spec, draw)
