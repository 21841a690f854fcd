"""Counting what a training step does, on the CPU (bench/step_counts.py; tests may use it too):

- ``OpCounter``: every aten op that reaches the dispatcher's Python key (forward, the autograd
  engine's backward, the optimizer), by name. Composite-implicit ops arrive already
  decomposed, so this counts roughly the kernels a GPU would launch.
- ``HostSyncCounter``: the calls that would make the host wait for a GPU: reading a value
  (``.item()``, ``.tolist()``, ``bool(t)``, ``int(t)``, ``.cpu()``, ``.numpy()``,
  ``.to("cpu")``), the aten ops whose output shape or whose argument checks depend on the
  data (nonzero, masked_select, unique, segment_reduce's length check, boolean indexing,
  ...) and blocking host-to-device copies. ``.syncs`` is a list of strings, one per sync.
  On the CPU nothing waits, which is why the counting names calls instead of timing them;
  which tensors a GPU run would hold on the host is tracked (see the class).
- ``SavedBytes``: the bytes autograd keeps for backward (``saved_tensors_hooks``), each
  storage once, parameters and the inputs it is told about left out; works on the meta device.

A second helper (tests/helpers/host_syncs.py, ``HostSyncCounter``) may replace this one's
host-sync counter; the interface is the same.
"""

from __future__ import annotations

import collections
import traceback
from contextlib import ExitStack

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

# Tensor methods that copy a value to the host (a device-to-host copy the host waits for)
_READS = {
    torch.Tensor.item: "Tensor.item",
    torch.Tensor.tolist: "Tensor.tolist",
    torch.Tensor.__bool__: "Tensor.__bool__",
    torch.Tensor.__int__: "Tensor.__int__",
    torch.Tensor.__float__: "Tensor.__float__",
    torch.Tensor.__index__: "Tensor.__index__",
    torch.Tensor.cpu: "Tensor.cpu",
    torch.Tensor.numpy: "Tensor.numpy",
}

# aten ops that sync on CUDA whatever their caller: data-dependent output shapes, or kernels
# that check their arguments' values on the host
_SYNC_OPS = {
    aten._local_scalar_dense.default: "aten._local_scalar_dense",
    aten.nonzero.default: "aten.nonzero",
    aten.argwhere.default: "aten.argwhere",
    aten.masked_select.default: "aten.masked_select",
    aten._unique2.default: "aten._unique2",
    aten.unique_dim.default: "aten.unique_dim",
    aten.unique_consecutive.default: "aten.unique_consecutive",
    aten.segment_reduce.default: "aten.segment_reduce",
    aten.repeat_interleave.Tensor: "aten.repeat_interleave (no output_size)",
    aten.is_nonzero.default: "aten.is_nonzero",
    aten.equal.default: "aten.equal",
    aten.bincount.default: "aten.bincount",
}

# functions that make a tensor from nothing: without device= it is on the CPU, on a GPU run too
_FACTORIES = {torch.tensor, torch.as_tensor, torch.scalar_tensor, torch.zeros, torch.ones,
              torch.empty, torch.full, torch.arange, torch.linspace, torch.logspace,
              torch.rand, torch.randn, torch.randint, torch.randperm, torch.eye}

_HOST = "_step_audit_host"          # attribute marking a tensor that lives on the host


def is_host(t) -> bool:
    return isinstance(t, torch.Tensor) and getattr(t, _HOST, False)


def mark_host(obj) -> None:
    for t in _tensors(obj):
        try:
            setattr(t, _HOST, True)
        except (AttributeError, RuntimeError):
            pass


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _tensors(o)


def _where(skip: int = 3) -> str:
    """The innermost frame outside torch and this file: where in the project the call is."""
    for frame in reversed(traceback.extract_stack()[:-skip]):
        f = frame.filename
        if "/torch/" not in f and not f.endswith("step_audit.py"):
            return f"{f.rsplit('/', 2)[-2]}/{f.rsplit('/', 1)[-1]}:{frame.lineno}"
    return "?"


def _to_target(args, kwargs):
    """Tensor.to's device argument (None without one) and whether it is the string 'cpu'."""
    for a in [*args[1:], kwargs.get("device")]:
        if isinstance(a, str) or isinstance(a, torch.device):
            return a
    return None


class _SyncFunctions(TorchFunctionMode):
    def __init__(self, owner: "HostSyncCounter"):
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = list(_tensors(list(args) + list(kwargs.values())))
        host_in = bool(inputs) and all(is_host(t) for t in inputs)
        name = None
        if func in _READS and not is_host(args[0]):
            name = _READS[func]
        elif func is torch.Tensor.to and not kwargs.get("non_blocking"):
            target = _to_target(args, kwargs)
            if target == "cpu" and not is_host(args[0]):
                name = "Tensor.to('cpu') (device to host)"
            elif target is not None and target != "cpu" and is_host(args[0]):
                name = "Tensor.to (host to device, blocking)"
        elif func is torch.Tensor.copy_ and len(args) > 1 and not kwargs.get("non_blocking"):
            if is_host(args[1]) and not is_host(args[0]):
                name = "Tensor.copy_ (host to device, blocking)"
        if name is not None:
            self.owner._record(name)
        self.owner._inside += name is not None       # the aten ops under it: the same sync
        try:
            out = func(*args, **kwargs)
        finally:
            self.owner._inside -= name is not None
        to_device = (func is torch.Tensor.cuda or (func is torch.Tensor.to and _to_target(
            args, kwargs) not in (None, "cpu")))
        if (func in (torch.Tensor.cpu, torch.Tensor.numpy) or (host_in and not to_device)
                or (func in _FACTORIES and kwargs.get("device") is None)
                or (func is torch.Tensor.to and _to_target(args, kwargs) == "cpu")):
            mark_host(out)
        return out


class _SyncOps(TorchDispatchMode):
    def __init__(self, owner: "HostSyncCounter"):
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _SYNC_OPS.get(func)
        if name is None and func in (aten.index.Tensor, aten.index_put.default,
                                     aten.index_put_.default):
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool
                   for i in (args[1] or []) if i is not None):
                name = f"{func} with a boolean mask"
        times = 1
        if func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is not None:
            name = None                     # told its output size: nothing to read back
        if func is aten.segment_reduce.default:
            # unless unsafe=True its kernel checks the lengths (offsets) on the host:
            # lengths.min().item() and (lengths.sum(-1) == data.size(axis)).all().item()
            if kwargs.get("unsafe") or (kwargs.get("lengths") is None
                                        and kwargs.get("offsets") is None):
                name = None
            else:
                name, times = "aten.segment_reduce (two .item() checks of its lengths)", 2
        inputs = list(_tensors(list(args)))
        if (name is not None and not self.owner._inside
                and not (inputs and all(is_host(t) for t in inputs))):
            for _ in range(times):
                self.owner._record(name)
        return func(*args, **kwargs)


class HostSyncCounter:
    """``with HostSyncCounter() as c: step()``; then ``c.syncs`` lists one string per host
    sync (``"Tensor.item at models/allattn.py:124"``) and ``c.counts()`` groups them.

    On the CPU every tensor is on the host, so the counter stands the CPU in for the GPU:
    a tensor is on the host where a GPU run would have it there — made by a factory
    function without ``device=`` (``torch.tensor(0.0)``, an optimizer's step counter, a seed
    from ``torch.randint``), read back (``.cpu()``, ``.to('cpu')``), or computed from host
    tensors only — and on the device otherwise. A sync is then: a read of a device tensor's
    value, a data-dependent op on device tensors, or a blocking copy from the host to the
    device (PyTorch synchronises the stream after it). Tensors made before the counter was
    entered are device tensors: enter it before the warm-up steps and ``reset()`` after
    them, so that the optimizer's state is seen being made."""

    def __init__(self, where: bool = True, host=()):
        """host: tensors made before the counter that a GPU run keeps on the host (torch's
        optimizers keep their ``step`` counters there, say)."""
        mark_host(list(host))
        self.syncs: list[str] = []
        self.where = where
        self._inside = 0
        self._stack: ExitStack | None = None

    def _record(self, name: str) -> None:
        self.syncs.append(f"{name} at {_where()}" if self.where else name)

    def reset(self) -> None:
        self.syncs.clear()

    def counts(self) -> collections.Counter:
        return collections.Counter(self.syncs)

    def __enter__(self):
        self._stack = ExitStack()
        self._stack.enter_context(_SyncFunctions(self))
        self._stack.enter_context(_SyncOps(self))
        return self

    def __exit__(self, *exc):
        self._stack.close()
        return False


class OpCounter(TorchDispatchMode):
    """``with OpCounter() as c: step()``; ``c.total`` aten ops, ``c.ops`` a Counter by name.
    Ops on tensors of any device, meta included; views and in-place ops count as ops."""

    def __init__(self):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()

    @property
    def total(self) -> int:
        return sum(self.ops.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


class SavedBytes:
    """``with SavedBytes(exclude=model.parameters()) as s: loss = model(x)``; then ``s.bytes``:
    the bytes of the distinct storages autograd saved for backward, leaving out those of
    ``exclude`` (the parameters, which exist anyway). Each storage counts once however many
    views of it are saved; on the meta device storages are told apart by their identity."""

    def __init__(self, exclude=()):
        self._exclude = {self._key(t) for t in exclude}
        self._seen: dict[int, int] = {}
        self._what: dict[int, str] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    @staticmethod
    def _key(t: torch.Tensor) -> int:
        return t.untyped_storage()._cdata

    def _pack(self, t: torch.Tensor):
        if isinstance(t, torch.Tensor) and t.layout == torch.strided:
            key = self._key(t)
            if key not in self._exclude and key not in self._seen:
                self._seen[key] = t.untyped_storage().nbytes()
                self._what[key] = f"{str(t.dtype).split('.')[-1]}{list(t.shape)}"
        return t

    @property
    def bytes(self) -> int:
        return sum(self._seen.values())

    def largest(self, n: int = 5) -> list[tuple[int, str]]:
        """The n largest storages kept: (bytes, dtype and shape of the first view saved)."""
        return sorted(((b, self._what[k]) for k, b in self._seen.items()), reverse=True)[:n]

    def __enter__(self):
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)
        return False
