"""Planned span lengths (pipeline/models/allattn/model.py, "Planned span lengths"): training with
L' planned from span fractions two updates old gives the synchronous L''s losses while the
spans grow slowly (up to the reference op's +1e-8 guard); a span that jumps past its plan
is counted and warned about; the plan resumes exactly from plan_state(); forwards outside
planned_update() stay synchronous."""

from __future__ import annotations

import copy
from contextlib import nullcontext

import pytest
import torch

from pipeline.models.allattn.layers import attn_span_len, planned_span_len
from pipeline.models.allattn.span_planner import SpanPlanner
from tests.fixtures.tiny_models import tiny_allattn

V, B, M, MAX_SPAN, RAMP = 13, 2, 8, 256, 8


PLANNED = dict(
    n_persistent=3, max_span=MAX_SPAN, span_ramp=RAMP, span_init=0.05, span_loss_coef=0.0
)


def data(steps: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, V, (steps, B, M + 1), generator=g)


class Run:
    """A model and an Adam optimizer trained one update per block, the trainer's way."""

    def __init__(self, planned: bool, grow: float = 0.02, dtype=torch.float64, **kw):
        self.model = tiny_allattn(V, **(PLANNED | kw)).to(dtype).train()
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-3)
        self.planned, self.grow = planned, grow
        self.state = self.model.init_state(B)
        self.seen: list[tuple[list[int], list[int]]] = []  # (L' used, synchronous L')

    def step(self, tokens: torch.Tensor) -> float:
        m = self.model
        sync = m.span_lens()
        with m.planned_update() if self.planned else nullcontext():
            self.seen.append((m.span_lens(), sync))
            out = m(tokens[:, :-1], tokens[:, 1:], self.state)
            loss = out.nll.mean() + m.aux_loss()
            self.opt.zero_grad()
            loss.backward()
            self.opt.step()
        with torch.no_grad():  # spans that grow by grow * max_span tokens per update
            for layer in m.layers if self.grow else []:
                layer.attn.adaptive_span.frac.add_(self.grow)
        m.after_step()
        if self.planned:
            m.request_plan()
        self.state = out.state
        return loss.item()


def test_planned_span_len_covers_the_synchronous_one_with_slack():
    for frac in [0.0, 0.01, 0.2, 0.5, 0.74, 0.9, 1.0]:
        sync = attn_span_len(frac, 8192, 32)
        planned = planned_span_len(frac, 8192, 32)
        assert planned == 8192 or planned >= sync + 64
        assert planned <= 8192
    buckets = {planned_span_len(f / 1000, 8192, 32) for f in range(1001)}
    assert len(buckets) <= 15  # ~2 per doubling: what compiled code sees


def test_planned_training_equals_synchronous_while_spans_grow_slowly():
    blocks = data(24)
    sync, planned = Run(planned=False), Run(planned=True)
    a = [sync.step(t) for t in blocks]
    b = [planned.step(t) for t in blocks]
    # float64: what remains is the reference op's +1e-8 renormalisation guard, against a
    # softmax over more (masked) columns: a relative 1e-8 at most, below float32's resolution
    assert b == pytest.approx(a, rel=1e-7, abs=0)
    # the plans were not the synchronous L' (slack, buckets), and never too short
    assert any(used != now for used, now in planned.seen)
    assert all(u >= n for used, now in planned.seen for u, n in zip(used, now, strict=False))
    assert len({tuple(used) for used, _ in planned.seen}) >= 2  # the plan followed
    assert planned.model.metric_tensors()["span_plan_overflows"].item() == 0
    assert planned.model.metric_warnings({"span_plan_overflows": 0.0}) == []


def test_a_span_that_jumps_past_its_plan_is_counted_and_warned_about():
    run = Run(planned=True, grow=0.0)
    blocks = data(8)
    for t in blocks[:4]:
        run.step(t)
    assert run.model.metric_tensors()["span_plan_overflows"].item() == 0
    with torch.no_grad():  # layer 1 jumps to the whole span
        run.model.layers[1].attn.adaptive_span.frac.fill_(0.9)
    run.model.request_plan()  # (as after an optimizer step)
    for t in blocks[4:]:
        run.step(t)
    # the update after the jump plans from values two updates old: one forward cut short;
    # the next plans from the jump
    values = {k: v.item() for k, v in run.model.metric_tensors().items()}
    assert values["span_plan_overflows"] == 1
    [line] = run.model.metric_warnings(values)
    assert "outgrew its planned length" in line and "1 forward(s)" in line
    assert run.model.metric_warnings(values) == []  # said once
    # a forward outside planned_update() reads the spans now, and is never cut
    run.model.eval()
    with torch.no_grad():
        run.model(blocks[0][:, :-1], blocks[0][:, 1:], run.state)
    assert run.model.metric_tensors()["span_plan_overflows"].item() == 1


def test_the_plan_resumes_exactly_from_plan_state():
    blocks = data(16)
    straight = Run(planned=True)
    losses = [straight.step(t) for t in blocks]

    first = Run(planned=True)
    for t in blocks[:7]:
        first.step(t)
    saved = {
        "model": first.model.state_dict(),
        "opt": first.opt.state_dict(),
        "state": [s.clone() for s in first.state],
        "plan": first.model.plan_state(),
    }
    assert saved["plan"]["planned"] is not None and len(saved["plan"]["pending"]) == 2

    def resumed(plan) -> tuple[Run, list[float]]:
        run = Run(planned=True)
        run.model.load_state_dict(saved["model"])
        run.opt.load_state_dict(copy.deepcopy(saved["opt"]))  # Adam steps its tensors in place
        run.state = [s.clone() for s in saved["state"]]
        run.model.load_plan_state(plan)
        return run, [run.step(t) for t in blocks[7:]]

    run, after = resumed(saved["plan"])
    assert after == losses[7:]  # bit for bit
    assert [u for u, _ in run.seen] == [u for u, _ in straight.seen[7:]]
    # a checkpoint from before plans: planned from the current spans at the first update
    run, after = resumed(None)
    assert after == pytest.approx(losses[7:], rel=1e-7, abs=0)


def test_models_without_adaptive_span_plan_nothing():
    run = Run(planned=True, grow=0.0, adaptive_span=False)
    for t in data(3):
        run.step(t)
    assert run.model.plan_state() is None
    assert "span_plan_overflows" not in run.model.metric_tensors()


def test_the_planner_reads_the_spans_only_when_it_has_no_copy_to_plan_from():
    """SpanPlanner alone: update 1 reads the current fractions, update 2 keeps its plan,
    update s >= 3 plans from the copy requested after update s - 2 without reading; a fixed
    span never reads."""
    planner = SpanPlanner(2, MAX_SPAN, RAMP, adaptive=True)
    reads: list[float] = []

    def fracs(value: float):
        def read() -> torch.Tensor:
            reads.append(value)
            return torch.tensor([value, value / 2])

        return read

    def plan(value: float) -> list[int]:
        return [planned_span_len(f, MAX_SPAN, RAMP) for f in (value, value / 2)]

    device = torch.device("cpu")
    values = [0.1, 0.3, 0.5, 0.7]
    for update, value in enumerate(values):
        with planner.update(fracs(-1.0 if update else value), device):
            assert planner.in_force() == plan(values[max(0, update - 2)])
        assert planner.in_force() is None
        planner.request(fracs(value))
    assert reads == [0.1, *values]  # the first update's read, then one per request
    assert planner.state() == {
        "planned": plan(0.3),
        "pending": [pytest.approx([v, v / 2]) for v in values[2:]],
        "overflows": 0,
    }

    def never() -> torch.Tensor:
        raise AssertionError("a fixed span reads no fractions")

    fixed = SpanPlanner(2, MAX_SPAN, RAMP, adaptive=False)
    with fixed.update(never, device):
        assert fixed.in_force() == [MAX_SPAN, MAX_SPAN]
        fixed.count_overflow(never)
    fixed.request(never)
    assert fixed.state() is None and fixed.metric_tensors() == {}
