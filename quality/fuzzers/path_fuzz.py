"""The path fuzzer: random path shapes for every path argument and path-valued key, and
commands run at once on one workspace.

Each case runs in a fresh sandbox holding things the command does not own: a foreign
directory with files (`victim/`), a file, a symlink to the foreign directory, a dangling
symlink, a sibling named like an old temporary (`.out.tmp/`), a directory whose files merely
have an export's names, and $HOME (so `~` stays in the sandbox). The path given is drawn from
`..` through missing directories, symlinks, a trailing `/.`, `~`, existing files and foreign
directories, unicode and very long names. Dataset cases (quality/fuzzers/archive_fuzz.py): card
file paths and archive member names, downloaded from a file:// source in the sandbox.

A case fails on a traceback, on a run past HANG_SECONDS, or when any file or directory in the
sandbox changed outside what the command owns: the resolved destination it was given (and the
missing directories above it), the workspace root and the cache the spec names. Used by
tests/system/commands/test_cli_fuzz.py (a short run) and quality/fuzz.py --paths N (the figure).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from hypothesis import strategies as st

from quality.fuzzers.archive_fuzz import draw_dataset_case
from quality.fuzzers.cli_fuzz import World
from quality.fuzzers.fuzz_kit import Case, invoke

HANG_SECONDS = 60
ROOT = Path(__file__).resolve().parents[2]

# the sandbox's foreign things, relative to it
FOREIGN = [
    "victim/thesis.tex",
    "victim/data/a.bin",
    "file.txt",
    ".out.tmp/theirs.txt",
    "export_like/config.json",
    "export_like/model.safetensors",
    "export_like/vocab.json",
    "cwd/notes.txt",
    "home/.bashrc",
]


def make_sandbox(root: Path, world: World) -> None:
    for name in FOREIGN:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(f"not yours: {name}\n")
    (root / "link_to_victim").symlink_to(root / "victim")
    (root / "dangling").symlink_to(root / "nowhere")
    (root / "cwd" / "sub").mkdir()
    # the trained tiny pipeline, as this case's own: its workspace is the command's
    shutil.copytree(world.root, root / "world", symlinks=True)
    (root / "world" / "tiny.yaml").write_text(
        (world.root / "tiny.yaml").read_text().replace(str(world.root), str(root / "world"))
    )


# a path, relative to the sandbox's cwd/ (where every command runs) unless absolute
segments = st.sampled_from(
    [
        "..",
        ".",
        "typo",
        "victim",
        "link_to_victim",
        "dangling",
        "file.txt",
        ".out.tmp",
        "export_like",
        "out",
        "new",
        "sub",
        "é☃",
        "日本",
        "x" * 255,
        "x" * 300,
        "~",
        "$HOME",
        "a b",
        "-",
        "--x",
        "\n",
    ]
)


@st.composite
def paths(draw, sandbox: Path) -> str:
    start = draw(st.sampled_from(["", "", "..", "../", str(sandbox) + "/", "~/", "~", "/"]))
    parts = draw(st.lists(segments, min_size=0, max_size=4))
    tail = draw(st.sampled_from(["", "", "", "/", "/.", "/..", "//"]))
    text = start.rstrip("/") + ("/" if start.endswith("/") and parts else "") + "/".join(parts)
    text = (text + tail) if text else tail.lstrip("/") or "."
    if len(text) > 4000:
        text = text[:4000]
    return text


def draw_case(draw, sandbox: Path) -> Case:
    tiny = str(sandbox / "world" / "tiny.yaml")
    path = draw(paths(sandbox))
    # commands run at once are two processes (seconds each): one case in about 25
    command = draw(
        st.sampled_from(
            ["export"] * 8
            + ["sync root"] * 4
            + ["sync cache"] * 2
            + ["validate experiment"] * 3
            + ["validate root"] * 2
            + ["compare --plot"] * 2
            + ["launch slurm --output"] * 2
            + ["export at once", "sync at once"]
            + ["dataset"] * 5
        )
    )
    if command == "dataset":
        return draw_dataset_case(draw, sandbox)
    if command == "export":
        return Case(command, ["export", tiny, "--out", path], [path])
    if command == "sync root":
        return Case(command, ["sync", tiny, "--set", f"workspace.root={path}"], [path])
    if command == "sync cache":
        return Case(command, ["sync", tiny, "--set", f"workspace.cache={path}"], [])
    if command == "validate experiment":
        name = draw(
            st.sampled_from(["", "..", "/", "a/b", "../../x", "ok-name", "é"]) | paths(sandbox)
        )
        return Case(command, ["validate", tiny, "--set", f"tracking.experiment={name}"])
    if command == "validate root":
        return Case(
            command,
            [
                "validate",
                tiny,
                "--set",
                f"workspace.root={path}",
                "--set",
                f"workspace.cache={draw(paths(sandbox))}",
            ],
        )
    if command == "compare --plot":
        plot = path + draw(st.sampled_from(["", ".png", ".pdf", ".svg"]))
        return Case(command, ["compare", tiny, "--plot", plot], [plot])
    if command == "launch slurm --output":
        return Case(
            command,
            [
                "launch",
                "slurm",
                tiny,
                "--nodes",
                "1",
                "--gpus-per-node",
                "0",
                "--procs-per-node",
                "1",
                "--output",
                path,
            ],
            [path],
        )
    if command == "export at once":
        return Case(command, ["export", tiny, "--out", path], [path], concurrent=True)
    return Case(command, ["sync", tiny], [], concurrent=True)


# ---------------------------------------------------------------- checking one


def snapshot(root: Path) -> dict[str, str]:
    """Every entry under `root` (symlinks not followed): a hash of a file's bytes, a symlink's
    target, 'dir' or 'special'."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            if os.path.islink(p):
                out[p] = "-> " + os.readlink(p)
            elif os.path.isdir(p):
                out[p] = "dir"
            elif not os.path.isfile(p):  # a FIFO, a socket: never opened (it would block)
                out[p] = "special"
            else:
                with open(p, "rb") as f:
                    out[p] = hashlib.sha256(f.read()).hexdigest()
    return out


def owned_paths(case: Case, sandbox: Path, cwd: Path) -> list[str]:
    """What the case's command may change: its workspace (the copied world), the store,
    and each destination resolved as the project resolves it (`~` is the sandbox's home)."""
    out = [str(sandbox / "world")] if case.world_owned else []
    for given in case.owned:
        if "--set" in case.args:
            given = _as_set_value(given)
        try:
            out.append(os.path.realpath(os.path.join(cwd, os.path.expanduser(given))))
        except (ValueError, OSError):
            pass
    return out


def _as_set_value(text: str) -> str:
    """A `--set KEY=VALUE` value as the spec reads it: typed as YAML (a newline in a plain
    scalar folds into a space, a trailing one goes)."""
    import yaml

    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    return value if isinstance(value, str) else text


def inside(path: str, owned: list[str]) -> bool:
    real_parent = os.path.realpath(os.path.dirname(path))
    real = os.path.join(real_parent, os.path.basename(path))
    for top in owned:
        if real == top or real.startswith(top.rstrip("/") + "/"):
            return True
        # a missing directory made on the way to a destination
        if top.startswith(real.rstrip("/") + "/"):
            return True
    return False


@dataclass
class Outcome:
    command: str
    args: list[str]
    exit_codes: list
    seconds: float
    problem: str | None


def _run_in_process(args: list[str], cwd: Path) -> tuple[int | None, str | None]:
    inv = invoke(args, cwd, timeout=HANG_SECONDS)
    return inv.exit_code, inv.problem


def _run_at_once(args: list[str], cwd: Path, env: dict) -> tuple[list, str | None]:
    cmd = [sys.executable, "-m", "pipeline.commands.cli", *args]
    procs = [
        subprocess.Popen(
            cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    codes, problem = [], None
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=HANG_SECONDS * 3)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            codes.append(None)
            problem = problem or "hang: a concurrent command did not end"
            continue
        codes.append(proc.returncode)
        if "Traceback" in err or proc.returncode not in (0, 2):
            problem = problem or f"traceback: exit {proc.returncode}: {err[-400:]!r}"
        elif (
            proc.returncode == 2
            and len([line for line in err.splitlines() if line.startswith("error: ")]) != 1
        ):
            problem = problem or f"not one 'error: ...' line: {err[-400:]!r}"
    return codes, problem


def run_case(case: Case, sandbox: Path) -> Outcome:
    cwd = sandbox / "cwd"
    before = snapshot(sandbox)
    start = time.monotonic()
    if case.concurrent:
        env = {
            **os.environ,
            "HOME": str(sandbox / "home"),
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        }
        codes, problem = _run_at_once(case.args, cwd, env)
    else:
        code, problem = _run_in_process(case.args, cwd)
        codes = [code]
    seconds = time.monotonic() - start
    if problem is None:
        owned = owned_paths(case, sandbox, cwd)
        after = snapshot(sandbox)
        changed = sorted(
            k
            for k in before.keys() | after.keys()
            if before.get(k) != after.get(k) and not inside(k, owned)
        )
        if changed:
            problem = f"changed what it does not own: {changed[:4]}"
        elif case.verify and codes == [0]:
            problem = case.verify()
    return Outcome(case.command, case.args, codes, seconds, problem)


def fuzz_paths(world: World, cases: int, on_outcome) -> None:
    """`cases` derandomized cases, each in a fresh sandbox with $HOME inside it."""
    import tempfile

    from quality.fuzzers.fuzz_kit import derandomized

    def one_case(draw):
        with tempfile.TemporaryDirectory() as tmp:
            sandbox = Path(tmp).resolve()
            make_sandbox(sandbox, world)
            home = os.environ.get("HOME")
            os.environ["HOME"] = str(sandbox / "home")
            try:
                case = draw_case(draw, sandbox)
                outcome = run_case(case, sandbox)
            finally:
                if home is None:
                    os.environ.pop("HOME", None)
                else:
                    os.environ["HOME"] = home
            on_outcome(outcome)

    derandomized(cases, one_case)
