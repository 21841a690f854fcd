"""Each family's ``activation_memory`` count (pipeline/models/capabilities.py) against what
autograd itself keeps for backward in a real training forward on the CPU (``SavedBytes``:
``saved_tensors_hooks``, each storage once, the weights left out) and the logits the forward
returns, which the trainer holds through the backward, at small shapes with
every size distinct, for every mode that keeps something of its own: the all-attention's
persistent modes, feed-forward kinds, dropout and fixed spans, the adaptive softmax; every
active-memory mixer; the ∞-former with and without its long-term memory."""

from __future__ import annotations

import pytest
import torch

from pipeline.diagnostics.step_audit import SavedBytes
from pipeline.models.active_memory.model import ActiveMemoryConfig, ActiveMemoryModel
from pipeline.models.allattn.config import AllAttnConfig
from pipeline.models.allattn.model import AllAttnLM
from pipeline.models.infinity_former.model import InfinityFormerConfig, InfinityFormerLM

WITHIN = 0.05  # the counts leave out tensors of a few elements (LayerNorm weights' views)


def traced_saved(model, tokens, state) -> int:
    """Bytes autograd keeps for backward over one training forward and loss, and the logits
    the forward returns (the trainer holds its output through the backward)."""
    model.train()
    with SavedBytes(exclude=[*model.parameters(), *state]) as saved:
        out = model(tokens, tokens, state)
        loss = out.nll.float().mean() + model.aux_loss()
    del loss
    logits = 0 if out.logits is None else out.logits.numel() * out.logits.element_size()
    return saved.bytes + logits


ALLATTN = dict(d_model=48, n_heads=4, max_span=96, span_ramp=8, span_init=0.3, n_layers=2)


@pytest.mark.parametrize(
    "extra",
    [
        dict(n_persistent=24, attn_dropout=0.0),
        dict(n_persistent=24, attn_dropout=0.3),
        dict(n_persistent=24, attn_dropout=0.3, adaptive_span=False),
        dict(n_persistent=24, persistent_mode="attn_split", attn_dropout=0.3),
        dict(n_persistent=24, persistent_mode="head_split", attn_dropout=0.3),
        dict(n_persistent=24, persistent_mode="single_head", attn_dropout=0.3),
        dict(n_persistent=0, ff_dim=40, ff_kind="relu", attn_dropout=0.3),
        dict(n_persistent=0, ff_dim=40, ff_kind="softmax", attn_dropout=0.0),
        dict(n_persistent=0, ff_dim=40, ff_kind="ff_attn", attn_dropout=0.3),
        dict(n_persistent=16, emb_dropout=0.1, out_dropout=0.1, attn_dropout=0.2),
    ],
    ids=lambda e: ",".join(f"{k}={v}" for k, v in e.items()),
)
def test_allattn_counts_what_autograd_keeps(extra):
    torch.manual_seed(0)
    model = AllAttnLM(AllAttnConfig(**{**ALLATTN, **extra}), vocab_size=37)
    rows, block = 3, 20
    tokens = torch.randint(37, (rows, block))
    state = model.init_state(rows)
    with model.planned_update():  # the first update plans L' from span_init, as counted
        traced = traced_saved(model, tokens, state)
    model.hold_shapes_at(None)
    counted = model.activation_memory(rows, block, torch.float32, "cpu")
    assert counted.saved == pytest.approx(traced, rel=WITHIN)
    assert counted.state == sum(t.numel() * t.element_size() for t in state)


def test_the_adaptive_softmax_counts_its_bands_for_the_tokens_that_fall_in_them():
    torch.manual_seed(0)
    cfg = AllAttnConfig(
        **ALLATTN,
        n_persistent=8,
        adaptive_io=True,
        adaptive_cutoffs=[50, 300],
        adaptive_div=2,
    )
    model = AllAttnLM(cfg, vocab_size=2000)
    rows, block = 4, 64
    tokens = torch.randint(2000, (rows, block))  # uniform: the bands' shares are their sizes
    state = model.init_state(rows)
    with model.planned_update():
        traced = traced_saved(model, tokens, state)
    model.hold_shapes_at(None)
    counted = model.activation_memory(rows, block, torch.float32, "cpu", uniform_tokens=True)
    assert counted.saved == pytest.approx(traced, rel=WITHIN)


@pytest.mark.parametrize(
    "mixer",
    ["conv", "persistent_conv", "highway_conv", "cgru", "self_attention", "sa+highway_conv"],
)
@pytest.mark.parametrize("causal", [True, False])
def test_active_memory_counts_what_autograd_keeps(mixer, causal):
    torch.manual_seed(0)
    cfg = ActiveMemoryConfig(
        mixer=mixer, causal=causal, d_model=40, n_layers=2, ff_dim=72, kernel_size=7,
        n_heads=4, head_dim=12, dropout=0.1,
    )  # fmt: skip
    model = ActiveMemoryModel(cfg, 300)
    rows, block = 3, 48
    traced = traced_saved(model, torch.randint(300, (rows, block)), [])
    counted = model.activation_memory(rows, block, torch.float32, "cpu")
    assert counted.saved == pytest.approx(traced, rel=WITHIN)


@pytest.mark.parametrize("ltm", [True, False])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_infinity_former_counts_a_block_that_reads_its_memory(ltm, dropout):
    torch.manual_seed(0)
    cfg = InfinityFormerConfig(
        d_model=48, n_layers=2, n_heads=4, ff_dim=80, dropout=dropout, mem_len=24, ltm=ltm,
        n_basis=32, n_samples=20,
    )  # fmt: skip
    model = InfinityFormerLM(cfg, 25)
    rows, block = 3, 24
    stream = torch.randint(25, (rows, 4 * block))
    state = model.init_state(rows)
    with torch.no_grad():  # three blocks: the long-term memory holds states and is read
        for i in range(3):
            state = model(stream[:, i * block : (i + 1) * block], None, state).state
    traced = traced_saved(model, stream[:, 3 * block :], state)
    counted = model.activation_memory(rows, block, torch.float32, "cpu")
    assert counted.saved == pytest.approx(traced, rel=WITHIN)
    tensors = [t for t in state if t.is_floating_point()]
    assert counted.state == pytest.approx(sum(t.numel() * t.element_size() for t in tensors))


def test_a_model_without_counts_says_so():
    from pipeline.models.protocol import ModelOutput, SequenceModel

    class Plain(SequenceModel):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Linear(2, 2)

        def forward(self, tokens, targets=None, state=None):
            return ModelOutput(None, None, [])

    from pipeline.models.capabilities import MemoryCounts
    from pipeline.training.memory_plan import Planner, hold_shapes_at, model_states

    assert not isinstance(Plain(), MemoryCounts)  # opt in: not declared, not counted
    states = model_states(6, 0, 1, torch.float32, "adam", "cpu")
    assert Planner(Plain(), states, 8, torch.float32, "cpu", 2, documents=False).at(1) is None
    assert hold_shapes_at(Plain(), 1.0) == ""
