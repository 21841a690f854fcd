"""The model protocol (pipeline/models/protocol.py, capabilities.py): a small core every
family provides, and optional capabilities that a family declares (opt in), never inherits."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from pipeline.models import MODELS
from pipeline.models.capabilities import (
    AttentionSpans,
    BoundedParameters,
    HeadReports,
    MemoryCounts,
    PlannedShapes,
    TrainingBackends,
    TrainingMetrics,
    bounded_parameters,
)
from pipeline.models.protocol import ModelOutput, SequenceModel

CAPABILITIES = (
    BoundedParameters,
    PlannedShapes,
    TrainingBackends,
    TrainingMetrics,
    HeadReports,
    MemoryCounts,
    AttentionSpans,
)


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
        "train_hardware_flops_per_token",
        "describe",
        "parameter_groups",
    }
    groups = [hooks(c) for c in CAPABILITIES]
    assert sum(map(len, groups)) == len(set().union(*groups)) == 18  # no hook in two groups
    assert not set().union(*groups) & hooks(SequenceModel)
    assert not any(issubclass(SequenceModel, c) for c in CAPABILITIES)


def test_a_model_with_only_forward_answers_the_core_and_has_no_capability():
    model = Unigram()
    tokens = torch.zeros(2, 3, dtype=torch.long)
    out = model(tokens, tokens, model.init_state(2))
    assert out.nll.shape == (2, 3) and out.state == []
    assert float(model.aux_loss()) == 0.0 and model.describe() == "Unigram"
    assert model.parameter_groups() == {"logits": 5} and model.train_flops_per_token() == 30.0
    assert model.train_hardware_flops_per_token(3) == 30.0
    model.activation_checkpointing = True  # the forward again: 2 of the 6 per element
    assert model.train_hardware_flops_per_token(3) == 40.0
    assert [c.__name__ for c in CAPABILITIES if isinstance(model, c)] == []
    assert bounded_parameters(model) == []
    assert not hasattr(model, "planned_update") and not hasattr(model, "head_tables")


@pytest.mark.parametrize("capability", CAPABILITIES, ids=lambda c: c.__name__)
def test_a_family_that_declares_a_capability_without_its_hooks_cannot_be_built(capability):
    """Abstract hooks: a declared capability is answered in full or the model is refused at
    construction, never when a caller first asks (the four planning hooks go together:
    plan_state must save what planned_update plans from)."""
    declared = type("Declared", (Unigram, capability), {})
    with pytest.raises(TypeError, match="abstract"):
        declared()
    assert capability.__abstractmethods__  # each group has a hook a family must write


FAMILY_CAPABILITIES = {
    "allattn": set(CAPABILITIES),
    "infinity_former": {TrainingMetrics, MemoryCounts},
    "active_memory": {MemoryCounts},
}
"""What each built-in family declares (capabilities.py's module doc lists the same)."""


def test_each_family_declares_the_capabilities_it_has_and_answers_their_hooks():
    declared = {
        kind: {c for c in CAPABILITIES if issubclass(model, c)}
        for kind, (_, model) in MODELS.items()
        if kind in FAMILY_CAPABILITIES
    }
    assert declared == FAMILY_CAPABILITIES
    for kind in declared:
        assert MODELS[kind].model.__abstractmethods__ == frozenset(), kind


def test_the_capability_table_in_the_module_doc_is_the_families_declarations():
    import pipeline.models.capabilities as capabilities

    names = {"allattn": "all-attention", "infinity_former": "∞-former"}
    for capability in CAPABILITIES:
        line = next(
            line
            for line in capabilities.__doc__.splitlines()
            if line.startswith(f"- `{capability.__name__}`")
        )
        holders = {k for k, caps in FAMILY_CAPABILITIES.items() if capability in caps}
        if holders == set(FAMILY_CAPABILITIES):
            assert "every built-in family" in line, line
        else:
            assert {k for k, word in names.items() if word in line} == holders, line


ROOT = Path(__file__).resolve().parents[3]
# names a family defines that the pipeline's other objects have too (a dict's update, key
# and value; the spec's and the trainer's vocab_size; a URL's query): reading them says
# nothing of a model
SHARED_NAMES = {"key", "update", "value", "vocab_size", "query"}


def family_names() -> set[str]:
    """The public names a registered family defines beyond the protocol: its methods and the
    attributes its modules assign (``self.span_planner = ...``)."""
    protocol = set(dir(SequenceModel)).union(*(dir(c) for c in CAPABILITIES))
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
    """protocol.py's promise: the pipeline outside the models (the trainer, the stages, the
    commands, the workspace, tracking, ...) asks a model through its hooks, never its span
    planner, its layers or its config. Not pipeline/spec, whose config dataclasses share
    their field names with the modules built from them (model.attention)."""
    names = family_names()
    assert {"span_planner", "span_lens", "layers", "cfg"} <= names
    packages = [
        d for d in (ROOT / "pipeline").iterdir() if d.is_dir() and d.name not in ("models", "spec")
    ]
    assert {"commands", "training", "workspace", "tracking"} <= {d.name for d in packages}
    files = [
        *(ROOT / "pipeline").glob("*.py"),
        *(p for d in [*packages, ROOT / "stages"] for p in d.rglob("*.py")),
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
