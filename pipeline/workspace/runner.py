"""Runs a spec's stages in order, skipping what is already done.

The workspace's layout and the operations on it: `pipeline.workspace.layout`.

Nothing that can be resumed is deleted without an explicit flag: a partial directory holding
checkpoints that another config started is refused, naming the changed keys, until the user
passes `--force STAGE` (or `--from`). Publishing commits by writing `stage.json` into the
partial directory; the renames that move it into place are finished by the next run if the
process dies between them (`Workspace.finish_publish`).

A completed stage is trusted only while its outputs match the checksums its record holds
(`Workspace.output_damage`): a damaged one is rebuilt, keeping its build id when the rebuild
reproduces the recorded files (so nothing built from them re-runs), or refused where a
rebuild would cost checkpoints. A record written before outputs carried checksums is trusted
as before.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import cast

from pipeline.cluster import distributed
from pipeline.cluster.signals import RaiseOnSignal, stop_words
from pipeline.errors import Interrupted, PipelineError, Preempted, shown
from pipeline.redact import mask
from pipeline.spec.schema import Spec
from pipeline.workspace.layout import (
    PARTIAL_RECORD,
    Workspace,
    config_changes,
    fingerprint,
    output_checksums,
)
from pipeline.workspace.lock import WorkspaceLock
from stages import STAGES, StageContext, resolve_inputs
from stages.base import NullStageTracker

# what a signal before the first stage began says (the handler's words are a running stage's)
NOT_STARTED = "no stage had started; run the pipeline again"


@dataclass
class Step:
    """One entry of the plan: what the runner will do with a stage, and why."""

    stage: str
    action: str  # "run", "skip" or "hold" (not selected by --only)
    reason: str
    forced: bool = False  # by --force / --from: start clean, even over a resumable partial
    # run: the step of the newest checkpoint in its partial directory, which it resumes
    # from (or, forced, discards); None when there is none
    checkpoint: int | None = None
    # run: rebuilding an up-to-date output found damaged; its build id is kept if the
    # rebuild reproduces the recorded files, so the stages built from them stay up to date
    repair: bool = False

    def describe(self) -> str:
        """The reason, and what happens to the checkpoints of an interrupted run."""
        if self.checkpoint is None:
            return self.reason
        if self.forced:
            return f"{self.reason}; would discard checkpoints up to step {self.checkpoint}"
        return f"{self.reason}; resume from step {self.checkpoint}"


def _first_difference(old: dict, new: dict) -> str | None:
    """The first file whose recorded content differs between two `outputs`, or None."""
    content = lambda entry: (entry["sha256"], entry["bytes"])  # noqa: E731
    for name in sorted(old.keys() | new.keys()):
        if name not in old or name not in new or content(old[name]) != content(new[name]):
            return name
    return None


def _differences(kept: dict, config: dict, input_builds: dict) -> list[str]:
    """How `config` and `input_builds` differ from what a record or partial marker kept;
    [] when it kept no config (written by an older allattn-pipe): then nobody can tell."""
    if "config" not in kept:
        return []
    kept_builds = kept.get("inputs", {})
    return config_changes(kept["config"], config) + [
        f"input {i} is another build ({kept_builds.get(i)} -> {b})"
        for i, b in input_builds.items()
        if kept_builds.get(i) != b
    ]


def _checkpointed_stop(error: BaseException) -> Preempted | None:
    """The training loop's stop (`Preempted`, a checkpoint saved) that `error` is, or that
    it interrupted: a second signal raised while the stop's bookkeeping ran (the stage's
    MLflow run ended and made durable) has it as its context."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        if isinstance(current, Preempted):
            return current
        seen.add(id(current))
        current = current.__context__
    return None


def _cut_short(saved: Preempted) -> Preempted:
    """A checkpointed stop whose bookkeeping a second signal cut short: still that stop, with
    its checkpoint line and its exit code (a scheduler requeues on 143), not `Interrupted`'s
    "nothing more was saved", which would hide the checkpoint the re-run resumes from."""
    error = Preempted(
        f"{saved}; a second signal cut the tracking's bookkeeping short (the next run marks "
        f"this one's MLflow runs KILLED)"
    )
    error.exit_code = saved.exit_code
    return error


def _parse_selection(names: list[str] | None, spec: Spec, flag: str) -> list[str]:
    out = []
    for item in names or []:
        for name in filter(None, (n.strip() for n in item.split(","))):
            if name not in STAGES:
                raise PipelineError(
                    f"{flag} {shown(name)}: no such stage kind; known: {', '.join(STAGES)}"
                )
            if name not in spec.stages:
                raise PipelineError(
                    f"{flag} {name}: this pipeline's stages are {', '.join(spec.stages)}"
                )
            out.append(name)
    return out


class Runner:
    def __init__(
        self,
        spec: Spec,
        *,
        force: list[str] | None = None,
        start_from: str | None = None,
        only: list[str] | None = None,
        log=print,
        say_held: bool = True,
    ):
        """`say_held`: False where --only is the caller's, not the user's (a sweep building
        the stages its points share): a held stage is then not reported."""
        self.spec = spec
        self.say_held = say_held
        self.ws = Workspace(spec.workspace_dir)
        self.force = set(_parse_selection(force, spec, "--force"))
        self.only = set(_parse_selection(only, spec, "--only"))
        self.start_from = _parse_selection([start_from], spec, "--from")[0] if start_from else None
        self.log = lambda message: log(mask(message))  # every stage's log: no URL's secret

    def plan(self) -> list[Step]:
        """Decide run/skip for every stage, assuming each run stage gets a new build id (but
        a damaged one rebuilt keeps its own: `Step.repair`). Refuses (PipelineError) a run
        that would discard an interrupted run's checkpoints without --force, or a finished
        one's to rebuild a damaged output."""
        steps: list[Step] = []
        builds: dict[str, str | None] = {}
        rerun: set[str] = set()
        forced_from = (
            self.spec.stages[self.spec.stages.index(self.start_from) :] if self.start_from else []
        )
        for name in self.spec.stages:
            stage = STAGES[name]
            inputs = resolve_inputs(stage, self.spec.stages)
            record = self.ws.record(name)
            changed_inputs = [i for i in inputs if i in rerun]
            forced = False
            config = stage.fingerprinted(self.spec)
            input_builds = {i: builds.get(i) for i in inputs}
            fp = None if changed_inputs else fingerprint(config, input_builds)
            up_to_date = (
                record is not None and not changed_inputs and record.get("fingerprint") == fp
            )
            damage = (
                self.ws.output_damage(name, record) if up_to_date and record is not None else None
            )
            repair = False
            if self.only and name not in self.only:
                if record is None:
                    action, reason = "hold", "not selected by --only (and not done yet)"
                elif not up_to_date:
                    action, reason = "hold", "not selected by --only (out of date)"
                elif damage:
                    action, reason = "hold", f"not selected by --only (damaged: {damage})"
                else:
                    action, reason = "hold", "not selected by --only (up to date)"
            elif name in self.force:
                action, reason, forced = "run", "forced (--force)", True
            elif name in forced_from:
                action, reason, forced = "run", f"forced (--from {self.start_from})", True
            elif record is None:
                action, reason = "run", "not done yet"
            elif changed_inputs:
                action, reason = "run", f"input {', '.join(changed_inputs)} will be re-run"
            elif record.get("fingerprint") != fp:
                changes = _differences(record, config, input_builds)
                action, reason = (
                    "run",
                    (f"changed: {'; '.join(changes)}" if changes else "config or inputs changed"),
                )
            elif damage:
                self._check_repairable(name, damage)
                action, repair = "run", True
                reason = f"{damage} (damaged since it was published); rebuilding it"
            else:
                action, reason = "skip", f"up to date (finished {record.get('finished_at')})"
            checkpoint = None
            if action == "run":
                checkpoint = self._check_partial(
                    name, fp, config, input_builds, changed_inputs, forced
                )
            if action == "run" and not repair:
                rerun.add(name)
            elif record is not None:  # a repair is planned to keep its build (`_do`)
                builds[name] = record.get("build")
            steps.append(Step(name, action, reason, forced, checkpoint, repair))
        self._check_held_inputs(steps)
        return steps

    def _check_partial(
        self,
        name: str,
        fp: str | None,
        config: dict,
        input_builds: dict,
        changed_inputs: list[str],
        forced: bool,
    ) -> int | None:
        """The step of the newest checkpoint in `name`'s partial directory (None if it has
        none), which the run will resume or, forced, discard. Refuses to run when those
        checkpoints belong to other result-changing settings and nothing forces it."""
        step = self.ws.partial_checkpoint(name)
        if step is None or forced:
            return step
        kept = self.ws.partial_marker(name)
        assert kept is not None  # a partial checkpoint: the partial directory is there
        if fp is not None and kept.get("fingerprint") == fp:
            return step
        partial = self.ws.partial_dir(name)
        discard = (
            f"re-run with --force {name} to discard its checkpoints and start over "
            f"(nothing was deleted)"
        )
        if changed_inputs:
            changes = [f"input {i} will be re-run" for i in changed_inputs]
        elif "config" not in kept:
            raise PipelineError(
                f"{name}: {partial} holds an interrupted run with checkpoints up to step "
                f"{step}, started with other settings that its {PARTIAL_RECORD} does not "
                f"record (missing, or written by an older allattn-pipe); run it with the "
                f"config that started it to resume, or {discard}"
            )
        else:
            changes = _differences(kept, config, input_builds)
        raise PipelineError(
            f"{name}: {partial} holds an interrupted run with checkpoints up to step {step}, "
            f"started with other settings that change its result: {'; '.join(changes)}. "
            f"Set them back to resume it, or {discard}"
        )

    def _check_repairable(self, name: str, damage: str) -> None:
        """Refuse to rebuild a damaged stage that holds checkpoints: rebuilding would train it
        again from the start and replace them."""
        if self.ws.holds_checkpoints(name):
            raise PipelineError(
                f"{name}: {damage} in {self.ws.committed_dir(name)} (damaged since it was "
                f"published); rebuilding it would train it again and replace its checkpoints, "
                f"so nothing was changed: restore the file, or re-run with --force {name}"
            )

    def _check_held_inputs(self, steps: list[Step]) -> None:
        by_stage = {s.stage: s for s in steps}
        for s in steps:
            if s.action != "run":
                continue
            inputs = resolve_inputs(STAGES[s.stage], self.spec.stages)
            for i in inputs:
                if by_stage[i].action != "hold":
                    continue
                record = self.ws.record(i)
                if record is None:
                    raise PipelineError(
                        f"stage '{s.stage}' needs the output of '{i}', which "
                        f"has not run in {self.ws.path}; add it to --only or "
                        f"drop --only"
                    )
                if damage := self.ws.output_damage(i, record):
                    raise PipelineError(
                        f"stage '{s.stage}' needs the output of '{i}', which "
                        f"is damaged ({damage} in "
                        f"{self.ws.committed_dir(i)}); "
                        f"add it to --only to rebuild it, or drop --only"
                    )
                self._check_paired(s.stage, i, record, inputs, by_stage)

    def _check_paired(
        self, name: str, held: str, record: dict, inputs: list[str], by_stage: dict[str, Step]
    ) -> None:
        """Refuse to run `name` on a held input built from another build of a stage `name`
        also reads: evaluate scoring train's weights with the vocabulary of a preprocess
        rebuilt since train ran (same size, other symbols: nothing else would notice)."""
        for j, built_from in (record.get("inputs") or {}).items():
            if j not in inputs:
                continue
            step = by_stage[j]
            if step.action == "run" and not step.repair:
                now = "being re-run now"
            else:
                current = self.ws.record(j)
                if current is None or current.get("build") == built_from:
                    continue
                now = f"build {current.get('build')}, finished {current.get('finished_at')}"
            raise PipelineError(
                f"stage '{name}' reads '{held}' and '{j}', but {held} was built from "
                f"{j} build {built_from} and {j} is {now}: {held}'s output does not go with "
                f"it; add {held} to --only to re-run it on that build, or drop --only"
            )

    def needs_launcher(self) -> bool:
        """True when a stage that trains will run and the spec asks for more processes than
        this one (and we are not already one of them)."""
        train = self.spec.train
        if train is None or train.launcher.world_size == 1 or distributed.launched():
            return False
        return any(s.action == "run" and STAGES[s.stage].distributed for s in self.plan())

    def run(self, tracker) -> dict[str, dict | None]:
        """Execute the plan. Returns each stage's record (run or skipped; None: held, not done).

        In a multi-process launch rank 0 does all of this (lock, plan, tracking, the
        single-process stages, publishing); the other ranks only join the distributed stages,
        which rank 0 announces one at a time (`_follow`)."""
        if distributed.rank() != 0:
            self._follow()
            return {}
        records: dict[str, dict | None] = {}  # None: a held stage not done yet
        with WorkspaceLock(self.ws.path), RaiseOnSignal():
            with stop_words(NOT_STARTED):
                for name in self.spec.stages:
                    self.ws.finish_publish(name)  # one a crash interrupted
                steps = self.plan()
            if not any(s.action == "run" for s in steps):
                # a parent run with no stage under it would only be noise in MLflow
                distributed.broadcast_object(None)  # nothing for the other ranks
                for step in steps:
                    records[step.stage] = self._do(step, records, tracker, steps)
                self._reprint_results(steps, records)
                return records
            together = [s for s in steps if s.action == "run" and STAGES[s.stage].distributed]
            try:
                with stop_words(NOT_STARTED):
                    tracker.start(self.spec, plan=steps)
                if not together:
                    distributed.broadcast_object(None)  # nothing for the other ranks
                for step in steps:
                    records[step.stage] = self._do(step, records, tracker, steps)
                    if together and step is together[-1]:
                        distributed.broadcast_object(None)  # let them go; evaluate is ours
            except BaseException as e:
                killed = isinstance(e, (KeyboardInterrupt, Preempted, Interrupted))
                saved = _checkpointed_stop(e)
                try:
                    tracker.finish("KILLED" if killed else "FAILED")
                except Interrupted:
                    if saved is None:
                        raise
                    raise _cut_short(saved) from None
                if isinstance(e, Interrupted) and saved is not None:  # in the stage's end
                    raise _cut_short(saved) from None
                raise
            tracker.finish("FINISHED")
        return records

    def _reprint_results(self, steps: list[Step], records: dict[str, dict | None]) -> None:
        """Nothing ran: say that nothing was recorded, and print the results the records
        hold, as each stage formats its summary (Stage.result_lines: training's last step
        and best validation, evaluate's lines as it printed them, a plugin's own). evaluate's
        are printed only while they are the scores of the weights it would score now
        (pipeline.workspace.scores); else one line says they are stale."""
        from pipeline.workspace.scores import reprint_stale

        done = (
            "every stage is up to date"
            if all(s.action == "skip" for s in steps)
            else ("the stages selected are up to date")
        )
        self.log(f"nothing to run: {done}; no MLflow run recorded")
        for name, record in records.items():
            summary = (record or {}).get("summary") or {}
            result_lines = STAGES[name].result_lines
            if result_lines is None or not summary:
                continue
            stale = reprint_stale(self.spec, self.ws.path, name, summary)
            lines = [stale] if stale else result_lines(self.spec, summary)
            if not lines:
                continue
            assert record is not None  # a summary came from it
            run = record.get("mlflow_run_id")
            self.log(
                f"recorded results of {name} (finished {record.get('finished_at')}"
                + (f", MLflow run {run}" if run else "")
                + "):"
            )
            for line in lines:
                self.log(f"[{name}] {line}")

    def _do(self, step: Step, records: dict, tracker, steps: list[Step]) -> dict | None:
        name = step.stage
        stage = STAGES[name]
        if step.action != "run":
            if step.action == "skip" or self.say_held:
                said = "skipped" if step.action == "skip" else "held"
                self.log(f"[{name}] {said}: {step.reason}")
            return self.ws.record(name)
        # every input ran or was skipped/held with a record before this stage (plan() checks)
        input_records = {i: cast(dict, records[i]) for i in resolve_inputs(stage, self.spec.stages)}
        config = stage.fingerprinted(self.spec)
        builds = {i: r["build"] for i, r in input_records.items()}
        fp = fingerprint(config, builds)
        if step.forced:
            self.ws.invalidate(name)
            if step.checkpoint is not None:
                self.log(
                    f"[{name}] discarding the interrupted run's checkpoints up to step "
                    f"{step.checkpoint}"
                )
        out_dir = self.ws.begin(
            name, {"fingerprint": fp, "config": config, "inputs": builds}, fresh=step.forced
        )
        self.log(f"[{name}] running: {step.reason}")
        started = time.time()
        partial = self.ws.partial_marker(name)
        assert partial is not None  # begin() made it
        with tracker.stage(
            name, stage.config(self.spec), partial["series"], resumed=partial["attempt"] > 1
        ) as stage_tracker:
            inputs = {i: self.ws.done_dir(i) for i in input_records}
            if stage.distributed:
                distributed.broadcast_object({"stage": name, "out_dir": out_dir, "inputs": inputs})
            ctx = StageContext(
                spec=self.spec,
                out_dir=out_dir,
                inputs=inputs,
                tracker=stage_tracker,
                log=lambda m: self.log(f"[{name}] {m}"),
            )
            summary = stage.run(ctx) or {}
            if stage.distributed:
                distributed.barrier()
        outputs = output_checksums(out_dir)
        build = self._repaired_build(step, outputs, steps) if step.repair else uuid.uuid4().hex[:12]
        record = {
            "stage": name,
            "fingerprint": fp,
            "config": config,
            "build": build,
            "inputs": builds,
            "finished_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "seconds": round(time.time() - started, 2),
            "summary": summary,
            "mlflow_run_id": stage_tracker.run_id,
            "outputs": outputs,
        }
        self.ws.publish(name, record)
        self.log(f"[{name}] done in {record['seconds']:.1f}s")
        return record

    def _repaired_build(self, step: Step, outputs: dict, steps: list[Step]) -> str:
        """The build id of a damaged stage rebuilt (`Step.repair`): the damaged output's when
        the rebuild reproduced the files its record lists, since then what was built from
        them is still up to date; else a new one, unless stages this run keeps were built
        from the old files: then nothing is published (the rebuild stays in the partial
        directory) and the run stops, rather than leave them built from another output."""
        name = step.stage
        damaged = self.ws.record(name)
        assert damaged is not None  # a repair rebuilds a published stage
        kept = [
            s.stage
            for s in steps
            if s.action != "run" and name in resolve_inputs(STAGES[s.stage], self.spec.stages)
        ]
        differs = _first_difference(damaged["outputs"], outputs)
        if differs is None:
            if kept:
                self.log(
                    f"[{name}] rebuilt as it was published: {', '.join(kept)}, built "
                    f"from it, {'stays' if len(kept) == 1 else 'stay'} up to date"
                )
            return damaged["build"]
        if kept:
            raise PipelineError(
                f"{name}: rebuilt in {self.ws.partial_dir(name)}, but its {differs} differs "
                f"from the one {', '.join(kept)} {'was' if len(kept) == 1 else 'were'} built "
                f"from, so the damaged output was left as it was; restore the damaged file, "
                f"or re-run with --force {name} to rebuild it and what reads it"
            )
        return uuid.uuid4().hex[:12]

    def _follow(self) -> None:
        """A rank other than 0: run each distributed stage rank 0 announces, until it says
        there are no more. Rank 0 alone logs, tracks and publishes."""
        while (job := distributed.broadcast_object()) is not None:
            ctx = StageContext(
                spec=self.spec,
                out_dir=job["out_dir"],
                inputs=job["inputs"],
                tracker=NullStageTracker(),
                log=lambda m: None,
            )
            STAGES[job["stage"]].run(ctx)
            distributed.barrier()
