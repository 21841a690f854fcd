"""DeepSpeed's shared-memory comm op (deepspeed_shm_comm, a ~4-minute C++ build on first use)
on CPU: one process starts its group without building or loading it, since only several ranks
use it; a process among several still gets it, and a build is said before it starts. The op
builder's `load` is replaced by a recorder, and the process group by stand-ins, so nothing is
built and no group is made here."""

from __future__ import annotations

import importlib
import os

import pytest
import torch

from pipeline.cluster import distributed

OP = "deepspeed_shm_comm"


@pytest.fixture
def loads(monkeypatch, tmp_path) -> list[str]:
    """Each load of the comm op (what builds it when it is not built), with an empty
    TORCH_EXTENSIONS_DIR of this test's own."""
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().get_op_builder("ShareMemCommBuilder")
    if builder is None:
        pytest.skip("this accelerator has no shared-memory comm op")
    calls: list[str] = []

    def load(self, verbose=False):
        calls.append("load")
        print("<op loaded>", flush=True)
        return object()

    monkeypatch.setattr(builder, "load", load)
    monkeypatch.setitem(deepspeed.ops.__compatible_ops__, OP, True)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "torch_extensions"))
    return calls


@pytest.fixture
def group(monkeypatch, loads) -> dict:
    """init_process_group on CPU with the group itself replaced: what DeepSpeed's init would
    get from its `build_shm_op` (its TorchBackend calls it for every group) is recorded."""
    import deepspeed
    import torch.distributed as dist

    ds_torch = importlib.import_module("deepspeed.comm.torch")

    seen: dict = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda: int(os.environ["WORLD_SIZE"]))

    def init_distributed(**kwargs):
        seen["op"] = ds_torch.build_shm_op()

    monkeypatch.setattr(deepspeed, "init_distributed", init_distributed)
    monkeypatch.setattr(distributed, "_unlink_shm_buffer", lambda rank: None)
    monkeypatch.setattr(distributed.atexit, "register", lambda f: None)
    monkeypatch.setattr(distributed, "_group_started", False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    return seen


def test_one_cpu_process_neither_builds_nor_loads_the_op(group, loads, monkeypatch):
    ds_torch = importlib.import_module("deepspeed.comm.torch")
    build = ds_torch.build_shm_op
    monkeypatch.setenv("WORLD_SIZE", "1")
    distributed.init_process_group()
    assert loads == []
    assert group["op"] is None  # DeepSpeed's group went without it
    assert ds_torch.build_shm_op is build  # and later groups are DeepSpeed's own again


def test_a_process_among_several_loads_it(group, loads, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    distributed.init_process_group()
    assert loads  # by us, under the build lock, and by DeepSpeed's init
    assert group["op"] is not None


def test_a_build_is_said_before_it_starts(loads, tmp_path, capfd):
    distributed._load_comm_op()
    out, err = capfd.readouterr()
    extensions = tmp_path / "torch_extensions"
    said = (
        f"building DeepSpeed's CPU communication op {OP} in {extensions} "
        f"(once per virtualenv, ~4 min)\n"
    )
    assert err == said and out == "<op loaded>\n"
    (extensions / OP).mkdir()
    (extensions / OP / f"{OP}.so").touch()  # built: loading it is quick, and not said
    distributed._load_comm_op()
    assert capfd.readouterr().err == ""
