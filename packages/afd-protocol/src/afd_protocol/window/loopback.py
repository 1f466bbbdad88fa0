"""An in-process transport: every rank's window in one process, for tests and examples.

All windows are ordinary tensors (on the CPU, or on one GPU) owned by one :class:`LoopbackWorld`; a
:class:`LoopbackTransport` per rank exposes them through the same interface as the real
transports, so endpoint logic (fairness, rings, stale replies, shutdown) can be driven
step by step from a single thread, deterministically, with no processes. Waits poll
until the timeout; from a single thread a wait for something not yet published times
out, which is exactly what such a test wants to observe. :meth:`LoopbackWorld.connection`
wraps a rank's transport in a :class:`~afd_protocol.window.connection.WindowConnection`,
the :class:`~afd_protocol.core.endpoints.Connection` that makes its endpoint.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from afd_protocol.core.errors import PeerAborted, PeerTimeout
from afd_protocol.core.layout import WindowLayout
from afd_protocol.core.topology import Role
from afd_protocol.window.connection import WindowConnection
from afd_protocol.window.transport import Arrivals, WindowTransport
from afd_protocol.window.views import abort_words, flag_words


class LoopbackWorld:
    """The windows of every rank of one topology, in this process."""

    def __init__(self, window: WindowLayout, device: torch.device | str = "cpu") -> None:
        self.window = window
        # Resolved the way tensors report it ("cuda" -> "cuda:0"), so device checks compare equal.
        self.device = torch.empty(0, device=device).device
        topo = window.slot.topology
        self.windows = {
            (role, r): torch.zeros(window.total_bytes, dtype=torch.uint8, device=self.device)
            for role in Role
            for r in range(topo.num_role_ranks(role))
        }

    def transport(self, role: Role | str, rank: int) -> LoopbackTransport:
        """One rank's transport (a new one per call; they share the world's windows)."""
        return LoopbackTransport(self, Role(role), rank)

    def connection(self, role: Role | str, rank: int) -> WindowConnection:
        """One rank's connection over a new :meth:`transport`: ask it for the endpoint."""
        return WindowConnection(self.transport(role, rank))


class LoopbackTransport(WindowTransport):
    """One rank's view of a :class:`LoopbackWorld`."""

    def __init__(self, world: LoopbackWorld, role: Role, rank: int) -> None:
        super().__init__(world.window, role, rank)
        self._world = world
        self._local = world.windows[(role, rank)]
        self._flags = flag_words(self._local, self.window)
        self._aborts = abort_words(self._local, self.window)

    @property
    def device(self) -> torch.device:
        return self._world.device

    def local_window(self) -> torch.Tensor:
        return self._local

    def peer_window(self, peer: int) -> torch.Tensor:
        return self._world.windows[(self.role.opposite, self.check_peer(peer))]

    def publish(self, peer: int, flag_index: int, value: int) -> None:
        # fill_ takes the value as a kernel argument: on a GPU, item assignment would be a
        # host-to-device copy that synchronises (and dispatch() must not).
        flag_words(self.peer_window(peer), self.window)[flag_index : flag_index + 1].fill_(value)

    def wait_any(
        self,
        flag_indices: Sequence[int],
        last_seen: Sequence[int],
        timeout: float,
        peers: Sequence[int],
    ) -> Arrivals:
        deadline = time.monotonic() + timeout
        while True:
            current = [int(self._flags[i]) for i in flag_indices]
            if current != list(last_seen):
                return Arrivals(current)
            aborted = [p for p in peers if int(self._aborts[p]) != 0]
            if aborted:
                raise PeerAborted(f"{self.role.opposite.value} rank(s) {aborted} aborted")
            if time.monotonic() >= deadline:
                raise PeerTimeout(f"nothing arrived within {timeout:g} s")
            time.sleep(0.0001)

    def abort(self) -> None:
        for peer in range(self.num_peers):
            abort_words(self.peer_window(peer), self.window)[self.rank] = 1

    def close(self) -> None:
        """Nothing to release: the world owns the windows."""
