"""The model protocol (pipeline/models/protocol.py, capabilities.py): a small core every
family provides, and optional capabilities whose hooks every model answers, doing nothing
unless the family overrides them."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from pipeline.models import MODELS
from pipeline.models.capabilities import (
    AttentionSpans,
    BoundedParameters,
    HeadReports,
    PlannedShapes,
    TrainingBackends,
    TrainingMetrics,
)
from pipeline.models.protocol import ModelOutput, SequenceModel

CAPABILITIES = (BoundedParameters, PlannedShapes, TrainingBackends, TrainingMetrics, HeadReports)


def hooks(cls: type) -> set[str]:
    return {name for name, value in vars(cls).items() if callable(value) and name[0] != "_"}


class Unigram(SequenceModel):
    """The least a family writes: forward."""

    def __init__(self) -> None:
        super().__init__()
        self.logits = nn.Parameter(torch.zeros(5))

    def forward(self, tokens, targets=None, state=None):
        logits = self.logits.expand(*tokens.shape, 5)
        nll = (
            None
            if targets is None
            else F.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
        )
        return ModelOutput(logits, nll, [])


def test_the_core_is_small_and_the_capabilities_are_apart():
    assert hooks(SequenceModel) == {
        "init_state",
        "aux_loss",
        "train_flops_per_token",
        "describe",
        "parameter_groups",
    }
    groups = [hooks(c) for c in CAPABILITIES]
    assert sum(map(len, groups)) == len(set().union(*groups)) == 14  # no hook in two groups
    assert all(issubclass(SequenceModel, c) for c in CAPABILITIES)


def test_a_model_with_only_forward_answers_every_hook():
    model = Unigram()
    tokens = torch.zeros(2, 3, dtype=torch.long)
    with model.planned_update():
        out = model(tokens, tokens, model.init_state(2))
    assert out.nll.shape == (2, 3) and out.state == []
    assert float(model.aux_loss()) == 0.0 and model.describe() == "Unigram"
    assert model.parameter_groups() == {"logits": 5} and model.train_flops_per_token() == 30.0
    model.after_step()
    model.request_plan()
    model.load_plan_state(None)
    assert model.bounded_parameters() == [] and model.plan_state() is None
    assert not model.compile_for_training() and model.cannot_train_on(torch.device("cpu")) is None
    assert model.metrics() == {} and model.metric_tensors() == {}
    assert model.metric_warnings({}) == [] and model.head_tables() == {}
    with model.measure_persistent_share() as tables:
        assert tables is None


def test_a_family_plans_shapes_with_all_four_hooks_or_none():
    """plan_state must save what planned_update plans from: the group goes together."""
    for kind, (_, model) in MODELS.items():
        overridden = {
            name
            for name in hooks(PlannedShapes)
            if getattr(model, name) is not getattr(PlannedShapes, name)
        }
        assert overridden in (set(), hooks(PlannedShapes)), (kind, overridden)


def test_attention_spans_are_declared_by_the_family_that_has_them_not_inherited():
    """An opt-in capability: the estimate asks isinstance(model, AttentionSpans) and a model
    without spans is not one; a family that declares it answers every hook."""
    assert not issubclass(SequenceModel, AttentionSpans)
    assert not isinstance(Unigram(), AttentionSpans)
    declared = {kind for kind, (_, model) in MODELS.items() if issubclass(model, AttentionSpans)}
    assert declared == {"allattn"}
    for kind in declared:
        model = MODELS[kind].model
        unanswered = {
            name
            for name in hooks(AttentionSpans)
            if getattr(model, name) is getattr(AttentionSpans, name)
        }
        assert unanswered == set(), kind


ROOT = Path(__file__).resolve().parents[3]
# names a family defines that the pipeline's other objects have too (a dict's update, key
# and value; the spec's and the trainer's vocab_size): reading them says nothing of a model
SHARED_NAMES = {"key", "update", "value", "vocab_size"}


def family_names() -> set[str]:
    """The public names a registered family defines beyond the protocol: its methods and the
    attributes its modules assign (``self.span_planner = ...``)."""
    protocol = set(dir(SequenceModel)) | set(dir(AttentionSpans))
    names = set()
    for _, model in MODELS.values():
        names |= {n for n in dir(model) if not n.startswith("_")}
        for node in ast.walk(ast.parse(inspect.getsource(inspect.getmodule(model)))):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id == "self"
                and isinstance(node.ctx, ast.Store)
                and not node.attr.startswith("_")
            ):
                names.add(node.attr)
    return names - protocol - SHARED_NAMES


def family_reads(source: str, names: set[str]) -> set[str]:
    """Which of `names` `source` reads as an attribute, or by getattr / hasattr."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in names:
            found.add(node.attr)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr")
            and len(node.args) > 1
            and isinstance(node.args[1], ast.Constant)
            and node.args[1].value in names
        ):
            found.add(node.args[1].value)
    return found


def test_nothing_outside_the_models_reads_a_familys_own_attributes():
    """protocol.py's promise: the trainer, the stages and the commands ask a model through
    its hooks, never its span planner, its layers or its config."""
    names = family_names()
    assert {"span_planner", "span_lens", "layers", "cfg"} <= names
    files = [
        p
        for d in ("pipeline/commands", "pipeline/training", "stages")
        for p in (ROOT / d).rglob("*.py")
    ]
    reads = {
        str(p.relative_to(ROOT)): found
        for p in files
        if (found := family_reads(p.read_text(), names))
    }
    assert reads == {}


def test_the_family_attribute_rule_sees_each_kind_of_read():
    names = {"span_planner", "span_lens"}
    assert family_reads("getattr(model, 'span_planner', None)", names) == {"span_planner"}
    assert family_reads("hasattr(t.model, 'span_lens')", names) == {"span_lens"}
    assert family_reads("model.span_planner.adaptive", names) == {"span_planner"}
    assert family_reads("model.describe_spans()", names) == set()
