"""evaluate's scores, bound to the weights they scored.

evaluate names the checkpoint it scored by its content (`weights` in results.json: the id
pipeline.training.checkpoint_dirs.weights_id reads from the checkpoint's checksums), never by its
path alone: train re-run with another learning rate writes other weights under the same
`train/checkpoints/step-N`. Whatever shows or publishes the scores later (a re-run's reprint,
`export --register`, an export's model card; `compare` reads the same ids from MLflow's tags)
shows them only beside the weights of that id. Otherwise it shows the word `stale`, no
number, and says to re-run evaluate. Results written before they named their weights
(no `weights`) cannot be bound to any: they are stale too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pipeline.errors import PipelineError, shown
from pipeline.training.checkpoint_dirs import CHECKPOINTS, WEIGHTS, step_dirs, weights_id
from stages import STAGES, resolve_inputs
from stages.evaluate import checkpoint_source

RESULTS = "results.json"


def rerun(spec) -> str:
    """What to do about stale scores: evaluate again (forced: with only its results out of
    date, a plain `run` finds it up to date)."""
    return f"re-run evaluate (allattn-pipe run {shown(spec.source)} --force evaluate)"


def stale_reason(results: dict, weights: str | None, shown_as: str) -> str | None:
    """Why evaluate's `results` are not the scores of the weights whose id is `weights`
    (`shown_as` names them), or None when they are."""
    scored = results.get(WEIGHTS)
    label = results.get("checkpoint", "?")
    if not scored:
        return (
            f"evaluate's results of {label} do not name the weights they scored (an older "
            f"allattn-pipe wrote them)"
        )
    if weights is None or scored != weights:
        return f"evaluate scored the weights {label} held then, not those of {shown_as}"
    return None


def scored_now(spec, ws: Path) -> tuple[str, str | None]:
    """(the checkpoint evaluate would score now in workspace `ws`, as results name one, and
    its weights' id; None when it has none): the newest checkpoint, or the one marked best,
    as evaluate chooses. Not verified (that costs reading every file; evaluate verifies what
    it scores): a damaged newest one gives an id the results do not have, so they read as
    stale, never the other way."""
    inputs = {i: ws / i for i in resolve_inputs(STAGES["evaluate"], spec.stages)}
    try:
        source, tag = checkpoint_source(spec, inputs)
    except PipelineError:  # evaluate.checkpoint best, and none marked: nothing to score
        return "no checkpoint marked best", None
    root = inputs[source] / CHECKPOINTS
    if tag is None:
        newest = step_dirs(root)
        if not newest:
            return f"{source} (no checkpoint)", None
        tag = newest[0].name
    return f"{source}/{tag}", weights_id(root / tag)


def reprint_stale(spec, ws: Path, stage: str, results: dict) -> str | None:
    """The line a re-run prints in place of `stage`'s recorded `results` when they are
    evaluate's and not the scores of the weights evaluate would score now; None when they
    are, and for any other stage's."""
    if stage != "evaluate" or "checkpoint" not in results:
        return None
    label, weights = scored_now(spec, ws)
    why = stale_reason(results, weights, label)
    return None if why is None else f"stale: {why}; {rerun(spec)}"


@dataclass
class Scores:
    """What the workspace's evaluate results say about one checkpoint's weights."""

    results: dict | None
    """evaluate's results, when they are the scores of those weights; else None."""
    path: Path | None
    """Their results.json, then."""
    scored: str | None
    """The checkpoint evaluate scored, as its results name it (stage/step-N)."""
    problem: str | None = None
    """Why there are none for those weights (one clause), when there are none."""
    stale: bool = False
    """The results are of other weights that the checkpoint they name no longer holds (or
    they do not say which), not of another checkpoint still there."""


def scores_of(spec, checkpoint: Path) -> Scores:
    """evaluate's scores of the weights in checkpoint directory `checkpoint`, bound by
    content: the workspace's results when they name those weights' id."""
    ws = spec.workspace_dir
    path = ws / "evaluate" / RESULTS
    if (
        "evaluate" not in spec.stages
        or not (ws / "evaluate" / "stage.json").is_file()
        or not path.is_file()
    ):
        return Scores(None, None, None, "no evaluate results in the workspace")
    try:
        results = json.loads(path.read_text())
        scored = str(results["checkpoint"])
    except (ValueError, KeyError, TypeError, OSError) as e:
        return Scores(None, None, None, f"{path} is unreadable ({e})")
    why = stale_reason(results, weights_id(Path(checkpoint)), str(checkpoint))
    if why is None:
        return Scores(results, path, scored)
    stage, _, tag = scored.partition("/")
    there = ws / stage / CHECKPOINTS / tag
    if results.get(WEIGHTS) and weights_id(there) == results[WEIGHTS]:
        return Scores(None, None, scored, f"evaluate scored {scored}, not the checkpoint exported")
    return Scores(None, None, scored, why, stale=True)
