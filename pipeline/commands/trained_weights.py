"""The trained model a command works from (`sample`, `export`): the checkpoint that
`--checkpoint latest|best|PATH` names, loaded into the spec's model, after checking that the
preprocess stage's outputs (the vocabulary the prompt is encoded with, or that is exported)
are what the model was trained on: the files its record lists (`verify_published`), and the
build the weights' own record names (`verify_trained_on`).
"""

from __future__ import annotations

import os
from pathlib import Path

from pipeline.errors import PipelineError, shown
from pipeline.fsutil import home_problem


def checkpoint_of(spec, which: str, log) -> tuple[Path, str | None, str]:
    """(checkpoints root, tag or None for the newest intact one, a description) for
    `--checkpoint latest|best|PATH`: latest is finetune's if it ran, else train's; best is
    the checkpoint the validations marked best (finetune's pointer first), as evaluate chooses
    (stages.trained_checkpoint); PATH is a checkpoint directory (step-N) or a checkpoints
    directory."""
    from pipeline.training.checkpoint_dirs import CHECKPOINTS
    from stages.trained_checkpoint import trained_checkpoint, trained_stages

    if which in ("latest", "best"):
        ws = spec.workspace_dir
        trained = {
            s: ws / s for s in trained_stages(spec.stages) if (ws / s / "stage.json").is_file()
        }
        if not trained:
            raise PipelineError(
                f"{spec.source}: no finished train stage in {ws}; run "
                f"`allattn-pipe run {spec.source}` first, or name a "
                f"checkpoint directory with --checkpoint PATH"
            )
        if found := trained_checkpoint(which, trained):
            stage, root, tag = found
            return root, tag, (f"{stage} (latest)" if tag is None else f"{stage}/{tag} (best)")
        raise PipelineError(
            f"--checkpoint best: no checkpoint is marked best under "
            f"{', '.join(str(folder / CHECKPOINTS) for folder in trained.values())} "
            f"(train.eval_every's validations mark it)"
        )
    if not which.strip():  # Path("") is the current directory
        raise PipelineError("--checkpoint is empty: give latest, best, or a checkpoint directory")
    if problem := home_problem(which):  # Path.expanduser would raise RuntimeError
        raise PipelineError(f"--checkpoint {shown(which)}: {problem}")
    path = Path(os.path.expanduser(which))
    try:  # is_file / is_dir answer False for a missing path, but raise for one too long
        if (path / "mp_rank_00_model_states.pt").is_file() or path.name.startswith("step-"):
            return path.parent, path.name, str(path)
        if path.is_dir():
            return path, None, str(path)
    except OSError as error:
        raise PipelineError(f"--checkpoint {shown(which)}: {error.strerror}") from None
    raise PipelineError(f"--checkpoint {shown(which)}: not latest, best, or a checkpoint directory")


def verify_published(spec, stage: str) -> None:
    """Refuse (one line) a stage's outputs that are not the files its record lists, as `run`
    refuses to build on them: an edited vocabulary would encode the prompt, or be exported,
    with ids the trained model never saw."""
    from pipeline.workspace.layout import Workspace

    ws = Workspace(spec.workspace_dir)
    record = ws.record(stage)
    if record is not None and (damage := ws.output_damage(stage, record)):
        raise PipelineError(
            f"{ws.committed_dir(stage)}: {damage} (changed since {stage} published it, so "
            f"it is not what the model was trained on); nothing was read: run "
            f"`allattn-pipe run {shown(spec.source)}` to rebuild it"
        )


def verify_trained_on(spec, checkpoints: Path) -> None:
    """Refuse (one line) weights whose stage record names another preprocess build than the
    workspace's: preprocess was re-run (a vocabulary of the same size, other symbols, looks
    the same to the model) and train was not. The record is the one beside `checkpoints`
    (a published stage's stage.json, or an interrupted one's partial.json); a checkpoint
    directory with neither is another program's, which nothing here can check."""
    from pipeline.fsutil import read_json
    from pipeline.workspace.layout import PARTIAL_RECORD, RECORD, Workspace

    ws = Workspace(spec.workspace_dir)
    current = ws.record("preprocess")
    if current is None:
        return
    stage_dir = checkpoints.parent
    for name in (RECORD, PARTIAL_RECORD):
        try:
            record = read_json(stage_dir / name)
            break
        except (OSError, ValueError, PipelineError):
            continue
    else:
        return
    built_from = (
        (record.get("inputs") or {}).get("preprocess") if isinstance(record, dict) else None
    )
    if built_from is None or built_from == current.get("build"):
        return
    stage = record.get("stage") or stage_dir.name.removesuffix(".partial")
    raise PipelineError(
        f"{stage_dir}: {stage} was trained on preprocess build {built_from}, but the "
        f"workspace's preprocess is build {current.get('build')} (finished "
        f"{current.get('finished_at')}), whose vocabulary these weights never saw; nothing "
        f"was read: run `allattn-pipe run {shown(spec.source)}` to re-run train and the "
        f"stages after it on that build"
    )


def trained_model(spec, which: str, log):
    """The spec's model with the weights of checkpoint `which`, in eval mode, and the
    preprocess stage's directory (its vocabulary, its manifest)."""
    from pipeline.data.manifest import load_manifest
    from pipeline.training.checkpoint_dirs import load_model_weights
    from stages import STAGES

    if "train" not in spec.stages or "preprocess" not in spec.stages:
        raise PipelineError(
            f"{spec.source}: sample and export need a language model that "
            f"preprocess and train made; this config's stages are "
            f"{', '.join(spec.stages)}"
        )
    preprocess = spec.workspace_dir / "preprocess"
    verify_published(spec, "preprocess")
    manifest = load_manifest(preprocess)
    model = spec.build_model(manifest["vocab_size"], str(preprocess / "manifest.json"))
    root, tag, description = checkpoint_of(spec, which, log)
    verify_trained_on(spec, root)
    # the model section as the train stage records it, to compare with what made the weights
    tag = load_model_weights(model, root, log, tag, STAGES["train"].config(spec)["model"])
    return model.eval(), preprocess, f"{root}/{tag}"
