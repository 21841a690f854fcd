"""The write-failure fuzzer (issue 45, item 8): a file too large (EFBIG) and a full disk
(ENOSPC) drawn at every write site of a run, each a real failure of the kernel's, not a
stand-in for the code that writes.

- EFBIG: the command runs in a child process whose RLIMIT_FSIZE (`ulimit -f`) is set by
  `preexec_fn`; Python ignores SIGXFSZ, so the write past the limit fails with EFBIG. The
  limit is drawn from the sizes of the files the stage writes (a byte under one of them, so
  that file is the first too large), 0 and a few bytes (the workspace lock's pid line), or
  any number up to the largest.
- ENOSPC: the command runs in its own mount namespace (`unshare --mount`) on a tmpfs that
  holds a copy of the world and then is shrunk (`mount -o remount,size=`) to what the copy
  uses plus a drawn number of bytes, up to what the stage writes: the disk fills at the
  write site that many bytes in. This needs root (CI) or unprivileged user namespaces;
  where neither is there, ENOSPC draws are counted as skipped, never as passed.

The sites: the download's copy (the built-in corpus into files/, and an http download's
`.part` in the cache from a local server), preprocess's shards, vocabulary and manifest,
train's and finetune's checkpoints, evaluate's results and every stage's records (stage.json,
the MLflow store and its artifacts), `export`'s files, and the workspace lock's pid line.

A case fails on a traceback, an exit other than 0 or 2, an exit 2 without exactly one
`error: ...` line, a file of the world that changed although it belongs to no stage the
command re-ran (earlier files intact), a temporary left in a published place, or a
published file that does not match its record (a stage's outputs, a checkpoint's checksums,
an export's marker): no partial final file. Used by tests/system/commands/test_write_fuzz.py
(a short run) and quality/fuzz.py --writes N (the figure).
"""

from __future__ import annotations

import hashlib
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from hypothesis import strategies as st

from quality.fuzzers.cli_fuzz import World, copy_world
from quality.fuzzers.fuzz_kit import CORPUS_SHA256

ROOT = Path(__file__).resolve().parents[2]
HANG_SECONDS = 300
PAGE = 4096

# command -> the stage it re-runs (None: not a stage)
COMMANDS = {
    "download": "download",
    "download http": "download",
    "preprocess": "preprocess",
    "train": "train",
    "finetune": "finetune",
    "evaluate": "evaluate",
    "export": None,
}
# what a run changes besides its stage's directories: the MLflow store, its artifacts, the
# tracking backlog a refusing store leaves, the lock, the download cache (a `.part` is kept
# there on purpose, to resume from)
MUTABLE = ("mlflow.db", "mlartifacts", "tracking-backlog", ".lock", "cache")
TEMPORARY = (".tmp", ".part")


def can_fill_a_disk() -> bool:
    """Whether this process may mount a small tmpfs in a mount namespace of its own."""
    if not shutil.which("unshare"):
        return False
    with tempfile.TemporaryDirectory() as tmp:
        probe = subprocess.run(
            [
                "unshare",
                "--mount",
                "--propagation",
                "private",
                "sh",
                "-c",
                f"mount -t tmpfs -o size=64k tmpfs {tmp}",
            ],
            capture_output=True,
            check=False,
        )
    return probe.returncode == 0


@dataclass
class Outcome:
    command: str
    failure: str  # "EFBIG <limit>" or "ENOSPC <bytes free>"
    exit_code: int | None
    seconds: float
    said: str  # the error line, or the output's tail
    problem: str | None
    skipped: bool = False


def stage_bytes(world: World, stage: str) -> list[int]:
    """The sizes of the files a finished stage holds: where its writes can fail."""
    done = world.root / "runs" / "tiny" / stage
    return sorted(f.stat().st_size for f in done.rglob("*") if f.is_file())


def args_for(command: str, world: Path, server_url: str | None, tracked: bool) -> list[str]:
    tiny = str(world / "tiny.yaml")
    if command == "export":
        return ["export", tiny, "--out", str(world / "exported")]
    stage = COMMANDS[command]
    assert stage is not None
    out = ["run", tiny, "--only", stage, "--force", stage]
    if not tracked:  # the MLflow store, a large file of its own, would fail first
        out += ["--set", "tracking.enabled=false"]
    if command == "download http":
        assert server_url is not None
        out += ["--set", f"dataset.url={server_url}", "--set", f"dataset.sha256={CORPUS_SHA256}"]
    return out


def draw_case(draw, world: World) -> tuple[str, bool, str, int]:
    """(command, tracked, EFBIG or ENOSPC, the size limit or the bytes left free)."""
    command = draw(st.sampled_from(list(COMMANDS)))
    tracked = draw(st.booleans())
    stage = COMMANDS[command] or "finetune"  # export writes about the finetuned weights
    sizes = stage_bytes(world, stage) or [1 << 16]
    kind = draw(st.sampled_from(["EFBIG", "ENOSPC"]))
    if kind == "EFBIG":
        limit = draw(
            st.sampled_from([0, 8])  # the lock's pid line, the first record
            | st.sampled_from(sizes).map(lambda n: max(n - 1, 0))
            | st.integers(0, max(sizes))
        )
        return command, tracked, kind, limit
    free = draw(st.integers(0, sum(sizes) + len(sizes) * PAGE))
    return command, tracked, kind, free


# ---------------------------------------------------------------- one case


def snapshot(root: Path) -> dict[str, str]:
    out = {}
    for f in sorted(root.rglob("*")):
        if f.is_file() and not f.is_symlink():
            out[str(f.relative_to(root))] = hashlib.sha256(f.read_bytes()).hexdigest()
    return out


def owned(name: str, command: str) -> bool:
    """Whether the command may change this file of the world (relative to its root)."""
    parts = Path(name).parts
    if any(part.startswith(MUTABLE) for part in parts):
        return True
    stage = COMMANDS[command]
    if stage is None:  # export: its --out, and the staging beside it
        return name.startswith("exported")
    # the stage's own directories: done, in progress, being replaced
    return len(parts) > 2 and parts[2] in (stage, f"{stage}.partial", f"{stage}.old")


def damage(world: Path, before: dict[str, str], command: str) -> str | None:
    """What the failed (or finished) run left wrong in `world`, or None."""
    from pipeline.fsutil import file_mismatch, read_json
    from pipeline.training.checkpoint_dirs import CHECKSUMS
    from pipeline.training.checkpoint_dirs import damage as checkpoint_damage

    after = snapshot(world)
    changed = [k for k in before if not owned(k, command) and after.get(k) != before[k]]
    if changed:
        return f"earlier files changed or lost: {changed[:4]}"
    workspace = world / "runs" / "tiny"
    for f in workspace.rglob("*"):
        inside_partial = any(p.endswith(".partial") for p in f.relative_to(workspace).parts)
        name = f.name
        if inside_partial or "cache" in f.relative_to(world).parts:
            continue
        if name.endswith(TEMPORARY) or name.startswith("tmp-step-"):
            return f"a temporary left in a published place: {f.relative_to(world)}"
    for record in workspace.glob("*/stage.json"):
        if record.parent.name.endswith(".partial"):
            continue
        for rel, expected in read_json(record).get("outputs", {}).items():
            why = file_mismatch(record.parent / rel, rel, expected, read=True)
            if why:
                return f"published {record.parent.name} is not what its record says: {why}"
    for checksums in workspace.rglob(CHECKSUMS):
        why = checkpoint_damage(checksums.parent)
        if why:
            return f"checkpoint {checksums.parent.relative_to(world)} is damaged: {why}"
    exported = world / "exported"
    if exported.exists() and not (exported / ".allattn-export").is_file():
        return "a partial export at --out (no marker)"
    leftovers = [p.name for p in world.iterdir() if p.name.startswith(".exported.")]
    if leftovers:
        return f"the export's staging left beside --out: {leftovers}"
    return None


def judged(code: int | None, stdout: str, stderr: str) -> tuple[str, str | None]:
    """The error line (or the output's tail) and the problem, if any."""
    errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
    said = errors[0] if errors else (stderr or stdout)[-300:]
    if code is None:
        return said, "hang"
    if "Traceback (most recent call last)" in stdout + stderr or code not in (0, 2):
        return said, f"traceback: exit {code}: {(stderr or stdout)[-600:]!r}"
    if code == 2 and len(errors) != 1:
        return said, f"not one 'error: ...' line: {stderr[-600:]!r}"
    return said, None


def _child_env() -> dict[str, str]:
    from pipeline.cluster.distributed import environment_for_new_group

    # without this process's group variables: the world trained here set MASTER_PORT, whose
    # store this process still holds (the child's rendezvous: "address already in use")
    env = dict(environment_for_new_group(), DS_ACCELERATOR="cpu", PYTHONPATH=str(ROOT))
    env["no_proxy"] = "127.0.0.1,localhost"
    for var in ("http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY"):
        env.pop(var, None)
    return env


def run_cli(args: list[str], cwd: Path, timeout: float, **popen) -> tuple[int | None, str, str]:
    """`allattn-pipe ARGS` in a child process: its exit code (None: still running after
    `timeout`, then killed), stdout and stderr."""
    try:
        done = subprocess.run(
            [sys.executable, "-m", "pipeline.commands.cli", *args],
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            **popen,
        )
    except subprocess.TimeoutExpired as e:
        return None, str(e.stdout or ""), str(e.stderr or "")
    return done.returncode, done.stdout, done.stderr


def run_efbig(
    world: World, command: str, limit: int, server_url: str | None, tracked: bool = True
) -> Outcome:
    with tempfile.TemporaryDirectory() as tmp:
        copy = copy_world(world, Path(tmp) / "world").root
        before = snapshot(copy)

        def limited():  # in the child, before exec: its files may grow to `limit` bytes
            hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))

        start = time.monotonic()
        code, out, err = run_cli(
            args_for(command, copy, server_url, tracked),
            copy,
            HANG_SECONDS,
            env=_child_env(),
            preexec_fn=limited,
        )
        seconds = time.monotonic() - start
        said, problem = judged(code, out, err)
        problem = problem or damage(copy, before, command)
        return Outcome(command, f"EFBIG {limit}", code, seconds, said, problem)


def run_enospc(
    world: World, command: str, free: int, server_url: str | None, tracked: bool = True
) -> Outcome:
    """The command on a tmpfs left with `free` bytes once the world is on it."""
    import json

    with tempfile.TemporaryDirectory() as tmp:
        mount = Path(tmp) / "disk"
        mount.mkdir()
        copy = mount / "world"
        case = Path(tmp) / "case.json"
        case.write_text(
            json.dumps(
                {
                    "world": str(world.root),
                    "copy": str(copy),
                    "free": free,
                    "command": command,
                    "args": args_for(command, copy, server_url, tracked),
                }
            )
        )
        # the copy, its snapshot and the checks run inside the namespace, where the tmpfs is
        script = (
            f"mount -t tmpfs -o size=1g tmpfs {mount} && "
            f"{sys.executable} -m quality.fuzzers.write_fuzz {case}"
        )
        start = time.monotonic()
        try:
            done = subprocess.run(
                ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
                cwd=ROOT,
                env=_child_env(),
                capture_output=True,
                text=True,
                timeout=HANG_SECONDS,
                check=False,
            )
        except subprocess.TimeoutExpired:
            return Outcome(command, f"ENOSPC {free}", None, HANG_SECONDS, "", "hang")
        seconds = time.monotonic() - start
        try:
            verdict = json.loads(done.stdout.strip().splitlines()[-1])
        except (IndexError, ValueError):
            verdict = None
        if done.returncode != 0 or not isinstance(verdict, dict):
            return Outcome(
                command,
                f"ENOSPC {free}",
                None,
                seconds,
                "",
                f"the case did not run: {(done.stderr or done.stdout)[-600:]!r}",
            )
        return Outcome(
            command, f"ENOSPC {free}", verdict["exit"], seconds, verdict["said"], verdict["problem"]
        )


def inside(case_file: Path) -> None:
    """In the case's mount namespace: copy the world onto the tmpfs, shrink the tmpfs to
    what is used plus the case's free bytes (whole pages), run the command, and print the
    verdict as one JSON line."""
    import json

    case = json.loads(case_file.read_text())
    copy = Path(case["copy"])
    copy_world(World(Path(case["world"])), copy)
    before = snapshot(copy)
    st_ = os.statvfs(copy)
    used = (st_.f_blocks - st_.f_bfree) * st_.f_frsize
    size = used + max(-(-case["free"] // PAGE) * PAGE, PAGE)
    subprocess.run(["mount", "-o", f"remount,size={size}", str(copy.parent)], check=True)
    code, out, err = run_cli(case["args"], copy, HANG_SECONDS - 30)
    said, problem = judged(code, out, err)
    # room to read back what is there
    subprocess.run(["mount", "-o", "remount,size=1g", str(copy.parent)], check=True)
    problem = problem or damage(copy, before, case["command"])
    print(json.dumps({"exit": code, "said": said, "problem": problem}))


# ---------------------------------------------------------------- the campaign


def fuzz_writes(world: World, cases: int, on_outcome) -> None:
    """`cases` derandomized cases against copies of the trained `world`."""
    from quality.fuzzers.fuzz_kit import Server, derandomized

    can_fill = can_fill_a_disk()
    server = Server()
    url = f"http://127.0.0.1:{server.port}/corpus.txt"
    try:

        def one_case(draw):
            command, tracked, kind, amount = draw_case(draw, world)
            served = url if command == "download http" else None
            if kind == "EFBIG":
                outcome = run_efbig(world, command, amount, served, tracked)
            elif can_fill:
                outcome = run_enospc(world, command, amount, served, tracked)
            else:
                outcome = Outcome(command, f"ENOSPC {amount}", None, 0.0, "", None, skipped=True)
            on_outcome(outcome)

        derandomized(cases, one_case)
    finally:
        server.close()


if __name__ == "__main__":
    inside(Path(sys.argv[1]))
