"""Every score a command shows, found and checked against the true score of the weights it
stands beside (quality/fuzzers/true_scores.py): the stateful fuzzer's score oracle.

Where scores are shown, and the weights each stands beside:
- evaluate's lines (`[evaluate] valid bpc X ppl Y`), printed when it runs and reprinted by a
  `run` that has nothing to do: the checkpoint the block names (`checkpoint
  train/step-00000004`) in the command's workspace, else the workspace's published model;
- `compare`'s rows (table, csv or json): the row's workspace's published model, the newest
  checkpoint of its committed train stage (what evaluate would score now);
- `export --register`: the registered version's tags and description, and the metrics of
  its `export` run: the weights the version registered (its source's model.safetensors,
  else the export's);
- an export's model card (any .md file in it): the exported weights.

The convention the fixes follow: a score that does not belong to the weights shown is not
printed as a number; the word `stale` stands in its place. A number is checked; `stale`, `-`
and an empty cell are not numbers. A number off the true score by more than half a unit of
its last printed digit (and a float's noise) is a problem.
"""

from __future__ import annotations

import csv
import io
import json
import re
from dataclasses import dataclass
from pathlib import Path

from quality.fuzzers.true_scores import Scorer

METRIC = re.compile(r"^(valid|test)_(bpc|ppl|loss|bits/token)$")
EVALUATE_LINE = re.compile(r"\[evaluate\] (valid|test)\s+(bpc|bits/token)\s+(\S+)\s+ppl\s+(\S+)")
CHECKPOINT = re.compile(r"checkpoint (train|finetune)/(step-\d+)")
CARD_SCORE = re.compile(
    r"\b(valid|test)[ _](bpc|ppl|loss|bits/token)\b\W{0,3}?([-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?)",
    re.IGNORECASE,
)
NUMBER = re.compile(r"^[-+]?(\d+)(?:\.(\d+))?(?:e([-+]?\d+))?$", re.IGNORECASE)


@dataclass
class Shown:
    """One score as shown: where, about what, its text, and the weights it stands beside
    (a checkpoint directory or an export directory; None: no weights to judge it by)."""

    where: str
    about: str
    metric: str  # valid_bpc, test_ppl, ...
    text: str
    weights: Path | None
    exported: bool = False


def number(text: str) -> tuple[float, float] | None:
    """(value, half a unit of its last digit) of a number as printed; None for a word."""
    text = text.strip().replace(",", "")
    found = NUMBER.match(text)
    if not found:
        return None
    decimals = len(found.group(2) or "")
    exponent = int(found.group(3) or 0)
    return float(text), 0.5 * 10.0 ** (exponent - decimals)


def problem(shown: Shown, scorer: Scorer) -> str | None:
    """Why `shown` is not the score of its weights (None: it is, or it is no number, or
    nothing says what weights it stands beside)."""
    parsed = number(shown.text)
    if parsed is None or shown.weights is None:
        return None
    value, half = parsed
    scores = (scorer.of_export if shown.exported else scorer.of_checkpoint)(shown.weights)
    if scores is None:
        return None
    split, _, kind = shown.metric.partition("_")
    if split not in scores:
        return None
    true = scores[split].value(kind)
    if true is None or abs(value - true) <= half + 1e-6 * abs(true) + 1e-9:
        return None
    return (
        f"score: {shown.where} shows {shown.metric} {shown.text} for {shown.about}; its "
        f"weights ({_short(shown.weights)}) score {true:.4g}"
    )


def _short(path: Path) -> str:
    parts = path.parts
    return "/".join(parts[-3:]) if "checkpoints" in parts else path.name


# ---------------------------------------------------------------- the weights


def published_checkpoint(workspace: Path) -> Path | None:
    """The newest checkpoint of the workspace's committed train stage (the partial
    directory while a publish holds its record, else train/), or None."""
    for stage_dir in (workspace / "train.partial", workspace / "train"):
        if (stage_dir / "stage.json").is_file():
            steps = sorted(
                p.parent for p in (stage_dir / "checkpoints").glob("step-*/checksums.json")
            )
            return steps[-1] if steps else None
    return None


# ---------------------------------------------------------------- finding them


def evaluate_lines(stdout: str, workspace: Path, where: str) -> list[Shown]:
    """evaluate's score lines, each beside the checkpoint its block names."""
    found, weights = [], published_checkpoint(workspace)
    for line in stdout.splitlines():
        if line.startswith("[evaluate]") and (named := CHECKPOINT.search(line)):
            # a checkpoint no longer there: the results stand beside the model there now
            there = workspace / named.group(1) / "checkpoints" / named.group(2)
            weights = there if there.is_dir() else published_checkpoint(workspace)
        elif scored := EVALUATE_LINE.search(line):
            split, bits, bpc, ppl = scored.groups()
            for metric, text in ((f"{split}_bpc", bpc), (f"{split}_ppl", ppl)):
                found.append(Shown(where, workspace.name, metric, text, weights))
    return found


def compare_output(stdout: str, fmt: str, runs: Path) -> list[Shown]:
    """The scores of compare's rows, each beside its workspace's published model (runs/NAME
    for a row named NAME). A group of several rows (seeds) shows a mean: judged only in
    json, row by row."""
    if fmt == "json":
        found = []
        for group in json.loads(stdout) if stdout.strip().startswith("[") else []:
            for row in group.get("runs", []):
                for metric, value in (row.get("metrics") or {}).items():
                    if METRIC.match(metric) and isinstance(value, int | float):
                        found.append(_row(row["name"], metric, repr(float(value)), runs))
        return found
    header, rows, notes = _table(stdout, fmt)
    found = []
    for metric, text in notes.items():
        if METRIC.match(metric):
            found += [_row(row["name"], metric, text, runs) for row in rows]
    for row in rows:
        if row.get("n", "1") not in ("", "1"):
            continue
        found += [_row(row["name"], m, text, runs) for m, text in row.items() if METRIC.match(m)]
    return found


def _row(name: str, metric: str, text: str, runs: Path) -> Shown:
    metric = metric.replace("_bits/token", "_bpc")
    return Shown("compare", f"row {name}", metric, text, published_checkpoint(runs / name))


def _table(stdout: str, fmt: str) -> tuple[list[str], list[dict[str, str]], dict[str, str]]:
    """(header, rows as {column: cell}, the folded 'column: value' notes) of compare's table
    or csv."""
    lines = stdout.splitlines()
    notes: dict[str, str] = {}
    if fmt == "csv":
        table = list(csv.reader(io.StringIO(stdout)))
        if not table:
            return [], [], notes
        header = table[0]
        return header, [dict(zip(header, r, strict=False)) for r in table[1:]], notes
    rows: list[dict[str, str]] = []
    header: list[str] = []
    starts: list[int] = []
    for line in lines:
        if line.startswith("equal in every row: "):
            for item in line.removeprefix("equal in every row: ").split("; "):
                key, _, value = item.partition(": ")
                notes[key] = value
        elif not header and line.startswith("name"):
            header = line.split()
            starts = [m.start() for m in re.finditer(r"\S+", line)]
        elif header and line.strip():
            cells = [
                line[a:b].strip()
                for a, b in zip(starts, [*starts[1:], len(line) + 1], strict=False)
            ]
            rows.append(dict(zip(header, cells, strict=False)))
    return header, rows, notes


def registered(version: dict, export_dir: Path | None) -> list[Shown]:
    """The scores a registered version carries (tags, description) and its export run's
    metrics (`version`: see record_checks.Store.versions), beside the weights it
    registered."""
    weights = export_dir
    source = version.get("source") or ""
    local = Path(source.removeprefix("file://")) if source.startswith(("/", "file://")) else None
    if local is not None and (local / "model.safetensors").is_file():
        weights = local
    about = f"model {version['name']} version {version['version']}"
    found = [
        Shown("registered tag", about, k, v, weights, exported=True)
        for k, v in version["tags"].items()
        if METRIC.match(k)
    ]
    for m in re.finditer(
        r"\b((?:valid|test)_(?:bpc|ppl|loss)) (\S+?)(?:;|$)", version["description"] or ""
    ):
        found.append(Shown("registered description", about, m.group(1), m.group(2), weights, True))
    for k, v in version["run_metrics"].items():
        if METRIC.match(k):
            found.append(Shown("export run metric", about, k, repr(v), weights, exported=True))
    return found


def model_card(export_dir: Path) -> list[Shown]:
    """Scores written in an export's model card (its .md files)."""
    found = []
    for card in sorted(export_dir.glob("*.md")):
        for m in CARD_SCORE.finditer(card.read_text(errors="replace")):
            split, kind, text = m.groups()
            found.append(
                Shown(
                    "model card",
                    f"{export_dir.name}/{card.name}",
                    f"{split.lower()}_{kind.lower()}",
                    text,
                    export_dir,
                    exported=True,
                )
            )
    return found
