"""The example plugin of docs/extending.md (tests/system/plugins/example_plugin), installed with a
real, offline `pip install` into a temporary virtual environment layered over this one: a
spec using its model kind and its stage runs there like a built-in one, `validate`, `show`
and the reference know it. A broken plugin and a clashing one, installed the same way, are
one line naming their distribution. (tests/unit/plugins/test_registry.py: the same refusals on
faked entry points, in-process.)
"""

from __future__ import annotations

import json
import os
import re
import shutil
import site
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
HERE = Path(__file__).resolve().parent
EXAMPLE = HERE / "example_plugin"
SPEC = HERE / "example.yaml"


# ---------------------------------------------------------------- a real installed plugin


class PluginEnv:
    """A virtual environment whose site-packages come first, this one's (torch, the project,
    pip, setuptools) after it: what is installed there is seen by that interpreter alone."""

    def __init__(self, root: Path):
        self.root = root
        venv.create(root / "env", with_pip=False)
        self.python = root / "env" / "bin" / "python"
        purelib = subprocess.run(
            [self.python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        # addsitedir, not a bare path: this environment's own .pth files (the project's
        # editable install) must be read too
        parents = [p for p in site.getsitepackages() if Path(p).is_dir()]
        Path(purelib, "parent_env.pth").write_text(
            "".join(f"import site; site.addsitedir({p!r})\n" for p in parents)
        )

    def pip(self, *args: str) -> None:
        subprocess.run(
            [self.python, "-m", "pip", "--disable-pip-version-check", *args],
            check=True,
            capture_output=True,
            text=True,
            timeout=300,
        )

    def install(self, folder: Path) -> None:
        """pip install a copy of `folder` (a build writes into its source tree), offline."""
        copy = self.root / "src" / folder.name
        shutil.copytree(folder, copy, ignore=shutil.ignore_patterns("build", "*.egg-info"))
        self.pip("install", "--no-index", "--no-deps", "--no-build-isolation", str(copy))

    def run(self, *args, module: str = "pipeline.commands.cli") -> subprocess.CompletedProcess:
        # DeepSpeed's C++ ops built once for this environment, not again for every new one
        extensions = os.environ.get(
            "TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions")
        )
        env = dict(os.environ, DS_ACCELERATOR="cpu", TORCH_EXTENSIONS_DIR=extensions)
        return subprocess.run(
            [self.python, "-m", module, *map(str, args)],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )


def package(
    root: Path, dist: str, entry_points: dict[str, dict[str, str]], modules: dict[str, str]
) -> Path:
    """A one-module distribution folder: pyproject.toml with these entry points."""
    folder = root / dist
    folder.mkdir(parents=True)
    tables = "".join(
        f'\n[project.entry-points."{group}"]\n'
        + "".join(f'{name} = "{value}"\n' for name, value in names.items())
        for group, names in entry_points.items()
    )
    (folder / "pyproject.toml").write_text(
        f'[build-system]\nrequires = ["setuptools>=61"]\nbuild-backend = '
        f'"setuptools.build_meta"\n\n[project]\nname = "{dist}"\nversion = "0.1"\n'
        f"[tool.setuptools]\npy-modules = {json.dumps(list(modules))}\n{tables}"
    )
    for name, text in modules.items():
        (folder / f"{name}.py").write_text(text)
    return folder


@pytest.fixture(scope="module")
def plugin_env(tmp_path_factory):
    env = PluginEnv(tmp_path_factory.mktemp("plugin_env"))
    env.install(EXAMPLE)
    return env


def test_the_example_plugin_runs_like_a_builtin(plugin_env, tmp_path):
    root = tmp_path / "runs"
    result = plugin_env.run(
        "run", SPEC, "--set", f"workspace.root={root}", "--set", "tracking.enabled=false"
    )
    assert result.returncode == 0, result.stdout + result.stderr
    ran = [line.split("]")[0][1:] for line in result.stdout.splitlines() if "] running:" in line]
    assert ran == ["download", "preprocess", "corpus_stats", "train", "evaluate"]
    stats = json.loads((root / "tiny_gru" / "corpus_stats" / "stats.json").read_text())
    manifest = json.loads((root / "tiny_gru" / "preprocess" / "manifest.json").read_text())
    assert stats["vocab_size"] == manifest["vocab_size"]
    assert stats["train_tokens"] == manifest["splits"]["train"]["tokens"] > 0

    # `show` counts the plugin's parameters: embedding, GRU (3 gates), output layer
    shown = plugin_env.run("show", SPEC, "--set", f"workspace.root={root}")
    assert shown.returncode == 0, shown.stderr
    vocab, d = manifest["vocab_size"], 32
    expected = vocab * d + 3 * (2 * d * d + 2 * d) + d * vocab + vocab
    assert f"parameters: {expected:,} " in shown.stdout


def test_a_plugins_config_is_validated_with_file_and_line(plugin_env, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(f"extends: [{SPEC}]\nmodel:\n  d_modle: 16\n")
    result = plugin_env.run("validate", bad)
    assert result.returncode == 2
    assert result.stderr.strip() == (
        f"error: {bad}:3: model.d_modle: unknown key 'd_modle' (did you mean 'd_model'?)"
    )
    bad.write_text(f"extends: [{SPEC}]\nmodel:\n  dropout: 1.5\n")
    result = plugin_env.run("validate", bad)
    assert result.returncode == 2
    assert re.fullmatch(
        rf"error: {re.escape(str(bad))}:\d: model: dropout must be in "
        rf"\[0, 1\), got 1.5",
        result.stderr.strip(),
    ), result.stderr
    bad.write_text(f"extends: [{SPEC}]\nstages: [download, preprocess, corpus_stat]\n")
    result = plugin_env.run("validate", bad)
    assert result.stderr.strip().startswith(
        f"error: {bad}:2: stages.2: unknown stage kind 'corpus_stat' (did you mean "
        f"'corpus_stats'?); known: curriculum, download, preprocess, corpus_stats, train, "
        f"finetune, evaluate"
    ), result.stderr


def test_the_reference_documents_a_plugin_where_it_is_installed(plugin_env):
    result = plugin_env.run(module="pipeline.spec.reference")
    assert result.returncode == 0, result.stderr
    page = result.stdout
    assert (
        "`tiny_gru` (TinyGRUConfig, from the installed distribution "
        "`allattn-example-plugin`)" in page
    )
    assert '<a id="model.d_model@tiny_gru"></a>`model.d_model` (kind `tiny_gru`)' in page
    assert "Width of the embedding and of the GRU's hidden state." in page
    assert (
        "- `corpus_stats` (from the installed distribution `allattn-example-plugin`): "
        "Count the preprocessed corpus's tokens per split. Comes after `preprocess`." in page
    )


def _validate_with(plugin_env, package_dir, dist):
    """`validate SPEC` with the package at `package_dir` installed, uninstalled after."""
    plugin_env.install(package_dir)
    try:
        return plugin_env.run("validate", SPEC)
    finally:
        plugin_env.pip("uninstall", "--yes", dist)


def test_a_broken_or_clashing_installed_plugin_is_one_line(plugin_env, tmp_path):
    broken = package(
        tmp_path,
        "broken-plugin",
        {"allattn_pipe.models": {"broken": "broken_mod:FAMILY"}},
        {"broken_mod": "import no_such_module_here\n"},
    )
    result = _validate_with(plugin_env, broken, "broken-plugin")
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "error: model kind 'broken' of the distribution 'broken-plugin' (broken_mod:FAMILY) "
        "failed to load: ModuleNotFoundError: No module named 'no_such_module_here'"
    )

    clash = package(
        tmp_path,
        "clash-plugin",
        {"allattn_pipe.stages": {"train": "clash_mod:STAGE"}},
        {"clash_mod": "STAGE = None\n"},
    )
    result = _validate_with(plugin_env, clash, "clash-plugin")
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "error: stage kind 'train' of the distribution 'clash-plugin' (clash_mod:STAGE): the "
        "name is taken by the distribution 'allattn-pipe'; rename one of them in its "
        '[project.entry-points."allattn_pipe.stages"] table'
    )


def test_the_example_plugin_is_documented_as_tested():
    """docs/extending.md quotes the example package's files whole, as they are tested."""
    page = (ROOT / "docs" / "extending.md").read_text()
    for path in [
        SPEC,
        EXAMPLE / "pyproject.toml",
        *sorted((EXAMPLE / "src" / "allattn_example").glob("[!_]*.py")),
    ]:
        assert path.read_text().strip() in page, f"{path.name} differs from docs/extending.md"
