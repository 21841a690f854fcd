"""`--point NAME`: a sweep's point reached afterwards by `export`, `sample`, `compare` and
`run`, from the record (`POINT_RECORD`) the sweep wrote in each point's workspace."""

from __future__ import annotations

import json
import re
from pathlib import Path

from pipeline.commands.sweep import OLD_NOT_IN_NAME, POINT_RECORD, SWEEP_SETS, overlapping
from pipeline.errors import PipelineError, Preempted, shown
from pipeline.fsutil import not_ours, read_ours
from pipeline.spec import load_spec


def recorded_points(config: str, root: Path) -> tuple[list[dict], list[str]]:
    """The point records under `root` that sweeps of `config` wrote, and why each record
    that another user could have written was not read. A workspace root may be shared: a
    record counts only where its workspace and the file are this user's (or root's) and no
    one else can write them (fsutil.not_ours), or a planted one would name the point."""
    target = str(Path(config).resolve())
    found, refused = [], []
    for path in sorted(root.glob(f"*/{POINT_RECORD}")):
        try:
            if why := not_ours(path.parent):
                refused.append(f"{shown(str(path.parent))} is {why}")
                continue
            record = json.loads(read_ours(path, "sweep point record"))
        except Preempted:  # a signal, not the record
            raise
        except PipelineError as e:
            refused.append(str(e))
            continue
        except (OSError, ValueError):
            continue  # not a record this package wrote: not a point
        if isinstance(record, dict) and record.get("config") == target:
            found.append(record)
    return found, refused


def _not_read(refused: list[str]) -> str:
    """What an error about a point adds where records were passed over as not this user's."""
    if not refused:
        return ""
    more = f" and {len(refused) - 1} more" if len(refused) > 1 else ""
    return f" (not read, as another user could have written it: {refused[0]}{more})"


def point_overrides(
    config: str, name: str, overrides: list[str], smoke: bool = False
) -> tuple[list[str], bool]:
    """The --set (then `overrides`) and --smoke of the point `name` of a sweep of `config`,
    as its sweep recorded them under the config's workspace root. `name` is the point's
    name as the sweep printed it, or its end (`mixerconv`, `seed2`) where only one point's
    name ends so, an old name (`sa_conv` for `sa+conv`), or one of its --set (`mixer=conv`,
    `model.mixer=conv`) that only one point has."""
    base = load_spec(config, overrides, smoke=smoke)
    root = base.workspace_dir.parent
    found, refused = recorded_points(config, root)
    records = {r["name"]: r for r in found if isinstance(r.get("name"), str)}
    if not records:
        raise PipelineError(
            f"--point {shown(name)}: no sweep of {shown(config)} has recorded its points "
            f"under {root}{_not_read(refused)}; a sweep run before points were recorded "
            f"records them when it runs again (it skips the points that are done)"
        )

    def old(n: str) -> str:
        return re.sub(OLD_NOT_IN_NAME, "_", n)

    def ends(full: str, given: str) -> bool:
        return full == given or full.endswith(f"-{given}")

    # the whole name, else its end; each as written, else as names were spelled before `+`
    matches = (
        [n for n in records if n == name]
        or [n for n in records if ends(n, name)]
        or [n for n in records if ends(old(n), old(name))]
        or [n for n in records if name in _settings(records[n])]
    )
    if len(matches) != 1:
        which = "names several points" if matches else "is not a point of its sweeps"
        raise PipelineError(
            f"--point {shown(name)} {which} (under {root}); the points: "
            f"{', '.join(matches or sorted(records))}{_not_read(refused)}"
        )
    record = records[matches[0]]
    sets, withheld = record.get("overrides"), record.get("withheld") or []
    if (
        not isinstance(sets, list)
        or not isinstance(withheld, list)
        or not all(isinstance(o, str) for o in [*sets, *withheld])
    ):
        raise PipelineError(f"{root / matches[0] / POINT_RECORD}: not a sweep point record")
    given = [o.partition("=")[0].strip() for o in overrides]
    missing = [k for k in withheld if not any(overlapping(k, g) for g in given)]
    if missing:
        raise PipelineError(
            f"--point {matches[0]}: its {', '.join(f'--set {k}' for k in missing)} held a "
            f"credential, which the sweep did not record; give it again (--set {missing[0]}=...)"
        )
    return [*sets, *overrides], bool(record.get("smoke"))


def _settings(record: dict) -> set[str]:
    """A point's grid and seed settings as `--point` takes them: `model.mixer=conv`, and
    `mixer=conv` as its name spells the key."""
    sets = [o for o in record.get("overrides") or [] if isinstance(o, str) and "=" in o]
    pairs = [o.split("=", 1) for o in sets if o.split("=", 1)[0] not in SWEEP_SETS]
    return {f"{k}={v}" for k, v in pairs} | {f"{k.rsplit('.', 1)[-1]}={v}" for k, v in pairs}
