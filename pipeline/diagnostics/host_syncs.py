"""Count the operations that make the host wait for the device (host syncs). The one sync
counter of the tests and benches (it replaced tests/helpers/optim_syncs.py's ``HostSyncs``
and pipeline/diagnostics/step_audit.py's ``HostSyncCounter``).

    with HostSyncCounter() as counter:
        trainer.train_step()
    assert counter.syncs == [], counter.syncs

``counter.syncs`` gets one entry per operation that needs a device value on the host, or
that blocks the host until the device's queue reaches it: ``"op @ where"``, where is the
innermost ``pipeline/`` line (and the innermost line outside torch when that is elsewhere,
e.g. in DeepSpeed or the authors' code).

It runs on CPU too, where nothing really waits: it counts what WOULD wait on a GPU, by the
operation rather than by the devices involved. Two modes work together:

- a ``TorchFunctionMode`` catches the Python-level reads of a tensor's values: ``item``,
  ``tolist``, ``numpy``, ``bool()``, ``float()``, ``int()``, ``operator.index``, ``.cpu()``
  and blocking ``.to('cpu')`` of an accelerator's tensor (on a CPU run the CPU is the training
  device too, so ``.to(cpu)`` is not a read there); and blocking copies of a host tensor to an
  accelerator
  (``.to(device)``, ``.cuda()``, ``copy_``), after which PyTorch waits for the stream.
  A Python call is one sync: the aten ops it dispatches (``float(t)`` dispatches
  ``_local_scalar_dense``) are not counted again.
- a ``TorchDispatchMode`` catches the aten ops whose output shape or result depends on the
  values: ``_local_scalar_dense`` (reached from C++), ``is_nonzero``, ``equal``,
  ``allclose``, ``nonzero``, ``argwhere``, ``masked_select``, the ``unique`` family,
  ``bincount``, boolean-mask ``index``/``index_put``, ``repeat_interleave`` without
  ``output_size``, and ``segment_reduce`` given ``lengths`` or ``offsets`` (two syncs unless
  ``unsafe=True``: its kernel checks ``lengths.min()`` and their sum with ``.item()``); and,
  on a real accelerator, copies between it and the host that are not ``non_blocking``.
  (``nonzero_static`` is not a sync: its size is given.)

What a GPU run keeps on the host is no sync to read. A tensor counts as on the host when

- it really is on the CPU while CUDA is in use (a GPU run);
- it is named in ``HostSyncCounter(host=...)`` (made before the counter, e.g. the ``step``
  counters torch.optim's optimizers keep on the host unless ``capturable``/``fused``);
- it was made inside the counter by a factory function without ``device=``
  (``torch.tensor(0.0)``, an optimizer's new step counter), read back (``.cpu()``,
  ``.numpy()``, ``.to('cpu')``), or computed from host tensors only;
- torch.optim reads it through ``torch.optim.optimizer._get_value`` (its step counters, however
  they were made).

Otherwise, on a CPU-only run, every tensor stands in for a device tensor. The host marks are
the counter's own (weak references): they end with it.
"""

from __future__ import annotations

import collections
import os
import sys
import types
import weakref

import torch
from torch.optim.optimizer import _get_value
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
    torch.Tensor.cpu: "Tensor.cpu",
}
"""Python-level calls that read a tensor's values on the host."""

_VALUE_DEPENDENT = {
    _aten._local_scalar_dense.default,
    _aten.is_nonzero.default,
    _aten.equal.default,
    _aten.nonzero.default,
    _aten.argwhere.default,
    _aten.masked_select.default,
    _aten._unique.default,
    _aten._unique2.default,
    _aten.unique_dim.default,
    _aten.unique_consecutive.default,
    _aten.unique_dim_consecutive.default,
    _aten.bincount.default,
    _aten.allclose.default,
}
"""aten ops that always need device values on the host (output shape or a Python value)."""

_FACTORIES = {
    torch.tensor,
    torch.as_tensor,
    torch.scalar_tensor,
    torch.zeros,
    torch.ones,
    torch.empty,
    torch.full,
    torch.arange,
    torch.linspace,
    torch.logspace,
    torch.rand,
    torch.randn,
    torch.randint,
    torch.randperm,
    torch.eye,
}
"""Functions that make a tensor from nothing: without device= it is on the host, on a GPU
run too."""

_OPTIM_STEP_VALUE = _get_value.__code__

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_PIPELINE = os.path.join(_ROOT, "pipeline") + os.sep
_DIAGNOSTICS = os.path.dirname(os.path.abspath(__file__)) + os.sep  # the counters, not a culprit
_SKIP = (
    os.path.dirname(torch.__file__) + os.sep,
    os.path.abspath(__file__),
    os.path.dirname(os.__file__) + os.sep + "contextlib.py",
)


def _where() -> str:
    """The innermost pipeline/ line of the caller's stack (and the innermost line outside
    torch and this file, if different)."""
    ours = outside = None
    frame: types.FrameType | None = sys._getframe(2)
    while frame is not None and ours is None:
        path = frame.f_code.co_filename
        shown = os.path.relpath(path, _ROOT) if path.startswith(_ROOT) else path
        here = f"{shown}:{frame.f_lineno}"
        if outside is None and not path.startswith(_SKIP):
            outside = here
        if path.startswith(_PIPELINE) and not path.startswith(_DIAGNOSTICS):
            ours = here
        frame = frame.f_back
    if ours and outside and ours != outside:
        return f"{ours} (via {outside})"
    return ours or outside or "?"


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _tensors(o)


def _is_cpu(device) -> bool:
    return device is not None and torch.device(device).type == "cpu"


def _to_target(func, args, kwargs):
    """The device a ``Tensor.to``/``cpu``/``cuda`` call moves to (None: it stays)."""
    if func is torch.Tensor.cpu:
        return torch.device("cpu")
    if func is torch.Tensor.cuda:
        return torch.device("cuda")
    if func is torch.Tensor.to:
        try:
            return torch._C._nn._parse_to(*args[1:], **kwargs)[0]
        except (TypeError, RuntimeError):
            return None
    return None


class _Functions(TorchFunctionMode):
    def __init__(self, counter: HostSyncCounter):
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        counter = self.counter
        if counter._inside:  # under a counted call: its own ops, one sync
            return func(*args, **kwargs)
        name = None
        target = _to_target(func, args, kwargs)
        blocking = not kwargs.get("non_blocking", False)
        src = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if func in _READS and src is not None:
            if sys._getframe(1).f_code is _OPTIM_STEP_VALUE:
                name = ""  # torch.optim's step counter: on the host, no sync
            elif not counter.is_host(src):
                name = _READS[func]
        elif func is torch.Tensor.to and src is not None and target is not None and blocking:
            # to the CPU from a real accelerator only: on a CPU run the CPU is also the
            # training device (DeepSpeed's .to(current_device_name()), the trainer's batches)
            if _is_cpu(target) and src.device.type != "cpu" and not counter.is_host(src):
                name = "Tensor.to('cpu') (device to host)"
            elif not _is_cpu(target) and counter.is_host(src):
                name = "Tensor.to (host to device, blocking)"
        elif func is torch.Tensor.cuda and src is not None and blocking and counter.is_host(src):
            name = "Tensor.cuda (host to device, blocking)"
        elif (
            func is torch.Tensor.copy_
            and len(args) > 1
            and blocking
            and isinstance(args[1], torch.Tensor)
        ):
            if counter.is_host(args[1]) and not counter.is_host(args[0]):
                name = "Tensor.copy_ (host to device, blocking)"
        if name is not None:
            if name:
                counter._add(name)
            counter._inside += 1  # what it dispatches is this one sync (or none)
            try:
                out = func(*args, **kwargs)
            finally:
                counter._inside -= 1
        else:
            out = func(*args, **kwargs)
        # what a GPU run would hold on the host
        if func in (torch.Tensor.cpu, torch.Tensor.numpy) or (
            func is torch.Tensor.to
            and src is not None
            and src.device.type != "cpu"
            and target is not None
            and _is_cpu(target)
        ):
            counter._mark(out)
        elif func in _FACTORIES and kwargs.get("device") is None:
            counter._mark(out)
        elif target is None and func is not torch.Tensor.copy_:
            inputs = list(_tensors(list(args) + list(kwargs.values())))
            if inputs and all(counter.is_host(t) for t in inputs):
                counter._mark(out)
        return out


class _Dispatch(TorchDispatchMode):
    def __init__(self, counter: HostSyncCounter):
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        counter = self.counter
        if not counter._inside:
            name, times = _sync_name(func, args, kwargs)
            if name is not None:
                inputs = list(_tensors(list(args) + list(kwargs.values())))
                if not (inputs and all(counter.is_host(t) for t in inputs)) or name.endswith(
                    "copy"
                ):
                    for _ in range(times):
                        counter._add(name)
        return func(*args, **kwargs)


def _sync_name(func, args, kwargs) -> tuple[str | None, int]:
    if func in _VALUE_DEPENDENT:
        return str(func.overloadpacket.__name__), 1
    if func is _aten.repeat_interleave.Tensor:
        if kwargs.get("output_size") is None:
            return "repeat_interleave without output_size", 1
        return None, 1
    if func is _aten.segment_reduce.default:
        if kwargs.get("unsafe") or (
            kwargs.get("lengths") is None and kwargs.get("offsets") is None
        ):
            return None, 1
        return "segment_reduce with lengths (two .item() checks)", 2
    if func in (
        _aten.index.Tensor,
        _aten.index_put.default,
        _aten.index_put_.default,
        _aten._index_put_impl_.default,
    ):
        if any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in args[1]):
            return f"{func.overloadpacket.__name__} with a boolean mask", 1
    return _syncing_copy(func, args, kwargs), 1


def _syncing_copy(func, args, kwargs) -> str | None:
    """A blocking copy between a real accelerator and the host, by its direction."""
    if kwargs.get("non_blocking", False) or (len(args) > 2 and args[2] is True):
        return None
    if func is _aten._to_copy.default:
        src, dst = args[0].device, kwargs.get("device") or args[0].device
    elif func is _aten.copy_.default:
        dst, src = args[0].device, args[1].device
    else:
        return None
    if _is_cpu(src) and not _is_cpu(dst):
        return "blocking host-to-device copy"
    if not _is_cpu(src) and _is_cpu(dst):
        return "device-to-host copy"
    return None


class HostSyncCounter:
    """A context manager; ``syncs`` lists "op @ where" for each host sync inside it.

    host: tensors made before the counter that a GPU run keeps on the host (torch's
    optimizers keep their ``step`` counters there, say)."""

    def __init__(self, host=()) -> None:
        self.syncs: list[str] = []
        self._inside = 0
        self._host: dict[int, weakref.ref] = {}  # by id: a tensor's == is elementwise
        self._gpu_run = torch.cuda.is_available() and torch.cuda.is_initialized()
        self._mark(list(host))
        self._modes = (_Functions(self), _Dispatch(self))

    def is_host(self, t) -> bool:
        """Whether a GPU run would hold this tensor on the host."""
        if not isinstance(t, torch.Tensor):
            return True
        if self._gpu_run and t.device.type == "cpu":
            return True
        ref = self._host.get(id(t))
        return ref is not None and ref() is t

    def _mark(self, obj) -> None:
        for t in _tensors(obj):
            try:
                self._host[id(t)] = weakref.ref(t)
            except TypeError:
                pass

    def _add(self, name: str) -> None:
        self.syncs.append(f"{name} @ {_where()}")

    def reset(self) -> None:
        self.syncs.clear()

    def counts(self) -> collections.Counter:
        return collections.Counter(self.syncs)

    def __enter__(self) -> HostSyncCounter:
        self._gpu_run = torch.cuda.is_available() and torch.cuda.is_initialized()
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
