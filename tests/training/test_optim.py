"""The paper's optimizer: Adagrad whose step is clipped per parameter tensor."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from pipeline.errors import PipelineError
from pipeline.training.optim import ClippedAdagrad, bind_to_engine

ROOT = Path(__file__).resolve().parents[2]


def test_clipped_adagrad_equals_its_update_rule_in_float64():
    torch.manual_seed(0)
    shapes, scales = [(4, 3), (7,), (2, 2, 2)], [1.0, 1e-3, 0.3]   # ‖g‖ above, below, above
    params = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    ref = [p.detach().double().clone() for p in params]
    acc = [torch.zeros_like(r) for r in ref]
    lr, clip, eps = 0.2, 0.03, 1e-10
    opt = ClippedAdagrad(params, lr=lr, clip_norm=clip, eps=eps)
    clipped = unclipped = 0
    for _ in range(5):
        grads = [torch.randn(s) * c for s, c in zip(shapes, scales)]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
        for i, g in enumerate(grads):
            g = g.double()
            acc[i] += g * g                       # the accumulator takes the unclipped g²
            norm = g.norm().item()
            clipped, unclipped = clipped + (norm > clip), unclipped + (norm <= clip)
            ref[i] -= lr * min(1.0, clip / (norm + 1e-10)) * g / (acc[i].sqrt() + eps)
    assert clipped and unclipped
    for p, r, a in zip(params, ref, acc):
        torch.testing.assert_close(p.detach().double(), r, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(opt.state[p]["sum"].double(), a, rtol=1e-5, atol=0)


def test_a_flattened_parameter_it_was_not_told_about_is_refused():
    opt = ClippedAdagrad([torch.nn.Parameter(torch.ones(3))], lr=0.1)
    flat = torch.nn.Parameter(torch.ones(8))     # what a DeepSpeed wrapper substitutes
    flat.grad = torch.ones(8)
    opt.param_groups[0]["params"] = [flat]
    with pytest.raises(PipelineError, match="bind_to_engine"):
        opt.step()


def test_an_unknown_deepspeed_wrapper_is_refused():
    opt = ClippedAdagrad([torch.nn.Parameter(torch.ones(3))], lr=0.1)
    engine = SimpleNamespace(basic_optimizer=opt, optimizer=SimpleNamespace(optimizer=opt))
    with pytest.raises(PipelineError, match="unknown DeepSpeed optimizer wrapper"):
        bind_to_engine(engine)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def two_rank_results(tmp_path_factory) -> dict:
    """tests/helpers/dist_optim_worker.py on 2 CPU processes (gloo), every configuration in one run."""
    out = tmp_path_factory.mktemp("dist_optim") / "results.json"
    env = os.environ | {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(_free_port()), "DS_ACCELERATOR": "cpu",
                        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    procs = [subprocess.Popen([sys.executable, str(ROOT / "tests" / "helpers" / "dist_optim_worker.py"), str(out)],
                              env=env | {"RANK": str(r), "LOCAL_RANK": str(r)}, cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(2)]
    # a first run on a machine builds DeepSpeed's shared-memory comm op (~70 s)
    logs = [p.communicate(timeout=600)[0] for p in procs]
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-5000:]
    return json.loads(out.read_text())


WRAPPERS = {
    "zero0": "ClippedAdagrad",                       # no wrapper: steps the parameters
    "zero1": "DeepSpeedZeroOptimizer",
    "zero2": "DeepSpeedZeroOptimizer",
    "zero3": "DeepSpeedZeroOptimizer_Stage3",
    "zero0_bf16": "FP16_UnfusedOptimizer",           # one fp32 copy per parameter
    "zero1_bf16_fp32acc": "BF16_Optimizer",          # flat partitions, like ZeRO 1
    "zero2_bf16": "DeepSpeedZeroOptimizer",
}


@pytest.mark.parametrize("config", list(WRAPPERS))
def test_clipped_adagrad_equals_its_update_rule_under_deepspeed_with_2_processes(
        two_rank_results, config):
    """The Adagrad-with-step-clipping optimizer equals a direct implementation of its update
    rule over several steps, under ZeRO 0, 1 and 2 with 2 processes (also ZeRO 3 and bf16).
    Tolerances, stated and justified in tests/helpers/dist_optim_worker.py: fp32 rtol 1e-5 + atol
    1e-7; bf16 atol 0.05·lr. errors are |got - want| / tolerance, so they must stay <= 1."""
    result = two_rank_results[config]
    assert result["wrapper"] == WRAPPERS[config]
    assert result["clipped"] > 0 and result["unclipped"] > 0
    if result["wrapper"] in ("DeepSpeedZeroOptimizer", "BF16_Optimizer"):
        assert "emb" in result["straddling"]     # a tensor split between the two ranks
    assert max(result["errors"]) <= 1.0, result["errors"]
