"""A small discrete-event kernel: processes are generators, the processor is shared.

Each simulated rank is a Python generator that yields what it does next:

* ``(COMPUTE, seconds, weight)`` -- work that needs a processor for ``seconds`` when it
  has one to itself. ``weight`` is how many identical ranks do this same work at this
  moment (the FFN ranks are simulated as one, see :mod:`afd_tools.sim.modes`). With
  ``cores=None`` every rank has its own processor and the work takes ``seconds``. With
  ``cores=C`` the running work shares ``C`` processors: while ``n`` ranks compute, each
  advances at ``min(1, C / n)`` (processor sharing, how an operating system time-slices
  more busy processes than cores);
* ``(DELAY, seconds)`` -- time passes without using a processor (a link, a sleep);
* ``(WAIT, signal)`` -- block until ``signal`` fires (at once if it already has).

Processor sharing is computed exactly with a virtual clock: every running piece of work
advances at the same rate, so it ends when the virtual clock reaches its start value plus
its seconds; only the rate (a function of how many compute) changes at events.

A rank that waits is not free on a real machine: it polls (the shared-memory transport
sleeps between polls, 20 us growing to 0.5 ms). ``idle_load`` is the share of a core each
of the ``processes`` that is not computing takes from the cores; 0 ignores it.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Generator
from typing import Any

COMPUTE = 0
DELAY = 1
WAIT = 2

Action = tuple[Any, ...]
Process = Generator[Action, Any, None]
Part = Generator[Action, Any, float]
"""A piece of a process (used with ``yield from``) that returns seconds waited."""


class Signal:
    """Fires once; processes waiting on it resume at the firing time."""

    __slots__ = ("fired", "value", "waiters")

    def __init__(self) -> None:
        self.fired = False
        self.value: Any = None
        self.waiters: list[Generator[Action, Any, Any]] = []


class Engine:
    """Runs processes until none can advance (see the module docstring)."""

    def __init__(
        self, cores: float | None = None, idle_load: float = 0.0, processes: int = 0
    ) -> None:
        if cores is not None and not cores > 0:
            raise ValueError(f"cores must be > 0 or None, got {cores}")
        self.cores = cores
        self.idle_load = idle_load
        self.processes = processes
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[[Any], None], Any]] = []
        self._seq = 0
        # processor sharing
        self._virtual = 0.0
        self._load = 0.0
        self._jobs: list[tuple[float, int, Generator[Action, Any, Any], float]] = []

    # scheduling ---------------------------------------------------------------------
    def at(self, when: float, fn: Callable[[Any], None], arg: Any = None) -> None:
        """Call ``fn(arg)`` at time ``when`` (not before now)."""
        self._seq += 1
        heapq.heappush(self._heap, (max(when, self.now), self._seq, fn, arg))

    def spawn(self, process: Generator[Action, Any, Any]) -> None:
        self.at(self.now, self._step, (process, None))

    def fire(self, signal: Signal, value: Any = None) -> None:
        """Fire ``signal`` now: its waiters resume (in the order they waited)."""
        if signal.fired:
            return
        signal.fired = True
        signal.value = value
        for process in signal.waiters:
            self.at(self.now, self._step, (process, value))
        signal.waiters = []

    def fire_at(self, signal: Signal, when: float, value: Any = None) -> None:
        self.at(when, lambda _: self.fire(signal, value))

    # processor sharing --------------------------------------------------------------
    def _rate(self) -> float:
        if self.cores is None:
            return 1.0
        load = self._load + self.idle_load * max(0.0, self.processes - self._load)
        return 1.0 if load <= self.cores else self.cores / load

    def _advance(self, when: float) -> None:
        if self._load > 0:
            self._virtual += (when - self.now) * self._rate()
        self.now = when

    def _next_finish(self) -> float:
        if not self._jobs:
            return math.inf
        return self.now + max(0.0, self._jobs[0][0] - self._virtual) / self._rate()

    # the loop -----------------------------------------------------------------------
    def run(self) -> float:
        """Run to completion; the time of the last event."""
        heap = self._heap
        while True:
            t_event = heap[0][0] if heap else math.inf
            t_finish = self._next_finish()
            if t_event == math.inf and t_finish == math.inf:
                return self.now
            if t_finish <= t_event:
                self._advance(t_finish)
                _, _, process, weight = heapq.heappop(self._jobs)
                self._load -= weight
                if self._load < 1e-9:
                    self._load = 0.0
                self._step((process, None))
            else:
                when, _, fn, arg = heapq.heappop(heap)
                self._advance(when)
                fn(arg)

    def _step(self, pair: tuple[Generator[Action, Any, Any], Any]) -> None:
        """Resume a process and carry out what it yields until it blocks."""
        process, value = pair
        while True:
            try:
                action = process.send(value)
            except StopIteration:
                return
            kind = action[0]
            if kind == COMPUTE:
                seconds = action[1]
                if seconds <= 0:
                    value = None
                    continue
                if self.cores is None:
                    self.at(self.now + seconds, self._step, (process, None))
                else:
                    self._seq += 1
                    heapq.heappush(
                        self._jobs, (self._virtual + seconds, self._seq, process, action[2])
                    )
                    self._load += action[2]
                return
            if kind == DELAY:
                self.at(self.now + action[1], self._step, (process, None))
                return
            signal: Signal = action[1]
            if signal.fired:
                value = signal.value
                continue
            signal.waiters.append(process)
            return
