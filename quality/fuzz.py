"""The command-line fuzzer's figure: cases, tracebacks, hangs, exit codes, cases per command,
seconds. The same derandomized cases as tests/system/commands/test_cli_fuzz.py (which fails on any
bad one); here every case runs and the bad ones are listed.

    .venv/bin/python -m quality.fuzz [--cases 2000] [--show-bad 20]
    .venv/bin/python -m quality.fuzz --paths 1000   # the path fuzzer (quality/fuzzers/path_fuzz.py)
    .venv/bin/python -m quality.fuzz --secrets 1000 --injection 1000 --links 1000
        # issue 35's classes: secret_fuzz.py, injection_fuzz.py, link_fuzz.py (quality/fuzzers/)
    .venv/bin/python -m quality.fuzz --writes 60   # EFBIG and ENOSPC at every write site
        # (quality/fuzzers/write_fuzz.py; ENOSPC needs root or user namespaces for a tmpfs)
    .venv/bin/python -m quality.fuzz --stateful 300 --signals 200 [-j 2] [--seed 51]
        # issue 51's: sequences of commands, scores against their weights, records, signals
        # (quality/fuzzers/state_fuzz.py, signal_fuzz.py); --first I replays case I
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
import tempfile
import time
from pathlib import Path

from quality.fuzzers.cli_fuzz import build_world, fuzz
from quality.fuzzers.injection_fuzz import fuzz_injection
from quality.fuzzers.link_fuzz import fuzz_links
from quality.fuzzers.path_fuzz import fuzz_paths
from quality.fuzzers.secret_fuzz import fuzz_secrets
from quality.fuzzers.write_fuzz import fuzz_writes

ROOT = Path(__file__).resolve().parent.parent


def timed(run_fuzzer, cases: int) -> tuple[list, float, float]:
    """A fuzzer's outcomes over a fresh tiny world, the seconds the world took to train and
    the seconds the cases took."""
    outcomes = []
    with tempfile.TemporaryDirectory() as tmp:
        start = time.monotonic()
        world = build_world(Path(tmp) / "world")
        built = time.monotonic() - start
        start = time.monotonic()
        run_fuzzer(world, cases, outcomes.append)
        return outcomes, built, time.monotonic() - start


def print_headline(label: str, outcomes: list, built: float, seconds: float) -> None:
    """A campaign's first line: its cases, their time and the world's, the slowest case."""
    print(
        f"{label}{len(outcomes):,} in {seconds:.0f} s (+ {built:.0f} s to train the tiny "
        f"pipeline); slowest case {max(o.seconds for o in outcomes):.1f} s"
    )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=2000)
    parser.add_argument("--show-bad", type=int, default=20, help="bad cases to print")
    parser.add_argument(
        "--paths", type=int, metavar="N", help="run N cases of the path fuzzer instead"
    )
    for flag in ("secrets", "injection", "links"):
        parser.add_argument(f"--{flag}", type=int, metavar="N", help=f"run N {flag} cases instead")
    parser.add_argument(
        "--writes", type=int, metavar="N", help="run N write-failure (EFBIG, ENOSPC) cases instead"
    )
    parser.add_argument("--stateful", type=int, metavar="N", help="run N command sequences")
    parser.add_argument("--signals", type=int, metavar="N", help="run N signal cases")
    parser.add_argument("--steps", type=int, default=8, help="drawn steps per sequence")
    parser.add_argument("-j", "--jobs", type=int, default=2, help="workers (each a world)")
    parser.add_argument("--seed", type=int, default=51)
    parser.add_argument("--first", type=int, default=0, help="the first case's index")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    if args.stateful or args.signals:
        from quality.fuzzers.campaign import signal_campaign, stateful_campaign

        bad = 0
        if args.stateful:
            bad |= stateful_campaign(args)
        if args.signals:
            bad |= signal_campaign(args)
        sys.exit(bad)
    if args.paths:
        paths(args.paths, args.show_bad)
        return
    if args.writes:
        writes(args.writes, args.show_bad)
        return
    chosen = [(f, n) for f in ("secrets", "injection", "links") if (n := getattr(args, f))]
    if chosen:
        sys.exit(max(classes(f, n, args.show_bad) for f, n in chosen))
    outcomes, built, seconds = timed(fuzz, args.cases)
    bad = [o for o in outcomes if o.problem]
    kinds = collections.Counter(o.problem.split(":")[0] for o in bad)
    print_headline(f"{'cases':<17}", outcomes, built, seconds)
    print(f"tracebacks       {kinds['traceback']}")
    print(f"hangs (> 30 s)   {kinds['hang']}")
    print(f"other bad cases  {len(bad) - kinds['traceback'] - kinds['hang']}")
    exits = collections.Counter(o.exit_code for o in outcomes)
    print(
        "exit codes       "
        + ", ".join(
            f"{code}: {n}" for code, n in sorted(exits.items(), key=lambda item: str(item[0]))
        )
    )
    print_table(by_command(outcomes), "command", 24)
    for o in bad[: args.show_bad]:
        print(f"\n{o.args!r}\n  {o.problem}")
    sys.exit(1 if bad else 0)


def paths(cases: int, show_bad: int) -> None:
    """The path fuzzer's figure: cases, files changed outside what the command owns,
    tracebacks, hangs, by command."""
    outcomes, built, seconds = timed(fuzz_paths, cases)
    bad = [o for o in outcomes if o.problem]
    kinds = collections.Counter(o.problem.split(":")[0] for o in bad)
    print_headline(f"{'path cases':<17}", outcomes, built, seconds)
    print(f"changed files outside what the command owns  {kinds['changed what it does not own']}")
    print(f"tracebacks       {kinds['traceback']}")
    print(f"hangs            {kinds['hang']}")
    named = sum(kinds[k] for k in ("traceback", "hang", "changed what it does not own"))
    print(f"other bad cases  {len(bad) - named}")
    exits = collections.Counter(str(c) for o in outcomes for c in o.exit_codes)
    print("exit codes       " + ", ".join(f"{code}: {n}" for code, n in sorted(exits.items())))
    print_table(by_command(outcomes), "command", 24, exits=False)
    for o in bad[:show_bad]:
        print(f"\n{o.args!r}\n  {o.problem}")
    sys.exit(1 if bad else 0)


def by_command(outcomes) -> dict[str, list]:
    groups = collections.defaultdict(list)
    for o in outcomes:
        groups[o.command].append(o)
    return groups


def print_table(
    groups: dict[str, list], label: str, width: int, exits=True, seconds=True, cut=False
):
    """One row per group of cases: how many, how many exited 0 and 2, how many went wrong,
    the slowest case's seconds; with `cut`, a label longer than `width` is cut to it."""
    columns = [("cases", 6, len)]
    if exits:
        columns += [
            ("exit 0", 7, lambda g: sum(o.exit_code == 0 for o in g)),
            ("exit 2", 7, lambda g: sum(o.exit_code == 2 for o in g)),
        ]
    columns += [("bad", 4, lambda g: sum(bool(o.problem) for o in g))]
    print(f"\n{label:<{width}} " + " ".join(f"{name:>{w}}" for name, w, _ in columns), end="")
    print(f" {'max s':>6}" if seconds else "")
    for key, group in sorted(groups.items()):
        row = " ".join(f"{count(group):>{w}}" for _, w, count in columns)
        slowest = f" {max(o.seconds for o in group):>6.1f}" if seconds else ""
        print(f"{key[:width] if cut else key:<{width}} {row}{slowest}")


NOT_ONE_LINE = "not one 'error"


def writes(cases: int, show_bad: int) -> None:
    """The write-failure fuzzer's figure: cases by command and failure kind, the ones that
    went wrong (a traceback, not one error line, earlier files changed, a partial file)."""
    outcomes, built, seconds = timed(fuzz_writes, cases)
    ran = [o for o in outcomes if not o.skipped]
    bad = [o for o in ran if o.problem]
    kinds = collections.Counter(o.problem.split(":")[0] for o in bad)
    print_headline(f"{'write cases':<17}", outcomes, built, seconds)
    print(f"skipped          {len(outcomes) - len(ran)} (ENOSPC: no tmpfs can be mounted here)")
    print(f"tracebacks       {kinds['traceback']}")
    print(f"not one line     {kinds[NOT_ONE_LINE]}")
    print(f"bad cases        {len(bad)}")
    groups = collections.defaultdict(list)
    for o in ran:
        groups[f"{o.command:<16} {o.failure.split()[0]:<7}"].append(o)
    print_table(groups, f"{'command':<16} failure", 24, seconds=False)
    said = collections.Counter(
        " ".join(re.sub(r"(/[^\s:;,()]+)+", "PATH", o.said).split()[:9])
        for o in ran
        if o.exit_code == 2
    )
    print("\nerror lines, by their first words (paths as PATH):")
    for words, n in said.most_common():
        print(f"  {n:>4}  {words}")
    for o in bad[:show_bad]:
        print(f"\n{o.command} {o.failure}\n  {o.problem}\n  said: {o.said}")
    sys.exit(1 if bad else 0)


CLASS_FUZZERS = {"secrets": fuzz_secrets, "injection": fuzz_injection, "links": fuzz_links}
# what each figure counts: a case whose problem names it (a case can name more than one)
FIGURES = [
    ("leaks", "leak:", "secrets"),
    ("commands run", "command ran", "injection"),
    ("values mangled", "mangled", "injection"),
    ("bad #SBATCH lines", "directives", "injection"),
    ("scripts failing", "script failed", "injection"),
    ("files changed outside", "changed outside", "links"),
    ("tracebacks", "traceback", None),
    ("hangs (> 30 s)", "hang", None),
    ("not one error line", NOT_ONE_LINE, None),
]


def classes(name: str, cases: int, show_bad: int) -> int:
    """One of issue 35's fuzzers: its figures, cases by command, the bad cases; 1 if any."""
    outcomes, built, seconds = timed(CLASS_FUZZERS[name], cases)
    bad = [o for o in outcomes if o.problem]
    print_headline(f"{name} cases  ", outcomes, built, seconds)
    for label, marker, only in FIGURES:
        if only in (None, name):
            n = sum(marker in o.problem for o in bad)
            extra = f" ({sum(o.ran for o in outcomes)} canaries)" if marker == "command ran" else ""
            print(f"  {label:<24} {n}{extra}")
    print(f"  {'bad cases':<24} {len(bad)}")
    known = collections.Counter(k for o in outcomes if (k := getattr(o, "known", None)))
    for what, n in sorted(known.items()):
        print(f"  known, not counted: {what}: {n}")
    print_table(by_command(outcomes), "command", 58, cut=True)
    for o in bad[:show_bad]:
        print(f"\n{o.args!r}\n  {o.problem}\n  said: {o.said}")
    print()
    return 1 if bad else 0


if __name__ == "__main__":
    main()
