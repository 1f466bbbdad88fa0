"""``afd run --assign pull``: the replicas of a launch claim requests from one shared pool.

No request is given to a replica before the run. Per mode the launcher makes one claim
cursor -- an int64 in shared memory with its lock (``multiprocessing.Value``), the index
of the next unclaimed request in arrival order -- and hands it to every replica process
when the process is created (:class:`Pulling`, one of the rank's arguments). Each replica
builds an :class:`~afd_tools.prefill.workload.ArrivalPool` over every request and the
mode's cursor, and at the start of each step claims from it by the rule of
:meth:`~afd_tools.prefill.workload.ChunkQueue.refill`, which the simulator shares. The
cost: one lock taken per claim and per step start (a few microseconds), and one named
semaphore per mode, which the launcher releases when the launch object is dropped.

The warm-up (the untimed batches and ``--warm-pass``) does not claim: each replica warms
on a fixed round-robin share of the requests (:func:`warm_shares`), about 1/A of them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing as mp
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from afd_tools.prefill.workload import ArrivalPool, Request, arrival_order

CLAIM_TIMEOUT = 30.0
"""Seconds a claim waits for the cursor's lock (held for a few instructions by a claim):
only a replica that died holding it can keep it longer."""

_SPAWN = mp.get_context("spawn")


class PullError(RuntimeError):
    """The shared claim cursor could not be used (its lock was not released in time)."""


class SharedCursor:
    """A :class:`~afd_tools.prefill.workload.Cursor` shared by processes: ``value`` is a
    ``multiprocessing.Value("q")`` with its lock, passed to each process at its creation."""

    def __init__(self, value: Any, what: str, timeout: float = CLAIM_TIMEOUT) -> None:
        self.value = value
        self.what = what
        """The cursor in words (``"mode async"``), for errors."""
        self.timeout = timeout

    @contextlib.contextmanager
    def _locked(self) -> Iterator[Any]:
        lock = self.value.get_lock()
        if not lock.acquire(timeout=self.timeout):
            raise PullError(
                f"the request pool of {self.what} stayed locked for {self.timeout:g} s (a "
                "replica died while claiming?)"
            )
        try:
            yield self.value.get_obj()
        finally:
            lock.release()

    def take(self, ready: Callable[[int], bool]) -> int | None:
        with self._locked() as raw:
            index = int(raw.value)
            if not ready(index):
                return None
            raw.value = index + 1
            return index

    def peek(self) -> int:
        with self._locked() as raw:
            return int(raw.value)


@dataclass(frozen=True)
class Pulling:
    """What each replica of a pull launch receives: every request (their prompts and the
    pool), and per mode the claim cursor its replicas share."""

    requests: tuple[Request, ...]
    cursors: dict[str, SharedCursor]

    @classmethod
    def over(cls, requests: Sequence[Request], modes: Sequence[str]) -> Pulling:
        """New cursors (at the first request), one per mode of ``modes``, over ``requests``;
        made in the launcher, before the rank processes."""
        cursors = {m: SharedCursor(_SPAWN.Value("q", 0), f"mode {m}") for m in modes}
        return cls(tuple(requests), cursors)

    def pool(self, mode: str) -> ArrivalPool:
        """The pool ``mode``'s replicas claim from."""
        return ArrivalPool(self.requests, self.cursors[mode])


def warm_shares(requests: Sequence[Request], replicas: int) -> list[Request]:
    """``requests`` given round-robin over ``replicas`` in arrival order: under pull, what
    each replica warms up on (``replica`` set; the timed modes claim instead)."""
    ordered = arrival_order(requests)
    shares = {q.request_id: i % replicas for i, q in enumerate(ordered)}
    return [dataclasses.replace(q, replica=shares[q.request_id]) for q in requests]


__all__ = ["CLAIM_TIMEOUT", "PullError", "Pulling", "SharedCursor", "warm_shares"]
