"""The model protocol (pipeline/models/protocol.py, capabilities.py): a small core every
family provides, and optional capabilities whose hooks every model answers, doing nothing
unless the family overrides them."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from pipeline.models import MODELS
from pipeline.models.capabilities import (
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
