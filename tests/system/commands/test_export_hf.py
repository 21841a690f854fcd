"""`export --format hf`: a folder transformers loads without this package, that generates
what `sample` generates. Needs transformers (the `test` extra); where it is absent the tests
skip, and under $ALLATTN_REQUIRE_TRANSFORMERS (CI, .ci/run) they fail instead."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner

from pipeline.commands.cli import main
from pipeline.spec import load_spec

REQUIRE_TRANSFORMERS = "ALLATTN_REQUIRE_TRANSFORMERS"
# prompts shorter and longer than a block (32); 60 new tokens, as issue 46 timed them
SHORT_PROMPT, LONG_PROMPT, NEW_TOKENS, SEQ_LEN = 5, 100, 60, 160

# Run with `pipeline` unimportable: the folder must load on a machine without this package.
# `positions`: the tokens each call of the family's model reads during `generate`.
LOAD_AND_GENERATE = """
import json, sys
sys.modules["pipeline"] = None  # any `import pipeline...` now raises ImportError
import torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True)
prompts, sequence = json.loads(sys.argv[2]), json.loads(sys.argv[3])
outs, positions = [], []
hook = model.model.register_forward_pre_hook(lambda m, args: positions[-1].append(args[0].shape[1]))
with torch.no_grad():
    for prompt in prompts:
        positions.append([])
        out = model.generate(torch.tensor([prompt]), max_new_tokens=int(sys.argv[4]),
                             do_sample=False)
        outs.append(out[0].tolist())
    hook.remove()
    logits = model(torch.tensor([sequence])).logits
torch.save(logits, sys.argv[5])
print(json.dumps({"outs": outs, "positions": positions}))
"""

# The tokenizer and `pipeline("text-generation")`, without this package: each text's ids
# (or the error that refused it) and decoded text, and the pipeline's greedy continuation.
TOKENIZE_AND_PIPELINE = """
import json, sys
sys.modules["pipeline"] = None
from transformers import AutoTokenizer, pipeline
tokenizer = AutoTokenizer.from_pretrained(sys.argv[1], trust_remote_code=True)
texts, result = json.loads(sys.argv[2]), {"ids": [], "decoded": [], "errors": []}
for text in texts:
    try:
        ids = tokenizer(text)["input_ids"]
    except ValueError as e:
        ids = None
        result["errors"].append(str(e))
    result["ids"].append(ids)
    result["decoded"].append(None if ids is None else tokenizer.decode(ids))
generate = pipeline("text-generation", model=sys.argv[1], trust_remote_code=True)
out = generate(texts[0], max_new_tokens=int(sys.argv[3]), do_sample=False)
result["generated"] = out[0]["generated_text"]
print(json.dumps(result))
"""


def need_transformers() -> None:
    try:
        import transformers  # noqa: F401
    except ImportError:
        reason = "needs transformers (pip install -e '.[hf]')"
        if os.environ.get(REQUIRE_TRANSFORMERS):
            pytest.fail(f"{reason} ({REQUIRE_TRANSFORMERS} is set)", pytrace=False)
        pytest.skip(reason)


def run_clean(script: str, *args, tmp_path) -> dict:
    """Run `script` in a fresh interpreter offline (its last line of output is JSON)."""
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf_home"), "HF_HUB_OFFLINE": "1"}
    run = subprocess.run(
        [sys.executable, "-c", script, *map(str, args)],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.splitlines()[-1])


def export_hf(config, out) -> None:
    result = CliRunner().invoke(main, ["export", str(config), "--out", str(out), "--format", "hf"])
    assert result.exit_code == 0, result.output


def test_the_hf_folder_loads_without_the_package_and_generates_what_sample_does(trained, tmp_path):
    need_transformers()
    from pipeline.commands.sample import generate
    from pipeline.commands.trained_weights import trained_model
    from pipeline.data.manifest import load_manifest, load_split

    out = tmp_path / "hf"
    export_hf(trained, out)
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "vocab.json", "README.md"} <= names
    for path in out.glob("*.py"):  # the copied code imports nothing of this package
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and not node.level:
                assert not (node.module or "").startswith("pipeline"), path.name
            if isinstance(node, ast.Import):
                assert all(not a.name.startswith("pipeline") for a in node.names), path.name

    spec = load_spec(trained, [])
    model, preprocess, _ = trained_model(spec, "latest", lambda m: None)
    assert json.loads((out / "vocab.json").read_text()) == load_manifest(preprocess)["vocab"]
    sequence = [int(t) for t in load_split(preprocess, "valid")[:SEQ_LEN]]
    prompts = [sequence[:SHORT_PROMPT], sequence[:LONG_PROMPT]]
    greedy = [list(generate(model, p, NEW_TOKENS, temperature=0.0, block_len=32)) for p in prompts]

    got = run_clean(
        LOAD_AND_GENERATE, out, json.dumps(prompts), json.dumps(sequence), NEW_TOKENS,
        tmp_path / "logits.pt", tmp_path=tmp_path,
    )  # fmt: skip
    # what `sample --temperature 0` draws, token for token
    assert got["outs"] == [p + g for p, g in zip(prompts, greedy, strict=True)]
    for prompt, positions in zip(prompts, got["positions"], strict=True):
        # the prompt once, in blocks as `sample` reads it; then one position per new token
        # (the last token drawn is never read), whatever the prompt's length
        blocks = -(-len(prompt) // 32)
        assert positions[:blocks] == [min(32, len(prompt) - 32 * i) for i in range(blocks)]
        assert positions[blocks:] == [1] * (NEW_TOKENS - 1)

    # the package model over the same sequence, in blocks through its state (the cache)
    state, expected = model.init_state(1), []
    with torch.no_grad():
        for start in range(0, SEQ_LEN, 32):
            o = model(torch.tensor([sequence[start : start + 32]]), None, state)
            state = o.state
            expected.append(o.logits)
    hf_logits = torch.load(tmp_path / "logits.pt")
    torch.testing.assert_close(hf_logits, torch.cat(expected, 1), atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", ["char", "sentencepiece"])
def test_the_hf_folder_s_tokenizer_and_pipeline_work_without_the_package(
    trained_with_tokenizer, tmp_path, kind
):
    """AutoTokenizer encodes and decodes as `sample` does, refuses (char) or maps to <unk>
    (sentencepiece) what the vocabulary lacks as training did, and pipeline("text-generation")
    continues a prompt as `sample --temperature 0` does."""
    need_transformers()
    from pipeline.commands.sample import decode, encode_prompt, generate
    from pipeline.commands.trained_weights import trained_model
    from pipeline.data.manifest import load_tokenizer
    from pipeline.data.sentencepiece_tokenizer import UNK_ID
    from pipeline.errors import PipelineError

    config = trained_with_tokenizer(kind)
    out = tmp_path / "hf"
    export_hf(config, out)
    spec = load_spec(config, [])
    model, preprocess, _ = trained_model(spec, "latest", lambda m: None)
    tokenizer = load_tokenizer(preprocess)
    texts = [
        "Return the value of x, if any.",
        "  two lines:\n    the second  indented, with no end",
        "one line\n",
        "a snowman \u2603 is not in the corpus",
    ]
    expected: list[list[int] | None] = []
    errors = []
    for text in texts:
        try:
            expected.append(encode_prompt(tokenizer, text))
        except PipelineError as e:
            expected.append(None)
            errors.append(str(e).removeprefix("--prompt: "))
    snowman, prompt = expected[-1], expected[0]
    if kind == "char":
        assert snowman is None  # the vocabulary lacks the snowman: refused
    else:
        assert snowman is not None and UNK_ID in snowman  # sentencepiece's <unk>, as trained
    assert prompt is not None
    greedy = list(generate(model, prompt, 20, temperature=0.0, block_len=32))
    continued = decode(tokenizer, prompt + greedy)  # what sample prints

    got = run_clean(TOKENIZE_AND_PIPELINE, out, json.dumps(texts), 20, tmp_path=tmp_path)
    assert got["ids"] == expected
    for text, ids, decoded in zip(texts, expected, got["decoded"], strict=True):
        if ids is not None:
            assert decoded == decode(tokenizer, ids)
            if UNK_ID not in ids or kind != "sentencepiece":
                assert decoded == text

    def unknown(error: str) -> str:  # the symbol and its position
        found = re.match(r"unknown character .* at position \d+", error)
        assert found, error
        return found.group()

    assert [unknown(e) for e in got["errors"]] == [unknown(e) for e in errors]
    # the pipeline decodes the new tokens alone (sentencepiece drops a space that begins a
    # decoded text): sample's tokens, and for char its text
    assert got["generated"] == texts[0] + decode(tokenizer, greedy)
    if kind == "char":
        assert got["generated"] == continued


def test_export_hf_replaces_an_earlier_hf_export(trained, tmp_path):
    out = tmp_path / "hf"
    for _ in range(2):
        result = CliRunner().invoke(
            main, ["export", str(trained), "--out", str(out), "--format", "hf"]
        )
        assert result.exit_code == 0, result.output
    assert (out / "modeling_allattn_pipe.py").is_file()
    (out / "notes.txt").write_text("mine")  # not the export's: never replaced
    result = CliRunner().invoke(main, ["export", str(trained), "--out", str(out), "--format", "hf"])
    assert result.exit_code == 2 and "notes.txt" in result.output


@pytest.mark.parametrize(
    "model, error",
    [
        ("{kind: infinity_former}", "model kind infinity_former is not supported"),
        ("{kind: allattn, adaptive_io: true}", "an adaptive softmax (model.adaptive_io)"),
    ],
)
def test_export_hf_refuses_what_it_cannot_export_in_one_line(tmp_path, model, error):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        f"name: c\ndataset: python_docs\nmodel: {model}\ntracking: {{enabled: false}}\n"
        "train: {steps: 2, batch_size: 2, seq_len: 8}\n"
        f"workspace: {{root: {tmp_path}}}\nstages: [download, preprocess, train]\n"
    )
    result = CliRunner().invoke(main, ["export", str(cfg), "--out", str(tmp_path / "o")])
    assert error not in result.output  # the native format has no such limit
    result = CliRunner().invoke(
        main, ["export", str(cfg), "--out", str(tmp_path / "o"), "--format", "hf"]
    )
    assert result.exit_code == 2
    assert len(result.output.strip().splitlines()) == 1 and error in result.output
