"""Where a MoE layer's time goes, measured on every rank of ``afd run``.

An attention rank's step is cut at its endpoint calls: ``dispatch`` (planning, packing,
sending), ``combine`` (waiting for the replies and the weighted sum), sync mode's barrier
before each dispatch, and everything between -- attention, dense layers, router, local
shared experts -- counted as compute.
On a GPU the cuts are CUDA events on the current stream, read once the step has finished,
so they measure the device's timeline, not the host's enqueue; on the CPU they are clock
readings. An FFN rank times each work item's expert compute the same way.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from afd_protocol import AttentionEndpoint, Compute, DispatchHandle, WorkItem
from afd_tools.prefill.layer_times import LayerTimes
from afd_tools.run.forwarding import DispatchCall, ForwardingEndpoint


class Clock:
    """Marks on the device's timeline (CUDA events) or the host's (``perf_counter``)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            event.record()
            return event
        return time.perf_counter()

    def seconds(self, start: Any, end: Any) -> float:
        """Between two marks (after the device finished both, on a GPU)."""
        if self.cuda:
            return float(start.elapsed_time(end)) / 1e3
        return float(end - start)


class TimedEndpoint(ForwardingEndpoint):
    """An attention endpoint whose calls are timed (see the module docstring); call
    :meth:`begin_step` before a step and :meth:`end_step` once the device finished it."""

    def __init__(self, endpoint: AttentionEndpoint, clock: Clock) -> None:
        super().__init__(endpoint)
        self.clock = clock
        self.totals = LayerTimes()
        self._marks: list[tuple[str, Any, Any]] = []
        self._step_start: Any = None

    def begin_step(self) -> None:
        self._marks.clear()
        self._step_start = self.clock.mark()

    def end_step(self) -> None:
        """Add the finished step's marks to :attr:`totals` (the device must be done)."""
        end = self.clock.mark()
        if self.clock.cuda:
            end.synchronize()
        if self._step_start is not None:
            self.totals.step_s += self.clock.seconds(self._step_start, end)
        for what, start, stop in self._marks:
            seconds = self.clock.seconds(start, stop)
            if what == "dispatch":
                self.totals.dispatch_s += seconds
                self.totals.layers += 1
            elif what == "barrier":
                self.totals.barrier_s += seconds
            else:
                self.totals.combine_s += seconds
        self._marks.clear()
        self._step_start = None

    def add_barrier(self, start: Any, stop: Any) -> None:
        """Count the span between two of :attr:`clock`'s marks as a barrier of this step
        (:class:`~afd_tools.run.lockstep.LockstepEndpoint`'s, marked around its wait)."""
        self._marks.append(("barrier", start, stop))

    def forward_dispatch(self, call: DispatchCall) -> DispatchHandle:
        """Time the wrapped endpoint's dispatch."""
        start = self.clock.mark()
        handle = super().forward_dispatch(call)
        self._marks.append(("dispatch", start, self.clock.mark()))
        return handle

    def combine(self, handle: DispatchHandle, timeout: float | None = None) -> torch.Tensor:
        start = self.clock.mark()
        out = self.endpoint.combine(handle, timeout)
        self._marks.append(("combine", start, self.clock.mark()))
        return out


class ItemTimer:
    """Times each work item's expert compute on an FFN rank: marks are kept and read at
    the end (:meth:`seconds`), so timing adds no synchronisation to the serving loop."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self._marks: list[tuple[Any, Any]] = []

    def wrap(self, compute: Compute) -> Compute:
        def run(item: WorkItem) -> tuple[torch.Tensor, torch.Tensor | None]:
            start = self.clock.mark()
            out = compute(item)
            self._marks.append((start, self.clock.mark()))
            return out

        return run

    def seconds(self) -> list[float]:
        """Every item's compute time, in serving order (waits for the device first)."""
        if self.clock.cuda:
            torch.cuda.synchronize()
        return [self.clock.seconds(start, end) for start, end in self._marks]
