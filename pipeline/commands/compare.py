"""`allattn-pipe compare`: pipeline runs side by side, read back from the MLflow store.

One row per workspace: its pipeline runs (MLflow runs tagged `spec`, one per `run` that ran
at least one stage: a first attempt, its resumption, ...) merged. Its numbers come from
their stage runs and describe the weights the row shows, its latest training run's: steps
from that run's loss history, its size, the spec and wall time of the pipeline runs that
trained them, the final metrics from evaluate (`_row`). Rows that differ only in
`train.seed` (and in the run name, which a sweep derives from the seed) form one group: each
metric is the mean ± sample standard deviation over the group, with n. A config with a
`paper:` section logged its published row as parameters; the group gets that row beneath
it, with our mean minus the published value.

Columns equal in every row are folded into one header line, so the table shows what differs;
`csv` and `json` keep every column (they are for programs, not eyes).

A row's scores are shown only beside the weights they scored: evaluate's run names them by
content (its `weights` tag), and so does each training stage's run (the weights it ended with,
and its best validation's). Where the row's latest training run ended with other weights (train
re-run without evaluate), or a run does not say (an older allattn-pipe, a training run killed),
each score cell reads `stale`, such rows are grouped apart, and a line below the table says why
and to re-run evaluate.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import re
import socket
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.errors import PipelineError, shown

# parameters that name where a run lived rather than what it computed
_PLACE = ("name", "workspace.", "tracking.", "paper.")
SEED = "train.seed"
TOKENIZER = "dataset.tokenizer.kind"
# the metrics shown by default, in this order, when a run logged them
METRICS = ("valid_bpc", "test_bpc", "valid_ppl", "test_ppl")
TRAINING = ("train", "finetune", "curriculum")  # the stages whose runs make weights
STATUS = {
    "FINISHED": "finished",
    "KILLED": "killed",
    "FAILED": "failed",
    "RUNNING": "running",
    "SCHEDULED": "running",
}


@dataclass
class RunRow:
    """One workspace's pipeline runs, as MLflow recorded them."""

    run_id: str  # the latest pipeline run of its workspace
    run_ids: list[str]  # all of them, oldest first
    name: str
    status: str
    params: dict[str, str]  # the resolved spec that trained the weights shown, flattened
    metrics: dict[str, float]  # evaluate's (and the tasks') final numbers
    steps: int | None  # the last optimizer step the latest training run logged
    parameters: int | None  # the model's size, as that run (or the train before it) logged it
    wall_s: float  # the pipeline runs' since that training run began
    sweep: str | None  # the run of the sweep it belongs to, if any
    stale: str | None = None  # why `metrics` are not the scores of the weights shown, if not


@dataclass
class Group:
    """Rows alike in everything but the seed and the run name."""

    rows: list[RunRow]
    paper: dict | None = None  # {"table", "parameters", "results": {metric: value}}
    key: dict[str, str] = field(default_factory=dict)

    @property
    def stale(self) -> str | None:
        """Why the group's scores are not of the weights its rows show (its rows are all
        stale or none is: `group`), or None."""
        return next((r.stale for r in self.rows if r.stale), None)

    @property
    def name(self) -> str:
        """The run name, less a sweep's `-seedN` when the seeds differ."""
        names = sorted({r.name for r in self.rows})
        if len(names) == 1:
            return names[0]
        stems = sorted({re.sub(r"-seed[^-]*", "", n) for n in names})
        return stems[0] if len(stems) == 1 else f"{names[0]} (+{len(names) - 1})"

    @property
    def seeds(self) -> str:
        return ",".join(sorted({r.params.get(SEED, "?") for r in self.rows}, key=_natural))

    def metric(self, name: str) -> tuple[float, float | None, int] | None:
        """(mean, sample std or None for one value, n) of `name` over the group's rows; None
        for stale scores, which are never shown as numbers."""
        values = [r.metrics[name] for r in self.rows if name in r.metrics and not r.stale]
        if not values:
            return None
        if not all(math.isfinite(v) for v in values):
            # a NaN or infinite run leaves the statistics undefined (null in JSON);
            # statistics.stdev would raise on it
            return math.nan, math.nan if len(values) > 1 else None, len(values)
        std = statistics.stdev(values) if len(values) > 1 else None
        return statistics.fmean(values), std, len(values)


def _natural(text: str):
    return (0, int(text), "") if text.lstrip("-").isdigit() else (1, 0, text)


def store_uri(specs) -> str:
    """The tracking store `run` would use: the first config's, else MLFLOW_TRACKING_URI,
    else the embedded store under the default workspace root."""
    from pipeline.tracking.tracker import default_tracking_uri, tracking_uri

    if specs:
        return tracking_uri(specs[0])
    return os.environ.get("MLFLOW_TRACKING_URI") or default_tracking_uri("runs")


def collect(
    client, specs=(), experiments=(), run_ids=(), filter_string: str = "", overrides=()
) -> list[RunRow]:
    """The pipeline runs that the targets name: each spec's runs (its experiment, its name,
    the values its --set overrides give), every run of each experiment, and each run id;
    everything in the store when no target is given. `filter_string` (MLflow's search
    syntax) keeps a pipeline run when it or one of its stage runs matches."""
    from mlflow.exceptions import MlflowException

    # experiment id -> predicates on a pipeline run's row
    wanted: dict[str, list[Callable[..., bool]]] = {}
    for spec in specs:
        exp = client.get_experiment_by_name(spec.tracking.experiment or spec.name)
        if exp is None:
            raise PipelineError(
                f"{spec.source}: no runs of it in {client.tracking_uri} "
                f"(experiment '{spec.tracking.experiment or spec.name}')"
            )
        wanted.setdefault(exp.experiment_id, [])
        wanted[exp.experiment_id].append(_names(spec, overrides))
    for name in experiments:
        exp = client.get_experiment_by_name(name)
        if exp is None:
            raise PipelineError(
                f"no experiment '{shown(name)}' in {client.tracking_uri} (nor a "
                f"config file or a run id of that name)"
            )
        wanted.setdefault(exp.experiment_id, []).append(lambda row: True)
    for run_id in run_ids:
        try:
            run = client.get_run(run_id)
        except MlflowException:
            raise PipelineError(f"no run {run_id} in {client.tracking_uri}") from None
        ids = set(_pipelines_of(run, _search(client, run.info.experiment_id, "")))
        wanted.setdefault(run.info.experiment_id, []).append(
            lambda row, ids=ids: bool(ids & set(row.run_ids))
        )
    if not (specs or experiments or run_ids):
        for exp in client.search_experiments():
            wanted[exp.experiment_id] = [lambda row: True]
    rows = []
    for exp_id, predicates in wanted.items():
        try:
            runs = _search(client, exp_id, "")
            matching = _search(client, exp_id, filter_string) if filter_string else runs
        except MlflowException as e:
            raise PipelineError(f"--filter {filter_string!r}: {shown(e.message)}") from None
        chosen = {p for r in matching for p in _pipelines_of(r, runs)}
        children: dict[str, list] = {}
        by_workspace: dict[str, list] = {}
        for r in runs:
            tags = r.data.tags
            if "stage" in tags:
                children.setdefault(tags.get("mlflow.parentRunId"), []).append(r)
            elif "spec" in tags and tags.get("stages.run") != "none":
                by_workspace.setdefault(tags.get("workspace", r.info.run_id), []).append(r)
        for invocations in by_workspace.values():
            if not chosen & {r.info.run_id for r in invocations}:
                continue
            row = _row(client, invocations, children)
            if any(p(row) for p in predicates):
                rows.append(row)
    rows.sort(key=lambda row: (row.name, _natural(row.params.get(SEED, "")), row.run_id))
    return rows


def _pipelines_of(run, runs) -> list[str]:
    """The pipeline runs a run stands for: itself, its parent (a stage run), or its
    children (a sweep's run)."""
    tags = run.data.tags
    if "spec" in tags:
        return [run.info.run_id]
    if "stage" in tags:
        return [tags.get("mlflow.parentRunId")]
    return [r.info.run_id for r in runs if r.data.tags.get("mlflow.parentRunId") == run.info.run_id]


def _search(client, exp_id: str, filter_string: str) -> list:
    out, token = [], None
    while True:
        page = client.search_runs([exp_id], filter_string, max_results=1000, page_token=token)
        out += list(page)
        token = page.token
        if not token:
            return out


def _names(spec, overrides):
    """A predicate: a pipeline run of `spec` in its experiment (its name, or a sweep
    point's name made from it; and the values --set gave)."""
    from pipeline.spec import parse_override
    from pipeline.tracking.tracker import flatten

    resolved = flatten(spec.resolved())
    keys = [".".join(parse_override(text)[0]) for text in overrides]
    fixed = {
        k: v for k, v in resolved.items() if any(k == x or k.startswith(x + ".") for x in keys)
    }
    return lambda row: (
        (row.name == spec.name or row.name.startswith(f"{spec.name}-"))
        and all(row.params.get(k) == v for k, v in fixed.items())
    )


def _row(client, invocations, children: dict[str, list]) -> RunRow:
    """One workspace's pipeline runs (a first run, its resumption after a kill, ...) as one
    row that describes the weights it shows, those of its latest training run
    (`_made_by`): their steps and size from that run and the attempts it resumed, the spec
    of the pipeline run that trained them (evaluate's settings from the one that scored),
    the wall time of the pipeline runs since their training began. Before, the steps were the
    largest of every training run and the wall time that of them all: a model trained again
    with fewer steps showed the older one's. The status is the latest pipeline run's; the
    final metrics are those of the latest evaluate run that finished."""
    from pipeline.tracking.tracker import last_activity

    invocations = sorted(invocations, key=lambda r: r.info.start_time or 0)
    latest = invocations[-1]
    status = STATUS.get(latest.info.status, latest.info.status.lower())
    if status == "running" and _died(latest):
        status = "killed"
    parent_of = {}  # stage run id -> its pipeline run
    stage_runs = []
    for parent in invocations:
        for child in children.get(parent.info.run_id, []):
            parent_of[child.info.run_id] = parent
            stage_runs.append(child)
    stage_runs.sort(key=lambda c: c.info.start_time or 0)
    trained = {}  # training stage -> its latest run
    evaluated = None  # the evaluate run whose numbers the row shows
    for child in stage_runs:
        stage = child.data.tags.get("stage")
        if stage in TRAINING:
            trained[stage] = child
        elif stage == "evaluate" and child.data.metrics and child.info.status == "FINISHED":
            # a killed or failed evaluate's numbers are a part of the splits, never published
            evaluated = child
    made = _made_by(stage_runs, trained)
    steps = parameters = since = None
    params = dict(latest.data.params)
    if made:
        since = parent_of[made[0].info.run_id].info.start_time or 0
        params = dict(parent_of[made[-1].info.run_id].data.params)
        for run in made:
            if made[-1].data.tags.get("stage") == run.data.tags.get("stage"):
                history = client.get_metric_history(run.info.run_id, "loss")
                if history:
                    steps = max(steps or 0, max(m.step for m in history))
        # the size: as the run logged it, or (finetune) as the train run it went on from did
        parameters = next(
            (
                int(r.data.params["parameters"])
                for r in reversed(made)
                if "parameters" in r.data.params
            ),
            None,
        )
    if evaluated is not None:
        scoring = parent_of[evaluated.info.run_id].data.params
        params = {k: v for k, v in params.items() if not k.startswith("evaluate.")}
        params |= {k: v for k, v in scoring.items() if k.startswith("evaluate.")}
    wall = 0.0
    for parent in invocations:
        info = parent.info
        if since is not None and (info.start_time or 0) < since:
            continue  # a pipeline run before these weights' training began
        end = info.end_time
        if end is None and (parent is not latest or status == "killed"):
            # killed without a word (kill -9): its time ended with its last record
            end = last_activity(client, parent, children.get(info.run_id, []))
        wall += ((end or int(time.time() * 1000)) - info.start_time) / 1000
    info = latest.info
    return RunRow(
        run_id=info.run_id,
        run_ids=[r.info.run_id for r in invocations],
        name=latest.data.tags.get("mlflow.runName", info.run_id),
        status=status,
        params=params,
        metrics=dict(evaluated.data.metrics) if evaluated else {},
        steps=steps,
        parameters=parameters,
        wall_s=wall,
        sweep=latest.data.tags.get("mlflow.parentRunId"),
        stale=(_stale(evaluated, trained, params) or _unsent(latest)) if evaluated else None,
    )


def _made_by(stage_runs: list, trained: dict[str, Any]) -> list:
    """The training runs behind the weights a row shows, oldest first (none without a
    training run). The weights are the latest
    training run's; it made them with the attempts it resumed (its `series`) and, for
    finetune, from the weights of the latest train run before its first attempt (and that
    run's attempts)."""
    if not trained:
        return []
    last = max(trained.values(), key=lambda r: r.info.start_time or 0)
    made = _attempts(stage_runs, last)
    if last.data.tags.get("stage") == "finetune":
        began = made[0].info.start_time or 0
        before = [
            r
            for r in stage_runs
            if r.data.tags.get("stage") == "train" and (r.info.start_time or 0) < began
        ]
        if before:
            made = _attempts(stage_runs, before[-1]) + made
    return made


def _attempts(stage_runs: list, run) -> list:
    """`run` and the earlier attempts of its stage's output that it resumed (the runs of its
    `series`, oldest first); `run` alone where it names none (an older allattn-pipe)."""
    tags = run.data.tags
    series = tags.get("series")
    if series is None:
        return [run]
    return [
        r
        for r in stage_runs
        if r.data.tags.get("series") == series
        and r.data.tags.get("stage") == tags.get("stage")
        and (r.info.start_time or 0) <= (run.info.start_time or 0)
    ]


def _stale(evaluated, trained: dict[str, Any], params: dict[str, str]) -> str | None:
    """Why the scores of evaluate's run `evaluated` are not of the weights the row shows,
    its training stages' latest runs (`trained`, by stage), or None when they are: the
    weights evaluate would score, the latest training run's last or its best (finetune's
    best, else train's), must have the id evaluate's run names. With no training run in the
    row (a sweep's point that reused another's), nothing it shows is other weights."""
    from pipeline.training.checkpoint_dirs import BEST_WEIGHTS, WEIGHTS

    scored = evaluated.data.tags.get(WEIGHTS)
    if not scored:
        return "evaluate's run does not name the weights it scored (an older allattn-pipe ran it)"
    if not trained:
        return None
    run = max(trained.values(), key=lambda r: r.info.start_time or 0)
    stage = run.data.tags.get("stage")
    key = (
        BEST_WEIGHTS
        if stage != "curriculum" and params.get("evaluate.checkpoint") == "best"
        else WEIGHTS
    )
    current = run.data.tags.get(key)
    if current is None and key == BEST_WEIGHTS and stage == "finetune" and "train" in trained:
        current = trained["train"].data.tags.get(key)  # finetune never beat train's best
    if current is None:
        return (
            f"{stage}'s latest run does not name the weights it ended with (it was killed or "
            f"failed, or an older allattn-pipe ran it)"
        )
    if current != scored:
        return f"evaluate scored other weights than {stage}'s latest run ended with"
    return None


# the end of a stale reason that says what to do itself (in place of RERUN)
SYNC = "send them with `allattn-pipe sync` its config"


def _unsent(latest) -> str | None:
    """Why the store's view of a workspace (on this host) is behind it, or None: a training
    stage or evaluate ran there since with the server away, its runs still waiting in the
    workspace's tracking backlog, so the store's latest weights and scores are no longer the
    workspace's. A file that cannot be read as a backlog (a FIFO, another's) says nothing."""
    from pipeline.tracking.backlog import read_backlog
    from pipeline.tracking.tracker import BACKLOG

    tags = latest.data.tags
    if tags.get("host") != socket.gethostname() or "workspace" not in tags:
        return None
    path = Path(tags["workspace"]) / BACKLOG
    try:
        if not path.is_file():
            return None
        waiting = read_backlog(path).waiting
    except (PipelineError, OSError):
        return None
    ran = {
        str(record.get("tags", {}).get("stage"))
        for _, record in waiting
        if record["op"] == "create" and isinstance(record.get("tags"), dict)
    } & {*TRAINING, "evaluate"}
    if not ran:
        return None
    return (
        f"{' and '.join(sorted(ran))} ran since with the tracking server away: their runs "
        f"wait in {shown(path)}, not yet in this store; {SYNC}"
    )


def _died(run) -> bool:
    """A run MLflow has as running whose workspace (on this host) no run holds: killed
    without a word. On another host nobody here can tell."""
    from pipeline.workspace.lock import lock_is_free

    tags = run.data.tags
    return (
        tags.get("host") == socket.gethostname()
        and "workspace" in tags
        and lock_is_free(Path(tags["workspace"]))
    )


def group(rows: list[RunRow]) -> list[Group]:
    """Rows equal in every parameter but the seed and the place, and in status, together."""
    groups: dict[tuple, Group] = {}
    for row in rows:
        key = {k: v for k, v in row.params.items() if k != SEED and not k.startswith(_PLACE)}
        # stale scores apart: a mean never mixes them in, and their cells read `stale`
        ident = (
            tuple(sorted(key.items())),
            row.status,
            re.sub(r"-seed[^-]*", "", row.name),
            row.stale is not None,
        )
        if ident not in groups:
            groups[ident] = Group([], paper=_paper(row.params), key=key)
        groups[ident].rows.append(row)
    return list(groups.values())


def _paper(params: dict[str, str]) -> dict | None:
    results = {
        k.removeprefix("paper.results."): float(v)
        for k, v in params.items()
        if k.startswith("paper.results.")
    }
    if not results:
        return None
    return {
        "table": params.get("paper.table", ""),
        "parameters": int(params["paper.parameters"]) if "paper.parameters" in params else None,
        "results": results,
    }


def metric_names(groups: list[Group], chosen=()) -> list[str]:
    if chosen:
        return list(chosen)
    present = {m for g in groups for r in g.rows for m in r.metrics}
    present |= {m for g in groups if g.paper for m in g.paper["results"]}
    return [m for m in METRICS if m in present] + sorted(present - set(METRICS))


# ----------------------------------------------------------------------------------- render


def _varying_params(groups: list[Group]) -> list[str]:
    keys = sorted({k for g in groups for k in g.key})
    return [k for k in keys if len({g.key.get(k) for g in groups}) > 1]


def _fmt_number(value: float) -> str:
    return f"{value:.4g}" if abs(value) < 1000 else f"{value:,.0f}"


STALE = "stale"
"""What a score cell reads in place of a number that is not the score of the weights its row
shows (and what the line below the table begins with)."""
RERUN = "re-run evaluate (`allattn-pipe run` its config with --force evaluate)"


def _fmt_metric(stat) -> str:
    if stat is None:
        return "-"
    mean, std, _ = stat
    return _fmt_number(mean) if std is None else f"{_fmt_number(mean)} ± {std:.2g}"


def _fmt_wall(seconds: float) -> str:
    return f"{seconds:.0f}s" if seconds < 120 else f"{seconds / 60:.1f}m"


def _fmt_size(n) -> str:
    """A parameter count: whole below 100,000, else three significant figures in k, M or B
    (113,775 and 146,543 are 114k and 147k; one decimal of millions made both 0.1M)."""
    if n is None:
        return "-"
    if n < 100_000:
        return f"{n:,}"
    scale, unit = 1e3, "k"
    for bigger, name in ((1e6, "M"), (1e9, "B")):
        if float(f"{n / scale:.3g}") < 1000:  # rounded first: 999,600 is 1.00M, not 1000k
            break
        scale, unit = bigger, name
    value = float(f"{n / scale:.3g}")
    return f"{value:.{max(0, 2 - math.floor(math.log10(value)))}f}{unit}"


def _tokens(row: RunRow) -> int | None:
    if row.steps is None:
        return None
    try:
        return row.steps * int(row.params["train.batch_size"]) * int(row.params["train.seq_len"])
    except (KeyError, TypeError, ValueError):
        return None


def _mean_of(values):
    values = [v for v in values if v is not None]
    return round(statistics.fmean(values)) if values else None


def _metric_header(metric: str, groups: list[Group]) -> str:
    """A metric's column: `*_bpc` (evaluate's bits per token) is `*_bits/token` unless every
    run's tokens are characters or bytes, where bits per token are bits per character."""
    from pipeline.data.vocab import bits_name

    if not metric.endswith("_bpc"):
        return metric
    names = {bits_name(g.rows[0].params.get(TOKENIZER)) for g in groups}
    return metric if names == {"bpc"} else f"{metric.removesuffix('_bpc')}_bits/token"


def table_rows(groups: list[Group], metrics: list[str]) -> tuple[list[str], list[list[str]]]:
    """The header and the cells of every row (paper rows included), nothing folded yet."""
    params = _varying_params(groups)
    header = (
        ["name", "status", "n", "seeds", "model", "parameters", "steps", "tokens", "wall"]
        + params
        + [_metric_header(m, groups) for m in metrics]
    )
    cells = []
    for g in groups:
        first = g.rows[0]
        tokens = _mean_of(_tokens(r) for r in g.rows)
        cells.append(
            [
                g.name,
                first.status,
                str(len(g.rows)),
                g.seeds,
                first.params.get("model.kind", "?"),
                _fmt_size(_mean_of(r.parameters for r in g.rows)),
                str(_mean_of(r.steps for r in g.rows) or "-"),
                "-" if tokens is None else f"{tokens:,}",
                _fmt_wall(statistics.fmean(r.wall_s for r in g.rows)),
            ]
            + [g.key.get(p, "-") for p in params]
            + [
                STALE
                if g.stale and any(m in r.metrics for r in g.rows)
                else _fmt_metric(g.metric(m))
                for m in metrics
            ]
        )
        if g.paper:
            label = f"  published: {g.paper['table']}"
            if g.paper["parameters"]:
                label += f", {_fmt_size(g.paper['parameters'])} parameters"
            row = [label, "published", "", "", "", _fmt_size(g.paper["parameters"]), "", "", ""] + [
                "" for _ in params
            ]
            for m in metrics:
                published, ours = g.paper["results"].get(m), g.metric(m)
                if published is None:
                    row.append("")
                elif ours is None:
                    row.append(_fmt_number(published))
                else:
                    row.append(f"{_fmt_number(published)} ({ours[0] - published:+.3g})")
            cells.append(row)
    return header, cells


def _fold(
    header: list[str], cells: list[list[str]]
) -> tuple[list[str], list[str], list[list[str]]]:
    """Drop the columns whose value is the same in every run row (paper rows leave theirs
    blank); return them as 'column: value' notes, and the columns left."""
    runs = [c for c in cells if c[1] != "published"]
    keep, notes = [], []
    for i, col in enumerate(header):
        values = {c[i] for c in runs}
        if col != "name" and len(runs) > 1 and len(values) == 1:
            notes.append(f"{col}: {values.pop()}")
        else:
            keep.append(i)
    return notes, [header[i] for i in keep], [[c[i] for i in keep] for c in cells]


def stale_lines(groups: list[Group]) -> list[str]:
    """One line for each group whose score cells read `stale`: why, and what to re-run."""
    return [f"{STALE}: {g.name}: {_with_remedy(g.stale)}" for g in groups if g.stale]


def _with_remedy(reason: str) -> str:
    return reason if reason.endswith(SYNC) else f"{reason}; {RERUN}"


def render(groups: list[Group], metrics: list[str], fmt: str) -> str:
    if not groups:
        return "no pipeline runs found"
    if fmt == "json":
        # JSON has no NaN or infinity: a non-finite value is null, as a missing one is
        rows = _finite_or_null([_as_json(g, metrics) for g in groups])
        return json.dumps(rows, indent=2, allow_nan=False)
    header, cells = table_rows(groups, metrics)
    if fmt == "csv":
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        writer.writerow(header)
        writer.writerows(cells)
        return out.getvalue().rstrip("\n")
    notes, header, cells = _fold(header, cells)
    if fmt == "markdown":
        lines = [f"*equal in every row:* {'; '.join(notes)}", ""] if notes else []
        lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in cells]
        return "\n".join(
            lines + ["", *stale_lines(groups)] if any(g.stale for g in groups) else lines
        )
    widths = [max(len(r[i]) for r in [header] + cells) for i in range(len(header))]
    lines = [f"equal in every row: {'; '.join(notes)}"] if notes else []
    for row in [header] + cells:
        lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=False)).rstrip())
    return "\n".join(lines + stale_lines(groups))


def _finite_or_null(value):
    """`value` (plain data) with every NaN and infinity replaced by None."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite_or_null(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite_or_null(v) for v in value]
    return value


def _as_json(g: Group, metrics: list[str]) -> dict:
    out: dict[str, Any] = {
        "name": g.name,
        "status": g.rows[0].status,
        "n": len(g.rows),
        "runs": [
            {
                "run_id": r.run_id,
                "run_ids": r.run_ids,
                "name": r.name,
                "seed": r.params.get(SEED),
                "steps": r.steps,
                "tokens": _tokens(r),
                "parameters": r.parameters,
                "wall_s": r.wall_s,
                # stale scores are no run's numbers: none are given, `stale` says why
                "metrics": {} if r.stale else r.metrics,
                "stale": r.stale,
            }
            for r in g.rows
        ],
        "params": g.key,
        "metrics": {},
    }
    if g.stale:
        out["stale"] = _with_remedy(g.stale)
    for m in metrics:
        stat = g.metric(m)
        if stat is not None:
            mean, std, n = stat
            out["metrics"][m] = {"mean": mean, "std": std, "n": n}
    if g.paper:
        out["paper"] = dict(
            g.paper,
            difference={
                m: out["metrics"][m]["mean"] - v
                for m, v in g.paper["results"].items()
                if m in out["metrics"]
            },
        )
    return out


def paper_line(paper) -> str:
    """`show`'s line for a spec's `paper:` section."""
    results = ", ".join(f"{k} {v:g}" for k, v in paper.results.items())
    size = f" with {paper.parameters / 1e6:g}M parameters" if paper.parameters else ""
    return f"published: {results}{size} ({paper.table})"
