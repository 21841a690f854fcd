"""Learning curves (matplotlib, headless): train loss and valid bpc of several runs, each by
optimizer step, by tokens seen and by wall-clock time, for `allattn-pipe compare --plot`.

`curves` reads them from MLflow, so what is drawn can be checked without looking at pixels.
"""

from __future__ import annotations

import gzip
import io
import os
import stat
import zlib
from pathlib import Path

from pipeline.errors import PipelineError, shown
from pipeline.training.head_maps import image_format, save

# metric -> the y-axis label; train and finetune log both under these names
SERIES = {"loss": "train loss (nats)", "valid_bpc": "valid bpc"}
AXES = (("step", "step"), ("tokens", "tokens seen"), ("minutes", "wall-clock (minutes)"))


# The picture's own mark (its "Creator"), which `compare --plot` looks for before it replaces
# a file: only a picture it drew is replaced, never a user's report.pdf, as `launch slurm
# --output` replaces only a script holding its marker line (pipeline.cluster.slurm.MARKER).
MARK = (
    "allattn-pipe compare --plot drew these learning curves; drawing them again replaces this file"
)
# The formats whose files can carry the mark (matplotlib's metadata "Creator"); a file of any
# other format (.jpg, .tif, .webp, ...) is never replaced.
MARKED_FORMATS = ("png", "pdf", "svg", "svgz", "eps", "ps")
MAX_PICTURE_BYTES = 64 << 20  # a larger file is no learning-curve picture: not read


def check_replaceable(path) -> None:
    """Refuse (one line naming it) to replace anything at `path` but a regular file holding
    MARK: a link, a directory, a FIFO, or a file this command did not draw (a user's
    report.pdf, a picture of a format that cannot hold the mark)."""
    try:
        mode = os.lstat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return  # nothing there to replace (where the picture cannot go, its writer says)
    except OSError as e:
        raise PipelineError(f"{shown(path)}: cannot read it: {e.strerror or e}") from None
    if not stat.S_ISREG(mode):
        raise PipelineError(
            f"{shown(path)}: not a regular file (a link, a directory, a FIFO); refusing to "
            f"replace it with the picture: name a new file"
        )
    image = image_format(path)
    if image not in MARKED_FORMATS:
        raise PipelineError(
            f"{shown(path)}: exists, and a .{image} picture cannot carry the mark that shows "
            f"compare --plot drew it; refusing to replace it: name a new file, or remove "
            f"this one (a .png, .pdf or .svg it drew, it replaces)"
        )
    if not _drawn_here(Path(path)):
        raise PipelineError(
            f"{shown(path)}: not a picture allattn-pipe compare --plot drew (no {MARK!r} "
            f"in it); refusing to replace it: name a new file, or remove this one"
        )


def _drawn_here(path: Path) -> bool:
    from pipeline.fsutil import read_bytes

    try:
        if path.stat().st_size > MAX_PICTURE_BYTES:
            return False
        data = read_bytes(path, "picture")
        if data[:2] == b"\x1f\x8b":  # .svgz: read as far as a picture of ours can be
            data = gzip.GzipFile(fileobj=io.BytesIO(data)).read(MAX_PICTURE_BYTES)
    except (OSError, EOFError, zlib.error, PipelineError):
        return False
    return MARK.encode() in data


def curves(client, row) -> dict[str, list[dict]]:
    """{metric: [{"step", "tokens", "minutes", "value"}, ...]} of one compare row (one
    workspace: its train and finetune runs, over every invocation), ordered by step; the
    minutes count from the row's first logged point (of either metric)."""
    try:
        per_step = int(row.params["train.batch_size"]) * int(row.params["train.seq_len"])
    except (KeyError, ValueError):
        per_step = 0
    stage_runs = [
        child
        for run_id in row.run_ids
        for child in client.search_runs(
            [client.get_run(run_id).info.experiment_id], f"tags.`mlflow.parentRunId` = '{run_id}'"
        )
        if child.data.tags.get("stage") in ("train", "finetune")
    ]
    stage_runs.sort(key=lambda child: child.info.start_time or 0)  # so the latest wins
    found: dict[str, dict[int, tuple[int, float]]] = {}
    for metric in SERIES:
        points = {}
        for child in stage_runs:
            for m in client.get_metric_history(child.info.run_id, metric):
                points[m.step] = (m.timestamp, m.value)  # a resumed run re-logs: last wins
        if points:
            found[metric] = points
    if not found:
        return {}
    start = min(t for points in found.values() for t, _ in points.values())
    return {
        metric: [
            {"step": s, "tokens": s * per_step, "minutes": (t - start) / 60000, "value": v}
            for s, (t, v) in sorted(points.items())
        ]
        for metric, points in found.items()
    }


def learning_curves(data: dict[str, dict[str, list[dict]]], path) -> Path:
    """A PNG at `path`: one row of panels per metric of SERIES, one column per x-axis of
    AXES, one line per run (`data`: run name -> `curves`). A file already at `path` is
    replaced only when it is a picture this drew (`check_replaceable`)."""
    import matplotlib

    check_replaceable(path)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(SERIES), len(AXES), figsize=(15, 8), squeeze=False)
    for i, (metric, ylabel) in enumerate(SERIES.items()):
        for j, (x, xlabel) in enumerate(AXES):
            ax = axes[i][j]
            for name, series in data.items():
                points = series.get(metric, [])
                if points:
                    ax.plot(
                        [p[x] for p in points],
                        [p["value"] for p in points],
                        marker="." if len(points) < 30 else None,
                        label=name,
                    )
            if not ax.lines:
                ax.text(
                    0.5,
                    0.5,
                    f"no run logged {metric}",
                    ha="center",
                    va="center",
                    transform=ax.transAxes,
                    color="grey",
                )
            ax.set_xlabel(xlabel)
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="upper center", ncol=min(4, len(labels)), fontsize="small")
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    marked = image_format(path) in MARKED_FORMATS
    return save(fig, path, dpi=100, **({"metadata": {"Creator": MARK}} if marked else {}))
