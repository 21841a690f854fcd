"""setuptools' build step, plus the project's files that the package reads at run time.

The dataset cards, the paper configs and the Slurm template have one place, the checkout's
`datasets/`, `configs/` and `launch/`; a wheel carries a copy of them in `pipeline/_project/`,
where `pipeline.resources` finds them. They go in as data under `pipeline`, never as top-level
folders: a top-level `datasets` would shadow Hugging Face's package of that name. An editable
install copies nothing: it reads the checkout's folders. The metadata is pyproject.toml's.
"""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

SHIPPED_AS = Path("pipeline", "_project")  # pipeline.resources.SHIPPED
SHIPPED = {"configs": "**/*.yaml", "datasets": "*.yaml", "launch": "slurm.sbatch"}


class BuildWithProjectFiles(build_py):
    def run(self) -> None:
        super().run()
        if self.editable_mode:
            return
        for folder, pattern in SHIPPED.items():
            files = sorted(Path(folder).glob(pattern))
            if (
                not files
            ):  # an sdist without them (see MANIFEST.in) would build a wheel that knows nothing
                raise SystemExit(f"setup.py: no {folder}/{pattern} to ship in the wheel")
            for source in files:
                target = Path(self.build_lib, SHIPPED_AS, source)
                self.mkpath(str(target.parent))
                self.copy_file(str(source), str(target))


setup(cmdclass={"build_py": BuildWithProjectFiles})
