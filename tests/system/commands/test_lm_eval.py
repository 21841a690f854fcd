"""lm-evaluation-harness on an `export --format hf` folder, as a user runs it: its CLI, the
`hf` model with no model argument but pretrained and trust_remote_code, offline, a task that
reads the test split from a local file as one document (`loglikelihood_rolling`). Its bits
per byte must come within 0.5% of `evaluate`'s (the evaluate stage's total bits on the split
over the split's bytes), for a byte and a sentencepiece vocabulary.

The two differ in two ways, both small (docs/running.md): the harness restarts its window
with an empty memory every `n_ctx` tokens of config.json (2,048 here: 42 windows of the byte
split), where evaluate starts from an empty memory once in each of its `evaluate.batch_size`
streams (8); and the harness scores the split's first token too, read after the declared
separator (evaluate scores from the second token on). On these tiny, barely trained models
they agree within 0.003%; on the quickstart's, 0.09%.

Needs lm-eval (the `harness` extra); where it is absent the test skips, and under
$ALLATTN_REQUIRE_LM_EVAL (CI, .ci/run) it fails instead. About 1 minute on 2 cores.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from pipeline.commands.cli import main
from pipeline.spec import load_spec

REQUIRE_LM_EVAL = "ALLATTN_REQUIRE_LM_EVAL"
REQUIRE_TRANSFORMERS = "ALLATTN_REQUIRE_TRANSFORMERS"
TOLERANCE = 0.005  # the acceptance: within 0.5% of evaluate's bits per byte
TASK = "allattn_test_split"

# The test split as one document: the `text` builder reads the whole file as one row.
TASK_YAML = """\
task: {task}
dataset_path: text
dataset_kwargs:
  data_files: {{test: {path}}}
  sample_by: document
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: text
metric_list:
  - metric: bits_per_byte
"""


# What a harness reads from the folder, with transformers alone: the declared tokens' ids,
# a text's ids and their decoding (skip_special_tokens, as harnesses decode), the window.
READ_TOKENS = """
import json, sys
from transformers import AutoConfig, AutoTokenizer
tokenizer = AutoTokenizer.from_pretrained(sys.argv[1], trust_remote_code=True)
config = AutoConfig.from_pretrained(sys.argv[1], trust_remote_code=True)
ids = tokenizer(sys.argv[2])["input_ids"]
print(json.dumps({
    "declared": [tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id],
    "ids": ids, "size": len(tokenizer),
    "decoded": tokenizer.decode(ids, skip_special_tokens=True),
    "n_ctx": getattr(config, "n_ctx", None),
}))
"""


def need_transformers() -> None:
    try:
        import transformers  # noqa: F401
    except ImportError:
        reason = "needs transformers (pip install -e '.[hf]')"
        if os.environ.get(REQUIRE_TRANSFORMERS):
            pytest.fail(f"{reason} ({REQUIRE_TRANSFORMERS} is set)", pytrace=False)
        pytest.skip(reason)


def need_lm_eval() -> None:
    try:
        import lm_eval.models.huggingface  # noqa: F401  (its `hf` model needs accelerate too)
    except ImportError as e:
        reason = f"needs lm-evaluation-harness (pip install -e '.[harness]'): {e}"
        if os.environ.get(REQUIRE_LM_EVAL):
            pytest.fail(f"{reason} ({REQUIRE_LM_EVAL} is set)", pytrace=False)
        pytest.skip(reason)


def split_bytes(spec) -> bytes:
    """The test split's bytes, cut from the download as preprocess cut them (a tail split:
    the last `test` bytes, or lines), not decoded from the tokens: sentencepiece decodes an
    <unk> as a symbol the text never had."""
    from pipeline.data.manifest import load_manifest

    workspace = Path(spec.workspace.root) / spec.name
    files = json.loads((workspace / "download" / "download.json").read_text())["files"]
    data = (workspace / "download" / files["all"]["path"]).read_bytes()
    split = load_manifest(workspace / "preprocess")["split"]
    assert split["kind"] == "tail", split
    if split["unit"] == "bytes":
        return data[-split["test"] :]
    assert split["unit"] == "lines" and data.endswith(b"\n"), split
    return b"\n".join(data.split(b"\n")[-split["test"] - 1 :])


def evaluate_test_bits(spec, out_dir) -> float:
    """The evaluate stage's total bits on the test split, run on the workspace's preprocess
    and train outputs with its results written into `out_dir` (the shared workspace keeps no
    evaluate of its own, which `export --register` would read)."""
    from stages.base import NullStageTracker, StageContext
    from stages.evaluate import run

    workspace = Path(spec.workspace.root) / spec.name
    inputs = {"preprocess": workspace / "preprocess", "train": workspace / "train"}
    out_dir.mkdir()
    ctx = StageContext(spec, out_dir, inputs, NullStageTracker(), log=lambda m: None)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the harness's process (OMP_NUM_THREADS below)
    try:
        result = run(ctx)["test"]
    finally:
        torch.set_num_threads(threads)
    return result["loss"] * result["tokens"] / math.log(2)


def offline_env(tmp_path) -> dict:
    return {
        **os.environ,
        "HF_HOME": str(tmp_path / "hf_home"),  # the datasets cache too: never the user's
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        # one thread: beside another test process on 2 cores, torch's two threads wait on
        # each other (30 times the CPU time of one, on this tiny model's 32-token blocks)
        "OMP_NUM_THREADS": "1",
    }


def export_hf(config, out) -> None:
    result = CliRunner().invoke(main, ["export", str(config), "--out", str(out), "--format", "hf"])
    assert result.exit_code == 0, result.output


def lm_eval_bits_per_byte(export, text: str, tmp_path) -> float:
    """lm-eval's CLI on `export` (pretrained and trust_remote_code, nothing else), offline."""
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    # a file of its own: the harness's `text` builder reads it back as the one document
    (tasks / "test.txt").write_bytes(text.encode("utf-8"))
    (tasks / f"{TASK}.yaml").write_text(TASK_YAML.format(task=TASK, path=tasks / "test.txt"))
    command = [
        sys.executable, "-m", "lm_eval", "--model", "hf",
        "--model_args", f"pretrained={export},trust_remote_code=True",
        "--tasks", TASK, "--include_path", str(tasks), "--device", "cpu",
        "--output_path", str(tmp_path / "results"),
    ]  # fmt: skip
    run = subprocess.run(
        command, capture_output=True, text=True, env=offline_env(tmp_path), cwd=tmp_path
    )
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    (written,) = (tmp_path / "results").rglob("results_*.json")
    return json.loads(written.read_text())["results"][TASK]["bits_per_byte,none"]


@pytest.mark.parametrize("kind", ["byte", "sentencepiece"])
def test_lm_eval_scores_an_export_s_test_split_as_evaluate_does(
    trained, trained_with_tokenizer, tmp_path, kind
):
    need_lm_eval()
    config = trained if kind == "byte" else trained_with_tokenizer(kind)
    spec = load_spec(config, ["evaluate.splits=[test]"])
    export = tmp_path / "hf"
    export_hf(config, export)

    data = split_bytes(spec)
    # a byte split cut inside a character would start or end with a piece of one, which the
    # harness's text cannot hold: only those bytes are dropped (python_docs is UTF-8)
    text = data.decode("utf-8", errors="ignore")
    assert len(text.encode("utf-8")) >= len(data) - 6
    expected = evaluate_test_bits(spec, tmp_path / "evaluate") / len(data)
    got = lm_eval_bits_per_byte(export, text, tmp_path)
    assert abs(got - expected) <= TOLERANCE * expected, (kind, got, expected)


@pytest.mark.parametrize("kind", ["byte", "sentencepiece"])
def test_the_export_declares_its_separator_and_reads_text_as_training_did(
    trained, trained_with_tokenizer, tmp_path, kind
):
    """BOS, EOS and pad are the vocabulary's end of a line (the newline; sentencepiece's
    end-of-line piece), an id of the vocabulary (none added); encoding adds it nowhere and
    reads text that spells it as training did; decoding keeps it, skip_special_tokens or not;
    config.json gives the harness its window."""
    need_transformers()
    from pipeline.commands.sample import encode_prompt
    from pipeline.data.manifest import load_tokenizer

    config = trained if kind == "byte" else trained_with_tokenizer(kind)
    spec = load_spec(config, [])
    vocabulary = load_tokenizer(Path(spec.workspace.root) / spec.name / "preprocess")
    if kind == "byte":
        separator_id, size = vocabulary.symbols.index(ord("\n")), len(vocabulary)
    else:
        separator_id, size = vocabulary.eos_id, len(vocabulary)
        assert vocabulary.pieces[separator_id] == "<eos>"
    export = tmp_path / "hf"
    export_hf(config, export)
    text = "two lines, the first\nspells <eos> and ends the second\n"
    run = subprocess.run(
        [sys.executable, "-c", READ_TOKENS, str(export), text],
        capture_output=True, text=True, env=offline_env(tmp_path), cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.splitlines()[-1])
    assert got["declared"] == [separator_id] * 3
    assert got["size"] == size
    assert got["ids"] == encode_prompt(vocabulary, text)
    assert got["ids"].count(separator_id) == 2  # the two line ends; "<eos>" is text
    assert got["decoded"] == text
    assert got["n_ctx"] == 2048  # 16 spans of 32 are fewer than the harness's own default
