"""`allattn-pipe export --register NAME`: an export as a version of a model in MLflow's model
registry, in the tracking store the pipeline's runs are in (`tracking.tracking_uri`; the
registry is that store's own, or MLFLOW_REGISTRY_URI's).

The exported files are logged as the artifacts (under `model/`) of an `export` run, nested
under the workspace's latest pipeline run, with the resolved spec (`spec.resolved.yaml`),
its values as params, and evaluate's `results.json` and numbers as metrics when evaluate
scored the very weights exported, which its results name by content
(pipeline.workspace.scores): stale scores are never attached. The version's source is that
run's `model/`; its tags name the checkpoint and the spec and carry the headline numbers.
The files are the plain export (no MLflow flavour):
`mlflow.artifacts.download_artifacts("models:/NAME/VERSION")` fetches them and
`pipeline.commands.export.load_exported` loads them.
"""

from __future__ import annotations

import contextlib
import math
import os
import posixpath
import tempfile
from pathlib import Path

import yaml

from pipeline.errors import Interrupted, PipelineError, shown

# the numbers of evaluate's results that a model version carries as tags
HEADLINE = ("bpc", "ppl", "loss", "paper_loss", "token_accuracy", "exact_match")
_NAME_LIMIT = 256  # MLflow's database column for a registered model's name


def check_name(name: str) -> None:
    """Refuse, before anything is exported, a registered model's name that MLflow would
    refuse, that its models:/NAME/VERSION URIs cannot carry, or that a database could not
    hold."""
    problem = None
    if not name.strip():
        problem = "is empty"
    elif not name.isprintable():
        problem = "holds a control character"
    elif set(name) & set("/:?#"):
        problem = "holds '/', ':', '?' or '#', which a models:/NAME/VERSION URI cannot carry"
    elif name != name.strip():
        problem = "begins or ends with a space"
    elif posixpath.normpath(name) != name or name == "." or name.startswith(".."):
        problem = "reads as another path (MLflow may store a name as a file name)"
    elif len(name) > _NAME_LIMIT:
        problem = f"is longer than MLflow's {_NAME_LIMIT} characters"
    if problem:
        raise PipelineError(
            f"--register '{shown(name)}': not a registered model's name, it {problem}"
        )


def check_registrable(spec, name: str):
    """Before exporting: the name is valid, tracking is on, and the store answers and holds
    a model registry. Returns the MLflow client to register with."""
    from pipeline.tracking.store import bound_requests, open_store, registry_uri
    from pipeline.tracking.tracker import tracking_uri

    check_name(name)
    if not spec.tracking.enabled:
        raise PipelineError(
            f"--register: tracking is off in {spec.source} (tracking.enabled "
            f"is false), and the model registry is MLflow's; turn it on "
            f"(--set tracking.enabled=true) to register in its store"
        )
    uri = tracking_uri(spec)
    registry = registry_uri(uri)
    bound_requests(uri)  # a tracking variable MLflow cannot read: named, not the store blamed
    try:
        # every request to a server, here and in `register`, is bounded (`bound_requests`)
        client = open_store(uri, make_parent=True)
    except Exception as e:  # MLflow opens a local store as it makes the client
        raise PipelineError(_unusable(uri, "tracking store", e)) from None
    bound_requests(registry)
    try:
        client.search_experiments(max_results=1)
    except Exception as e:
        raise PipelineError(
            f"--register: the tracking store {uri} is not answering ({_reason(e)})"
        ) from None
    try:
        client.search_registered_models(max_results=1)
    except Exception as e:
        raise PipelineError(_unusable(registry, "model registry", e)) from None
    return client


def _unusable(store: str, what: str, error: Exception) -> str:
    scheme = store.split(":", 1)[0].lower() if ":" in store else ""
    if (scheme in ("", "file") or len(scheme) == 1) and os.environ.get(
        "MLFLOW_ALLOW_FILE_STORE", ""
    ).lower() not in ("true", "1"):
        return (
            f"--register: {store} is a file store, which MLflow refuses as a {what} "
            f"unless MLFLOW_ALLOW_FILE_STORE=true; use a database store (the default, "
            f"sqlite:///<workspace root>/mlflow.db) or a tracking server"
        )
    return f"--register: {store} cannot serve as a {what} ({_reason(error)})"


def _reason(error: Exception) -> str:
    from pipeline.tracking.sender import reason

    return reason(error)


def evaluation(spec, checkpoint: str) -> tuple[Path | None, dict[str, float], str]:
    """(evaluate's results.json, its numbers as metrics, a note) when evaluate's results are
    the scores of the weights in `checkpoint` (a checkpoint directory), bound by their
    content (pipeline.workspace.scores); (None, {}, why not) otherwise: stale scores are
    never attached, and the note says `stale` and to re-run evaluate."""
    from pipeline.training.checkpoint_dirs import CHECKPOINTS
    from pipeline.workspace.scores import rerun, scores_of

    found = scores_of(spec, Path(checkpoint))
    if found.stale:
        return (
            None,
            {},
            f"evaluate's numbers are stale ({found.problem}): registered without score "
            f"tags; {rerun(spec)} and register again",
        )
    if found.results is None and found.scored is not None:
        stage, _, tag = found.scored.partition("/")
        return (
            None,
            {},
            (
                f"evaluate scored {found.scored}, not the checkpoint exported: registered "
                f"without metrics (--checkpoint {spec.workspace_dir / stage / CHECKPOINTS / tag} "
                f"exports the one it scored)"
            ),
        )
    if found.results is None:
        return None, {}, f"{found.problem}: registered without metrics"
    results, path, scored = found.results, found.path, found.scored
    metrics = {}
    for split, values in results.items():
        if isinstance(values, dict):
            values = {**values, **(values.get("lines") or {})}
            metrics.update({f"{split}_{k}": float(v) for k, v in values.items() if _number(v)})
        elif _number(values):
            metrics[split] = float(values)
    return path, metrics, f"evaluate's numbers of {scored} attached"


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _pipeline_run(client, experiment_id: str, spec):
    """The workspace's latest pipeline run that ran a stage, or None."""
    ws = str(spec.workspace_dir.resolve())
    try:
        runs = client.search_runs(
            [experiment_id],
            f"tags.workspace = '{ws}'",
            order_by=["attributes.start_time DESC"],
            max_results=100,
        )
    except Exception:  # a workspace path MLflow's filter cannot quote
        return None
    return next(
        (
            r
            for r in runs
            if "spec" in r.data.tags and r.data.tags.get("stages.run", "none") != "none"
        ),
        None,
    )


def register(spec, out: Path, name: str, checkpoint: str, client=None, log=print):
    """Register the export in `out`, made from `checkpoint`, as a new version of model
    `name` (see the module's docstring); `client` from `check_registrable`. Returns MLflow's
    ModelVersion."""
    from mlflow.entities import Metric, Param
    from mlflow.exceptions import MlflowException

    from pipeline.tracking.sender import experiment_id
    from pipeline.tracking.tracker import (
        LOG_BATCH_SIZE,
        artifact_location,
        experiment_name,
        flatten,
        tracking_uri,
    )

    uri = tracking_uri(spec)
    client = client or check_registrable(spec, name)
    out = Path(out)
    results, metrics, note = evaluation(spec, checkpoint)
    run_id = None
    try:
        exp_id = experiment_id(client, experiment_name(spec), artifact_location(spec, uri))
        pipeline = _pipeline_run(client, exp_id, spec)
        tags = {
            "mlflow.runName": f"{spec.name}-export",
            "export.checkpoint": checkpoint,
            "export.registered_model": name,
        }
        if pipeline is not None:
            tags["mlflow.parentRunId"] = tags["pipeline_run_id"] = pipeline.info.run_id
        run = client.create_run(exp_id, tags=tags)
        run_id = run.info.run_id
        params = [Param(k, v) for k, v in flatten(spec.resolved()).items()]
        values = [Metric(k, v, run.info.start_time, 0) for k, v in metrics.items()]
        for i in range(0, max(len(params), len(values)), LOG_BATCH_SIZE):
            client.log_batch(
                run_id,
                metrics=values[i : i + LOG_BATCH_SIZE],
                params=params[i : i + LOG_BATCH_SIZE],
                tags=[],
            )
        client.log_artifacts(run_id, str(out), "model")
        with tempfile.TemporaryDirectory() as tmp:
            resolved = Path(tmp) / "spec.resolved.yaml"
            resolved.write_text(yaml.safe_dump(spec.resolved(), sort_keys=False))
            client.log_artifact(run_id, str(resolved))
        if results is not None:
            client.log_artifact(run_id, str(results))
        try:
            client.create_registered_model(name)
        except MlflowException as e:
            if e.error_code not in ("RESOURCE_ALREADY_EXISTS", "ALREADY_EXISTS"):
                raise
        headline = {k: f"{v:.6g}" for k, v in metrics.items() if k.partition("_")[2] in HEADLINE}
        version = client.create_model_version(
            name,
            source=f"{run.info.artifact_uri}/model",
            run_id=run_id,
            tags={
                "checkpoint": checkpoint,
                "spec": spec.source,
                "model.kind": spec.model_kind,
                **headline,
            },
            description=f"{spec.model_kind} model of {spec.source}, {checkpoint}"
            + "".join(f"; {k} {v}" for k, v in headline.items()),
        )
        client.set_terminated(run_id, "FINISHED")
    except Interrupted:  # a signal: the export run ends KILLED (one request), not RUNNING
        if run_id is not None:
            with contextlib.suppress(Exception):
                client.set_terminated(run_id, "KILLED")
        raise
    except (MlflowException, OSError) as e:
        from pipeline.tracking.sender import is_transient

        stalled = is_transient(e)
        if run_id is not None and not stalled:  # a server not answering: one wait is enough
            try:
                client.set_terminated(run_id, "FAILED")
            except (MlflowException, OSError):
                pass
        raise PipelineError(
            f"--register '{shown(name)}': MLflow ({uri}) "
            f"{'is not answering' if stalled else 'refused'} ({_reason(e)}); the export in "
            f"{out} is written, run the command again to register it"
        ) from None
    log(
        f"{out}: registered as model '{name}' version {version.version} in {uri} "
        f"(run {run_id}{', under the pipeline run ' + pipeline.info.run_id if pipeline else ''}"
        f"); {note}"
    )
    return version
