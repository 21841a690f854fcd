"""Document-level training for the ∞-former's sorting task (issue 13, part 2): preprocess of
the generated card, DocumentBatches, run_documents / score_documents, and the pipeline end to
end, resumed after a preemption."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner

from pipeline.commands.cli import main
from pipeline.data.documents import DocumentBatches, as_documents
from pipeline.data.frequency_sort import generate_split
from pipeline.data.manifest import load_manifest, load_split, load_tokenizer
from pipeline.models import build_model
from pipeline.models.protocol import ModelOutput, SequenceModel
from pipeline.spec import load_spec
from pipeline.training.document_passes import run_documents, score_documents
from stages.preprocess import preprocess

ROOT = Path(__file__).resolve().parents[3]
CPU = torch.device("cpu")


def card(
    tmp: Path,
    length: int = 24,
    vocab: int = 20,
    sequences: str = "{train: 16, valid: 4, test: 4}",
    extra: str = "",
) -> Path:
    path = tmp / "sort.yaml"
    path.write_text(f"""\
extends: [{ROOT / "configs" / "infinity_former" / "sort_base_cpu.yaml"}]
name: sort_tiny
dataset:
  generator:
    seed: 7
    frequency_sort: {{vocab: {vocab}, length: {length}, sequences: {sequences}}}
  shards: {{block_tokens: 100, blocks_per_shard: 2}}
workspace: {{root: {tmp / "runs"}}}
{extra}""")
    return path


# ---------------------------------------------------------------- preprocess


def test_preprocess_writes_generate_splits_documents(tmp_path):
    ds = load_spec(card(tmp_path)).dataset
    assert ds.vocab_size == 22  # known before preprocess: `show` counts parameters
    manifest = preprocess(ds, None, tmp_path / "pre", log=lambda m: None)
    assert manifest["documents"] == {
        "length": 45,
        "input_length": 24,
        "separator": 20,
        "padding": 21,
        "count": {"train": 16, "valid": 4, "test": 4},
    }
    assert manifest["vocab_size"] == 22 and manifest["dtype"] == "uint8"
    assert load_manifest(tmp_path / "pre") == manifest
    for split, count in manifest["documents"]["count"].items():
        docs = as_documents(load_split(tmp_path / "pre", split), manifest["documents"], split)
        np.testing.assert_array_equal(docs, generate_split(7, split, count, 20, 24, (1, 9)))
    # several shards (16 x 45 tokens in blocks of 100, 2 a shard): documents cross them
    assert len(manifest["splits"]["train"]["shards"]) == 4
    vocab = load_tokenizer(tmp_path / "pre")
    assert vocab.symbols == [str(s) for s in range(20)] + ["<sep>", "<pad>"]


# ---------------------------------------------------------------- batches


def test_document_batches_are_a_function_of_the_step_and_split_ranks_disjointly():
    docs = np.arange(11 * 3).reshape(11, 3)  # document i holds 3i .. 3i + 2
    ranks = [DocumentBatches(docs, rows=2, rank=r, world_size=2, seed=5) for r in (0, 1)]
    assert ranks[0].steps_per_epoch == 2  # 11 // 4: three documents left out
    for step in range(6):
        picked = [b.batch(step)[:, 0].numpy() // 3 for b in ranks]
        assert not set(picked[0]) & set(picked[1])
        # a fresh object (a resumed run) reads the same documents at that step
        again = DocumentBatches(docs, rows=2, rank=1, world_size=2, seed=5)
        assert torch.equal(again.batch(step), ranks[1].batch(step))
        assert torch.equal(ranks[0].batch(step), torch.from_numpy(docs[picked[0]]))
    for epoch in range(3):  # no document twice within an epoch
        seen = np.concatenate([b.indices(s) for b in ranks for s in (2 * epoch, 2 * epoch + 1)])
        assert len(set(seen)) == 8
    orders = [tuple(ranks[0].epoch_order(e)) for e in range(3)]
    assert len(set(orders)) == 3  # each epoch its own permutation
    with pytest.raises(ValueError, match="a step reads 12 documents"):
        DocumentBatches(docs, rows=3, world_size=4)


# ---------------------------------------------------------------- run_documents


class CopyModel(SequenceModel):
    """Stateless: predicts that the next token is the current one (logits 5 · one-hot), and
    records each call's segment length and whether it ran with a graph."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab = vocab
        self.scale = torch.nn.Parameter(torch.tensor(5.0))
        self.calls: list[tuple[int, bool]] = []

    def forward(self, tokens, targets=None, state=None):
        self.calls.append((tokens.shape[1], torch.is_grad_enabled()))
        logits = self.scale * F.one_hot(tokens, self.vocab).float()
        nll = (
            None
            if targets is None
            else F.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
        )
        return ModelOutput(logits, nll, [])


def test_only_the_targets_after_the_separator_count_and_only_their_segments_have_a_graph():
    # vocab 4: symbols 0..3, separator 4; input length 5, then 4 targets (document of 10)
    docs = torch.tensor([[0, 1, 2, 3, 3, 4, 3, 1, 1, 1], [2, 2, 2, 2, 2, 4, 4, 4, 4, 4]])
    model = CopyModel(6)
    out = run_documents(model, docs, seq_len=4, input_length=5, train=True)
    # segments [0, 4) [4, 8) [8, 9): the first holds no scored target (targets 5.. are)
    assert model.calls == [(4, False), (4, True), (1, True)]
    assert out.nll.requires_grad and out.nll.shape == (2, 4)
    right, wrong = (-math.log(math.exp(5) / (math.exp(5) + 5)), -math.log(1 / (math.exp(5) + 5)))
    # document 0 predicts 4 3 1 1 (its inputs) for 3 1 1 1; document 1 all right
    expected = torch.tensor([[wrong, wrong, right, right], [right] * 4])
    torch.testing.assert_close(out.nll.detach(), expected)
    torch.testing.assert_close(out.predictions, docs[:, 5:9])
    changed = docs.clone()
    changed[:, 1] = 0  # an input token: its target is not scored
    torch.testing.assert_close(run_documents(model, changed, 4, 5, True).nll, out.nll)
    changed[0, 9] = 3  # a scored target
    assert not torch.equal(run_documents(model, changed, 4, 5, True).nll, out.nll)

    scores = score_documents(
        model, docs.numpy(), batch_size=1, seq_len=4, input_length=5, device=CPU
    )
    assert scores.metrics() == pytest.approx(
        {
            "loss": (2 * wrong + 6 * right) / 8,
            "token_accuracy": 6 / 8,
            "exact_match": 1 / 2,
            "documents": 2,
            "targets": 8,
        }
    )


def test_a_documents_loss_does_not_depend_on_the_document_before_it():
    docs = generate_split(3, "valid", 2, 20, 24, (1, 9))  # 45 tokens: the LTM takes some in
    torch.manual_seed(0)
    model = (
        build_model(
            "infinity_former",
            dict(
                d_model=16,
                n_layers=1,
                n_heads=2,
                ff_dim=32,
                dropout=0.0,
                mem_len=8,
                n_basis=8,
                n_samples=8,
            ),
            22,
        )
        .double()
        .eval()
    )
    first, pair = (score_documents(model, docs[:n], 1, 8, 24, CPU).nll for n in (1, 2))
    alone = score_documents(model, docs[1:], 1, 8, 24, CPU).nll
    assert pair - first == pytest.approx(alone, rel=1e-12)
    # the second document read from the state the first left differs: the reset matters
    with torch.no_grad():
        state = model.init_state(1)
        for doc in torch.from_numpy(docs)[:, None]:
            nll = []
            for start in range(0, 44, 8):
                out = model(
                    doc[:, start : min(start + 8, 44)], doc[:, start + 1 : start + 9], state
                )
                state = out.state
                nll.append(out.nll)
    assert float(torch.cat(nll, 1)[:, 24:].sum()) != pytest.approx(alone, rel=1e-6)


# ---------------------------------------------------------------- end to end


@pytest.fixture
def cli():
    def invoke(cfg: Path, *args: str):
        return CliRunner().invoke(main, ["run", str(cfg), *args])

    return invoke


TRAIN = """\
model: {d_model: 16, n_layers: 1, n_heads: 2, ff_dim: 32, dropout: 0.1, mem_len: 16,
        n_basis: 8, n_samples: 8}
train: {steps: 8, batch_size: 4, seq_len: 16, log_every: 4, eval_every: 4, eval_batches: all,
        eval_batch_size: 2, checkpoint_every: 4, keep_checkpoints: 4}
evaluate: {batch_size: 2, splits: [valid, test]}
"""


def test_a_sorting_run_end_to_end_and_resumed_after_a_preemption(tmp_path, cli, monkeypatch):
    from tests.fixtures.runs import final_weights, metric_history, preempted_at_first_checkpoint

    straight_dir, resumed_dir = tmp_path / "straight", tmp_path / "resumed"
    straight_dir.mkdir(), resumed_dir.mkdir()
    cfg = card(straight_dir, extra=TRAIN)
    result = cli(cfg)
    assert result.exit_code == 0, result.output
    assert "nothing to fetch" in result.output
    assert "bpc" not in result.output
    ws = straight_dir / "runs" / "sort_tiny"
    results = json.loads((ws / "evaluate" / "results.json").read_text())
    for split in ("valid", "test"):
        assert set(results[split]) == {
            "loss",
            "token_accuracy",
            "exact_match",
            "documents",
            "targets",
        }
        assert results[split]["documents"] == 4 and results[split]["targets"] == 80
    logged = metric_history(straight_dir / "runs", "sort_tiny", "evaluate", "test_exact_match")
    assert logged == {0: results["test"]["exact_match"]}
    valid = metric_history(straight_dir / "runs", "sort_tiny", "train", "valid_token_accuracy")
    assert sorted(valid) == [4, 8]

    # the same run, preempted right after its step-4 checkpoint, then run again (untracked:
    # MLflow was checked above, and changes no result)
    cfg = card(resumed_dir, extra=TRAIN + "tracking: {enabled: false}\n")
    with preempted_at_first_checkpoint(monkeypatch):
        stopped = cli(cfg)
    assert stopped.exit_code == 143, stopped.output
    again = cli(cfg)
    assert again.exit_code == 0, again.output
    assert "resuming from step 4" in again.output
    resumed_ws = resumed_dir / "runs" / "sort_tiny"
    a, b = final_weights(ws / "train"), final_weights(resumed_ws / "train")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((resumed_ws / "evaluate" / "results.json").read_text()) == results


def test_the_cosine_schedule_is_the_authors_cosine_annealing():
    from pipeline.training.optim import scheduled_lr

    param = torch.nn.Parameter(torch.zeros(()))
    opt = torch.optim.SGD([param], lr=2e-4)
    annealing = torch.optim.lr_scheduler.CosineAnnealingLR(opt, 50)
    for update in range(1, 51):  # the lr update k runs with, then the scheduler steps
        assert scheduled_lr(2e-4, 0, update, "cosine", 50) == pytest.approx(
            opt.param_groups[0]["lr"], rel=1e-12, abs=1e-18
        )
        opt.step()
        annealing.step()
    assert scheduled_lr(2e-4, 10, 5, "cosine", 50) == pytest.approx(1e-4)  # warming up
    assert (
        load_spec(ROOT / "configs/infinity_former/sort_4k.yaml").train.optimizer.schedule
        == "cosine"
    )


@pytest.mark.parametrize(
    "config, lr", [("sort_4k", 2.5e-4), ("sort_8k", 2.5e-4), ("sort_16k", 2e-4)]
)
def test_the_paper_sort_configs_use_the_papers_lr_for_their_length(config, lr):
    # appendix C.1 of the ∞-former paper: 2.5e-4 for 4,000 and 8,000 tokens, 2e-4 for 16,000
    spec = load_spec(ROOT / f"configs/infinity_former/{config}.yaml")
    assert spec.train.optimizer.lr == lr
    assert spec.dataset.generator.frequency_sort.length == int(config[5:-1]) * 1000
    assert spec.train.steps == 20 * 8000 // spec.train.batch_size  # 20 epochs
