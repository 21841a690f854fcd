"""`allattn-pipe show`: the model's parameter count, and what it is made of."""

from __future__ import annotations

from collections import Counter

from pipeline.data.manifest import MANIFEST, load_manifest
from pipeline.errors import PipelineError


def vocab_size_for(spec) -> tuple[int | None, str]:
    """The vocabulary size and where it came from: the manifest if preprocess ran, else
    the dataset card's expectation."""
    preprocess = spec.workspace_dir / "preprocess"
    try:
        preprocessed = (preprocess / MANIFEST).is_file()
    except OSError as e:  # workspace.root too long for the filesystem, say
        raise PipelineError(
            f"{spec.source}: workspace.root: cannot read {preprocess / MANIFEST}: {e.strerror}"
        ) from None
    if preprocessed:
        return load_manifest(preprocess)["vocab_size"], str(preprocess / MANIFEST)
    if spec.dataset.vocab_size:
        return spec.dataset.vocab_size, f"dataset card '{spec.dataset.name}' (expected)"
    if spec.dataset.generator and (task := spec.dataset.generator.algorithmic):
        from pipeline.data.algorithmic import vocab_size

        return vocab_size(task.problem, task.vocab), f"the algorithmic task '{task.problem}'"
    return None, ""


def parameter_report(spec) -> str:
    import torch

    vocab, origin = vocab_size_for(spec)
    if vocab is None:
        return (
            "parameters: unknown until preprocess has run (the vocabulary size is not "
            "known; set dataset.vocab_size to estimate)"
        )
    with torch.device("meta"):  # sizes only: nothing is allocated
        model = spec.build_model(vocab, origin)
    groups = Counter(model.parameter_groups())
    total = sum(groups.values())
    lines = [f"parameters: {total:,} ({total / 1e6:.1f}M; vocabulary {vocab} from {origin})"]
    for role, n in groups.most_common():
        lines.append(f"  {role:<20} {n:>14,}")
    return "\n".join(lines)
