"""`allattn-pipe export`: a trained model as plain files, and the one call that loads them.

    <DIR>/model.safetensors   the weights (tied tensors stored once)
    <DIR>/config.json         {"kind", "model": the model section, "vocab_size", "source"}
    <DIR>/vocab.json          the preprocess stage's vocabulary (its manifest's "vocab")
    <DIR>/tokenizer.model     the sentencepiece model, for a sentencepiece vocabulary

Loading needs torch, safetensors and this package's models, not DeepSpeed, MLflow or YAML:

    from pipeline.commands.export import load_exported
    model, tokenizer = load_exported("DIR")     # an eval-mode SequenceModel, on the CPU
    out = model(tokens, None, model.init_state(tokens.shape[0]))   # ModelOutput
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict
from pathlib import Path

from pipeline.errors import PipelineError, shown

WEIGHTS, CONFIG, VOCAB, SP_MODEL = "model.safetensors", "config.json", "vocab.json", \
    "tokenizer.model"


def checkpoint_of(spec, which: str, log) -> tuple[Path, str | None, str]:
    """(checkpoints root, tag or None for the newest intact one, a description) for
    `--checkpoint latest|best|PATH`: latest is finetune's if it ran, else train's; best is
    the checkpoint the validations marked best (finetune's pointer first, as evaluate
    reads it); PATH is a checkpoint directory (step-N) or a checkpoints directory."""
    from pipeline.training.checkpoints import read_pointer

    ws = spec.workspace_dir
    trained = [s for s in ("finetune", "train") if s in spec.stages
               and (ws / s / "stage.json").is_file()]
    if which in ("latest", "best"):
        if not trained:
            raise PipelineError(f"{spec.source}: no finished train stage in {ws}; run "
                                f"`allattn-pipe run {spec.source}` first, or name a "
                                f"checkpoint directory with --checkpoint PATH")
        if which == "latest":
            return ws / trained[0] / "checkpoints", None, f"{trained[0]} (latest)"
        for stage in trained:
            root = ws / stage / "checkpoints"
            if tag := read_pointer(root / "best"):
                return root, tag, f"{stage}/{tag} (best)"
        raise PipelineError(f"--checkpoint best: no checkpoint is marked best under "
                            f"{', '.join(str(ws / s / 'checkpoints') for s in trained)} "
                            f"(train.eval_every's validations mark it)")
    if not which.strip():       # Path("") is the current directory
        raise PipelineError("--checkpoint is empty: give latest, best, or a checkpoint directory")
    path = Path(which)
    if (path / "mp_rank_00_model_states.pt").is_file() or path.name.startswith("step-"):
        return path.parent, path.name, str(path)
    if path.is_dir():
        return path, None, str(path)
    raise PipelineError(f"--checkpoint {shown(which)}: not latest, best, or a checkpoint directory")


def trained_model(spec, which: str, log):
    """The spec's model with the weights of checkpoint `which`, in eval mode, and the
    preprocess stage's directory (its vocabulary, its manifest)."""
    from pipeline.training.checkpoints import load_model_weights
    from pipeline.data.manifest import load_manifest
    from stages import STAGES

    if "train" not in spec.stages or "preprocess" not in spec.stages:
        raise PipelineError(f"{spec.source}: sample and export need a language model that "
                            f"preprocess and train made; this config's stages are "
                            f"{', '.join(spec.stages)}")
    preprocess = spec.workspace_dir / "preprocess"
    manifest = load_manifest(preprocess)
    model = spec.build_model(manifest["vocab_size"], str(preprocess / "manifest.json"))
    root, tag, description = checkpoint_of(spec, which, log)
    # the model section as the train stage records it, to compare with what made the weights
    tag = load_model_weights(model, root, log, tag, STAGES["train"].config(spec)["model"])
    return model.eval(), preprocess, f"{root}/{tag}"


def export(spec, out: Path, which: str = "latest", log=print) -> str:
    """Write the export files into `out`, built in a temporary directory beside it and
    renamed into place; refuses to replace a directory that holds anything else. Returns the
    checkpoint exported (as config.json records it)."""
    from safetensors.torch import save_model

    from pipeline.data.manifest import load_manifest
    from pipeline.fsutil import writable_dir

    out = Path(out)
    if out.exists() and (not out.is_dir() or set(p.name for p in out.iterdir())
                         - {WEIGHTS, CONFIG, VOCAB, SP_MODEL}):
        raise PipelineError(f"--out {shown(out)}: exists and holds other files; name a new or "
                            f"an earlier export's directory")
    model, preprocess, checkpoint = trained_model(spec, which, log)
    manifest = load_manifest(preprocess)
    vocab = manifest["vocab"]
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    writable_dir(out.parent, "--out")
    tmp.mkdir()
    save_model(model, str(tmp / WEIGHTS))
    (tmp / CONFIG).write_text(json.dumps({
        "kind": spec.model_kind, "model": asdict(spec.model_params),
        "vocab_size": manifest["vocab_size"],
        "source": {"spec": spec.source, "checkpoint": checkpoint}}, indent=2) + "\n")
    (tmp / VOCAB).write_text(json.dumps(vocab, indent=1) + "\n")
    if vocab["kind"] == "sentencepiece":
        shutil.copy2(preprocess / "shards" / vocab["model"], tmp / SP_MODEL)
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    log(f"{out}: {checkpoint} exported ({WEIGHTS}, {CONFIG}, {VOCAB})")
    return checkpoint


def load_exported(directory, device="cpu"):
    """(model, tokenizer) from an export directory: the plain torch model in eval mode with
    the exported weights, and the vocabulary (a Vocab, WordVocab or SentencePieceTokenizer)."""
    from safetensors.torch import load_model

    from pipeline.data.sentencepiece_tokenizer import SentencePieceTokenizer
    from pipeline.data.vocab import vocab_from_json
    from pipeline.models import build_model

    directory = Path(directory)
    config = json.loads((directory / CONFIG).read_text())
    model = build_model(config["kind"], config["model"], config["vocab_size"])
    load_model(model, str(directory / WEIGHTS), strict=True, device=str(device))
    vocab = json.loads((directory / VOCAB).read_text())
    tokenizer = (SentencePieceTokenizer.load(directory / SP_MODEL)
                 if vocab["kind"] == "sentencepiece" else vocab_from_json(vocab))
    return model.to(device).eval(), tokenizer
