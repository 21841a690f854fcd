"""`--smoke`: any config shrunk to a tiny model of the same family and a few steps of every
stage it lists, to try a paper config on a laptop in about a minute.

`smoke_data` is a pure function on the merged spec data (before `--set` and validation, so
the user's `--set` still wins and `show --smoke` prints what `run --smoke` runs). It keeps the
structure (model kind, mixer, persistent vectors, adaptive span or input, memories, the
optimizer and its schedule, the stages) and shrinks the sizes: widths, depths, heads, spans,
memories, steps, batches, sequence lengths, generated datasets. A downloaded corpus is
replaced by the built-in one (datasets/python_docs.yaml, made offline), tokenized the same
kind: bytes stay bytes, characters characters; words and sentencepiece pieces become a small
sentencepiece BPE vocabulary (a word vocabulary of the built-in text's train split would not
cover its valid and test splits). `--set dataset=...` (or any `dataset.` key) keeps the
config's own dataset.
"""

from __future__ import annotations

import copy
from dataclasses import MISSING, dataclass, field, fields

from pipeline.models import MODELS
from pipeline.spec.names import smoke_name
from pipeline.spec.training_schema import CURRICULUM_UNUSED_TRAIN

BUILTIN_CARD = "python_docs"

# Each model kind's sizes and their smoke caps: a value above its cap becomes the cap, a
# smaller one (0: no persistent vectors, no feed-forward) stays. Widths stay divisible by
# the heads; 64 keeps adaptive input's bands (d, d/4, d/16, d/64) at least 1 wide.
MODEL_CAPS: dict[str, dict[str, int]] = {
    "allattn": {
        "d_model": 64,
        "n_layers": 2,
        "n_heads": 2,
        "n_persistent": 8,
        "ff_dim": 64,
        "max_span": 64,
        "span_ramp": 8,
    },
    "active_memory": {
        "d_model": 32,
        "n_layers": 2,
        "ff_dim": 64,
        "kernel_size": 5,
        "n_heads": 2,
        "head_dim": 16,
    },
    "infinity_former": {
        "d_model": 32,
        "n_layers": 2,
        "n_heads": 2,
        "ff_dim": 64,
        "mem_len": 32,  # at least train.seq_len with the long-term memory on
        "n_basis": 16,
        "n_samples": 16,
        "sticky_bins": 16,
    },
}

TRAIN_SET = {
    "steps": 4,
    "log_every": 2,
    "eval_every": 2,  # a validation and a checkpoint mid-way, as a real run has
    "eval_batches": 2,
    "checkpoint_every": 2,
    "device": "auto",  # whatever is there
    "compile": False,  # compiling costs more than a smoke's few steps
}
TRAIN_CAPS = {"batch_size": 4, "seq_len": 32, "eval_seq_len": 32, "eval_batch_size": 4}
WARMUP_CAP = 1  # below train.steps: a schedule that warms up still warms up
FINETUNE_STEPS = 2
EVALUATE_CAPS = {"batch_size": 4, "seq_len": 32}
CURRICULUM_SET = {"epochs": 2, "steps_per_epoch": 4, "check_cases": 8}
SORT_SEQUENCES = {"train": 32, "valid": 8, "test": 8}
SORT_LENGTH_CAP = 64
# the built-in corpus's valid and test splits: units of the tokenizer (bytes, characters,
# lines), so evaluate scores about a thousand tokens
BUILTIN_SPLIT = {"byte": 1024, "char": 1024, "lines": 16}
PIECES = {"vocab_size": 512, "sample_sentences": 4000, "num_threads": 2}


@dataclass
class Smoke:
    """A smoke spec's data, the key paths it changed, and what it says of the dataset."""

    data: dict
    changed: list[tuple] = field(default_factory=list)
    note: str = ""


def smoke_data(data: dict, builtin_card: dict, keep_dataset: bool = False) -> Smoke:
    """The smoke version of the merged spec `data` (not modified); `builtin_card` is the
    built-in corpus's card (datasets/python_docs.yaml); `keep_dataset`: the user named the
    dataset on the command line, so a downloaded one is kept."""
    out = Smoke(copy.deepcopy(data))
    d = out.data

    def put(path: tuple, value) -> None:
        node = d
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                return  # validation reports the wrong type where the user wrote it
        node[path[-1]] = value
        out.changed.append(path)

    def cap(path: tuple, limit: int, default=None) -> None:
        node: dict | None = d
        for part in path[:-1]:
            node = node.get(part) if isinstance(node, dict) else None
        current = node.get(path[-1], default) if isinstance(node, dict) else default
        if isinstance(current, int) and not isinstance(current, bool) and current > limit:
            put(path, limit)

    if isinstance(d.get("name"), str):
        put(("name",), smoke_name(d["name"]))
    tracking = d.get("tracking")
    if isinstance(tracking, dict) and isinstance(tracking.get("experiment"), str):
        put(("tracking", "experiment"), smoke_name(tracking["experiment"]))

    stages = d["stages"] if isinstance(d.get("stages"), list) else []
    vocab = _smoke_dataset(d, out, put, cap, builtin_card, keep_dataset)
    _smoke_model(d, put, cap, vocab)

    train = d.get("train")
    if isinstance(train, dict):
        curriculum = "curriculum" in stages
        for key, value in TRAIN_SET.items():
            # a curriculum's epochs and checks are the task's: its inert train keys stay out
            if not (curriculum and f"train.{key}" in CURRICULUM_UNUSED_TRAIN):
                put(("train", key), value)
        for key, limit in TRAIN_CAPS.items():
            if key in train or key == "batch_size":
                cap(("train", key), limit, 64 if key == "batch_size" else None)
        for key in ("micro_batch_size", "launcher"):  # one process, the whole batch
            if key in train:
                train.pop(key)
                out.changed.append(("train", key))
        ds = train.get("deepspeed")
        if isinstance(ds, dict) and "gradient_accumulation_steps" in ds:
            ds.pop("gradient_accumulation_steps")
            out.changed.append(("train", "deepspeed", "gradient_accumulation_steps"))
        cap(("train", "optimizer", "warmup_steps"), WARMUP_CAP)
    if isinstance(d.get("finetune"), dict):
        put(("finetune", "steps"), FINETUNE_STEPS)
    if isinstance(d.get("evaluate"), dict) and "curriculum" not in stages:
        for key, limit in EVALUATE_CAPS.items():
            cap(("evaluate", key), limit)
    return out


def _smoke_model(d: dict, put, cap, vocab: int | None) -> None:
    model = d.get("model")
    if not isinstance(model, dict) or model.get("kind") not in MODEL_CAPS:
        return  # a plugin's model: only the steps shrink
    kind = model["kind"]
    defaults = {f.name: f.default for f in fields(MODELS[kind][0]) if f.default is not MISSING}
    for key, limit in MODEL_CAPS[kind].items():
        if key in model or key in defaults:
            cap(("model", key), limit, defaults.get(key))
    cutoffs = model.get("adaptive_cutoffs")
    if vocab and model.get("adaptive_io") and isinstance(cutoffs, list) and cutoffs:
        # as many bands as the config's, spread evenly over the smoke vocabulary
        n = len(cutoffs)
        put(("model", "adaptive_cutoffs"), [vocab * (i + 1) // (n + 1) for i in range(n)])


def _smoke_dataset(d: dict, out: Smoke, put, cap, builtin_card: dict, keep: bool) -> int | None:
    """Shrink a generated dataset, or put the built-in corpus in a downloaded one's place;
    the smoke vocabulary when it is a sentencepiece one (adaptive cutoffs are fitted to it)."""
    card = d.get("dataset")
    if not isinstance(card, dict):
        return None
    generator = card.get("generator")
    if isinstance(generator, dict):
        if isinstance(generator.get("frequency_sort"), dict):
            task = ("dataset", "generator", "frequency_sort")
            put(task + ("sequences",), dict(SORT_SEQUENCES))
            cap(task + ("length",), SORT_LENGTH_CAP, 4000)
        if isinstance(generator.get("algorithmic"), dict):
            for key, value in CURRICULUM_SET.items():
                put(("dataset", "generator", "algorithmic", "curriculum", key), value)
        return None
    if keep or str(card.get("url", "")).startswith("builtin://"):
        if str(card.get("url", "")).startswith("builtin://"):
            _shrink_builtin_splits(card, put)
        return None
    tokenizer = card.get("tokenizer")
    kind = tokenizer.get("kind") if isinstance(tokenizer, dict) else tokenizer
    kind = kind if isinstance(kind, str) else "byte"
    new = copy.deepcopy(builtin_card)
    new["name"] = f"{BUILTIN_CARD}_{kind}"
    vocab = None
    if kind in ("byte", "char"):
        new["tokenizer"] = {"kind": kind}
        said = f"{kind}s"  # the card's vocab_size: its bytes, a guess for show's count
    else:
        eos = tokenizer.get("eos", "<eos>") if isinstance(tokenizer, dict) else "<eos>"
        new["tokenizer"] = {"kind": "sentencepiece", "model_type": "bpe", "eos": eos, **PIECES}
        vocab = new["vocab_size"] = PIECES["vocab_size"]
        said = f"a {vocab}-piece sentencepiece BPE (for its {kind} tokens)"
    d["dataset"] = new
    out.changed.append(("dataset",))
    _shrink_builtin_splits(new, put)
    out.note = (
        f"--smoke: dataset {card.get('name', '?')} replaced by the built-in corpus "
        f"({builtin_card.get('url')}) in {said}; --set dataset={card.get('name', 'NAME')} "
        f"keeps the real one"
    )
    return vocab


def _shrink_builtin_splits(card: dict, put) -> None:
    tokenizer = card.get("tokenizer")
    kind = tokenizer.get("kind") if isinstance(tokenizer, dict) else tokenizer
    size = BUILTIN_SPLIT.get(kind, BUILTIN_SPLIT["lines"]) if isinstance(kind, str) else 4096
    split = card.get("split")
    if isinstance(split, dict) and split.get("kind", "tail") == "tail":
        for key in ("valid", "test"):
            put(("dataset", "split", key), size)
