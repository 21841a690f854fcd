"""`allattn-pipe sweep`: every point of a grid (x seeds) as its own pipeline run.

A point is the config with `--set KEY=VALUE` for each grid key and `train.seed`, named
`<name>-<key><value>...-seed<S>` (the last part of each dotted key), so each point has a
workspace of its own under the same `workspace.root`. All points log to the config's
experiment, under one MLflow run for the sweep (tagged `sweep.id`, found again on a re-run).

No point recomputes what another one built: the leading stages whose config is the same at
every point (download, preprocess, typically) run once, in the first point's workspace, and
every other point reuses that output (hard links, with the same build id and so the same
fingerprints downstream). More generally, before a point runs, each of its stages that a
workspace under the same root has already built with the same fingerprint is linked in.

Re-running the same sweep skips the points whose stages are all up to date, and resumes an
interrupted one from its workspace (the runner's own resume: train from its newest intact
checkpoint).

Each point's workspace holds `sweep-point.json`, the config and the --set that make it:
`export`, `sample`, `compare` and `run` take `--point NAME` and load the point from it.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import re
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from pipeline.cluster import distributed
from pipeline.cluster.signals import SignalHandler
from pipeline.errors import Interrupted, PipelineError, Preempted, shown
from pipeline.fsutil import atomic_write_json, open_for_write
from pipeline.locks import holding, stale_hint
from pipeline.redact import mask
from pipeline.spec import ALL, SpecError, inert_on_its_own, load_spec
from pipeline.spec.validation import InertKey, InertKeysError
from pipeline.tracking.store import ServerNotAnswering
from pipeline.tracking.sweep_run import SweepRun
from pipeline.workspace.layout import Workspace, fingerprint
from pipeline.workspace.runner import Runner

if TYPE_CHECKING:  # a name for annotations only
    from pipeline.spec.schema import Spec
from stages import STAGES, resolve_inputs


@dataclass
class Point:
    name: str
    overrides: list[str]  # the user's --set, the grid's, the seed, `~KEY` drops, name, experiment
    spec: Spec  # its resolved spec
    dropped: list[InertKey] = field(default_factory=list)  # keys that do nothing at this point
    smoke: bool = False  # the config shrunk by --smoke (pipeline.spec.smoke) before the sets

    def dropped_line(self) -> str:
        """'point NAME: dropped K1, K2 (why); K3 (why)': the keys grouped by their reason."""
        by_why: dict[str, list[str]] = {}
        for k in self.dropped:
            by_why.setdefault(k.why, []).append(k.key)
        return f"point {self.name}: dropped " + "; ".join(
            f"{', '.join(keys)} ({why})" for why, keys in by_why.items()
        )


def parse_grid(items: list[str]) -> list[tuple[str, list[str]]]:
    """['train.optimizer.lr=1e-3,3e-3'] -> [('train.optimizer.lr', ['1e-3', '3e-3'])]."""
    grid: list[tuple[str, list[str]]] = []
    for item in items:
        key, eq, values = item.partition("=")
        key, parts = key.strip(), [v.strip() for v in values.split(",")]
        if not eq or not key or not all(parts):
            raise PipelineError(
                f"--grid {shown(item)}: expected KEY=V1,V2,... (e.g. "
                f"--grid train.optimizer.lr=1e-3,3e-3)"
            )
        if key in SWEEP_SETS:
            raise PipelineError(f"--grid {shown(item)}: the sweep sets {key} itself, one per point")
        if key in (k for k, _ in grid):
            raise PipelineError(f"--grid {shown(key)} is given twice; list all its values in one")
        grid.append((key, parts))
    return grid


SWEEP_SETS = ("name", "tracking.experiment")
"""Keys the sweep sets at every point: the point's name, the sweep's experiment."""


def overlapping(a: str, b: str) -> bool:
    """Whether setting key path `a` changes what `b` sets (one contains the other)."""
    return a == b or a.startswith(b + ".") or b.startswith(a + ".")


def parse_seeds(text: str | None) -> list[str]:
    seeds = [s.strip() for s in (text or "").split(",") if s.strip()]
    # ASCII digits: str.isdigit() takes '²' and '١', which a script or YAML reads otherwise
    if text is not None and (not seeds or not all(re.fullmatch(r"[0-9]+", s) for s in seeds)):
        raise PipelineError(
            f"--seeds {shown(text)}: expected integers separated by commas, e.g. 1,2,3"
        )
    return seeds


NOT_IN_NAME = r"[^A-Za-z0-9_.+-]"
"""What a point's name spells as `_`: a value's `sa+conv` stays itself (a directory, an
MLflow run name, a shell word and a Slurm path alike take `+`), a URL's `/` or `:` does not."""

OLD_NOT_IN_NAME = r"[^A-Za-z0-9_.-]"
"""The same before names kept `+` (`sa+conv` was `sa_conv`)."""


def kept_spelling(root: Path, name: str) -> str:
    """`name`, or its spelling from before names kept `+` where a workspace of that name is
    under `root` and none of this one: a sweep run before then goes on in its workspace
    rather than training the point again under a new name."""
    old = re.sub(OLD_NOT_IN_NAME, "_", name)
    if old != name and (root / old).is_dir() and not (root / name).exists():
        return old
    return name


def _label(key: str, keys: list[str]) -> str:
    """The part of a run name a grid key contributes: its last component, or the whole key
    (dots as underscores) when two keys end alike."""
    last = key.rsplit(".", 1)[-1]
    return last if sum(k.rsplit(".", 1)[-1] == last for k in keys) == 1 else key.replace(".", "_")


def load_dropping_inert(
    config: str, sets_for, chosen: list[tuple[str, str]], smoke: bool = False, log=None
):
    """The spec of `config` with `sets_for(chosen, removals)`, less each key written there
    that does nothing under its other settings: a grid key's value is left out of `chosen`,
    any other key removed by `--set ~KEY`. Returns the spec, the grid values kept, the sets
    that load it and the keys dropped."""
    removals: list[str] = []
    dropped: dict[str, InertKey] = {}
    while True:
        sets = sets_for(chosen, removals)
        try:
            spec = load_spec(config, sets, smoke=smoke, log=log, strict=True)
            return spec, chosen, sets, list(dropped.values())
        except InertKeysError as e:
            if all(f"~{k.key}" in removals for k in e.keys):
                raise  # removed, yet still there: never loop
            for k in e.keys:
                # one left out of the grid may still be written in the file: a second round
                if any(g == k.key for g, _ in chosen):
                    chosen = [(g, v) for g, v in chosen if g != k.key]
                elif f"~{k.key}" not in removals:
                    removals.append(f"~{k.key}")
                dropped.setdefault(k.key, k)


def points(
    config: str,
    overrides: list[str],
    grid: list[tuple[str, list[str]]],
    seeds: list[str],
    smoke: bool = False,
    log=None,
) -> list[Point]:
    """Every point of the grid x seeds, each validated as its own spec. A key written in the
    config, by --set or by the grid that does nothing at a point is dropped there (a grid
    key's label leaves the point's name, and points that then coincide are one); one that
    does nothing at every point is refused, as a single run refuses it."""
    base, _, _, _ = load_dropping_inert(
        config, lambda chosen, removals: [*overrides, *removals], [], smoke, log
    )
    keys = [k for k, _ in grid]
    if seeds and any(overlapping(k, "train.seed") for k in keys):
        raise PipelineError(
            "--grid train.seed and --seeds both set train.seed: each point "
            "would run under two names; give the seeds once"
        )
    experiment = base.tracking.experiment or base.name
    root = base.workspace_dir.parent

    def point_name(chosen, seed) -> str:
        # a name is a directory, a run name and a line of output: no URL's secret in it
        parts = [f"{_label(k, keys)}{mask(v)}" for k, v in chosen]
        if seed is not None:
            parts.append(f"seed{seed}")
        return kept_spelling(root, re.sub(NOT_IN_NAME, "_", "-".join([base.name, *parts])))

    out: list[Point] = []
    names = set()
    for values in itertools.product(*(v for _, v in grid), *([seeds] if seeds else [])):
        seed = values[len(keys)] if seeds else None

        def sets_for(chosen, removals, seed=seed) -> list[str]:
            return [
                *overrides,
                *(f"{k}={v}" for k, v in chosen),
                *([f"train.seed={seed}"] if seed is not None else []),
                *removals,
                f"name={point_name(chosen, seed)}",
                f"tracking.experiment={experiment}",
            ]

        full = list(zip(keys, values, strict=False))
        try:
            spec, chosen, sets, dropped = load_dropping_inert(config, sets_for, full, smoke)
        except PipelineError as e:
            raise PipelineError(f"sweep point {point_name(full, seed)}: {e}") from None
        name = point_name(chosen, seed)
        if name in names:
            if len(chosen) < len(full):
                continue  # differs from an earlier point only in grid keys dropped here
            raise PipelineError(
                f"sweep: two points would both be named {name}; give each value once"
            )
        names.add(name)
        out.append(Point(name, sets, spec, dropped, smoke))
    refuse_inert_everywhere(out, grid, inert_on_its_own(config, smoke))
    return out


def refuse_inert_everywhere(
    pts: list[Point], grid: list[tuple[str, list[str]]], alone: frozenset[str] = ALL
) -> None:
    """A key dropped at every point does nothing in this sweep (a typo, most likely): refused
    where it was written, as `run` refuses it; as there, one the config file writes that acts
    in the file on its own (not in `alone`) is left to the --set and --grid that switch it off."""
    everywhere = set.intersection(*({k.key for k in p.dropped} for p in pts)) if pts else set()
    if alone is not ALL:
        everywhere -= {
            k.key
            for k in (pts[0].dropped if pts else [])
            if not k.origin.startswith("--set ") and k.key not in alone
        }
    if not everywhere:
        return
    grid_items = {k: f"--grid {k}={','.join(values)}" for k, values in grid}
    raise SpecError(
        "\n".join(
            f"{grid_items.get(k.key, k.origin)}: {k.key}: does nothing at any point of the "
            f"sweep ({k.why}); remove it"
            for k in pts[0].dropped
            if k.key in everywhere
        )
    )


def sweep_id(config: str, overrides: list[str], grid, seeds) -> str:
    blob = json.dumps([str(Path(config).resolve()), overrides, grid, seeds])
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def shared_prefix(pts: list[Point]) -> list[str]:
    """The leading stages whose fingerprinted config is the same at every point."""
    first = pts[0].spec
    prefix: list[str] = []
    for name in first.stages:
        if any(p.spec.stages[: len(prefix) + 1] != first.stages[: len(prefix) + 1] for p in pts):
            break
        config = STAGES[name].fingerprinted(first)
        if any(STAGES[name].fingerprinted(p.spec) != config for p in pts):
            break
        prefix.append(name)
    return prefix


def reuse_outputs(spec, log, told: set[str] | None = None) -> list[str]:
    """Link into `spec`'s workspace each stage, in order, that another workspace under the
    same root built with the fingerprint this one would compute; stop at the first stage
    neither built here nor there. Returns the stages linked in. A build another user could
    have written is passed over, said once per entry of `told` (the sweep's calls share it)."""
    ws = Workspace(spec.workspace_dir)
    told = set() if told is None else told

    def passed_over(name: str, why: str) -> None:
        if why not in told:
            told.add(why)
            log(f"[{spec.name}] {name}: not reusing a build another user could have written: {why}")

    builds: dict[str, str] = {}
    linked = []
    for name in spec.stages:
        stage = STAGES[name]
        inputs = resolve_inputs(stage, spec.stages)
        if any(i not in builds for i in inputs):
            break
        fp = fingerprint(stage.fingerprinted(spec), {i: builds[i] for i in inputs})
        record = ws.record(name)
        if record is None and not ws.partial_dir(name).exists():
            source = ws.built_elsewhere(name, fp, functools.partial(passed_over, name))
            if source is not None and ws.link_build(name, source):
                log(f"[{spec.name}] {name}: reusing {source}")
                linked.append(name)
                record = ws.record(name)
        if record is None or record.get("fingerprint") != fp:
            break
        builds[name] = record["build"]
    return linked


POINT_RECORD = "sweep-point.json"
"""In each point's workspace: the config and the --set that make the point, which
`export`, `sample`, `compare` and `run` read back for `--point NAME` (sweep_points.py)."""


def record_points(config: str, pts: list[Point]) -> None:
    """Write each point's record: its --set with a URL's credentials masked, as every record
    of the workspace has them, and the keys of those (`withheld`), which `--point` asks for."""
    for p in pts:
        p.spec.workspace_dir.mkdir(parents=True, exist_ok=True)
        record = {
            "config": str(Path(config).resolve()),
            "name": p.name,
            "overrides": [mask(o) for o in p.overrides],
            "withheld": [o.partition("=")[0].strip() for o in p.overrides if mask(o) != o],
            "smoke": p.smoke,
        }
        atomic_write_json(p.spec.workspace_dir / POINT_RECORD, record, private=True)


def is_done(spec) -> bool:
    return all(step.action == "skip" for step in Runner(spec, log=lambda m: None).plan())


def plan_sweep(
    config: str,
    overrides: list[str],
    grid_items: list[str],
    seeds_text: str | None,
    log=None,
    smoke: bool = False,
) -> tuple[list[Point], list[str], str]:
    """The sweep's points, the stages they share, and its id (its MLflow run's tag); `log`
    is told of each --set that the grid or the seeds replace, and of the keys each point
    drops because they do nothing there."""
    grid = parse_grid(grid_items)
    seeds = parse_seeds(seeds_text)
    if not grid and not seeds:
        raise PipelineError("sweep: give at least one --grid KEY=V1,V2 or --seeds")
    varied = [(k, f"--grid {k}") for k, _ in grid] + ([("train.seed", "--seeds")] if seeds else [])
    for item in overrides if log else ():
        key = item.partition("=")[0].strip()
        replaced_by = [flag for k, flag in varied if overlapping(key, k)]
        if replaced_by:
            log(f"--set {item}: replaced at every point by {', '.join(replaced_by)}")
    pts = points(config, overrides, grid, seeds, smoke, log)
    for p in pts if log else ():
        if p.dropped:
            log(p.dropped_line())
    ident = sweep_id(config, [*overrides, *(["--smoke"] if smoke else [])], grid, seeds)
    return pts, shared_prefix(pts), ident


def run_sweep(
    config: str,
    overrides: list[str],
    grid_items: list[str],
    seeds_text: str | None,
    parallel: int = 1,
    dry_run: bool = False,
    log=print,
    smoke: bool = False,
) -> list[str]:
    """Run (or, dry, describe) every point; returns the names of the points that failed.
    `smoke`: every point is the config shrunk by --smoke, run as `run --smoke` runs it."""
    from pipeline.tracking.store import is_remote
    from pipeline.tracking.tracker import make_tracker, tracking_uri

    pts, prefix, ident = plan_sweep(config, overrides, grid_items, seeds_text, log, smoke)
    if dry_run:
        log(
            f"{len(pts)} points; run once and reused by every point: "
            f"{', '.join(prefix) or 'nothing'}"
        )
        for p in pts:
            plan = Runner(p.spec, log=lambda m: None).plan()
            to_run = [s.stage for s in plan if s.action == "run"]
            sets = " ".join(f"--set {o}" for o in p.overrides[len(overrides) : -2])
            log(f"  {p.name:<40} {'done' if not to_run else 'run ' + ','.join(to_run)}  {sets}")
        return []
    first = pts[0].spec
    if first.tracking.enabled and is_remote(tracking_uri(first)):
        make_tracker(first).check(first)  # as `run` does: one line now, not one per point
    record_points(config, pts)
    sweep = _sweep_run(pts, ident, log)
    workspaces = [p.spec.workspace_dir for p in pts]
    failed: list[str] = []
    status = "FAILED"
    told: set[str] = set()  # builds passed over as another user's, said once
    try:
        if prefix and not all(is_done(p.spec) for p in pts):
            run_shared_prefix(pts, prefix, sweep, log, told)
        todo = []
        for p in pts:
            reuse_outputs(p.spec, log, told)
            if is_done(p.spec):
                log(f"[{p.name}] done")
            else:
                todo.append(p)
        if parallel > 1 or any(Runner(p.spec).needs_launcher() for p in todo):
            failed = _run_processes(config, todo, parallel, sweep, log)
        else:
            for p in todo:
                try:
                    Runner(p.spec, log=lambda m, p=p: log(f"[{p.name}] {m}")).run(
                        make_tracker(p.spec, sweep_run_id=sweep.run_id)
                    )
                except (Preempted, ServerNotAnswering):
                    # a signal stops the whole sweep, and so does a tracking server that
                    # does not answer: every later point would wait on it, and fail
                    raise
                except Exception as e:  # the other points still run
                    log(f"[{p.name}] failed: {e}")
                    failed.append(p.name)
                sweep.adopt([p.spec.workspace_dir])
        status = "FINISHED" if not failed else "FAILED"
    except BaseException as e:
        killed = isinstance(e, (KeyboardInterrupt, Preempted, Interrupted))
        status = "KILLED" if killed else "FAILED"
        if isinstance(e, ServerNotAnswering):
            sweep.forget()  # its last requests would wait on the same silence
        raise
    finally:
        sweep.adopt(workspaces)
        sweep.end(status)
    log(
        f"{len(pts) - len(failed)} of {len(pts)} points done"
        + (f"; failed: {', '.join(failed)}" if failed else "")
    )
    return failed


def _sweep_run(pts: list[Point], ident: str, log) -> SweepRun:
    description = f"{len(pts)}: " + "; ".join(p.name for p in pts)
    return SweepRun(pts[0].spec, ident, description[:5000], warn=lambda m: log(f"warning: {m}"))


def run_shared_prefix(
    pts: list[Point], prefix: list[str], sweep: SweepRun, log, told: set[str] | None = None
) -> None:
    """Build the stages every point shares once, in the first point's workspace (unless a
    workspace already holds them), and link them into every point's."""
    from pipeline.tracking.tracker import make_tracker

    told = set() if told is None else told
    for p in pts:
        reuse_outputs(p.spec, log, told)
    first = pts[0]
    if not all(
        s.action == "skip"
        for s in Runner(first.spec, only=prefix, log=lambda m: None).plan()
        if s.stage in prefix
    ):
        log(f"[{first.name}] running what every point shares: {', '.join(prefix)}")
        # the stages after the prefix are the points' own runs: not "held by --only"
        shared = Runner(
            first.spec, only=prefix, log=lambda m: log(f"[{first.name}] {m}"), say_held=False
        )
        shared.run(make_tracker(first.spec, sweep_run_id=sweep.run_id))
        sweep.adopt([first.spec.workspace_dir])


def point_command(config: str, point: Point) -> list[str]:
    """The command that runs one point in its own process (tests put stand-ins here): the
    installed package's CLI, the working directory off sys.path (`python_module`)."""
    from pipeline.cluster.interpreter import python_module

    return [
        *python_module("pipeline.commands.cli"),
        "run",
        config,
        *(["--smoke"] if point.smoke else []),
        *(x for o in point.overrides for x in ("--set", o)),
    ]


class ForwardSignals(SignalHandler):
    """While the points run as processes: the first SIGTERM / SIGINT / SIGHUP is passed on as
    SIGTERM to every running point (each saves a checkpoint and exits 143), and no new point
    starts; a second one is passed on as SIGINT (they stop at once) and stops the sweep."""

    def __init__(self, running: list):
        super().__init__()
        self.running = running

    def _send(self, sig) -> None:
        for _, proc, _ in self.running:
            if proc.poll() is None:
                proc.send_signal(sig)

    def _first(self, signum) -> None:
        self._send(signal.SIGTERM)

    def _handle(self, signum, frame) -> None:
        try:
            super()._handle(signum, frame)
        except Interrupted:
            self._send(signal.SIGINT)
            raise


def _point_environment(sweep: SweepRun) -> dict[str, str]:
    """A point process's environment: a process group of its own, and the sweep's MLflow run
    (its pipeline run is created as the sweep run's child, not only adopted when it ends);
    no PYTHONPATH entry naming the working directory, PYTHONSAFEPATH set (`safe_environment`)."""
    from pipeline.cluster.interpreter import safe_environment
    from pipeline.tracking.tracker import SWEEP_RUN_ENV

    env = safe_environment(distributed.environment_for_new_group())
    env.pop(SWEEP_RUN_ENV, None)  # a sweep run inside another's point files under its own
    return env | ({SWEEP_RUN_ENV: sweep.run_id} if sweep.run_id else {})


def _run_processes(
    config: str, todo: list[Point], parallel: int, sweep: SweepRun, log
) -> list[str]:
    """Each point as its own `allattn-pipe run`, at most `parallel` at a time; their output
    goes to `<workspace>/sweep.log`. A signal is forwarded to them (`ForwardSignals`); the
    sweep waits for them to save and exit, then stops with `Preempted` (exit 128 + the
    signal's number), its MLflow run marked KILLED."""
    failed: list[str] = []
    running: list[tuple[Point, subprocess.Popen, IO[Any]]] = []
    stopped: list[str] = []
    queue = list(todo)
    with ForwardSignals(running) as signals:
        try:
            while queue or running:
                while queue and len(running) < max(parallel, 1) and signals.received is None:
                    p = queue.pop(0)
                    p.spec.workspace_dir.mkdir(parents=True, exist_ok=True)
                    log_path = p.spec.workspace_dir / "sweep.log"
                    out = open_for_write(log_path, "sweep log", append=True)
                    # each point is a run of its own: its own process group, its own port
                    proc = subprocess.Popen(
                        point_command(config, p),
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        env=_point_environment(sweep),
                    )
                    running.append((p, proc, out))
                    log(f"[{p.name}] started (log: {p.spec.workspace_dir / 'sweep.log'})")
                if signals.received is not None and not running:
                    break
                time.sleep(0.5)
                for entry in [e for e in running if e[1].poll() is not None]:
                    running.remove(entry)
                    p, proc, out = entry
                    out.close()
                    sweep.adopt([p.spec.workspace_dir])
                    if proc.returncode == 0:
                        log(f"[{p.name}] finished")
                    elif signals.received is not None:
                        log(
                            f"[{p.name}] stopped by {signals.received} (exit "
                            f"{proc.returncode}); see {p.spec.workspace_dir / 'sweep.log'}"
                        )
                        stopped.append(p.name)
                    else:
                        log(
                            f"[{p.name}] failed (exit {proc.returncode}); see "
                            f"{p.spec.workspace_dir / 'sweep.log'}"
                        )
                        failed.append(p.name)
        finally:
            for _p, proc, out in running:  # interrupted: the points' runs stop too
                if proc.poll() is None and signals.received is None:
                    proc.terminate()
                proc.wait()
                out.close()
    if signals.received is not None:
        name = signals.received
        error = Preempted(
            f"sweep stopped by {name}: "
            + (f"{', '.join(stopped)} saved what they had and stopped; " if stopped else "")
            + "run the sweep again to resume its points"
        )
        error.exit_code = 128 + signal.Signals[name].value
        raise error
    return failed


# -- as a Slurm job array: pipeline.cluster.slurm renders it, each task calls these around its ranks


def prepare_array_task(
    config: str,
    overrides: list[str],
    grid_items: list[str],
    seeds_text: str | None,
    index: int,
    log=print,
) -> None:
    """Before task `index`'s ranks start: the shared stages built once (by whichever task
    gets here first; the others wait, then link them in) and whatever this point can reuse
    linked into its workspace."""
    pts, prefix, ident = plan_sweep(config, overrides, grid_items, seeds_text)
    point = _point(pts, index)
    root = point.spec.workspace_dir.parent
    root.mkdir(parents=True, exist_ok=True)
    path = root / f".sweep-{ident}.lock"

    def waiting() -> None:
        hint = stale_hint(path, "task")
        log(
            f"[{point.name}] waiting for another task of the sweep, which holds {path}"
            + (f"; {hint}" if hint else "")
        )

    with (
        open_for_write(path, "sweep lock file", append=True) as lock,
        holding(lock.fileno(), path, f"sweep task {index}", waiting),
    ):
        # inside the lock: the first task creates the tracking store, and two creating one
        # at once both fail
        sweep = _sweep_run(pts, ident, log)
        told: set[str] = set()
        if prefix and not is_done(point.spec):
            # built in the first point's workspace, linked into this one
            run_shared_prefix(
                list({id(p): p for p in (pts[0], point)}.values()), prefix, sweep, log, told
            )
        reuse_outputs(point.spec, log, told)
    record_points(config, [point])
    log(f"[{point.name}] sweep point {index + 1} of {len(pts)}")


def finish_array_task(
    config: str,
    overrides: list[str],
    grid_items: list[str],
    seeds_text: str | None,
    index: int,
    log=print,
) -> None:
    """After task `index`'s ranks end: its runs filed under the sweep's run, which is marked
    finished once every point is done."""
    pts, _, ident = plan_sweep(config, overrides, grid_items, seeds_text)
    point = _point(pts, index)
    sweep = _sweep_run(pts, ident, log)
    sweep.adopt([point.spec.workspace_dir])
    if all(is_done(p.spec) for p in pts):
        sweep.end("FINISHED")
        log(f"all {len(pts)} points of the sweep are done")


def _point(pts: list[Point], index: int) -> Point:
    if not 0 <= index < len(pts):
        raise PipelineError(f"sweep task {index}: the sweep has points 0 to {len(pts) - 1}")
    return pts[index]
