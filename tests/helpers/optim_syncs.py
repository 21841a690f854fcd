"""Counts, while active, the aten ops dispatched and the ones that make the host wait for the
device (tests/training/test_optim.py, bench/optim_step.py).

On the CPU nothing waits, so the ops are recognised by what they would do on a GPU: read a
value (`.item()`, `bool(t)`, `nonzero`, ...), or give a result whose shape depends on the data
(`segment_reduce` given `lengths` checks their sum with `.item()`; `repeat_interleave`
without `output_size` must read the repeats). Tensor methods that leave the dispatcher
(`.numpy()`) or are no-ops on a CPU tensor (`.cpu()`) are caught one level up, as Python calls.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

# Python-level calls that copy device values to the host
HOST_METHODS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__,
                torch.Tensor.cpu, torch.Tensor.numpy, torch.Tensor.__int__,
                torch.Tensor.__float__, torch.Tensor.__index__}

# aten ops that read device values on the host, or whose output shape depends on them
HOST_OPS = {"aten._local_scalar_dense", "aten.item", "aten.is_nonzero", "aten.equal",
            "aten.nonzero", "aten.nonzero_static", "aten.masked_select", "aten._unique",
            "aten._unique2", "aten.unique_dim", "aten.unique_consecutive", "aten.allclose"}


def _needs_host(func, args, kwargs) -> bool:
    name = func.overloadpacket._qualified_op_name.replace("::", ".")
    if name in HOST_OPS:
        return True
    if name == "aten.segment_reduce":
        return kwargs.get("lengths") is not None
    if name == "aten.repeat_interleave":
        return kwargs.get("output_size") is None
    if name == "aten.index" and len(args) > 1:      # a boolean mask means a nonzero
        return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
                   for i in args[1] if i is not None)
    if name in ("aten._to_copy", "aten.copy_"):     # device to host
        src = args[1] if name == "aten.copy_" else args[0]
        dst = args[0].device if name == "aten.copy_" else kwargs.get("device")
        return (isinstance(src, torch.Tensor) and src.device.type != "cpu"
                and dst is not None and torch.device(dst).type == "cpu")
    return False


class _Dispatch(TorchDispatchMode):
    def __init__(self, counter):
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.counter.ops.append(str(func))
        if not self.counter.in_host_method and _needs_host(func, args, kwargs):
            self.counter.syncs.append(str(func))
        return func(*args, **kwargs)


class _Function(TorchFunctionMode):
    def __init__(self, counter):
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func not in HOST_METHODS or self.counter.in_host_method:
            return func(*args, **(kwargs or {}))
        # one read, counted once: not again as the aten ops it dispatches
        self.counter.syncs.append(f"Tensor.{func.__name__}")
        self.counter.in_host_method = True
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.counter.in_host_method = False


class HostSyncs:
    """`with HostSyncs() as c: ...` then c.ops (every aten op dispatched) and c.syncs (those,
    and the Python calls, that would make the host wait for the device)."""

    def __init__(self):
        self.ops: list[str] = []
        self.syncs: list[str] = []
        self.in_host_method = False
        self._modes = [_Function(self), _Dispatch(self)]

    def __enter__(self):
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc):
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
