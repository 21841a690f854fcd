"""Every setting a training stage trains with is in its fingerprint (issue 51, item 5).

The train, finetune and curriculum stages run here on tiny models with every setting the
CPU allows away from its default, and each setting the stage and its Trainer read (recorded
as the code reads it) is checked: in the fingerprint of the stage that owns it at the value
read, or runtime-only for that stage (`Stage.runtime_only`, each with its reason), or inert
under the other settings (Spec.inert_keys) and read at its default, which is what every
fingerprint counts for an inert key. A key added to the schema that the Trainer reads fails
here until a fingerprint counts it or a stage says why it changes nothing.
"""

from __future__ import annotations

import json

import pytest
import torch
from pydantic import BaseModel

import stages
import stages.base
import stages.training
from pipeline.spec import load_spec
from pipeline.training.checkpoint_dirs import read_checkpoint_file, step_dirs
from pipeline.workspace.layout import fingerprint
from stages.base import NullStageTracker, StageContext
from tests.fixtures.curriculum import ROOT, StopAt, history
from tests.fixtures.tiny_corpus import tiny_corpus

# ---------------------------------------------------------------- what the code reads


class Reads:
    """A spec, or one of its sections, that records the dotted path and value (as JSON) of
    each setting read through it. A method called on a section (model_dump) reads it whole;
    the model is read whole (Spec.build_model, model_params, model_kind)."""

    def __init__(self, target, path: str, seen: dict):
        object.__setattr__(self, "_target", target)
        object.__setattr__(self, "_path", path)
        object.__setattr__(self, "_seen", seen)

    def __getattr__(self, name: str):
        target, seen = self._target, self._seen
        value = getattr(target, name)
        path = f"{self._path}.{name}" if self._path else name
        if not self._path and name in ("model", "model_params", "model_kind", "build_model"):
            seen.update(leaves("model", target.resolved()["model"]))
        elif isinstance(value, BaseModel):
            return Reads(value, path, seen)
        elif callable(value):
            if not self._path:
                seen[f"{name}()"] = "a method of the spec"
            else:
                seen.update(leaves(self._path, target.model_dump(mode="json")))
        else:
            seen.update(leaves(path, json.loads(json.dumps(value))))
        return value


def leaves(path: str, value) -> dict:
    """{dotted path: value} of each setting in `value` (a section as JSON, or one value)."""
    if isinstance(value, dict) and value:
        return {k: v for key, sub in value.items() for k, v in leaves(f"{path}.{key}", sub).items()}
    return {path: value}


def unwrapped(spec):
    return object.__getattribute__(spec, "_target") if isinstance(spec, Reads) else spec


@pytest.fixture
def recorded(monkeypatch):
    """{spec path: value read} of what the stages run here and their Trainers read: each
    stage gets a recording spec, and so does each Trainer, as it reads it (as_trained)."""
    import pipeline.training.trainer as trainer_module

    seen: dict = {}
    as_trained = trainer_module.as_trained
    monkeypatch.setattr(
        trainer_module, "as_trained", lambda spec: Reads(as_trained(unwrapped(spec)), "", seen)
    )
    return seen


def run_stage(name: str, spec, out_dir, inputs=None, tracker=None, seen=None) -> dict:
    """Stage `name` run in process; what it reads recorded into `seen` if given."""
    out_dir.mkdir(parents=True, exist_ok=True)
    ctx = StageContext(
        spec=spec if seen is None else Reads(spec, "", seen),
        out_dir=out_dir,
        inputs=inputs or {},
        tracker=tracker or NullStageTracker(),
        log=lambda _: None,
    )
    return stages.STAGES[name].run(ctx)


# Read, and no setting of the training: the words of a message, the plan. Nothing else is
# left out.
NOT_SETTINGS = {
    "dataset.tokenizer.kind": "names the unit of the printed loss (bpc or bits per token)",
    "dataset.name": "names the data in an error",
    "name": "names the run in the head tables' titles",
    "stages": "which stages run: train's config counts what it decides (finetune.patience)",
}


def owner(stage: str, path: str) -> tuple[str, str]:
    """(the stage whose fingerprint counts spec path `path` when `stage` reads it, its path
    in that stage's config): finetune's train and model settings are train's (through its
    build id), the dataset's are preprocess's, a curriculum's generator its task."""
    head = path.split(".")[0]
    if stage == "curriculum":
        if path.startswith("dataset.generator"):
            return stage, "task" + path.removeprefix("dataset.generator")
        return stage, path
    if head == "dataset":
        return "preprocess", path.removeprefix("dataset.")
    if stage == "finetune" and head == "finetune":
        return stage, path.removeprefix("finetune.")
    return "train", path


def under(path: str, keys) -> str | None:
    """The key of `keys` that is `path` or holds it."""
    return next((k for k in keys if path == k or path.startswith(f"{k}.")), None)


def uncounted(stage: str, spec, seen: dict) -> list[str]:
    """Each setting read that no fingerprint counts at the value read, with why."""
    lookup = stages.base._lookup
    inert = spec.inert_defaults()
    found = []
    for path, value in sorted(seen.items()):
        if under(path, NOT_SETTINGS):
            continue
        if (key := under(path, inert)) is not None:
            default = inert[key]
            if path != key:
                default = lookup(default, path.removeprefix(f"{key}."))
            if value != default:
                found.append(f"{path}: does nothing here, yet read as {value!r}, not {default!r}")
            continue
        by, at = owner(stage, path)
        if under(at, stages.STAGES[by].runtime_only):
            continue
        counted = lookup(stages.STAGES[by].fingerprinted(spec), at)
        added = stages.STAGES[by].added_keys
        if counted is stages.base._ABSENT and at in added and added[at] == value:
            continue  # what the stage did before the key existed: no key is that value
        if counted != value:
            shown = "nothing" if counted is stages.base._ABSENT else repr(counted)
            found.append(f"{path}: read as {value!r}, {by}'s fingerprint counts {shown}")
    return found


# ---------------------------------------------------------------- train and finetune

# every train.* and finetune.* setting the CPU can train with, away from its default
AWAY_FROM_DEFAULTS = [
    "train.seed=7",
    "train.steps=2",
    "train.micro_batch_size=2",
    "train.optimizer={type: adam, lr: 0.02, warmup_steps: 1, clip: global, "
    "clip_norm: 0.5, betas: [0.8, 0.95], weight_decay: 0.01}",
    "train.deepspeed={gradient_accumulation_steps: 1, bf16: true}",
    "train.log_every=1",
    "train.eval_every=1",
    "train.eval_batches=1",
    "train.eval_batch_size=2",
    "train.eval_seq_len=8",
    "train.checkpoint_every=1",
    "train.keep_checkpoints=1",
    "train.nonfinite=skip",
    "train.nonfinite_limit=7",
    "train.compile=false",
    "stages=[download, preprocess, train, finetune]",
    "finetune={steps: 1, lr_divisor: 5, patience: 3}",
]


def test_every_setting_train_and_finetune_read_is_in_a_fingerprint(tmp_path, recorded, monkeypatch):
    # the spans' heat maps (matplotlib, seconds) read the run's name alone
    monkeypatch.setattr(stages.training, "log_head_tables", lambda *args: None)
    cfg, pre = tiny_corpus(tmp_path)
    spec = load_spec(cfg, AWAY_FROM_DEFAULTS)
    train_out = tmp_path / "train.partial"
    run_stage("train", spec, train_out, {"preprocess": pre}, seen=recorded)
    assert {"train.deepspeed.bf16", "train.optimizer.lr", "train.nonfinite_limit"} <= set(recorded)
    assert uncounted("train", spec, recorded) == []
    recorded.clear()
    finetune_out = tmp_path / "finetune.partial"
    inputs = {"preprocess": pre, "train": train_out}
    run_stage("finetune", spec, finetune_out, inputs, seen=recorded)
    assert {"finetune.lr_divisor", "finetune.steps"} <= set(recorded)
    assert uncounted("finetune", spec, recorded) == []


# ---------------------------------------------------------------- the curriculum

TASK = """\
extends: [{base}, toy_model.yaml{engine}]
name: tiny_task
dataset: not_algorithmic
train: {{batch_size: 8, seed: 5, nonfinite: skip, nonfinite_limit: 3,
        optimizer: {{type: adam, lr: 0.02, warmup_steps: 2, schedule: cosine, clip: global,
                     clip_norm: 0.7, betas: [0.85, 0.99], weight_decay: 0.001}}}}
workspace: {{root: {root}}}
"""

TOY_MODEL = "model: {d_model: 16, n_layers: 1, ff_dim: 32, kernel_size: 3}\n"

# From a shared base a curriculum accepts the engine settings of a language-model run
# (pipeline.spec: a base sets what some of its variants switch off); it trains without them.
ENGINE = "train: {engine}\n"


def task(tmp_path, engine: str | None = None):
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "toy_model.yaml").write_text(TOY_MODEL)
    if engine:
        (tmp_path / "engine.yaml").write_text(ENGINE.format(engine=engine))
    path = tmp_path / "task.yaml"
    path.write_text(
        TASK.format(
            base=ROOT / "configs" / "base" / "active_memory_task.yaml",
            engine=", engine.yaml" if engine else "",
            root=tmp_path / "runs",
        )
    )
    tiny = (
        "dataset.generator.algorithmic.curriculum={epochs: 3, steps_per_epoch: 4, check_cases: 8}"
    )
    return load_spec(path, [tiny])


def final_weights(out_dir) -> dict:
    newest = step_dirs(out_dir / "checkpoints")[0]
    return read_checkpoint_file(newest / "mp_rank_00_model_states.pt")["module"]


def test_every_setting_the_curriculum_reads_is_in_its_fingerprint(tmp_path, recorded):
    spec = task(tmp_path, "{micro_batch_size: 4, deepspeed: {bf16: true, zero_stage: 2}}")
    run_stage("curriculum", spec, tmp_path / "curriculum.partial", seen=recorded)
    assert {"train.optimizer.lr", "train.batch_size", "train.deepspeed.bf16"} <= set(recorded)
    assert uncounted("curriculum", spec, recorded) == []


def test_a_curriculum_trains_without_the_engine_settings_a_base_gives_it(tmp_path):
    """The defect: the trainer read a curriculum's train.deepspeed and micro_batch_size from
    a shared base, keys that do nothing there by the spec's rules and that its fingerprint
    leaves out: such a curriculum trained in bf16 on micro-batches, stayed "up to date" when
    they changed, and its checkpoints refused to resume under other ones. It trains as
    without them: the same history and weights, resumed under other ones, and the same
    fingerprint."""
    plain = task(tmp_path / "plain")
    run_stage("curriculum", plain, tmp_path / "plain" / "out")
    first = task(
        tmp_path / "first", "{micro_batch_size: 4, deepspeed: {bf16: true, zero_stage: 2}}"
    )
    out = tmp_path / "first" / "out"
    with pytest.raises(KeyboardInterrupt):
        run_stage("curriculum", first, out, tracker=StopAt(epoch=2))
    then = task(tmp_path / "then", "{deepspeed: {zero_stage: 1, gradient_accumulation_steps: 2}}")
    run_stage("curriculum", then, out)
    assert history(out) == history(tmp_path / "plain" / "out")
    assert json.loads((out / "resolved.json").read_text()) == json.loads(
        (tmp_path / "plain" / "out" / "resolved.json").read_text()
    )
    weights, expected = final_weights(out), final_weights(tmp_path / "plain" / "out")
    assert weights.keys() == expected.keys()
    assert all(torch.equal(weights[k], expected[k]) for k in expected)
    curriculum = stages.STAGES["curriculum"]
    assert {fingerprint(curriculum.fingerprinted(s), {}) for s in (plain, first, then)} == {
        fingerprint(curriculum.fingerprinted(plain), {})
    }


OLD_CURRICULUM_TRAIN = ("seed", "device", "batch_size", "optimizer", "nonfinite", "nonfinite_limit")
"""The train.* keys the curriculum's config named one by one before it took the trainer's."""


@pytest.mark.parametrize("problem", ["add", "mult", "not", "remember", "reverse", "sort"])
def test_a_finished_curriculum_stays_up_to_date_after_the_upgrade(problem):
    """The curriculum's config is now the trainer's settings less the keys it has no use
    for: every shipped task config hashes as the config that named its keys did."""
    spec = load_spec(ROOT / "configs" / "active_memory" / f"{problem}.yaml")
    train = spec.train.model_dump(mode="json")
    named = {
        "model": spec.resolved()["model"],
        "task": spec.dataset.generator.model_dump(mode="json"),
        "train": {key: train[key] for key in OLD_CURRICULUM_TRAIN},
    }
    curriculum = stages.STAGES["curriculum"]
    before = stages.without(
        named, [k for k, v in curriculum.added_keys.items() if stages.base._lookup(named, k) == v]
    )
    assert fingerprint(curriculum.fingerprinted(spec), {}) == fingerprint(before, {})
