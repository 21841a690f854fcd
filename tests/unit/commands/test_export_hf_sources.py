"""The files `export --format hf` writes hold together without the package: every relative
import among them names a file of the export and a name defined at its top level. Fast and
in-process, beside the slow test that loads the folder with transformers (a stub that lost a
constant the model imports failed only there, after a half-hour CI run)."""

from __future__ import annotations

import ast

import pytest

from pipeline.commands.hf_export import HF_FAMILIES, STUBS, family_sources, flat_name


def top_level_names(source: str) -> set[str]:
    names = set()
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


@pytest.mark.parametrize("kind", sorted(HF_FAMILIES))
def test_every_relative_import_of_the_export_resolves(kind):
    model_module, model_class, config_module, config_class = HF_FAMILIES[kind]
    files = {**family_sources(model_module), **family_sources(config_module)}
    assert model_class in top_level_names(files[f"{flat_name(model_module)}.py"])
    assert config_class in top_level_names(files[f"{flat_name(config_module)}.py"])
    for name, source in files.items():
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ImportFrom) and node.level:
                target = f"{node.module}.py"
                assert target in files, f"{name} imports .{node.module}, not in the export"
                missing = {a.name for a in node.names} - top_level_names(files[target])
                assert not missing, f"{name} imports {sorted(missing)} from {target}"


def test_a_stub_carries_the_constants_it_names_with_the_module_s_values():
    import importlib

    for module, (_, constants) in STUBS.items():
        stub = family_sources(module)[f"{flat_name(module)}.py"]
        namespace: dict = {}
        exec(compile(stub, module, "exec"), namespace)  # the stub is our own text
        real = importlib.import_module(module)
        for constant in constants:
            assert namespace[constant] == getattr(real, constant)


def test_the_remote_code_templates_are_python_that_imports_no_pipeline():
    """The tokenizer and the model written into the folder parse, import nothing of this
    package, and are named where transformers looks for them (auto_map)."""
    from pipeline.commands.hf_export import CONFIG_PY, MODELING_PY, imports_pipeline
    from pipeline.commands.hf_modeling import CONFIGURATION_TEMPLATE, MODELING_TEMPLATE
    from pipeline.commands.hf_tokenizer import (
        TOKENIZER_CLASS,
        TOKENIZER_PY,
        TOKENIZER_SOURCE,
        tokenizer_config,
    )

    fields = dict(config_module=CONFIG_PY[:-3], module="m", model_class="M", config_file="c")
    sources = {
        CONFIG_PY: CONFIGURATION_TEMPLATE.format(model_type="t"),
        MODELING_PY: MODELING_TEMPLATE.format(**fields, config_class="C"),
        TOKENIZER_PY: TOKENIZER_SOURCE,
    }
    for name, source in sources.items():
        assert not imports_pipeline(source), name
    assert TOKENIZER_CLASS in top_level_names(TOKENIZER_SOURCE)
    auto_map = tokenizer_config({"kind": "byte", "symbols": [10]})["auto_map"]
    module, cls = auto_map["AutoTokenizer"][0].split(".")
    assert (f"{module}.py", cls) == (TOKENIZER_PY, TOKENIZER_CLASS)
    # generate's cache: the model's own, passed back by prepare_inputs_for_generation
    assert {"AllAttnPipeCache", "AllAttnPipeForCausalLM"} <= top_level_names(sources[MODELING_PY])
