"""`allattn-pipe export --format hf`: a folder that Hugging Face transformers loads without
this package,

    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained("DIR", trust_remote_code=True)

The folder carries its own code ("remote code"): the configuration and modeling files
written from the templates below, and the model family's modules, copied from this package
as flat files, their `from pipeline.a.b import x` lines rewritten to `from .a_b import x`
(transformers' dynamic-module loader follows relative imports among the files of one folder).
The copies are made at export time from the installed source, so there is no second copy of
any model to keep in step.

The model reads a sequence as `sample` reads a prompt: in blocks of the evaluation length, each
carrying the state (the cache) from the one before. For the all-attention family, whose cache
holds at least the span, that gives the same logits for any blocking, so `generate`, which
keeps that state as its cache and reads one position per new token (the modeling template,
pipeline.commands.hf_modeling), draws what `sample` draws. The folder's tokenizer
(pipeline.commands.hf_tokenizer) encodes text as `sample` does.
The ∞-former's long-term memory and the active-memory model's blocks depend on the blocking,
so they are not exported in this format.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import re
from dataclasses import asdict
from pathlib import Path

from pipeline.commands.hf_modeling import CONFIGURATION_TEMPLATE, MODELING_TEMPLATE
from pipeline.commands.hf_tokenizer import (
    TOKENIZER_CONFIG,
    TOKENIZER_PY,
    separator,
    tokenizer_file_names,
    write_tokenizer_files,
)
from pipeline.errors import PipelineError

MODEL_TYPE = "allattn_pipe"
CONFIG_PY = "configuration_allattn_pipe.py"
MODELING_PY = "modeling_allattn_pipe.py"
README = "README.md"

HF_FAMILIES = {
    "allattn": (
        "pipeline.models.allattn.model",
        "AllAttnLM",
        "pipeline.models.allattn.config",
        "AllAttnConfig",
    )
}
"""kind -> (model module, model class, config module, config class) of the families this
format exports."""

STUBS = {
    "pipeline.ops.triton_attention": (
        '''\
"""The triton attention backend is left out of this export: its kernels train on
CUDA and need the triton package; the export's config names the reference op instead
(same numbers)."""


def attend_triton(*args, **kwargs):
    raise RuntimeError(
        "attention impl triton is not in this export; use reference, sdpa, flex or auto"
    )
''',
        ("RECOMPUTED_PRODUCTS",),
    ),
}
"""Modules written as a stub instead of copied: what they hold is not needed to run the
model, and copying it would make transformers require a package (triton) to load it.
Each is (the stub's code, the module's constants that the copied modules import from it,
written out with their values at export time)."""


def stub_source(module: str) -> str:
    """The stub of `module`, its carried constants appended as literals."""
    code, constants = STUBS[module]
    real = importlib.import_module(module)
    return code + "".join(f"\n{name} = {getattr(real, name)!r}\n" for name in constants)


def hf_refusal(spec) -> str | None:
    """Why `spec`'s model cannot be exported in this format (one line), or None."""
    kind = spec.model_kind
    if kind not in HF_FAMILIES:
        return (
            f"export --format hf: model kind {kind} is not supported (its state between "
            f"blocks makes `generate` differ from `sample`); supported: "
            f"{', '.join(HF_FAMILIES)}; use --format native"
        )
    if getattr(spec.model_params, "adaptive_io", False):
        return (
            "export --format hf: an adaptive softmax (model.adaptive_io) forms no logits "
            "to generate from; use --format native"
        )
    return None


def flat_name(module: str) -> str:
    """The flat file stem of a `pipeline.*` module: pipeline.models.allattn.model ->
    models_allattn_model."""
    return module.removeprefix("pipeline.").replace(".", "_")


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def flat_source(module: str) -> tuple[str, list[str]]:
    """(the module's source with its `pipeline` imports made flat and relative, the
    `pipeline.*` modules it imports)."""
    found = importlib.util.find_spec(module)
    if found is None or found.origin is None:
        raise PipelineError(f"export --format hf: cannot find the source of {module}")
    source = Path(found.origin).read_text(encoding="utf-8")
    lines = source.splitlines(keepends=True)
    needed = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import) and any(
            a.name.split(".")[0] == "pipeline" for a in node.names
        ):
            raise PipelineError(
                f"export --format hf: {module} line {node.lineno}: `import "
                f"pipeline...` cannot be made flat; use `from pipeline.x import y`"
            )
        if not isinstance(node, ast.ImportFrom) or node.level or not node.module:
            continue
        if node.module.split(".")[0] != "pipeline":
            continue
        submodules = [a.name for a in node.names if _is_module(f"{node.module}.{a.name}")]
        if submodules and node.module != "pipeline" and module not in STUBS:
            raise PipelineError(
                f"export --format hf: {module} line {node.lineno} imports the module "
                f"{node.module}.{submodules[0]}; import names from it instead"
            )
        i = node.lineno - 1
        lines[i], n = re.subn(
            rf"\bfrom\s+{re.escape(node.module)}\s+import",
            f"from .{flat_name(node.module)} import",
            lines[i],
            count=1,
        )
        if not n:
            raise PipelineError(f"export --format hf: {module} line {node.lineno}: cannot rewrite")
        needed.append(node.module)
    return "".join(lines), needed


def imports_pipeline(source: str) -> bool:
    """Whether Python source imports the `pipeline` package anywhere (function bodies too)."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import) and any(
            a.name.split(".")[0] == "pipeline" for a in node.names
        ):
            return True
        if isinstance(node, ast.ImportFrom) and not node.level and node.module:
            if node.module.split(".")[0] == "pipeline":
                return True
    return False


def family_sources(root: str) -> dict[str, str]:
    """{flat file name: text} of `root` and every `pipeline.*` module it needs, transitively."""
    files: dict[str, str] = {}
    todo, seen = [root], set()
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        if module in STUBS:
            files[f"{flat_name(module)}.py"] = stub_source(module)
            continue
        text, needed = flat_source(module)
        files[f"{flat_name(module)}.py"] = text
        todo.extend(needed)
    return files


def hf_config(spec, vocab_size: int, checkpoint: str) -> dict:
    """config.json: transformers' keys, `auto_map` naming the folder's code, and the model
    section (`model`) the family's config dataclass is built from."""
    model = asdict(spec.model_params)
    if model.get("attention", {}).get("impl") == "triton":
        model["attention"]["impl"] = "reference"  # same numbers; the stub says why
    module, model_class, _, config_class = HF_FAMILIES[spec.model_kind]
    return {
        "model_type": MODEL_TYPE,
        "architectures": ["AllAttnPipeForCausalLM"],
        "auto_map": {
            "AutoConfig": f"{CONFIG_PY[:-3]}.AllAttnPipeConfig",
            "AutoModelForCausalLM": f"{MODELING_PY[:-3]}.AllAttnPipeForCausalLM",
        },
        "kind": spec.model_kind,
        "family": {"module": flat_name(module), "model": model_class, "config": config_class},
        "model": model,
        "vocab_size": vocab_size,
        "block_len": spec.train.eval_seq_len or spec.train.seq_len,
        "n_ctx": harness_window(spec),
        "use_cache": True,
        "source": {"spec": str(spec.source), "checkpoint": checkpoint},
    }


HARNESS_SPANS = 16
"""An evaluation harness's window holds this many attention spans: after each restart of the
window (an empty memory) the tokens read with less than a span before them are at most
1/16 of it."""


def harness_window(spec) -> int:
    """config.json's `n_ctx`: the tokens an evaluation harness scores in one forward before it
    restarts with an empty memory (lm-evaluation-harness reads it as the model's maximum
    length; its own default is 2,048). The model reads a sequence of any length, in blocks;
    a longer window costs the harness only the logits it holds. Not max_position_embeddings,
    which transformers' `generate` would take for a limit on the sequence."""
    return max(2048, HARNESS_SPANS * spec.model_params.max_span)


def readme(spec, vocab: dict, checkpoint: str) -> str:
    sp = vocab["kind"] == "sentencepiece"
    files = "vocab.json" + (", tokenizer.model" if sp else "")
    unknown = (
        "A piece that vocabulary lacks becomes <unk> (or its bytes, with byte fallback), as\n"
        "  in training. `pipeline` decodes the new tokens alone, which can drop the space\n"
        "  between prompt and continuation; `tokenizer.decode` of the whole sequence keeps it."
        if sp
        else "Text with a symbol that vocabulary lacks is refused (ValueError\n"
        "  naming it), as in training."
    )
    return f"""# {spec.name}: an allattn-pipe model in Hugging Face format

Exported by `allattn-pipe export --format hf` from {checkpoint}. Loads without allattn-pipe
(`trust_remote_code=True`: the model and tokenizer are the .py files of this folder):

```python
from transformers import pipeline
generate = pipeline("text-generation", model="DIR", trust_remote_code=True)
print(generate("Some text", max_new_tokens=100, do_sample=False)[0]["generated_text"])
```

or, step by step:

```python
from transformers import AutoModelForCausalLM, AutoTokenizer
tokenizer = AutoTokenizer.from_pretrained("DIR", trust_remote_code=True)
model = AutoModelForCausalLM.from_pretrained("DIR", trust_remote_code=True)
ids = tokenizer("Some text", return_tensors="pt").input_ids
print(tokenizer.decode(model.generate(ids, max_new_tokens=100, do_sample=False)[0]))
```

- config.json, {CONFIG_PY}, {MODELING_PY}: the transformers config and model; the other
  .py files are the model's code, copied from allattn-pipe.
- model.safetensors: the weights.
- {TOKENIZER_CONFIG}, {TOKENIZER_PY}, {files}: the tokenizer, the {vocab["kind"]}
  vocabulary the model was trained on. {unknown} Encoding adds no special
  token, and generation runs to max_new_tokens (config.json names no end of sequence).

The model reads a sequence in blocks of {{block_len}} tokens (config.json), each carrying the
memory of the one before. `generate` keeps that memory as its cache (no padding, batches of
prompts of one length): each new token costs one position, whatever the prompt's length, and
greedy decoding gives what `allattn-pipe sample --temperature 0` gives. (On one CPU thread,
a 1.9M-parameter model of 6 layers: 60 new tokens in 1.5 s after a 128-token prompt, 3.0 s
after 4,096, 16-25 ms a token either way, as `sample`; `use_cache=False` reads the whole
sequence again for each token: 5.7 s after 128, 14.3 s after 512.)
"""


def harness_readme(config: dict, vocab: dict) -> str:
    """The README's section on evaluation harnesses: the tokens and the window they read."""
    _, why = separator(vocab)
    window = (
        f"{config['n_ctx']:,} tokens, the larger of 2,048 and {HARNESS_SPANS} attention spans "
        f"of {config['model']['max_span']:,}"
    )
    return f"""
## lm-evaluation-harness

`lm_eval --model hf --model_args pretrained=DIR,trust_remote_code=True` needs no other model
argument; its `loglikelihood_rolling` tasks give bits per byte.

- The token a harness reads a document's first token after: tokenizer_config.json declares
  one as the BOS, EOS and pad token,
  {why}.
  It is text like any other token: encoding adds it nowhere, decoding keeps it (with
  skip_special_tokens too), and the harness's generation tasks stop at it.
- The harness's window: config.json's n_ctx,
  {window}.
  The model reads a sequence of any length in blocks, but the harness starts each window
  with an empty memory, so the tokens at a window's start see less than in training. Its
  bits per byte on a split differ from `allattn-pipe evaluate`'s by that: evaluate starts
  from an empty memory only at the start of each of its evaluate.batch_size streams (and
  does not score the split's first token, which the harness scores after the declared one).
"""


def write_hf_files(tmp: Path, spec, model, vocab: dict, vocab_size: int, checkpoint: str):
    """Write the Hugging Face folder's files into `tmp` (weights, config, code, vocabulary,
    README); returns the file names written."""
    from safetensors.torch import save_file

    module, model_class, config_module, config_class = HF_FAMILIES[spec.model_kind]
    config = hf_config(spec, vocab_size, checkpoint)
    # every tensor its own copy under the wrapper's prefix: transformers loads each name
    weights = {f"model.{k}": v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    code = family_sources(module)
    code[CONFIG_PY] = CONFIGURATION_TEMPLATE.format(model_type=MODEL_TYPE)
    code[MODELING_PY] = MODELING_TEMPLATE.format(
        config_module=CONFIG_PY[:-3],
        module=flat_name(module),
        model_class=model_class,
        config_file=flat_name(config_module),
        config_class=config_class,
    )
    for name, text in code.items():
        (tmp / name).write_text(text)
    if stray := [name for name, text in code.items() if imports_pipeline(text)]:
        raise PipelineError(f"export --format hf: {stray[0]} still imports pipeline")
    (tmp / "vocab.json").write_text(json.dumps(vocab, indent=1) + "\n")
    write_tokenizer_files(tmp, vocab)  # tokenizer.model, for sentencepiece, is export's to copy
    (tmp / README).write_text(
        readme(spec, vocab, checkpoint).replace("{block_len}", str(config["block_len"]))
        + harness_readme(config, vocab)
        + scores_section(spec, checkpoint)
    )
    return hf_file_names(spec)


def scores_section(spec, checkpoint: str) -> str:
    """The model card's scores: evaluate's lines when its results are of these very weights
    (bound by content, pipeline.workspace.scores); when they are of other weights, the word
    stale and what to re-run, never their numbers."""
    from pipeline.workspace.scores import rerun, scores_of
    from stages.evaluate import result_lines

    found = scores_of(spec, Path(checkpoint))
    if found.results is not None:
        lines = "\n".join(result_lines(found.results))
        return (
            f"\n## Scores\n\nallattn-pipe's evaluate scored these weights:\n\n```\n{lines}\n```\n"
        )
    if found.stale:
        return (
            f"\n## Scores\n\nstale: {found.problem}, so none are given here; "
            f"{rerun(spec)} and export again.\n"
        )
    return f"\n## Scores\n\nNone for these weights: {found.problem}.\n"


def hf_file_names(spec) -> list[str]:
    """The names of the files `write_hf_files` writes for `spec`'s model."""
    code = family_sources(HF_FAMILIES[spec.model_kind][0])
    return [
        "model.safetensors",
        "config.json",
        "vocab.json",
        README,
        CONFIG_PY,
        MODELING_PY,
        *tokenizer_file_names(),
        *code,
    ]
