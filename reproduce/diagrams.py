"""The manual's two diagrams, drawn with matplotlib (headless) so they are remade, not edited:

    python -m reproduce.diagrams [--out docs/img]

- `allattn_layer.png` (docs/models.md): one all-attention layer, the context's keys and values
  with each head's N persistent key/value vectors after them, one softmax over both, the
  adaptive-span mask over distance (computed by `pipeline.ops.attention.adaptive_span_mask`,
  the model's own), and no feed-forward sublayer.
- `stages.png` (docs/design.md): the built-in stages in order, what each writes into its
  workspace directory, the record beside it (`stage.json`) and the MLflow runs.

What the stages diagram names is `STAGE_OUTPUTS`; tests/system/test_docs.py holds it to the files
the stages write.
"""

from __future__ import annotations

import argparse
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "docs" / "img"

STAGE_OUTPUTS = {
    "download": ["files/", "download.json"],
    "preprocess": ["shards/*.tar", "manifest.json"],
    "train": ["checkpoints/step-N/", "spans.json, spans.png"],
    "finetune": ["checkpoints/step-N/", "spans.json, spans.png"],
    "evaluate": ["results.json", "persistent_share.png"],
}
"""Each built-in stage of a language-model run, in order, and what it writes in its directory."""

BOX = dict(boxstyle="round,pad=0.4", linewidth=1.2)
BLUE, GREEN, ORANGE, GREY = "#dbe8f6", "#dff0d8", "#fbe5cc", "#eeeeee"


def box(ax, x, y, text, colour, **kw):
    ax.text(x, y, text, ha="center", va="center", bbox=dict(BOX, facecolor=colour), zorder=3, **kw)


def arrow(ax, start, end, text="", **kw):
    ax.annotate(
        "",
        xy=end,
        xytext=start,
        arrowprops=dict(arrowstyle="-|>", color="#333333", lw=1.2, shrinkA=0, shrinkB=0, **kw),
        zorder=2,
    )
    if text:
        mid = ((start[0] + end[0]) / 2, (start[1] + end[1]) / 2)
        ax.text(mid[0] + 0.02, mid[1], text, fontsize="small", color="#333333", va="center")


def layer_diagram(path) -> Path:
    """One all-attention layer (left) and the adaptive-span mask of two heads (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import torch

    from pipeline.ops.attention import adaptive_span_mask
    from pipeline.training.head_maps import save

    fig, (ax, mask_ax) = plt.subplots(
        1, 2, figsize=(11, 5.2), gridspec_kw={"width_ratios": [1.45, 1]}
    )
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.axis("off")
    # boxes at fixed heights; arrows run from the top edge of one to the bottom edge of the
    # next (a box is about 0.05 high per line of text)
    box(ax, 0.22, 0.06, "x: this block's\nhidden states (M tokens)", GREY)
    box(ax, 0.62, 0.06, "cache: the previous L'\nhidden states (Transformer-XL)", GREY)
    box(ax, 0.13, 0.33, "queries\nQ = x Wq", BLUE)
    box(ax, 0.48, 0.33, "keys, values of [cache; x]\nK = h Wk,  V = h Wv", BLUE)
    box(ax, 0.85, 0.33, "N persistent\nkeys and values\nper head (learned)", ORANGE)
    box(
        ax,
        0.5,
        0.6,
        "scores: context  q·k + q·r (relative positions)  |  persistent  q·p_k\n"
        "one softmax over [context | persistent]\n"
        "× span mask m_z(distance) on the context, 1 on the persistent vectors\n"
        "output = Σ weights · [V | persistent values],  heads joined by Wo",
        GREEN,
        fontsize="small",
    )
    box(ax, 0.5, 0.81, "LayerNorm(x + AllAttn(x))", BLUE)
    box(ax, 0.5, 0.95, "next layer (no feed-forward sublayer)", GREY)
    arrow(ax, (0.17, 0.11), (0.13, 0.27))
    arrow(ax, (0.27, 0.11), (0.42, 0.28))
    arrow(ax, (0.6, 0.11), (0.52, 0.28))
    arrow(ax, (0.13, 0.385), (0.2, 0.525))
    arrow(ax, (0.48, 0.385), (0.48, 0.525))
    arrow(ax, (0.85, 0.265 + 0.14), (0.8, 0.525))
    arrow(ax, (0.5, 0.675), (0.5, 0.78))
    arrow(ax, (0.5, 0.84), (0.5, 0.92))
    # the residual: x joins the sum before the LayerNorm
    ax.annotate(
        "",
        xy=(0.3, 0.81),
        xytext=(0.07, 0.1),
        arrowprops=dict(
            arrowstyle="-|>",
            color="#888888",
            lw=1,
            connectionstyle="angle,angleA=90,angleB=0,rad=0",
        ),
    )
    ax.text(0.04, 0.7, "residual", fontsize="small", color="#888888", rotation=90)
    ax.set_title("an all-attention layer (kind: allattn, ff_dim 0)", fontsize="medium")

    ramp, span_len = 32, 256
    spans = torch.tensor([40.0, 160.0])
    mask = adaptive_span_mask(spans, ramp, span_len)  # [heads, L'], column j: distance L' - j
    distance = list(range(span_len, 0, -1))
    for z, row in zip(spans.tolist(), mask.tolist(), strict=True):
        mask_ax.plot(distance, row, label=f"span z = {z:.0f}")
    mask_ax.axvline(0, color="grey", lw=0.8)
    mask_ax.set_xlim(0, span_len)
    mask_ax.set_ylim(-0.05, 1.1)
    mask_ax.set_xlabel("distance t − c (tokens back)")
    mask_ax.set_ylabel("mask m_z")
    mask_ax.set_title(f"adaptive span: m_z(x) = clamp((R + z − x) / R, 0, 1), R = {ramp}")
    mask_ax.title.set_fontsize("medium")
    mask_ax.grid(alpha=0.3)
    mask_ax.legend(loc="upper right", fontsize="small")
    mask_ax.text(
        0.3,
        0.45,
        "z is learned per head\n(L1 span loss); a layer\nkeeps max z + R keys",
        transform=mask_ax.transAxes,
        fontsize="small",
        color="#333333",
    )
    fig.tight_layout()
    return save(fig, path, dpi=100)


def stages_diagram(path) -> Path:
    """The stages in order, each with its outputs, its record and its MLflow run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from pipeline.training.head_maps import save
    from pipeline.workspace.layout import RECORD

    fig, ax = plt.subplots(figsize=(11, 4.6))
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.axis("off")
    n = len(STAGE_OUTPUTS)
    xs = [(i + 0.5) / n for i in range(n)]
    box(
        ax, 0.5, 0.96, "allattn-pipe run CFG   →   runs/<name>/  (one workspace per run name)", GREY
    )
    for i, (x, (stage, outputs)) in enumerate(zip(xs, STAGE_OUTPUTS.items(), strict=True)):
        box(ax, x, 0.8, stage, BLUE, fontweight="bold")
        if i + 1 < n:
            arrow(ax, (x + 0.07, 0.8), (xs[i + 1] - 0.07, 0.8))
        box(ax, x, 0.57, f"{stage}/\n" + "\n".join(outputs), GREEN, fontsize="small")
        box(
            ax,
            x,
            0.33,
            f"{stage}/{RECORD}\nfingerprint, build id,\nsha256 of every output",
            ORANGE,
            fontsize="small",
        )
        box(
            ax,
            x,
            0.1,
            f"MLflow: stage run\n'{stage}' (metrics,\nartifacts)",
            GREY,
            fontsize="small",
        )
        arrow(ax, (x, 0.76), (x, 0.66))
    ax.text(
        0.005,
        0.45,
        "a stage writes <stage>.partial/; stage.json commits it and the rename publishes it.\n"
        "A stage runs again only when its fingerprint (config + its inputs' build ids) changes.",
        fontsize="small",
        color="#333333",
        va="center",
    )
    ax.text(
        0.005,
        0.215,
        "one MLflow parent run per `run` that runs a stage (params, resolved spec, "
        "environment), a nested run per stage that ran; a re-run with nothing to do records none",
        fontsize="small",
        color="#333333",
        va="center",
    )
    fig.tight_layout()
    return save(fig, path, dpi=100)


DIAGRAMS = {"allattn_layer.png": layer_diagram, "stages.png": stages_diagram}
"""File name -> the function that draws it."""


def draw_all(out_dir) -> list[Path]:
    """Every diagram of DIAGRAMS, written into out_dir; returns their paths."""
    return [draw(Path(out_dir) / name) for name, draw in DIAGRAMS.items()]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m reproduce.diagrams", description=__doc__)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="directory (docs/img)")
    args = parser.parse_args(argv)
    for path in draw_all(args.out):
        print(f"{path}  {path.stat().st_size / 1024:.0f} KB")


if __name__ == "__main__":
    main()
