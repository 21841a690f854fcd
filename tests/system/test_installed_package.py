"""The package as a cluster user has it (issue 52 item 2): the wheel built from this checkout,
installed into a fresh virtual environment where the checkout cannot be imported, and run from
an empty directory. It knows its dataset cards and paper configs by name, writes one out to
edit, renders a Slurm script, and starts a two-process run, with no file of the checkout.

The wheel is built offline with this environment's setuptools (`pip wheel --no-build-isolation
--no-index`) from a copy of the checkout (a build writes into its source tree). The new
environment gets its dependencies from this one's site-packages through a path in a .pth file,
without this project's editable finder: `import pipeline` there is the wheel's, which the
first test checks.

Cost: about a minute of CPU on 2 cores (57 s measured; 173 s of wall time at a load average of
11 on 2 cores): the wheel, the environment, a smoke run and a two-process run. DeepSpeed's CPU
comm op is this environment's (its TORCH_EXTENSIONS_DIR, built with its ninja, the sources
at the same paths), so it is built at most once, by whichever test of several processes runs
first (~4 min).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# what the build reads: pyproject.toml's metadata, setup.py's copy of the project's files
SOURCES = ["pyproject.toml", "setup.py", "MANIFEST.in", "README.md", "pipeline", "stages"]
SOURCES += ["configs", "datasets", "launch"]


class Installed:
    """A virtual environment holding the wheel, over this environment's dependencies."""

    def __init__(self, root: Path):
        self.root = root
        wheel = self._build(root)
        venv.create(root / "env", with_pip=False)
        self.bin = root / "env" / "bin"
        self.python = self.bin / "python"
        # this environment's pip installing into the new one, before anything of this
        # environment is visible there (pip would see this project's install as installed)
        done = subprocess.run(
            [sys.executable, "-m", "pip", "--python", self.python, "install", "--no-deps"]
            + ["--no-index", "--disable-pip-version-check", "-q", wheel],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        self.purelib = Path(self._ask("import sysconfig; print(sysconfig.get_paths()['purelib'])"))
        # The dependencies: this environment's site-packages as a bare path, after the new
        # one's. Its .pth files are not read, so this project's editable finder is not
        # installed (the checkout cannot be imported); its metadata comes second to the
        # wheel's (importlib.metadata takes the first of a name). The real path, not links to
        # it: DeepSpeed rebuilds its C++ op whenever the include paths it was built with change.
        (self.purelib / "dependencies.pth").write_text(f"{sysconfig.get_paths()['purelib']}\n")
        # and the dependencies' console script that builds DeepSpeed's op: an environment with
        # them installed has it in its bin/, and another ninja (the system's) rebuilds the op
        ninja = Path(sys.executable).parent / "ninja"
        if ninja.exists():
            (self.bin / "ninja").symlink_to(ninja)

    @staticmethod
    def _build(root: Path) -> Path:
        source = root / "source"
        source.mkdir()
        for name in SOURCES:
            if (ROOT / name).is_dir():
                ignore = shutil.ignore_patterns("__pycache__")
                shutil.copytree(ROOT / name, source / name, ignore=ignore)
            else:
                shutil.copy2(ROOT / name, source / name)
        done = subprocess.run(
            [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation"]
            + ["--no-index", "-q", "-w", str(root / "wheel"), str(source)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        (wheel,) = (root / "wheel").glob("allattn_pipe-*.whl")
        return wheel

    def _ask(self, code: str) -> str:
        done = subprocess.run([self.python, "-c", code], capture_output=True, text=True, check=True)
        return done.stdout.strip()

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        # DeepSpeed's C++ ops built once for this environment, not again for the new one
        extensions = os.environ.get(
            "TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions")
        )
        env.update(
            PATH=f"{self.bin}{os.pathsep}{env['PATH']}",
            DS_ACCELERATOR="cpu",
            TORCH_EXTENSIONS_DIR=extensions,
        )
        return env

    def run(self, where: Path, *args: str, timeout: int = 420) -> subprocess.CompletedProcess:
        """`allattn-pipe ARGS` in `where`, as a user types it."""
        return subprocess.run(
            [self.bin / "allattn-pipe", *args],
            cwd=where,
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=timeout,
        )


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Installed:
    return Installed(tmp_path_factory.mktemp("installed"))


@pytest.fixture
def empty(tmp_path) -> Path:
    """A scratch directory with nothing of the checkout in it."""
    here = tmp_path / "scratch"
    here.mkdir()
    return here


def test_the_wheel_is_what_runs_and_it_carries_the_projects_files(installed, empty):
    code = (
        "import sys, importlib.metadata as m, pipeline, stages\n"
        "print(pipeline.__file__, stages.__file__, m.distribution('allattn-pipe')._path)\n"
        "print([type(f).__name__ for f in sys.meta_path if 'ditable' in type(f).__name__])"
    )
    done = subprocess.run(
        [installed.python, "-c", code],
        cwd=empty,
        env=installed.env(),
        capture_output=True,
        text=True,
        check=True,
    )
    assert done.stdout.splitlines() == [
        f"{installed.purelib / 'pipeline' / '__init__.py'} "
        f"{installed.purelib / 'stages' / '__init__.py'} "
        f"{installed.purelib / 'allattn_pipe-0.1.0.dist-info'}",
        "[]",  # no editable install's finder: nothing of the checkout can be imported
    ]
    shipped = installed.purelib / "pipeline" / "_project"
    assert sorted(p.name for p in (shipped / "datasets").iterdir()) == sorted(
        p.name for p in (ROOT / "datasets").glob("*.yaml")
    )
    ours = sorted(p.relative_to(ROOT / "configs") for p in (ROOT / "configs").rglob("*.yaml"))
    assert (
        sorted(p.relative_to(shipped / "configs") for p in shipped.rglob("configs/**/*.yaml"))
        == ours
    )
    assert (shipped / "launch" / "slurm.sbatch").read_text() == (
        ROOT / "launch" / "slurm.sbatch"
    ).read_text()
    # nothing at the top of site-packages but the two packages (a `datasets` there would
    # shadow Hugging Face's)
    top = {p.name for p in installed.purelib.iterdir()} - {"dependencies.pth", "_virtualenv.pth"}
    assert {t for t in top if not t.endswith(".dist-info") and t != "__pycache__"} == {
        "pipeline",
        "stages",
    }


def test_a_users_config_names_a_card_of_the_package(installed, empty):
    """The reported failure: "dataset: no dataset card named 'python_docs'; known cards:
    none" from a config in a directory of the user's own."""
    (empty / "my.yaml").write_text(
        "name: mine\ndataset: python_docs\nmodel: {kind: allattn, d_model: 16, n_layers: 1,\n"
        "  n_heads: 2, n_persistent: 4, max_span: 16}\ntrain: {steps: 1, batch_size: 2, "
        "seq_len: 8}\nstages: [download, preprocess, train]\n"
    )
    done = installed.run(empty, "validate", "my.yaml")
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert done.stdout == "my.yaml: valid (mine: download, preprocess, train)\n"


def test_a_paper_config_runs_by_name_from_an_empty_directory(installed, empty):
    listed = installed.run(empty, "list")
    assert listed.returncode == 0, listed.stderr
    assert "  python_docs " in listed.stdout and "  enwik8_small " in listed.stdout
    # enwik8_small extends base/char_small.yaml and base/char.yaml and names the card enwik8,
    # all inside the package; --smoke puts the built-in corpus in place of the download
    done = installed.run(empty, "run", "enwik8_small", "--smoke", "--set", "tracking.enabled=false")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads(
        (empty / "runs" / "enwik8_small-smoke" / "evaluate" / "results.json").read_text()
    )
    assert results["test"]["bpc"] > 0
    assert sorted(p.name for p in empty.iterdir()) == ["runs"]


def test_a_copied_config_runs_on_two_processes(installed, empty):
    copied = installed.run(empty, "copy", "quickstart", "mine.yaml")
    assert copied.returncode == 0, copied.stderr
    assert copied.stdout == "wrote mine.yaml; run it with: allattn-pipe run mine.yaml\n"
    done = installed.run(
        empty,
        "run",
        "mine.yaml",
        "--smoke",
        "--set",
        "train.launcher.procs_per_node=2",
        "--set",
        "tracking.enabled=false",
        "--only",
        "download,preprocess,train",
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-5000:]
    assert "starting 2 processes: " in output
    assert " --module pipeline.commands.launched --config mine.yaml --smoke " in output
    # the ranks train what the run planned: the smoke model's few steps
    assert "4 steps of 4 x 32 tokens on cpu (world size 2)" in output
    assert (empty / "runs" / "quickstart-smoke" / "train" / "stage.json").is_file()


def test_a_slurm_script_from_the_installed_package(installed, empty):
    done = installed.run(
        empty,
        "launch",
        "slurm",
        "enwik8_large",
        "--nodes",
        "2",
        "--gpus-per-node",
        "4",
        "--dry-run",
    )
    assert done.returncode == 0, done.stderr
    config = installed.purelib / "pipeline" / "_project" / "configs" / "enwik8_large.yaml"
    srun = next(line for line in done.stdout.splitlines() if line.startswith("srun "))
    assert srun == (
        f"srun --kill-on-bad-exit=1 {installed.python} -P -m pipeline.commands.launched "
        f"--ranks-from-slurm \\"
    ) or sys.version_info < (3, 11)
    assert f"    --config {config} \\" in done.stdout.splitlines()
