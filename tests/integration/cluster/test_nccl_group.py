"""The NCCL group is bound to the local rank's GPU (`device_id`), checked without a GPU: every
call that would touch CUDA or the network is replaced, and what init_process_group gets is
recorded."""

from __future__ import annotations

import pytest
import torch

from pipeline.cluster import distributed


@pytest.fixture
def calls(monkeypatch):
    import deepspeed
    import torch.distributed as dist

    seen: dict = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: seen.setdefault("set_device", d))
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "get_rank", lambda: 1)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)

    def init_process_group(backend, **kwargs):
        seen["init_process_group"] = (backend, kwargs)

    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    monkeypatch.setattr(
        deepspeed, "init_distributed", lambda **kw: seen.setdefault("deepspeed", kw["dist_backend"])
    )
    monkeypatch.setattr(distributed, "_load_comm_op", lambda: None)
    monkeypatch.setattr(distributed, "_unlink_shm_buffer", lambda rank: None)
    monkeypatch.setattr(distributed.atexit, "register", lambda f: None)
    monkeypatch.setattr(distributed, "_group_started", False)
    return seen


@pytest.mark.parametrize("world, local_rank, bound", [(2, 1, True), (8, 3, True), (1, 0, False)])
def test_nccl_group_is_bound_to_the_local_rank_gpu(calls, monkeypatch, world, local_rank, bound):
    monkeypatch.setenv("RANK", str(local_rank))
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    distributed.init_process_group()
    backend, kwargs = calls["init_process_group"]
    assert backend == "nccl" and calls["deepspeed"] == "nccl"
    assert calls["set_device"] == local_rank
    assert kwargs["timeout"] == distributed.collective_timeout()
    if bound:
        assert kwargs["device_id"] == torch.device("cuda", local_rank)
    else:  # a group of one stays unbound (deepspeedai/DeepSpeed#8248)
        assert "device_id" not in kwargs


def test_a_cpu_group_is_left_to_deepspeed(calls, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    distributed.init_process_group()
    assert "init_process_group" not in calls and calls["deepspeed"] == "gloo"


def test_under_nccl_the_loop_s_shared_values_are_added_on_the_cpu(monkeypatch):
    """The stop flag (every step) and the logged loss go through a gloo group made once over
    the same ranks: under NCCL they would cross to the GPU and back, a host sync each."""
    import torch.distributed as dist

    made, reduced = [], []
    monkeypatch.setattr(distributed, "_host_group", None)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(dist, "new_group", lambda backend: made.append(backend) or "gloo-group")

    def all_reduce(t, op=None, group=None):
        reduced.append((t.device.type, group))
        t.mul_(2)

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    assert distributed.any_rank(True) is True
    assert distributed.mean_over_ranks(1.5) == 1.5
    assert made == ["gloo"]  # made once, reused
    assert reduced == [("cpu", "gloo-group")] * 2
