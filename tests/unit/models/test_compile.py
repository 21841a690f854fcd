"""torch.compile of the all-attention model (train.compile): a planned (training) forward has
no graph break; the per-layer compiled code recompiles once per span bucket, no more; compiled
training follows eager training (losses and gradients). On CPU with the "aot_eager" backend
(AOT autograd's forward and backward graphs, run by eager kernels): inductor compiles the
same graphs, but at ~100 s a graph on this machine's CPU it is too slow for a test."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from pipeline.models import AllAttnLM
from pipeline.ops.fused import flex_bucket
from tests.fixtures.tiny_models import tiny_allattn

V, B, M = 13, 2, 8


def model(seed: int = 0, **kw) -> AllAttnLM:
    three_layers = dict(
        n_layers=3, n_persistent=3, max_span=512, span_init=0.02, span_loss_coef=0.0,
        attn_dropout=0.1,
    )  # fmt: skip
    return tiny_allattn(V, seed, **(three_layers | kw)).train()


def blocks(n: int) -> torch.Tensor:
    return torch.randint(0, V, (n, B, M + 1), generator=torch.Generator().manual_seed(3))


def planned(m):
    """The trainer's context for an update (absent before plans existed: a plain forward)."""
    return getattr(m, "planned_update", nullcontext)()


def train(m, data, grow: float = 0.03, seen=None) -> list[float]:
    """Adam updates, one per block, spans growing by grow * max_span tokens per update."""
    opt = torch.optim.Adam(m.parameters(), lr=1e-3)
    state, losses = m.init_state(B), []
    for t in data:
        torch.manual_seed(len(losses))  # the same dropout draws in every run
        with planned(m):
            if seen is not None:
                seen.append(tuple(m.span_lens()))
            out = m(t[:, :-1], t[:, 1:], state)
            loss = out.nll.mean() + m.aux_loss()
            opt.zero_grad()
            loss.backward()
            opt.step()
        with torch.no_grad():
            for layer in m.layers:
                layer.attn.adaptive_span.frac.add_(grow)
        m.after_step()
        getattr(m, "request_plan", lambda: None)()
        state = out.state
        losses.append(loss.item())
    return losses


def test_a_planned_forward_of_the_whole_model_has_no_graph_break():
    m = model()
    data = blocks(3)
    train(m, data[:2])  # a plan in force, as in steady state
    state = m.init_state(B)
    with planned(m):
        explained = torch._dynamo.explain(m)(data[2][:, :-1], data[2][:, 1:], state)
    assert explained.graph_break_count == 0, [str(r) for r in explained.break_reasons]


def test_layers_compile_once_per_span_bucket_without_graph_break():
    torch._dynamo.reset()
    counters.clear()
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    m = model()
    assert m.compile_for_training(backend=counting)
    seen: list[tuple[int, ...]] = []
    train(m, blocks(12), seen=seen)
    buckets = {s for plan in seen for s in plan}
    assert len(buckets) >= 3 and all(flex_bucket(s) == s for s in buckets)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert len(graphs) <= len(buckets)  # one graph per bucket, shared by the layers


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_compiled_training_follows_eager(dropout):
    torch._dynamo.reset()
    data = blocks(6)
    eager, compiled = model(attn_dropout=dropout), model(attn_dropout=dropout)
    compiled.compile_for_training(backend="aot_eager")
    a, b = train(eager, data), train(compiled, data)
    assert b == pytest.approx(a, rel=1e-5)
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters(), strict=False):
        assert torch.allclose(p, q, rtol=1e-4, atol=1e-6), name
    # gradients of one more update, from the same weights
    compiled.load_state_dict(eager.state_dict())
    t = data[0]
    for m in (eager, compiled):
        m.zero_grad()
        torch.manual_seed(99)
        with planned(m):
            out = m(t[:, :-1], t[:, 1:], m.init_state(B))
            (out.nll.mean() + m.aux_loss()).backward()
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters(), strict=False):
        assert torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-6), name


def test_train_compile_is_a_runtime_setting_with_an_auto_default(tmp_path):
    from pathlib import Path

    import stages.train
    from pipeline.spec import load_spec

    quickstart = Path(__file__).resolve().parents[3] / "configs" / "quickstart.yaml"
    assert load_spec(quickstart).train.compile == "auto"
    assert load_spec(quickstart, ["train.compile=true"]).train.compile is True
    assert load_spec(quickstart, ["train.compile=false"]).train.compile is False
    assert "train.compile" in stages.train.RUNTIME_ONLY  # not in the fingerprint
    assert load_spec(quickstart, ["train.compile=graphs"]).train.compile == "graphs"
    with pytest.raises(Exception, match="train.compile"):
        load_spec(quickstart, ["train.compile=cudagraphs"])


def test_graphs_compile_in_reduce_overhead_mode_and_mark_each_update(monkeypatch):
    """train.compile: graphs asks torch.compile for its CUDA-graph mode (reduce-overhead) per
    layer, tells the graphs' memory that a new update begins at each planned update (the
    last one's outputs may then be overwritten), and never keeps a view of a layer's output
    as the state for the next block: a replay would overwrite it."""
    calls: list[dict] = []

    def fake_compile(layer, **kw):
        calls.append(kw)
        return layer  # eager stand-in: what matters is what was asked

    marks: list[int] = []
    monkeypatch.setattr(torch, "compile", fake_compile)
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(1))
    m = model(max_span=64)  # a cache of 64 rows: a block of 64 tokens is all of it
    assert m.compile_for_training(graphs=True)
    assert calls == [dict(backend="inductor", dynamic=False, mode="reduce-overhead")] * 3
    outputs: set[int] = set()
    for layer in m.layers:
        layer.register_forward_hook(
            lambda mod, args, out: outputs.add(out.untyped_storage().data_ptr())
        )
    t = torch.randint(0, V, (B, 65), generator=torch.Generator().manual_seed(3))
    with m.planned_update():
        out = m(t[:, :-1], t[:, 1:], m.init_state(B))
    assert marks == [1]
    # the states of layers 1 and 2 are the last 64 rows of layers 0 and 1's outputs
    kept = {s.untyped_storage().data_ptr() for s in out.state}
    assert len(outputs) == 3 and not kept & outputs
    calls.clear()
    m2 = model()
    assert m2.compile_for_training()
    assert calls == [dict(backend="inductor", dynamic=False)] * 3
    with m2.planned_update():
        pass
    assert marks == [1]  # without graphs, nothing to mark


def test_the_layers_with_the_triton_kernels_compile_without_graph_break():
    """The Triton op inside a planned (training) forward: one graph per layer call, no graph
    break (the custom ops are opaque to the compiler, their shapes from register_fake)."""
    torch._dynamo.reset()
    m = model(n_layers=2, max_span=64)
    m.set_attention_impl("triton")
    t = blocks(1)[0]
    with m.planned_update():
        explained = torch._dynamo.explain(m.layers[0])(
            m.embed(t[:, :-1]), torch.zeros(B, 64, 16), m.pos_table, 64
        )
    assert explained.graph_break_count == 0, [str(r) for r in explained.break_reasons]
    assert explained.graph_count == 1
