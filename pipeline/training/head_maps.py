"""Heat maps of numbers per layer and head (learned spans, the share of attention on the
persistent vectors), written by train and evaluate; and the safe write of any picture
(matplotlib, headless), which the learning-curve plots share.

A heat map's table is the model's own report, which the PNG also carries as text, so what is
drawn can be checked without looking at pixels.
"""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

from pipeline.errors import PipelineError, shown


def image_format(path) -> str:
    """The image format a picture's file name asks for (png when it has no extension); a
    name with an extension matplotlib writes no format for is one line."""
    from matplotlib.backend_bases import FigureCanvasBase

    suffix = Path(path).suffix.lower().removeprefix(".")
    formats = FigureCanvasBase.get_supported_filetypes()
    if suffix and suffix not in formats:
        raise PipelineError(
            f"{shown(path)}: no image format is called .{shown(suffix)}; "
            f"name a .png, .svg or .pdf file (or {', '.join('.' + f for f in sorted(formats))})"
        )
    return suffix or "png"


def save(fig, path, **savefig_args) -> Path:
    """Write `fig` at `path` through a temporary file beside it, and close it. A place that
    cannot be written is one line naming it, and no half-written picture is left there."""
    import matplotlib.pyplot as plt

    from pipeline.fsutil import public_mode, temporary_beside

    path = Path(path)
    try:
        image = image_format(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        # a name of our own, written through the descriptor it gave: a link planted at a
        # fixed temporary name would be written through; the rename replaces a link at
        # `path` itself, never what it names; a half-written picture is removed
        with temporary_beside(path) as (fd, tmp), os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), public_mode())
            fig.savefig(f, format=image, **savefig_args)
            f.flush()
            os.replace(tmp, path)
    except OSError as e:
        blocker = f" ({e.filename})" if e.filename and not _temporary_of(e.filename, path) else ""
        raise PipelineError(
            f"{shown(path)}: cannot write the picture: {e.strerror or e}{blocker}"
        ) from None
    finally:
        plt.close(fig)
    return path


def _temporary_of(name, path: Path) -> bool:
    return Path(name).parent == path.parent and Path(name).name.startswith(f".{path.name[:64]}.")


HEAT_MAP_KEY = "head_table"
"""The PNG text chunk holding a heat map's table (JSON), read back with PIL's ``Image.text``."""

ANNOTATE_CELLS = 512
"""Up to this many layer x head cells each carries its value as text (beyond, the colour bar
alone: the numbers would not fit)."""


def head_heat_map(table: list[list[float]], title: str, path) -> Path:
    """A PNG at `path`: one cell per layer (y, layer 1 at the bottom) and head (x), coloured
    from 0 to the table's largest value, each value written in its cell, a colour bar beside.
    `table[layer][head]`; every layer has the same number of heads."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    head_counts = {len(row) for row in table}
    if not table or len(head_counts) != 1 or 0 in head_counts:
        raise ValueError(
            f"a heat map needs the same number (> 0) of heads in every layer; "
            f"got rows of {sorted(head_counts) or 'no'} values"
        )
    n_layers, n_heads = len(table), head_counts.pop()
    top = max(max(row) for row in table)
    width = 2 + 0.9 * n_heads
    fig, ax = plt.subplots(figsize=(width, 1.5 + 0.45 * n_layers))
    image = ax.imshow(
        table, origin="lower", aspect="auto", cmap="viridis", vmin=0, vmax=top if top > 0 else 1
    )
    fig.colorbar(image, ax=ax)
    if n_layers * n_heads <= ANNOTATE_CELLS:
        for i, row in enumerate(table):
            for j, value in enumerate(row):
                # dark text on the light (high) end of viridis, light text on the dark end
                ax.text(
                    j,
                    i,
                    f"{value:.3g}",
                    ha="center",
                    va="center",
                    fontsize="small",
                    color="black" if value > 0.6 * top else "white",
                )
    ax.set_xticks(range(n_heads), [str(j + 1) for j in range(n_heads)])
    ax.set_yticks(range(n_layers), [str(i + 1) for i in range(n_layers)])
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    ax.set_title(textwrap.fill(title, int(9 * width)), fontsize="medium")  # ~9 chars/inch
    fig.tight_layout()
    return save(fig, path, dpi=100, metadata={HEAT_MAP_KEY: json.dumps(table)})


TABLE_TITLES = {"spans": "learned span in tokens"}
"""What a heat map's title calls a table `SequenceModel.head_tables` reports (else its name)."""


def save_head_tables(tables: dict[str, list[list[float]]], out_dir, title: str) -> list[Path]:
    """For each table a model reports (`SequenceModel.head_tables`): `<name>.json` (the
    numbers) and `<name>.png` (its heat map, titled "<what it is> <title>") in `out_dir`;
    returns the files written."""
    from pipeline.fsutil import atomic_write_json

    written = []
    for name, table in tables.items():
        atomic_write_json(Path(out_dir) / f"{name}.json", table)
        written += [
            Path(out_dir) / f"{name}.json",
            head_heat_map(
                table, f"{TABLE_TITLES.get(name, name)} {title}", Path(out_dir) / f"{name}.png"
            ),
        ]
    return written
