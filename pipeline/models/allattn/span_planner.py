"""Planned span lengths: each layer's L' for a training update, fixed on the host from span
fractions copied after an earlier update, so that no training forward waits for the device.

Each layer's L' is a Python int (it sets tensor shapes), a function of the learned span
fractions, which live on the device: reading them before every forward would make the host
wait for the device. Inside the trainer's ``planned_update()`` the model does not read them.
After each optimizer step, ``request()`` starts a non-blocking copy of each layer's largest
span fraction to a (pinned, on CUDA) host buffer and records an event; before update s, the
copy requested after update s - 2 is taken (its event long complete while the device is
busy; update 1 reads the current fractions, update 2 keeps update 1's plan) and each layer's
L' planned from it with slack (``planned_span_len``: the synchronous L' plus 64 tokens,
rounded up to a span bucket, at most max_span). The mask is still computed on the device
from the CURRENT fractions, so while the planned L' covers the span really needed the result
equals the synchronous one up to rounding (the extra columns have mask exactly 0). When a
span outgrows its plan (it grew by more than the slack within two updates), the oldest
columns it would attend to are cut: each forward where some layer's current span needs more
than its planned L' is counted on the device (``span_plan_overflows``, read with the loss at
each report; the trainer warns in its log). The plan in force and the requested values are
saved with checkpoints (``state()``), so a resumed run plans as the uninterrupted one.
Forwards outside ``update()`` (evaluation, sampling) compute L' synchronously from the
current fractions, as always.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np
import torch
from torch import Tensor

from pipeline.models.allattn.layers import SPAN_GRANULARITY, planned_span_len

MaxFracs = Callable[[], Tensor]
"""Reads each layer's largest span fraction: [n_layers] float32, on the model's device."""


class SpanPlanner:
    """The L' plan of one all-attention model, its host copies of the span fractions and its
    count of planned forwards whose plan was too short. A plain object, not a module: it adds
    no parameter or buffer (the model's state_dict is unchanged); ``state()`` is what a
    checkpoint keeps of it. Without adaptive span every L' is max_span and nothing is read.

    The model hands it a ``MaxFracs`` reader wherever fractions may be needed; it is called
    only when they are (never for a fixed span, and not when a requested copy is there)."""

    def __init__(self, n_layers: int, max_span: int, ramp: int, adaptive: bool) -> None:
        self.n_layers, self.max_span, self.ramp, self.adaptive = n_layers, max_span, ramp, adaptive
        self.planned: list[int] | None = None
        """L' per layer of the last update's plan (None before the first)."""
        self._planning = False  # inside update()
        self._limits: Tensor | None = None  # ``planned`` on the device, float32
        # requested [n_layers] host copies: (buffer, a numpy view of it, CUDA event or None)
        self._pending: list[tuple[Tensor, np.ndarray, torch.cuda.Event | None]] = []
        self._free: list[tuple[Tensor, np.ndarray]] = []  # (buffer, view) to reuse
        self._overflows: Tensor | None = None  # forwards whose plan was too short
        self._overflows_seen = 0  # the count at the last report

    def in_force(self) -> list[int] | None:
        """The L' per layer a forward uses now: the plan inside ``update()``, else None (the
        caller reads the current spans)."""
        return self.planned if self._planning else None

    @contextmanager
    def update(self, read_max_fracs: MaxFracs, device: torch.device) -> Iterator[None]:
        """One training update's forwards and backwards, with L' planned from the copy
        requested after update s - 2 (update 1: the current fractions; update 2: update 1's
        plan kept)."""
        if not self.adaptive:  # a fixed span: L' = max_span, nothing to read
            self.planned = [self.max_span] * self.n_layers
        elif len(self._pending) >= 2:  # requested after update s - 2
            buffer, view, event = self._pending.pop(0)
            if event is not None:
                event.synchronize()  # long done while the device is busy
            self._set_plan(view.tolist(), device)  # host memory: a numpy read
            self._free.append((buffer, view))
        elif self.planned is None:  # the first update (or a checkpoint without a plan)
            self._set_plan(read_max_fracs().tolist(), device)
        self._planning = True
        try:
            yield
        finally:
            self._planning = False

    def _set_plan(self, max_fracs: list[float], device: torch.device) -> None:
        plan = [planned_span_len(f, self.max_span, self.ramp) for f in max_fracs]
        if plan == self.planned and self._limits is not None:
            return
        self.planned = plan
        limits = torch.tensor(plan, dtype=torch.float32)
        if device.type == "cuda":
            limits = limits.pin_memory()
        self._limits = limits.to(device, non_blocking=True)

    def request(self, read_max_fracs: MaxFracs) -> None:
        """After an optimizer step: start, without waiting, the copy of the layers' largest
        span fractions to the host that update s + 2 plans from."""
        if not self.adaptive:
            return
        fracs = read_max_fracs()
        buffer, view = self._free.pop() if self._free else self._host_buffer(fracs.device)
        buffer.copy_(fracs, non_blocking=True)
        event = None
        if fracs.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        self._pending.append((buffer, view, event))
        while len(self._pending) > 2:  # requested twice without an update between
            self._free.append(self._pending.pop(0)[:2])

    def _host_buffer(self, device: torch.device) -> tuple[Tensor, np.ndarray]:
        """A [n_layers] float32 host buffer (pinned for CUDA) and a numpy view of it."""
        buffer = torch.empty(self.n_layers, dtype=torch.float32, pin_memory=device.type == "cuda")
        return buffer, buffer.numpy()

    def count_overflow(self, read_max_fracs: MaxFracs) -> None:
        """In a planned forward, on the device: +1 if some layer's current span needs more
        than its planned L' (the mask's first cut column, distance L' + 1, is R + z - L' > 0)."""
        if not self.adaptive:
            return
        spans = read_max_fracs() * self.max_span
        assert self._limits is not None  # update() set them
        cut = ((self.ramp + spans) - self._limits).gt(0).any()
        if self._overflows is None:
            self._overflows = torch.zeros((), dtype=torch.int64, device=spans.device)
        self._overflows += cut

    def metric_tensors(self) -> dict[str, Tensor]:
        """``span_plan_overflows``, the planned forwards so far whose plan was too short, once
        a planned forward has run (on the device: read with the loss)."""
        return {} if self._overflows is None else {"span_plan_overflows": self._overflows}

    def overflow_warnings(self, values: dict[str, float]) -> list[str]:
        """A line for the training log when ``span_plan_overflows`` grew since the last
        report."""
        n = int(values.get("span_plan_overflows", 0))
        new, self._overflows_seen = n - self._overflows_seen, n
        if new <= 0:
            return []
        return [
            f"warning: in {new} forward(s) since the last report a span outgrew its "
            f"planned length (it grew by more than {SPAN_GRANULARITY} tokens within two "
            f"updates): the oldest context columns it would attend to were cut "
            f"({n} so far)"
        ]

    def state(self) -> dict | None:
        """The plan in force, the requested copies not yet planned from and the overflow
        count, for a checkpoint (waits for the copies); None for a fixed span."""
        if not self.adaptive:
            return None
        pending = []
        for _, view, event in self._pending:
            if event is not None:
                event.synchronize()
            pending.append(view.tolist())
        overflows = 0 if self._overflows is None else int(self._overflows)
        return {"planned": self.planned, "pending": pending, "overflows": overflows}

    def load_state(self, state: dict | None, device: torch.device) -> None:
        """Restore ``state()``'s dict onto `device`; None: plan from the current fractions at
        the next update."""
        self._pending, self.planned, self._limits = [], None, None
        self._overflows = None
        if not self.adaptive or state is None:
            return
        if state["planned"] is not None:
            self.planned = list(state["planned"])
            self._limits = torch.tensor(self.planned, dtype=torch.float32).to(device)
        for values in state["pending"]:
            buffer, view = self._host_buffer(device)
            view[:] = values
            self._pending.append((buffer, view, None))
        self._overflows = torch.tensor(state["overflows"], dtype=torch.int64).to(device)
        self._overflows_seen = state["overflows"]
