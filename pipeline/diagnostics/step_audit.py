"""Counting what a training step does, on the CPU (bench/step_counts.py; tests may use it too):

- ``OpCounter``: every aten op that reaches the dispatcher's Python key (forward, the autograd
  engine's backward, the optimizer), by name. Composite-implicit ops arrive already
  decomposed, so this counts roughly the kernels a GPU would launch.
- ``SavedBytes``: the bytes autograd keeps for backward (``saved_tensors_hooks``), each
  storage once, parameters and the inputs it is told about left out; works on the meta device.

The host syncs are counted by pipeline/diagnostics/host_syncs.py's ``HostSyncCounter`` (the one
sync counter); ``OpCounter`` here is the one op counter (tests/fixtures/layer_costs.py and the
benches import it).
"""

from __future__ import annotations

import collections

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class OpCounter(TorchDispatchMode):
    """``with OpCounter() as c: step()``; ``c.total`` aten ops, ``c.ops`` a Counter by name
    (the overload packet's, without ``aten.``: ``"add"``, ``"native_dropout"``). Ops on
    tensors of any device, meta included; views and in-place ops count as ops."""

    def __init__(self):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()

    @property
    def total(self) -> int:
        return sum(self.ops.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        packet = func.overloadpacket  # aten ops by bare name, others qualified
        self.ops[packet.__name__ if func.namespace == "aten" else str(packet)] += 1
        return func(*args, **(kwargs or {}))


class SavedBytes:
    """``with SavedBytes(exclude=model.parameters()) as s: loss = model(x)``; then ``s.bytes``:
    the bytes of the distinct storages autograd saved for backward, leaving out parameters
    and the storages of ``exclude`` (the parameters' other copies: both exist anyway). Each storage
    counts once however many
    views of it are saved; on the meta device storages are told apart by their identity."""

    def __init__(self, exclude=()):
        self._exclude = {self._key(t) for t in exclude}
        self._seen: dict[int, int] = {}
        self._what: dict[int, str] = {}
        self._keep: list[torch.Tensor] = []
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    @staticmethod
    def _key(t: torch.Tensor) -> int:
        return t.untyped_storage()._cdata

    def _pack(self, t: torch.Tensor):
        if (
            isinstance(t, torch.Tensor)
            and t.layout == torch.strided
            and not isinstance(t, torch.nn.Parameter)
        ):  # held whether saved or not
            key = self._key(t)
            if key not in self._exclude and key not in self._seen:
                self._seen[key] = t.untyped_storage().nbytes()
                self._keep.append(t)  # so no storage id is reused while counting
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
