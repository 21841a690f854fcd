"""`export --format hf`: a folder transformers loads without this package, that generates
what `sample` generates. Needs transformers (the `test` extra); where it is absent the tests
skip, and under $ALLATTN_REQUIRE_TRANSFORMERS (CI, .ci/run) they fail instead."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner

from pipeline.commands.cli import main
from pipeline.spec import load_spec

REQUIRE_TRANSFORMERS = "ALLATTN_REQUIRE_TRANSFORMERS"
PROMPT_LEN, NEW_TOKENS, SEQ_LEN = 40, 24, 80  # prompts longer than a block (32)

# Run with `pipeline` unimportable: the folder must load on a machine without this package.
LOAD_AND_GENERATE = """
import json, sys
sys.modules["pipeline"] = None  # any `import pipeline...` now raises ImportError
import torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True)
prompt, sequence = json.loads(sys.argv[2]), json.loads(sys.argv[3])
with torch.no_grad():
    out = model.generate(torch.tensor([prompt]), max_new_tokens=int(sys.argv[4]),
                         do_sample=False)
    logits = model(torch.tensor([sequence])).logits
torch.save(logits, sys.argv[5])
print(json.dumps(out[0].tolist()))
"""


def need_transformers() -> None:
    try:
        import transformers  # noqa: F401
    except ImportError:
        reason = "needs transformers (pip install -e '.[hf]')"
        if os.environ.get(REQUIRE_TRANSFORMERS):
            pytest.fail(f"{reason} ({REQUIRE_TRANSFORMERS} is set)", pytrace=False)
        pytest.skip(reason)


def test_the_hf_folder_loads_without_the_package_and_generates_what_sample_does(trained, tmp_path):
    need_transformers()
    from pipeline.commands.sample import generate
    from pipeline.commands.trained import trained_model
    from pipeline.data.manifest import load_manifest, load_split

    out = tmp_path / "hf"
    result = CliRunner().invoke(main, ["export", str(trained), "--out", str(out), "--format", "hf"])
    assert result.exit_code == 0, result.output
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
    prompt = sequence[:PROMPT_LEN]
    greedy = list(generate(model, prompt, NEW_TOKENS, temperature=0.0, block_len=32))

    env = {**os.environ, "HF_HOME": str(tmp_path / "hf_home"), "HF_HUB_OFFLINE": "1"}
    run = subprocess.run(
        [sys.executable, "-c", LOAD_AND_GENERATE, str(out), json.dumps(prompt),
         json.dumps(sequence), str(NEW_TOKENS), str(tmp_path / "logits.pt")],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads(run.stdout.splitlines()[-1]) == prompt + greedy

    # the package model over the same sequence, in blocks through its state (the cache)
    state, expected = model.init_state(1), []
    with torch.no_grad():
        for start in range(0, SEQ_LEN, 32):
            o = model(torch.tensor([sequence[start : start + 32]]), None, state)
            state = o.state
            expected.append(o.logits)
    hf_logits = torch.load(tmp_path / "logits.pt")
    torch.testing.assert_close(hf_logits, torch.cat(expected, 1), atol=1e-5, rtol=0)


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
