"""Heat maps of numbers per layer and head: the learned spans a model reports at the end of
training, and the share of attention weight on the persistent vectors measured by evaluate
(checked against the weights computed row by row, in float64)."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn as nn

from pipeline.models.allattn import AllAttnLM
from pipeline.models.capabilities import HeadReports
from pipeline.models.protocol import ModelOutput, SequenceModel
from pipeline.ops.attention import attend_reference
from pipeline.training.head_maps import HEAT_MAP_KEY, head_heat_map, save_head_tables
from tests.fixtures.tiny_models import tiny_allattn
from tests.fixtures.tracked_pipeline import pipeline

PNG = b"\x89PNG\r\n\x1a\n"
FRACS = [[0.1, 0.25], [0.4, 0.75]]  # per layer and head: spans 6.4, 16, 25.6, 48 tokens


def tiny_model(**overrides) -> AllAttnLM:
    """Two layers of two heads, float64, spans that cut into the 64 context columns."""
    model = tiny_allattn(11, **(dict(n_persistent=3, max_span=64) | overrides)).double().eval()
    if model.cfg.adaptive_span:
        with torch.no_grad():
            for layer, fracs in zip(model.layers, FRACS, strict=False):
                span = layer.attn.adaptive_span
                span.frac.copy_(torch.tensor(fracs[: span.frac.numel()], dtype=torch.float64))
    return model


def share_row_by_row(q, k, pos, pk, mask) -> torch.Tensor:
    """[B, H, M]: each query's weight on the persistent vectors, from eq. 12-13 written per
    query row (its L' keys before it, the span mask on the context, joint renormalisation)."""
    _, _, m, d_h = q.shape
    span_len = k.shape[2] - m
    rows = []
    for i in range(m):
        qi = q[:, :, i]  # [B, H, d_h]
        s_ctx = torch.einsum("bhd,bhjd->bhj", qi, k[:, :, i : i + span_len]) + torch.einsum(
            "bhd,dj->bhj", qi, pos
        )
        s_pers = torch.einsum("bhd,hnd->bhn", qi, pk)
        a = torch.softmax(torch.cat([s_ctx, s_pers], -1) / math.sqrt(d_h), -1)
        ctx = a[..., :span_len] * mask[None]
        pers = a[..., span_len:].sum(-1)
        rows.append(pers / (ctx.sum(-1) + pers + 1e-8))
    return torch.stack(rows, dim=-1)


def test_persistent_share_is_the_mean_weight_on_the_persistent_vectors():
    model = tiny_model()
    recorded: list[list[torch.Tensor]] = [[], []]
    for layer, calls in zip(model.layers, recorded, strict=False):

        def attend(q, k, v, pos, *, calls=calls, **kw):
            calls.append(share_row_by_row(q, k, pos, kw["persistent_k"], kw["span_mask"]))
            return attend_reference(q, k, v, pos, **kw)

        layer.attn.attend = attend
    blocks = torch.randint(0, 11, (2, 3, 5), generator=torch.Generator().manual_seed(1))
    plain = []
    state = None
    for x in blocks:  # two blocks with the cache: context beyond the block
        out = model(x, x, state)
        plain.append(out.nll)
        state = out.state
    for calls in recorded:
        calls.clear()
    with model.measure_persistent_share() as tables:
        state = None
        for x, nll in zip(blocks, plain, strict=False):
            out = model(x, x, state)
            state = out.state
            assert torch.equal(out.nll, nll)  # measuring changes no number
    expected = [
        torch.stack(calls).transpose(0, 2).reshape(2, -1).mean(-1).tolist() for calls in recorded
    ]  # per head, over blocks, rows, queries
    share = tables["persistent_share"]
    assert [len(row) for row in share] == [2, 2]
    torch.testing.assert_close(torch.tensor(share), torch.tensor(expected), rtol=0, atol=1e-12)
    assert all(0.0 < s < 1.0 for row in share for s in row)
    assert len({round(s, 6) for row in share for s in row}) == 4  # each head its own
    assert all(layer.attn.persistent_share is None for layer in model.layers)


def test_a_fused_backend_keeps_its_outputs_and_measures_the_reference_weights():
    x = torch.randint(0, 11, (3, 5), generator=torch.Generator().manual_seed(1))
    shares = {}
    for impl in ("reference", "sdpa"):
        model = tiny_model()
        model.set_attention_impl(impl)
        plain = model(x, x).nll
        with model.measure_persistent_share() as tables:
            assert torch.equal(model(x, x).nll, plain)
        shares[impl] = torch.tensor(tables["persistent_share"], dtype=torch.float64)
    # layer 1 sees the same inputs; layer 2 the backends' outputs, equal up to rounding
    assert torch.equal(shares["sdpa"][0], shares["reference"][0])
    torch.testing.assert_close(shares["sdpa"], shares["reference"], rtol=0, atol=1e-8)


def test_models_without_a_joint_persistent_softmax_report_no_share():
    x = torch.zeros(1, 4, dtype=torch.long)
    for overrides in (
        {"n_persistent": 0, "ff_dim": 8},
        {"persistent_mode": "attn_split"},
        {"persistent_mode": "head_split"},
    ):
        model = tiny_model(**overrides)
        with model.measure_persistent_share() as tables:
            model(x, x)
        assert tables is None, overrides

    class Bigram(SequenceModel):
        def __init__(self):
            super().__init__()
            self.out = nn.Embedding(11, 11)

        def forward(self, tokens, targets=None, state=None):
            return ModelOutput(self.out(tokens), None, [])

    assert not isinstance(Bigram(), HeadReports)  # the stages ask first (opt in)
    assert tiny_model(adaptive_span=False).head_tables() == {}


def test_span_heat_map_carries_the_models_spans(tmp_path):
    from PIL import Image

    model = tiny_model()
    spans = model.spans()
    assert spans == [[6.4, 16.0], [25.6, 48.0]]
    assert model.head_tables() == {"spans": spans}
    written = save_head_tables(model.head_tables(), tmp_path, "at the end")
    assert written == [tmp_path / "spans.json", tmp_path / "spans.png"]
    assert json.loads((tmp_path / "spans.json").read_text()) == spans
    png = tmp_path / "spans.png"
    assert png.read_bytes()[:8] == PNG and png.stat().st_size > 5_000
    with Image.open(png) as image:
        assert json.loads(image.text[HEAT_MAP_KEY]) == spans
    with pytest.raises(
        ValueError,
        match=r"same number \(> 0\) of heads in every layer; "
        r"got rows of \[1, 2\] values",
    ):
        head_heat_map([[1.0, 2.0], [3.0]], "ragged", tmp_path / "ragged.png")
    assert not (tmp_path / "ragged.png").exists()


def test_train_and_evaluate_log_their_heat_maps(tracked_cfg, tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient
    from PIL import Image

    corpus = tmp_path / "corpus.txt"  # small: a few valid batches of 8 x 64
    corpus.write_bytes(b"".join(b"line %d of a small corpus.\n" % i for i in range(2000)))
    pipeline(
        tracked_cfg,
        f"dataset.url=file://{corpus}",
        "evaluate.seq_len=64",
        "evaluate.splits=[valid]",
    )
    ws = tmp_path / "runs" / "pipe-seed1-lr0.001"
    client = MlflowClient((tmp_path / "store").as_uri())
    exp = client.get_experiment_by_name("pipe")
    stage_runs = {
        r.data.tags["stage"]: r.info.run_id
        for r in client.search_runs([exp.experiment_id], "tags.stage != ''")
    }
    artifacts = {
        stage: sorted(a.path for a in client.list_artifacts(run_id))
        for stage, run_id in stage_runs.items()
    }
    for stage in ("train", "finetune"):
        spans = json.loads((ws / stage / "spans.json").read_text())
        assert [len(row) for row in spans] == [2]  # 1 layer, 2 heads
        with Image.open(ws / stage / "spans.png") as image:
            assert json.loads(image.text[HEAT_MAP_KEY]) == spans
        assert {"spans.json", "spans.png"} <= set(artifacts[stage]), artifacts
    results = json.loads((ws / "evaluate" / "results.json").read_text())
    share = results["persistent_share"]
    assert [len(row) for row in share] == [2] and all(0 < s < 1 for s in share[0])
    with Image.open(ws / "evaluate" / "persistent_share.png") as image:
        assert json.loads(image.text[HEAT_MAP_KEY]) == share
    assert "persistent_share.png" in artifacts["evaluate"], artifacts
