"""Fuzzing `validate` and `show` with broken versions of the real configs: every input ends
either in success or in exit 2 with one located error per line, quickly; never a traceback
or a hang.

The mutations are the kinds of damage a spec meets: odd scalars and YAML tags in place of
values, huge and infinite numbers, deep structures, aliases (recursive, exponential),
complex and merge keys, bad bytes, odd `extends` targets and `--set` overrides.
"""

from __future__ import annotations

import copy
import functools
import re
import signal
import tempfile
import time
from pathlib import Path

import yaml
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.cli import main
from pipeline.spec import load_spec

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = sorted(p for p in (ROOT / "configs").rglob("*.yaml") if p.parent.name != "base")

# A hang detector, not a speed target: a refusal or a `show` takes well under a second alone
# (the deepest --set the fuzzer made: 0.3 s over a plain validate), but a shared 2-core CI
# machine has been seen to stretch one past 5 s; an exponential expansion never finishes.
SECONDS_PER_COMMAND = 10.0
HANG_SECONDS = 20

ODD_VALUES = [
    None, True, False, 0, -1, 2**31, 2**63, 10**12, 10**15, 8 * 10**9, 10**30, -10**30,
    float("inf"), float("-inf"), float("nan"), 1e-300, 0.5, "", " ", "x" * 300, "a\x00b",
    "../../etc", "é☃", [], {}, [None], {"kind": None}, "allattn", "python_docs",
]

# YAML text put where a value was (flow style, so it fits on the value's line)
LAUGHS = "[" + ", ".join(
    [f"&l0 [{', '.join(['lol'] * 9)}]"]
    + [f"&l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, 10)]) + "]"
RAW_VALUES = [
    "!!int abc", "!!bool maybe", "!!timestamp 2020-99-99", "!!merge x", "!!float abc",
    "!!binary '%%%'", "!!python/object:os.system x", "!!set {a, b}", "!!omap [a: 1]",
    "!!str [1]", "!<tag:yaml.org,2002:int> 1.5", "!custom x", "*undefined", "&a [*a]",
    "&a {k: *a}", LAUGHS, "[" * 3000 + "]" * 3000, "{a: " * 500 + "1" + "}" * 500,
    "{[1]: 2}", "{{a: 1}: 2}", "{<<: {a: 1}}", "9" * 5000, ".inf", "-.inf", ".nan",
    "1e999", "0x" + "f" * 40, "2020-01-01", "~", "'unterminated", "[1, 2", "{a: 1, a: 2}",
    '"\\0"', '"\\x07"', "|\n  text",
]
RAW_KEYS = ["[1]", "{a: 1}", "<<", "!!int abc", "*undefined", "'" + "k" * 300 + "'", "''",
            "? [1, 2]\n  "]

SENTINEL = "FUZZ_SENTINEL_{}"


def paths_in(data, prefix=()):
    """Every key path of a YAML tree (mapping keys and list indices)."""
    items = data.items() if isinstance(data, dict) else (
        enumerate(data) if isinstance(data, list) else ())
    for key, value in items:
        yield prefix + (key,)
        yield from paths_in(value, prefix + (key,))


def nested(depth: int, leaf):
    for _ in range(depth):
        leaf = [leaf]
    return leaf


values = (st.sampled_from(ODD_VALUES) | st.integers() | st.floats() | st.text(max_size=12)
          | st.builds(nested, st.integers(1, 150), st.sampled_from(ODD_VALUES))
          | st.recursive(st.sampled_from(ODD_VALUES),
                         lambda inner: st.lists(inner, max_size=3)
                         | st.dictionaries(st.text(max_size=6), inner, max_size=3),
                         max_leaves=8))


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
        parent[path[-1]] = copy.deepcopy(draw(values))   # ODD_VALUES holds mutable ones
    elif kind == "raw value":
        token = SENTINEL.format(len(raws))
        raws[token] = draw(st.sampled_from(RAW_VALUES))
        parent[path[-1]] = token
    elif kind == "raw key" and isinstance(parent, dict):
        token = SENTINEL.format(len(raws))
        raws[token] = draw(st.sampled_from(RAW_KEYS))
        parent[token] = parent.pop(path[-1])
    elif kind == "delete":
        del parent[path[-1]]
    else:
        bad_bytes = workdir / "bad_bytes.yaml"
        bad_bytes.write_bytes(b"name: \xff\xfe caf\xe9\n")
        data["extends"] = draw(st.sampled_from(
            [None, [None], "", ".", "a" * 300, "missing.yaml", str(bad_bytes),
             str(workdir / "spec.yaml"), [str(bad_bytes)], {"a": 1}, 12,
             [str(ROOT / "configs" / "base" / "char_small.yaml")]]))


def damage_bytes(text: bytes, draw) -> bytes:
    kind = draw(st.sampled_from(["none"] * 5 + ["insert", "truncate", "complex top key"]))
    if kind == "insert":
        at = draw(st.integers(0, len(text)))
        return text[:at] + draw(st.binary(min_size=1, max_size=3)) + text[at:]
    if kind == "truncate":
        return text[:draw(st.integers(0, len(text)))]
    if kind == "complex top key":
        return text + b"{[1]: 2}: 3\n"
    return text


def overrides_for(data: dict, draw) -> list[str]:
    out = []
    for _ in range(draw(st.integers(0, 2))):
        key = ".".join(str(k) for k in draw(st.sampled_from(list(paths_in(data)) or [("x",)])))
        value = draw(st.sampled_from(RAW_VALUES) | st.sampled_from(
            ["1e999", str(10**30), str(10**15), "", "x=y", "[", "null"]))
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
        data["extends"] = [str(config.parent / e)
                           for e in ([extends] if isinstance(extends, str) else extends)]
    return yaml.safe_dump(data, sort_keys=False)


def _hang(signum, frame):
    raise TimeoutError(f"still running after {HANG_SECONDS} s")


def run_command(args: list[str]):
    previous = signal.signal(signal.SIGALRM, _hang)
    signal.alarm(HANG_SECONDS)
    try:
        start = time.monotonic()
        result = CliRunner().invoke(main, args)
        return result, time.monotonic() - start
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def assert_clean(args: list[str], workdir: Path) -> None:
    result, seconds = run_command(args)
    assert result.exit_code in (0, 2), (
        f"{args}: exit {result.exit_code}: {result.exception!r}\n{result.output}")
    assert seconds < SECONDS_PER_COMMAND, f"{args}: took {seconds:.1f} s"
    if result.exit_code == 2:
        lines = result.stderr.splitlines()
        assert lines and lines[0].startswith("error: "), result.stderr
        lines[0] = lines[0][len("error: "):]
        # one error a line (every mistake is reported at once), each "PLACE: what", the place
        # a file (the damaged copy, or a config or card it reads) or the --set override
        assert all(re.match(rf"({re.escape(str(workdir))}|{re.escape(str(ROOT))}|--set )"
                            rf"[^\n]*?: \S", line) for line in lines), result.stderr
        assert "Traceback" not in result.output


@settings(max_examples=400, derandomize=True, database=None, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(config=st.sampled_from(CONFIGS), resolved=st.booleans(), data=st.data())
def test_validate_and_show_refuse_any_damaged_config_in_one_line(config, resolved, data):
    spec = yaml.safe_load(starting_point(config, resolved))
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        raws: dict[str, str] = {}
        for _ in range(data.draw(st.integers(1, 3))):
            if spec:
                mutate(spec, data.draw, raws, workdir)
        text = yaml.safe_dump(spec, sort_keys=False, allow_unicode=True)
        for token, raw in raws.items():
            text = text.replace(token, raw)
        target = workdir / "spec.yaml"
        target.write_bytes(damage_bytes(text.encode("utf-8"), data.draw))
        sets = [item for o in overrides_for(spec, data.draw) for item in ("--set", o)]
        for command in ("validate", "show"):
            assert_clean([command, str(target), *sets], workdir)
