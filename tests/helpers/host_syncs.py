"""Count the operations that make the host wait for the device (host syncs).

    with HostSyncCounter() as counter:
        trainer.train_step()
    assert counter.syncs == [], counter.syncs

``counter.syncs`` gets one entry per operation that needs a device value on the host, or
that blocks the host until the device's queue reaches it: the op's name and where it was
called from (the innermost ``pipeline/`` line, and the innermost line outside torch when that
is elsewhere, e.g. in DeepSpeed).

It runs on CPU too, where nothing really waits: it counts what WOULD wait on CUDA, by the
operation rather than by the devices involved. Two modes work together:

- a ``TorchFunctionMode`` catches the Python-level reads of a tensor's values:
  ``item``, ``tolist``, ``numpy``, ``bool()``, ``float()``, ``int()``, ``operator.index``,
  and ``.cpu()`` / ``.to(cpu)`` of a tensor that is not on the CPU. (On a CPU run a bare
  ``.cpu()`` is a no-op; it is the read of its result that counts.)
- a ``TorchDispatchMode`` catches the aten ops whose output shape or result depends on the
  values (``nonzero``, ``masked_select``, ``unique``, boolean-mask indexing,
  ``repeat_interleave`` without ``output_size``, ``segment_reduce`` with ``lengths``,
  ``equal``, ``allclose``, ``is_nonzero``, ``_local_scalar_dense`` from C++ code...) and,
  where a real accelerator is involved, copies between it and the host that are not
  ``non_blocking``.

An op reached from a counted Python call (``float(t)`` dispatches ``_local_scalar_dense``)
is counted once. Not counted: torch.optim's reads of its step counters
(``torch.optim.optimizer._get_value``): unless ``capturable``, those live on the host on
every device, and reading them waits for nothing.
"""

from __future__ import annotations

import os
import sys

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["HostSyncCounter"]

_aten = torch.ops.aten

_READS = {
    torch.Tensor.item: "Tensor.item",
    torch.Tensor.tolist: "Tensor.tolist",
    torch.Tensor.numpy: "Tensor.numpy",
    torch.Tensor.__bool__: "Tensor.__bool__",
    torch.Tensor.__float__: "Tensor.__float__",
    torch.Tensor.__int__: "Tensor.__int__",
    torch.Tensor.__index__: "Tensor.__index__",
}
"""Python-level calls that read a tensor's values on the host."""

_VALUE_DEPENDENT = {
    _aten._local_scalar_dense.default, _aten.is_nonzero.default, _aten.equal.default,
    _aten.nonzero.default, _aten.masked_select.default,
    _aten._unique.default, _aten._unique2.default, _aten.unique_dim.default,
    _aten.unique_consecutive.default, _aten.unique_dim_consecutive.default,
    _aten.bincount.default, _aten.allclose.default,
}
"""aten ops that always need device values on the host (output shape or a Python value)."""

from torch.optim.optimizer import _get_value  # noqa: E402

_OPTIM_STEP_VALUE = _get_value.__code__

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_PIPELINE = os.path.join(_ROOT, "pipeline") + os.sep
_SKIP = (os.path.dirname(torch.__file__) + os.sep, os.path.abspath(__file__),
         os.path.dirname(os.__file__) + os.sep + "contextlib.py")


def _where() -> str:
    """The innermost pipeline/ line of the caller's stack (and the innermost line outside
    torch and this file, if different)."""
    ours = outside = None
    frame = sys._getframe(2)
    while frame is not None and ours is None:
        path = frame.f_code.co_filename
        shown = os.path.relpath(path, _ROOT) if path.startswith(_ROOT) else path
        here = f"{shown}:{frame.f_lineno}"
        if outside is None and not path.startswith(_SKIP):
            outside = here
        if path.startswith(_PIPELINE):
            ours = here
        frame = frame.f_back
    if ours and outside and ours != outside:
        return f"{ours} (via {outside})"
    return ours or outside or "?"


def _is_host(device) -> bool:
    return torch.device(device).type == "cpu"


def _syncing_copy(func, args, kwargs) -> str | None:
    """A blocking copy between an accelerator and the host, by its direction."""
    if kwargs.get("non_blocking", False) or (len(args) > 2 and args[2] is True):
        return None
    if func is _aten._to_copy.default:
        src, dst = args[0].device, kwargs.get("device") or args[0].device
    elif func is _aten.copy_.default:
        dst, src = args[0].device, args[1].device
    else:
        return None
    if _is_host(src) and not _is_host(dst):
        return "blocking host-to-device copy"
    if not _is_host(src) and _is_host(dst):
        return "device-to-host copy"
    return None


def _sync_name(func, args, kwargs) -> str | None:
    if func in _VALUE_DEPENDENT:
        return str(func.overloadpacket.__name__)
    if func is _aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
        return "repeat_interleave without output_size"
    if func is _aten.segment_reduce.default and (
            kwargs.get("lengths") is not None or (len(args) > 2 and args[2] is not None)):
        return "segment_reduce with lengths"
    if func in (_aten.index.Tensor, _aten.index_put.default, _aten.index_put_.default,
                _aten._index_put_impl_.default):
        if any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in args[1]):
            return f"{func.overloadpacket.__name__} with a boolean mask"
    return _syncing_copy(func, args, kwargs)


class _Functions(TorchFunctionMode):
    def __init__(self, counter: HostSyncCounter):
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _READS.get(func)
        if func is torch.Tensor.item and _is_host(args[0].device) \
                and sys._getframe(1).f_code is _OPTIM_STEP_VALUE:
            name = ""                   # torch.optim's host-side step counter: no sync
        if name is None and func in (torch.Tensor.cpu, torch.Tensor.to) and args \
                and isinstance(args[0], torch.Tensor) and not _is_host(args[0].device):
            target = torch._C._nn._parse_to(*args[1:], **kwargs)[0] \
                if func is torch.Tensor.to else torch.device("cpu")
            if target is not None and _is_host(target) and not kwargs.get("non_blocking"):
                name = f"Tensor.{func.__name__} (to the host)"
        if name is None:
            return func(*args, **kwargs)
        if name:
            self.counter._add(name)
        self.counter._inside += 1       # what it dispatches is this one sync (or none)
        try:
            return func(*args, **kwargs)
        finally:
            self.counter._inside -= 1


class _Dispatch(TorchDispatchMode):
    def __init__(self, counter: HostSyncCounter):
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.counter._inside:
            name = _sync_name(func, args, kwargs)
            if name is not None:
                self.counter._add(name)
        return func(*args, **kwargs)


class HostSyncCounter:
    """A context manager; ``syncs`` lists "op @ where" for each host sync inside it."""

    def __init__(self) -> None:
        self.syncs: list[str] = []
        self._inside = 0
        self._modes = (_Functions(self), _Dispatch(self))

    def _add(self, name: str) -> None:
        self.syncs.append(f"{name} @ {_where()}")

    def __enter__(self) -> HostSyncCounter:
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
