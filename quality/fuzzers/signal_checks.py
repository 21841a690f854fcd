"""How a command must end, with or without a signal, and what it must not leave behind: the
checks the stateful and signal fuzzers share (quality/fuzzers/state_fuzz.py,
signal_fuzz.py).

The project's convention (pipeline/cluster/signals.py, docs/running.md "Signals"): the
first SIGTERM, SIGHUP or SIGINT ends a command with exit 128 + the signal's number and one
line `error: ...`; inside training, the update finishes, a checkpoint is saved and the exit
is 143 whatever the signal (the line names the step and the checkpoint). Never a traceback,
never a process killed by the signal itself (no line at all), never exit 0 (the signal
swallowed). A signal that reached a command after it had decided its exit (the fork
server's `ending` mark) judges nothing: it is counted apart, as late.

Without a signal: exit 0, or 2 with exactly one `error:` line, never a traceback or a hang.

Leftovers, after any command: no temporary in the world (`*.tmp`; `*.part` outside the
download cache, where a partial download is kept on purpose to resume; `tmp-step-*`; a
stage being linked in, `.STAGE.reuse-*`; a launcher's `.launch-*.json`); every committed
stage's files as its record lists them; every checkpoint directory whole; every tracking
backlog line a whole record; every export directory complete (its marker present and not
`complete: false`).
"""

from __future__ import annotations

import json
import re
import signal
from pathlib import Path

from quality.fuzzers.forkserver import Ended

NAMES = {signal.SIGTERM: "SIGTERM", signal.SIGHUP: "SIGHUP", signal.SIGINT: "SIGINT"}
# a training stop: the update finished and a checkpoint was saved (exit 143 for any signal)
TRAINING_STOP = re.compile(r"at step \d+: checkpoint .* saved|during the last checkpoint")
TRACEBACK = "Traceback (most recent call last)"


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error")]


def ending_problem(ended: Ended, signum: int | None, sent: float | None) -> str | None:
    """What is wrong with how the command ended (`signum` sent at `sent`, monotonic), or
    None. Use `was_late` first: a late signal is judged as no signal."""
    output = ended.stdout + ended.stderr
    errors = error_lines(ended.stderr)
    if ended.hung:
        return "hang: still running at the time limit"
    if signum is not None:
        name = NAMES[signum]
        if ended.killed_by == signum:
            return f"signal: killed by {name} without a word (no handler)"
        if ended.killed_by is not None:
            return f"signal: killed by signal {ended.killed_by} after {name}"
        if TRACEBACK in output or ended.exit_code == 1:
            return f"traceback: after {name}, exit {ended.exit_code}: {_tail(output)}"
        if ended.exit_code == 0:
            return f"signal: {name} swallowed: exit 0"
        stopped = bool(errors) and TRAINING_STOP.search(errors[-1]) is not None
        allowed = {128 + signum} | ({143} if stopped else set())
        if ended.exit_code not in allowed:
            return f"signal: exit {ended.exit_code} after {name} (expected {128 + signum})"
        if len(errors) != 1:
            return f"signal: {len(errors)} error lines after {name}: {_tail(ended.stderr)}"
        return None
    if ended.killed_by is not None:
        return f"killed by signal {ended.killed_by} (none was sent)"
    if TRACEBACK in output or ended.exit_code not in (0, 2):
        return f"traceback: exit {ended.exit_code}: {_tail(output)}"
    if ended.exit_code == 2 and len(errors) != 1:
        return f"not one error line: {_tail(ended.stderr)}"
    return None


def was_late(ended: Ended, sent: float | None) -> bool:
    """The signal arrived once the command had decided its exit (or after it was gone)."""
    return sent is not None and ended.ending is not None and ended.ending <= sent


def _tail(text: str, n: int = 300) -> str:
    return repr(text[-n:])


# ---------------------------------------------------------------- leftovers


def temporary(path: Path, root: Path) -> bool:
    name = path.name
    parts = path.relative_to(root).parts
    if name.endswith(".part"):
        return "cache" not in parts  # the download cache keeps one to resume from
    return (
        name.endswith(".tmp")
        or name.startswith("tmp-step-")
        or ".reuse-" in name
        or (name.startswith(".launch-") and name.endswith(".json"))
    )


def leftovers(places: list[Path]) -> list[str]:
    """What is left half-done under `places` (the workspace root, the exports): see the
    module's docstring. Each problem once, as `leftover: ...` or `half-published: ...`."""
    from pipeline.fsutil import file_mismatch
    from pipeline.training.checkpoint_dirs import damage

    found = []
    for top in places:
        if not top.exists():
            continue
        for path in sorted(top.rglob("*")):
            if temporary(path, top):
                found.append(f"leftover: {path.relative_to(top.parent)}")
        for record_path in sorted(top.glob("*/*/stage.json")):
            stage_dir = record_path.parent
            try:
                outputs = json.loads(record_path.read_text()).get("outputs", {})
            except (OSError, ValueError):
                found.append(f"half-published: {record_path.relative_to(top)} is unreadable")
                continue
            for rel, expected in outputs.items():
                if why := file_mismatch(stage_dir / rel, rel, expected, read=True):
                    found.append(f"half-published: {stage_dir.relative_to(top)}: {why}")
                    break
        for checksums in sorted(top.glob("*/*/checkpoints/step-*/checksums.json")):
            if why := damage(checksums.parent):
                found.append(
                    f"half-published: checkpoint {checksums.parent.relative_to(top)}: {why}"
                )
        for backlog in sorted(top.glob("*/tracking-backlog.jsonl")):
            for n, line in enumerate(backlog.read_text(errors="replace").splitlines(), 1):
                if line.strip() and not _json_object(line):
                    found.append(f"half-written: {backlog.relative_to(top)} line {n}")
                    break
        for marker in sorted(top.glob("*/.allattn-export")):
            if marker.parent.name.startswith("."):  # a staging directory: a leftover above
                continue
            try:
                complete = json.loads(marker.read_text()).get("complete", True)
            except (OSError, ValueError, AttributeError):
                complete = False
            if complete is False:
                found.append(f"half-published: export {marker.parent.relative_to(top.parent)}")
    return found


def _json_object(line: str) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except ValueError:
        return False
