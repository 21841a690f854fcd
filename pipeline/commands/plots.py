"""Learning curves (matplotlib, headless): train loss and valid bpc of several runs, each by
optimizer step, by tokens seen and by wall-clock time, for `allattn-pipe compare --plot`.

`curves` reads them from MLflow, so what is drawn can be checked without looking at pixels.
"""

from __future__ import annotations

from pathlib import Path

from pipeline.training.head_maps import save

# metric -> the y-axis label; train and finetune log both under these names
SERIES = {"loss": "train loss (nats)", "valid_bpc": "valid bpc"}
AXES = (("step", "step"), ("tokens", "tokens seen"), ("minutes", "wall-clock (minutes)"))


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
    AXES, one line per run (`data`: run name -> `curves`)."""
    import matplotlib

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
    return save(fig, path, dpi=100)
