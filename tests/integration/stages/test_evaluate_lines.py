"""What train and evaluate print of a run whose tokens are sentencepiece pieces: bits per
token named as such ("bpc" is bits per character, which these are not), and evaluate's
progress line named by its split once ("[evaluate] valid: ...", not "evaluate valid"); a
re-run with nothing to do reprints the recorded results in the same words."""

from __future__ import annotations

import pytest

from pipeline.spec import load_spec
from stages.evaluate import result_lines
from tests.fixtures.environment import restored_environment


def run_lines(tmp_path, tokenizer: str) -> list[str]:
    from pipeline.tracking.tracker import NullTracker
    from pipeline.workspace.runner import Runner

    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(f"""\
name: tiny
dataset: {{name: python_docs, url: "builtin://python-docs", tokenizer: {tokenizer},
          split: {{kind: tail, valid: 0.01, test: 0.01}}}}
model: {{kind: allattn, d_model: 16, n_layers: 1, n_heads: 2, n_persistent: 4, max_span: 16}}
train: {{steps: 2, batch_size: 4, seq_len: 16, log_every: 1, eval_every: 2, eval_batches: 1,
        checkpoint_every: 2}}
evaluate: {{batch_size: 16, seq_len: 64}}
tracking: {{enabled: false}}
workspace: {{root: {tmp_path / "runs"}}}
stages: [download, preprocess, train, evaluate]
""")
    lines: list[str] = []
    with restored_environment():
        Runner(load_spec(cfg, []), log=lines.append).run(NullTracker())
    return lines


def test_a_sentencepiece_run_prints_bits_per_token_and_the_split_once(tmp_path):
    tokenizer = "{kind: sentencepiece, vocab_size: 300, sample_sentences: 2000, num_threads: 1}"
    lines = run_lines(tmp_path, tokenizer)
    text = "\n".join(lines)
    assert " bpc " not in text, text
    assert "[train] step      2/2  loss" in text and "  bits/token " in text, text
    assert "valid bits/token " in text, text  # train's validation
    assert any(line.startswith("[evaluate] valid bits/token ") for line in lines), text
    assert any(line.startswith("[evaluate] valid: ") for line in lines), text
    assert "evaluate valid" not in text, text
    # a re-run with nothing to do reprints the recorded results in the same words
    again = "\n".join(run_lines(tmp_path, tokenizer))
    assert "nothing to run" in again and " bpc " not in again, again
    assert "best valid bits/token estimate " in again, again
    assert "[evaluate] valid bits/token " in again, again


@pytest.mark.parametrize(
    "tokenizer, name",
    [("byte", "bpc"), ("char", "bpc"), (None, "bpc"), ("word", "bits/token")],
)
def test_result_lines_name_the_bits_by_the_tokenizer(tokenizer, name):
    results = {
        "checkpoint": "train/step_2",
        "unigram_entropy_bits": 4.5,
        "valid": {"tokens": 1234, "loss": 1.5, "bpc": 2.164, "ppl": 4.48},
    }
    if tokenizer is not None:  # a results.json written before the tokenizer was recorded
        results["tokenizer"] = tokenizer
    assert result_lines(results)[1] == f"valid {name} 2.164   ppl 4.48   (1,234 tokens)"
