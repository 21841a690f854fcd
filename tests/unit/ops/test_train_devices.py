"""Which attention backend trains on which device: one table
(``pipeline.ops.backend_cannot_train_on``), and the three places that refuse a backend that
cannot train (spec validation, the model's ``cannot_train_on``, the flex op itself) say its
reason, word for word."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pipeline.models.allattn.config import ATTENTION_IMPL_NAMES, AttentionConfig
from pipeline.models.allattn.model import AllAttnLM
from pipeline.ops import (
    ATTENTION_IMPLS,
    attend_flex,
    backend_cannot_train_on,
    backends_that_train_on,
)
from pipeline.spec import SpecError, load_spec
from tests.fixtures.tiny_models import tiny_allattn

QUICKSTART = Path(__file__).resolve().parents[3] / "configs" / "quickstart.yaml"

EXPECTED = {
    ("flex", "cpu"): "flex runs forward only on CPU (torch has no CPU backward for FlexAttention)",
    ("triton", "cpu"): (
        "triton runs its kernels on CUDA (on the CPU only in Triton's interpreter, for tests: "
        "minutes a step)"
    ),
}
"""Every (backend, device) pair that cannot train; all others can."""

PAIRS = [(impl, device) for impl in ATTENTION_IMPL_NAMES for device in ("cpu", "cuda")]


def test_every_backend_the_spec_accepts_is_an_op_the_table_answers_for():
    assert set(ATTENTION_IMPL_NAMES) == set(ATTENTION_IMPLS)


@pytest.mark.parametrize("impl,device", PAIRS)
def test_the_table(impl, device):
    assert backend_cannot_train_on(impl, device) == EXPECTED.get((impl, device))


def test_what_to_use_instead_is_what_the_table_lets_train():
    assert backends_that_train_on("cpu") == "reference, sdpa or auto"
    assert backends_that_train_on("cuda") == "reference, sdpa, flex, triton or auto"


def tiny_model(impl: str) -> AllAttnLM:
    return tiny_allattn(
        11, None, n_layers=1, n_persistent=2, max_span=16, span_ramp=4, attn_dropout=0.3,
        attention=AttentionConfig(impl=impl),
    )  # fmt: skip


def validation_error(impl: str, device: str) -> str | None:
    try:
        load_spec(QUICKSTART, [f"model.attention.impl={impl}", f"train.device={device}"])
    except SpecError as error:
        return str(error)
    return None


@pytest.mark.parametrize("impl,device", PAIRS)
def test_validation_and_the_model_quote_the_table(impl, device):
    why = backend_cannot_train_on(impl, device)
    from_model = tiny_model(impl).cannot_train_on(torch.device(device))
    from_spec = validation_error(impl, device)
    if why is None:
        assert from_model is None and from_spec is None, (from_model, from_spec)
        return
    instead = backends_that_train_on(device)
    assert from_model == (
        f"model.attention.impl: {why} and this run trains on the CPU: use {instead}"
    )
    assert from_spec == (
        f"--set model.attention.impl={impl}: model.attention.impl: {why} and train.device is "
        f"{device}: use {instead} to train on CPU"
    )


def test_the_flex_op_quotes_the_table_when_asked_for_gradients_on_the_cpu():
    q = torch.zeros(1, 2, 4, 8, requires_grad=True)
    k = v = torch.zeros(1, 2, 8, 8)
    with pytest.raises(ValueError) as info:
        attend_flex(q, k, v, torch.zeros(8, 4))
    assert str(info.value) == (
        f"attention impl {backend_cannot_train_on('flex', 'cpu')}, and this call needs "
        f"gradients: use {backends_that_train_on('cpu')} to train on CPU"
    )
