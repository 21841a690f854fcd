"""`make gpu-check` on a machine without a GPU: one line saying so, then the dry run of the same
script (the nan part at a tiny shape, the CUDA tests collected, the benches and the pipeline
started with --dry-run, the authors' code imported from --reference-code), exit 0, for the
essentials, then for the rest by the second call its report prints; the essentials' budgets
fit one call; the models, ops and benches it runs import without deepspeed, mlflow or
webdataset, as on the GPU machine; its report keeps a failing test's traceback and FAILED
line and nothing of a log flood; and `make gpu-wheels DRY_RUN=1` resolves the wheels for the
GPU's Python (pip's metadata only: no wheel is downloaded, deepspeed is not built)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[3]

AUTHORS_FILES = (
    "models.py",
    "trainer.py",
    "adagrad_with_grad_clip.py",
    "adaptive_span.py",
    "persistent_memory.py",
)


def fake_reference_checkout(folder: Path) -> Path:
    """Stand-in for a user's checkout of the authors' code: the files the benches import
    (the dry run imports them and builds nothing)."""
    folder.mkdir()
    for name in AUTHORS_FILES:
        (folder / name).write_text("# stand-in\n")
    return folder


def make_gpu_check(*args: str) -> str:
    """`make -s gpu-check ARGS...` here (a dry run); its report."""
    done = subprocess.run(
        ["make", "-s", "gpu-check", f"PYTHON={sys.executable}", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "MAKEFLAGS": ""},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("gpu-check: no CUDA GPU here (torch ")
    assert lines[0].endswith("); dry run only")
    return (ROOT / "gpu-check.md").read_text()


def titles(report: str) -> list[str]:
    return [line.split(" (")[0] for line in report.splitlines() if line.startswith("## ")]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the dry run is the no-GPU mode")
def test_make_gpu_check_without_a_gpu_is_a_dry_run_of_the_essentials_then_the_second_call(
    tmp_path,
):
    reference = fake_reference_checkout(tmp_path / "adaptive-span")
    report = make_gpu_check(f"REFERENCE={reference}")
    assert titles(report) == [
        "## nan: what stops triton + bf16 + CUDA graphs on a non-finite update",
        "## CUDA tests",
        "## learning check: triton + bf16 + CUDA graphs against the reference in float32, 300 "
        "updates of enwik8_small's model",
        "## training step, configs/enwik8_large.yaml bf16, attention triton, eager vs the "
        "authors' code",
        "## the op alone: bench/attention.py, triton against the reference, bf16, dropout 0.4, N "
        "2048",
    ]
    nan = report.split("(gpu/nan_check.py) (--dry-run): ok\n\n")[1].split("\n## ")[0]
    assert nan.rstrip().splitlines()[-1].startswith("cause: ")  # (a)-(c) ran in the interpreter
    assert "## CUDA tests (collected): ok" in report
    collected = report.split("## CUDA tests (collected): ok\n\n")[1].split()[0]
    assert int(collected.split("/")[0]) >= 6  # the cuda-marked tests exist
    step = report.split(
        "## training step, configs/enwik8_large.yaml bf16, attention triton, eager vs the "
        "authors' code (fp32) (--dry-run): ok\n\n"
    )[1]
    assert step.startswith("dry run: enwik8_large: micro-batch 4, max x 512, spans 0.0625,1, bf16")
    assert f"the authors' code from {reference} (fp32)" in step.splitlines()[0]
    learning = report.split("## learning check: ")[1]
    assert learning.split("\n")[0].endswith("(--dry-run): ok")
    assert "model.attention.impl=triton" in learning and "train.compile=graphs" in learning
    assert "N 2048 (--help): ok" in report
    assert report.rstrip().endswith(
        "all parts passed\n\nsecond call, for the parts this one did not run: make gpu-check "
        f"PARTS=graphs,pipeline,fused-tests,flex,reference REFERENCE={reference}"
    )

    second = report.rstrip().splitlines()[-1].split("make gpu-check ")[1].split()
    report = make_gpu_check(*second)
    assert titles(report) == [
        "## training step, configs/enwik8_large.yaml bf16, attention triton, layers in CUDA graphs",
        "## pipeline: allattn-pipe run, 50 steps, enwik8_large's model bf16, attention triton, "
        "CUDA graphs",
        "## CUDA tests of flex",
        "## the op alone: bench/attention.py, flex against the reference, bf16, dropout 0.4, N "
        "2048",
        "## training step, configs/enwik8_large.yaml bf16, the reference op, eager",
    ]
    fused = report.split("(tests/unit/ops/test_attention_fused.py) (collected): ok\n\n")[1]
    assert int(fused.split("/")[0]) >= 2  # flex's cuda-marked tests, not in the first call
    graphs = report.split(
        "## training step, configs/enwik8_large.yaml bf16, attention triton, layers in CUDA "
        "graphs (train.compile: graphs) (--dry-run): ok\n\n"
    )[1]
    assert graphs.startswith("dry run: enwik8_large: micro-batch 4 x 512, spans 0.0625,1, bf16")
    pipeline = report.split(
        "## pipeline: allattn-pipe run, 50 steps, enwik8_large's model bf16, attention triton, "
        "CUDA graphs (--dry-run): ok\n\n"
    )[1]
    assert [line.split()[0] for line in pipeline.splitlines()[1:4]] == [
        "download",
        "preprocess",
        "train",
    ]
    reference_step = report.split(
        "## training step, configs/enwik8_large.yaml bf16, the reference op, eager (the path "
        "these replace) (--dry-run): ok\n\n"
    )[1]
    assert reference_step.startswith("dry run: enwik8_large: micro-batch 4 x 512")
    assert report.rstrip().endswith("all parts passed")  # nothing left for a third call


def test_the_essentials_fit_one_call_and_what_is_left_is_the_second_call():
    from gpu.check import BUDGETS, ESSENTIALS, REST, TOTAL_BUDGET, parse_args, second_call

    assert sum(BUDGETS[k] for k in ESSENTIALS) <= TOTAL_BUDGET
    assert list(BUDGETS) == [*ESSENTIALS, *REST]  # the essentials run first
    args = parse_args(["--wheels", "gpu-wheels"])
    assert args.chosen == list(ESSENTIALS)
    assert second_call(args, ["attention"]) == (
        "second call, for the parts this one did not run: make gpu-check "
        "PARTS=attention,graphs,pipeline,fused-tests,flex,reference WHEELS=gpu-wheels"
    )
    assert second_call(parse_args(["--parts", "graphs,pipeline"]), []) == ""
    assert second_call(parse_args(["--parts", "graphs,pipeline"]), ["pipeline"]).endswith(
        "make gpu-check PARTS=pipeline"
    )
    assert parse_args(["--parts", "all"]).chosen == list(BUDGETS)


def test_gpu_check_runs_the_parts_asked_for_and_refuses_an_unknown_one(tmp_path):
    report = tmp_path / "report.md"
    done = subprocess.run(
        [sys.executable, "-m", "gpu.check", "--parts", "attention", "--report", str(report)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert titles(report.read_text()) == [
        "## the op alone: bench/attention.py, triton against the reference, bf16, dropout 0.4, N "
        "2048"
    ]
    done = subprocess.run(
        [sys.executable, "-m", "gpu.check", "--parts", "attention,speed"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2
    assert "--parts: no part speed; parts: install, nan, tests, learning, step" in done.stderr


def test_a_reference_code_folder_without_the_authors_files_stops_the_dry_run(tmp_path):
    (tmp_path / "models.py").write_text("")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.train_step",
            "configs/enwik8_large.yaml",
            "--reference-code",
            str(tmp_path),
            "--dry-run",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode != 0
    assert (
        f"{tmp_path} is not a checkout of the authors' adaptive-span code: no "
        "trainer.py, adagrad_with_grad_clip.py"
    ) in done.stderr


def test_the_report_keeps_a_failure_and_drops_a_log_flood():
    from gpu.check import pytest_digest

    flood = "\n".join(
        f"V1126 12:00:00 inductor.py:1] [__graph_code] line {i}" for i in range(20000)
    )
    out = f"""\
.F.                                                                      [100%]
=================================== FAILURES ===================================
_____________________ test_bf16_span_mask_on_cuda_equals_float32 _____________________
tests/system/cluster/test_cuda.py:42: in test_bf16_span_mask_on_cuda_equals_float32
{flood}
    assert inside == expected
E   assert [31, 31, 31] == [32, 32, 32]
=========================== short test summary info ============================
FAILED tests/system/cluster/test_cuda.py::test_bf16_span_mask_on_cuda_equals_float32 - assert [31, 31, 31] == [32, 32, 32]
1 failed, 2 passed in 12.00s
"""  # noqa: E501  (pytest's summary line is one line)
    digest = pytest_digest(out)
    assert digest.startswith("1 failed, 2 passed in 12.00s")
    assert (
        "FAILED tests/system/cluster/test_cuda.py::test_bf16_span_mask_on_cuda_equals_float32 - "
        "assert [31, 31, 31] == [32, 32, 32]"
    ) in digest
    assert "E   assert [31, 31, 31] == [32, 32, 32]" in digest  # the traceback's end
    assert "test_bf16_span_mask_on_cuda_equals_float32 ___" in digest  # and which test
    assert len(digest) < 9000
    assert pytest_digest("5 passed in 3.00s\n") == "5 passed in 3.00s"


def test_only_the_wheels_of_missing_packages_are_installed(tmp_path):
    from gpu.check import missing_wheels

    for name in (
        "torch-2.11.0-cp312-cp312-manylinux_2_28_x86_64.whl",
        "PyYAML-6.0.2-cp312-cp312-manylinux_2_17_x86_64.whl",
        "no_such_package_here-1.0-py3-none-any.whl",
    ):
        (tmp_path / name).write_bytes(b"")
    assert [w.name for w in missing_wheels(tmp_path)] == [
        "no_such_package_here-1.0-py3-none-any.whl"
    ]


def test_make_gpu_wheels_dry_run_resolves_what_the_image_lacks(tmp_path):
    from gpu.wheels import MUST_CARRY, in_image

    dest = tmp_path / "wheels"
    done = subprocess.run(
        ["make", "-s", "gpu-wheels", "DRY_RUN=1", f"GPU_WHEELS={dest}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "MAKEFLAGS": ""},
    )
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    rows = [
        line.split("|")[1:4]
        for line in done.stdout.splitlines()
        if line.startswith("| ") and not line.startswith("| wheel ")
    ]
    names = {name.strip() for name, _, _ in rows}
    assert set(MUST_CARRY) <= names
    assert "mlflow" not in names and "pytest" in names
    assert not [n for n in names if in_image(n)]  # nothing the image has
    built = [r for r in rows if r[0].strip() == "deepspeed"]
    assert built and built[0][2].strip() == "built here"
    for name, _version, source in rows:  # every other one a wheel for 3.12
        if name.strip() != "deepspeed":
            assert source.strip().endswith(".whl")
            assert (
                "-py3-" in source or "-py2.py3-" in source or "cp312" in source or "abi3" in source
            ), source
    assert f"into {dest}" in done.stdout and not dest.exists()  # nothing fetched or built


def test_models_ops_and_benches_import_without_deepspeed_mlflow_webdataset():
    blocked = "; ".join(f"sys.modules[{m!r}] = None" for m in ("deepspeed", "mlflow", "webdataset"))
    code = (
        f"import sys; {blocked}; "
        "import pipeline.models, pipeline.ops, pipeline.training.optim, pipeline.spec, "
        "pipeline.commands.report, pipeline.cluster.device, pipeline.cluster.distributed; "
        "import runpy; sys.argv = ['train_step.py', 'configs/quickstart.yaml', "
        "'--steps', '1', '--warmup', '0', '--batch', '2']; "
        "runpy.run_module('bench.train_step', run_name='__main__')"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "| span frac |" in done.stdout
