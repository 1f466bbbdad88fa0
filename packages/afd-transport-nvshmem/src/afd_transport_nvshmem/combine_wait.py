"""The combine graph's wait for every expected reply, and the host's view of it.

A graph-replayed combine (:mod:`afd_transport_nvshmem.graphed_attention`) holds a bounded
device wait right before its kernel: :class:`CombineWait` is what the endpoint needs of it,
:func:`kernel_combine_wait` makes the Triton one
(:class:`~afd_transport_nvshmem.device_wait.WaitBlock`), :class:`PolledCombineWait` stands
in for it in CPU tests, and :class:`PeerCheck` is the host's liveness check while it waits.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from afd_protocol.window import WindowTransport, abort_words, flag_words, slot_view

MAX_DEADLINE_US = 2**31 - 1
"""The longest deadline a device wait's request holds, microseconds (about 36 minutes)."""
WAIT_POLLS = 20000
"""Device polls of one combine wait before it gives up and is replayed (about 10-20 ms)."""
LIVENESS_INTERVAL = 0.05
"""Seconds between the host's checks of the peers while a combine's wait runs."""
_ABANDONED_WAITS: list[object] = []
"""Combine waits whose kernel may still write their host buffers (kept for the process)."""


def abandon(wait: CombineWait) -> None:
    """Give up on a wait: cancel it (a running one ends within a few polls) and, if it may
    still be running, keep its buffers for the life of the process, since its kernel may
    still write them."""
    wait.cancel()
    if wait.status() == 0:
        _ABANDONED_WAITS.append(wait)


class CombineWait(Protocol):
    """A bounded wait for every expected reply, that a combine graph holds before its
    kernel: :class:`~afd_transport_nvshmem.device_wait.WaitBlock` on a GPU;
    :class:`PolledCombineWait` stands in for it in CPU tests."""

    def write(
        self,
        indices: Sequence[int],
        last: Sequence[int],
        peers: Sequence[int],
        polls: int,
        deadline_us: int = 0,
    ) -> None: ...

    def launch(self) -> None: ...

    def cancel(self) -> None: ...

    def prepare(self) -> None: ...

    def status(self) -> int: ...

    def values(self, n: int) -> list[int]: ...

    def header(self, position: int) -> torch.Tensor: ...


CombineWaitFactory = Callable[[WindowTransport], "CombineWait | None"]
"""Makes an endpoint's combine wait over a transport's local window (None: the host waits)."""


def device_combine_wait(transport: WindowTransport) -> CombineWait | None:
    """:func:`kernel_combine_wait` on a CUDA device; None on the CPU (whose endpoints wait
    on the host)."""
    return kernel_combine_wait(transport) if transport.device.type == "cuda" else None


def kernel_combine_wait(transport: WindowTransport) -> CombineWait:
    """The device wait kernel over ``transport``'s local window (on the CPU it runs only
    under Triton's interpreter)."""
    from afd_transport_nvshmem.device_wait import WaitBlock, header_offsets

    window = transport.window
    local = transport.local_window()
    return WaitBlock(
        flag_words(local, window),
        abort_words(local, window),
        local[: window.total_bytes // 4 * 4].view(torch.int32),
        header_offsets(window, transport.device),
        window.slot.header_words,
        transport.num_peers,
    )


class PeerCheck:
    """``transport.check_alive(peers)`` at most every :data:`LIVENESS_INTERVAL`, on one clock
    for a whole combine (a wait replayed slice after slice must not restart it)."""

    def __init__(self, transport: WindowTransport, peers: list[int]) -> None:
        self._transport = transport
        self._peers = peers
        self._next = time.monotonic() + LIVENESS_INTERVAL

    def when_due(self) -> float:
        """Check if due; returns the time it looked at."""
        now = time.monotonic()
        if now >= self._next:
            self._transport.check_alive(self._peers)
            self._next = now + LIVENESS_INTERVAL
        return now


class PolledCombineWait:
    """:class:`CombineWait` for tests on the CPU: each :meth:`launch` (a replay under
    :func:`replayed_calls`) looks at the flags once -- all changed, a watched abort word
    set, or not yet -- and captures the changed slots' headers, as the device wait does."""

    def __init__(self, transport: WindowTransport) -> None:
        window = transport.window
        local = transport.local_window()
        self._flags = flag_words(local, window)
        self._aborts = abort_words(local, window)
        self._headers = [
            slot_view(local, window, *divmod(i, window.ring_depth)).header
            for i in range(window.num_regions * window.ring_depth)
        ]
        self._request: tuple[list[int], list[int], list[int]] = ([], [], [])
        self._status = 0
        self._cancelled = False
        self._values: list[int] = []
        self._captured: list[torch.Tensor] = []
        self.launches = 0

    def write(
        self,
        indices: Sequence[int],
        last: Sequence[int],
        peers: Sequence[int],
        polls: int,
        deadline_us: int = 0,
    ) -> None:
        self._request = (list(indices), list(last), list(peers))
        self._status = 0
        self._cancelled = False

    def cancel(self) -> None:
        """A launch after this (and before the next write) reports status 4."""
        self._cancelled = True

    def launch(self) -> None:
        self.launches += 1
        indices, last, peers = self._request
        if self._cancelled:
            self._status = 4
            return
        self._values = [int(self._flags[i]) for i in indices]
        if all(v != old for v, old in zip(self._values, last, strict=True)):
            self._captured = [self._headers[i].clone() for i in indices]
            self._status = 1
        elif any(int(self._aborts[p]) for p in peers):
            self._status = 3
        else:
            self._status = 2

    def prepare(self) -> None:
        """Nothing to load."""

    def status(self) -> int:
        return self._status

    def values(self, n: int) -> list[int]:
        return self._values[:n]

    def header(self, position: int) -> torch.Tensor:
        return self._captured[position]
