"""The wheels a GPU machine without network needs to run `make gpu-check` (`make gpu-wheels`).

    python -m gpu.wheels [--dest gpu-wheels] [--max-mb 60] [--dry-run]

The GPU image (README of the device machine; a typical rented CUDA image) has CUDA torch,
click, pyyaml, numpy, sentencepiece, psutil, matplotlib and safetensors, and what they
depend on (IMAGE below). This downloads, for its Python (3.12, manylinux x86_64, CPython),
the closure of pyproject.toml's runtime dependencies minus IMAGE:

- deepspeed has no wheel on PyPI: it is built here into a pure-Python wheel with
  DS_BUILD_OPS=0 (no CUDA needed; the ops it would JIT-compile are not used by the pipeline's
  single-GPU step), at the version installed in .venv (the one the tests ran with);
- mlflow is replaced by mlflow-skinny of the same version plus SQLAlchemy and Alembic, what
  the pipeline's embedded sqlite tracking store needs; the full package's server, UI and
  data-science stack (pandas, pyarrow, scipy, scikit-learn, Flask, ...) would be over 100 MB
  and nothing the GPU check runs uses them (tests/integration/tracking runs the server, here only).

The closure is resolved by pip itself for the target platform (`pip install --dry-run
--report`: metadata only), then every package not in IMAGE is fetched with
`pip download --no-deps --only-binary=:all:`. It prints the table of wheels and the total,
and exits 1 if the folder is over --max-mb.

--dry-run resolves and prints what it would fetch (names, versions, where from) without
downloading a wheel or building deepspeed (deepspeed's own requirements then come from the
installed one's metadata). A test runs it.

On the GPU machine: `make gpu-check WHEELS=gpu-wheels` installs them with
`pip install --no-index --no-deps` before the check.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent

PYTHON_VERSION = "3.12"
PLATFORMS = (
    "manylinux2014_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_24_x86_64",
    "manylinux1_x86_64",
)

# What the GPU image already has: the packages the issue names and the packages they
# depend on (torch's CUDA stack, matplotlib's), and pip's own. Names normalised (PEP 503).
IMAGE_TOP = (
    "torch",
    "click",
    "pyyaml",
    "numpy",
    "sentencepiece",
    "psutil",
    "matplotlib",
    "safetensors",
)
IMAGE = frozenset(IMAGE_TOP) | {
    # torch
    "filelock",
    "typing-extensions",
    "sympy",
    "mpmath",
    "networkx",
    "jinja2",
    "markupsafe",
    "fsspec",
    "setuptools",
    "triton",
    "cuda-bindings",
    "cuda-pathfinder",
    "cuda-toolkit",
    # matplotlib
    "contourpy",
    "cycler",
    "fonttools",
    "kiwisolver",
    "packaging",
    "pillow",
    "pyparsing",
    "python-dateutil",
    "six",
    # installers
    "pip",
    "wheel",
}
IMAGE_PREFIXES = ("nvidia-",)  # nvidia-cublas-cu12, nvidia-nccl-cu13, ... (torch's)

# what must be in the folder, whatever the resolver picks: the packages the image lacks
MUST_CARRY = ("deepspeed", "mlflow-skinny", "pydantic", "webdataset")

# the embedded tracking store's needs from the full mlflow package
MLFLOW_STORE = ("sqlalchemy", "alembic")

# what the check itself runs beyond the pipeline: pytest for the CUDA tests (the GPU image
# usually has it; gpu/check.py installs only the wheels whose package is missing)
CHECK_NEEDS = ("pytest>=8",)


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def in_image(name: str) -> bool:
    name = normalise(name)
    return name in IMAGE or name.startswith(IMAGE_PREFIXES)


def requirement_name(req: str) -> str:
    return normalise(re.split(r"[\s<>=!~;\[(]", req.strip(), maxsplit=1)[0])


def installed_version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def runtime_requirements() -> list[str]:
    """pyproject.toml's [project] dependencies, with mlflow swapped for what the store needs."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    out = []
    for req in deps:
        name = requirement_name(req)
        if name == "deepspeed":
            continue  # built separately
        if name == "mlflow":
            version = installed_version("mlflow")
            out.append(
                f"mlflow-skinny=={version}"
                if version
                else req.replace("mlflow", "mlflow-skinny", 1)
            )
            store = {
                requirement_name(r): r.split(";")[0].strip()
                for r in (md.requires("mlflow") or [])
                if version
            }
            out += [store.get(s, s) for s in MLFLOW_STORE]
            continue
        out.append(req)
    return out + list(CHECK_NEEDS)


def deepspeed_requirement() -> str:
    """deepspeed==the version of this environment (the one the tests pass with), else
    pyproject's range (pip picks the newest in it)."""
    version = installed_version("deepspeed")
    if version:
        return f"deepspeed=={version}"
    return next(
        r
        for r in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
        if requirement_name(r) == "deepspeed"
    )


def build_deepspeed(dest: Path) -> Path:
    """A py3-none-any deepspeed wheel, no ops compiled (DS_BUILD_OPS=0), built against this
    interpreter's torch (no build isolation: deepspeed's setup imports torch)."""
    req = deepspeed_requirement()
    existing = sorted(dest.glob("deepspeed-*.whl"))
    if existing and req.startswith("deepspeed==") and f"-{req[11:]}-" in existing[-1].name:
        return existing[-1]  # built by an earlier run
    env = {**os.environ, "DS_BUILD_OPS": "0", "DS_SKIP_CUDA_CHECK": "1"}
    pip(
        [
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--no-binary",
            "deepspeed",
            "-w",
            str(dest),
            req,
        ],
        env=env,
    )
    return sorted(dest.glob("deepspeed-*.whl"))[-1]


def wheel_requirements(wheel: Path) -> list[str]:
    import zipfile

    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode()
    return [
        line.split(":", 1)[1].strip()
        for line in text.splitlines()
        if line.startswith("Requires-Dist:") and "extra ==" not in line
    ]


def pip(args: list[str], env=None, quiet=True) -> str:
    cmd = [sys.executable, "-m", "pip", *args] + (["--quiet"] if quiet else [])
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        noise = "WARNING: Location"
        err = "\n".join(line for line in done.stderr.splitlines() if noise not in line)
        raise SystemExit(f"gpu-wheels: pip {args[0]} failed:\n{err[-4000:]}")
    return done.stdout


def target_args(python_version: str = PYTHON_VERSION) -> list[str]:
    args = ["--only-binary=:all:", "--python-version", python_version, "--implementation", "cp"]
    for p in PLATFORMS:
        args += ["--platform", p]
    return args


def image_stubs(folder: Path) -> list[str]:
    """Stand-ins for the image's packages, so that pip resolves against them instead of
    fetching torch's and its CUDA libraries' metadata (minutes): one empty wheel per IMAGE
    package installed here, at this environment's version with the local label +image (no
    dependencies), and a constraint that only it satisfies. Returns pip's arguments."""
    import zipfile

    folder.mkdir(parents=True, exist_ok=True)
    constraints = []
    for dist in md.distributions():
        name = normalise(dist.metadata["Name"] or "")
        if not name or not in_image(name):
            continue
        version = dist.version.split("+")[0] + "+image"
        stem = f"{name.replace('-', '_')}-{version}"
        with zipfile.ZipFile(folder / f"{stem}-py3-none-any.whl", "w") as z:
            info = f"{stem}.dist-info"
            z.writestr(
                f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
            )
            z.writestr(
                f"{info}/WHEEL",
                "Wheel-Version: 1.0\nGenerator: gpu_wheels\n"
                "Root-Is-Purelib: true\nTag: py3-none-any\n",
            )
            z.writestr(f"{info}/RECORD", "")
        constraints.append(f"{name}=={version}")
    (folder / "constraints.txt").write_text("\n".join(constraints) + "\n")
    return ["--find-links", str(folder), "-c", str(folder / "constraints.txt")]


def resolve(requirements: list[str], target: list[str]) -> list[dict]:
    """pip's resolution for the target platform: [{name, version, url}], metadata only."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        pip(
            [
                "install",
                "--dry-run",
                "--ignore-installed",
                "--target",
                str(Path(tmp) / "t"),
                "--report",
                str(report),
                *target,
                *image_stubs(Path(tmp) / "image"),
                *requirements,
            ]
        )
        items = json.loads(report.read_text())["install"]
    return [
        {
            "name": normalise(i["metadata"]["name"]),
            "version": i["metadata"]["version"],
            "url": i["download_info"]["url"],
        }
        for i in items
    ]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dest", type=Path, default=ROOT / "gpu-wheels")
    parser.add_argument("--max-mb", type=float, default=60.0)
    parser.add_argument(
        "--dry-run", action="store_true", help="resolve and list; download nothing, build nothing"
    )
    parser.add_argument(
        "--python-version",
        default=PYTHON_VERSION,
        help="the GPU machine's Python (default %(default)s)",
    )
    return parser.parse_args(argv)


def deepspeed_wheel(args) -> tuple[str, list[str]]:
    """DeepSpeed's wheel (built here, or on a dry run its requirement) and what it needs."""
    if args.dry_run:
        ds = deepspeed_requirement()
        ds_needs = [
            r.split(";")[0].strip() for r in (md.requires("deepspeed") or []) if "extra ==" not in r
        ]
        print(f"gpu-wheels (dry run): would build {ds} (DS_BUILD_OPS=0, no deps) into {args.dest}")
        return ds, ds_needs
    args.dest.mkdir(parents=True, exist_ok=True)
    wheel = build_deepspeed(args.dest)
    return wheel.name, wheel_requirements(wheel)


def print_plan(ds: str, carry: list[dict], target: list[str], dest: Path) -> None:
    print("| wheel | version | from |\n|---|---|---|")
    print(f"| deepspeed | {ds.removeprefix('deepspeed')} | built here |")
    for r in carry:
        print(f"| {r['name']} | {r['version']} | {r['url'].rsplit('/', 1)[-1]} |")
    print(
        f"\n{len(carry) + 1} wheels; `pip download --no-deps {' '.join(target)} "
        f"-d {dest} NAME==VERSION ...`"
    )


def download(ds: str, carry: list[dict], target: list[str], dest: Path) -> list[Path]:
    """Fetch the planned wheels into ``dest``; the wheels there now."""
    pip(
        [
            "download",
            "--no-deps",
            *target,
            "-d",
            str(dest),
            *[f"{r['name']}=={r['version']}" for r in carry],
        ]
    )
    planned = {(r["name"], r["version"]) for r in carry}
    files = sorted(dest.glob("*.whl"))
    for f in files:  # a wheel an earlier plan fetched: two versions stop an install
        name, version = normalise(f.name.split("-")[0]), f.name.split("-")[1]
        if f.name != ds and (name, version) not in planned:
            f.unlink()
    return [f for f in files if f.exists()]


def check_size(files: list[Path], args) -> int:
    total = sum(f.stat().st_size for f in files)
    print("| wheel | MB |\n|---|---:|")
    for f in sorted(files, key=lambda f: -f.stat().st_size):
        print(f"| {f.name} | {f.stat().st_size / 1e6:.1f} |")
    print(f"\n{len(files)} wheels, {total / 1e6:.1f} MB in {args.dest} (limit {args.max_mb:g} MB)")
    if total > args.max_mb * 1e6:
        print(
            f"gpu-wheels: {total / 1e6:.1f} MB is over the {args.max_mb:g} MB limit",
            file=sys.stderr,
        )
        return 1
    return 0


def main() -> int:
    args = parse_args()
    target = target_args(args.python_version)
    requirements = runtime_requirements()
    ds, ds_needs = deepspeed_wheel(args)
    needs = requirements + [
        r
        for r in ds_needs
        if requirement_name(r) not in {requirement_name(x) for x in requirements}
    ]
    resolved = resolve(needs, target)
    carry = sorted((r for r in resolved if not in_image(r["name"])), key=lambda r: r["name"])
    skipped = sorted(r["name"] for r in resolved if in_image(r["name"]))
    names = {r["name"] for r in carry} | {"deepspeed"}
    missing = [m for m in MUST_CARRY if m not in names]
    if missing:
        print(f"gpu-wheels: the plan lacks {', '.join(missing)}", file=sys.stderr)
        return 1
    print(
        f"target: CPython {args.python_version}, {', '.join(PLATFORMS[:2])}, ...; the image's "
        f"{len(skipped)} packages left out: {', '.join(skipped)}\n"
    )
    if args.dry_run:
        print_plan(ds, carry, target, args.dest)
        return 0
    return check_size(download(ds, carry, target, args.dest), args)


if __name__ == "__main__":
    sys.exit(main())
