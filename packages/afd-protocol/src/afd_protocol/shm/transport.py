"""The shared-memory transport: AFD windows in POSIX shared memory between processes.

It is the embedded default (CPU), the reference the GPU and CAM transports are checked
against, and what CI exercises end to end.

Memory ordering -- why a visible flag implies a complete payload
----------------------------------------------------------------
A sender writes its payload into the peer's window (torch ``copy_``/``index_select``
into a shared mapping) and *afterwards*, in program order, stores the flag word with a
single aligned 4-byte store. On x86-64, stores become visible to other cores in program
order (total store order). The two exceptions do not apply here: non-temporal stores,
which glibc's ``memcpy`` uses for large copies, are followed by an ``sfence`` inside
glibc; and stores made by torch's intra-op worker threads are ordered before the flag
store by the thread-pool join (a synchronising atomic) that the copy returns through.
A receiver loads the flag first and the payload after, and x86-64 never reorders two
loads. So a receiver that sees the new flag sees the whole payload. Weakly ordered
machines (ARM, POWER) need explicit fences that Python cannot issue portably, so the
transport refuses to start there (see :func:`~afd_protocol.shm.segments.check_platform`).

Start-up
--------
Through :class:`~afd_protocol.core.rendezvous.Rendezvous` over any key-value store (a
private directory by default): each rank creates its segment, publishes its path and
geometry, checks every opposite-role peer's geometry, maps their segments, and waits until
every peer mapped its own; then it unlinks its segment's name, so nothing can leak.

Liveness
--------
Every wait has a timeout, checks the abort words of the peers it waits for, and checks
every ``liveness_interval`` seconds that those peers' processes still exist (pid and
start time from the rendezvous), so a SIGKILLed peer is reported as
:class:`PeerAborted` within that interval rather than after the full timeout.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from afd_protocol.core.errors import InvalidArgument, PeerAborted, PeerTimeout
from afd_protocol.core.layout import WindowLayout
from afd_protocol.core.rendezvous import DirectoryStore, KeyValueStore, Rendezvous
from afd_protocol.core.tensors import constant_index
from afd_protocol.core.topology import Role
from afd_protocol.shm.segments import SharedSegment, check_platform, share_segments
from afd_protocol.window.transport import Arrivals, WindowTransport
from afd_protocol.window.views import abort_words, flag_words

SPIN_POLLS = 200
"""Busy polls before a waiter starts sleeping, when every rank has a core of its own."""
OVERSUBSCRIBED_SPIN_POLLS = 4
"""Busy polls when ranks outnumber cores: spinning would steal the CPU from the rank
that is computing what we wait for, so back off almost at once."""
MIN_SLEEP = 0.00002
MAX_SLEEP = 0.0005
"""Sleeps between polls grow from MIN_SLEEP to MAX_SLEEP (bounds a wake-up's latency)."""


class ShmTransport(WindowTransport):
    """Shared-memory windows for one rank; see the module docstring.

    ``rendezvous`` is a directory every rank of the world uses (made private, 0700) or any
    :class:`~afd_protocol.core.rendezvous.KeyValueStore`.
    """

    def __init__(
        self,
        window: WindowLayout,
        role: Role | str,
        rank: int,
        rendezvous: str | Path | KeyValueStore,
        *,
        connect_timeout: float = 60.0,
        liveness_interval: float = 0.05,
    ) -> None:
        check_platform()
        super().__init__(window, Role(role), rank)
        self._closed = False
        self._aborted = False
        self._segment: SharedSegment | None = None
        self._peer_segments: list[SharedSegment] = []
        self._liveness_interval = liveness_interval
        cores = len(os.sched_getaffinity(0))
        oversubscribed = window.slot.topology.world_size > cores
        self._spin_polls = OVERSUBSCRIBED_SPIN_POLLS if oversubscribed else SPIN_POLLS
        topo = self.topology
        self._name = f"{self.role.value} rank {rank}"
        store = (
            DirectoryStore(rendezvous, timeout=connect_timeout)
            if isinstance(rendezvous, str | Path)
            else rendezvous
        )
        rdv = Rendezvous(store, topo, self.role, rank, liveness_interval=liveness_interval)
        self._rendezvous = rdv
        peer_role = self.role.opposite
        self._peer_world = [topo.world_rank(peer_role, r) for r in range(self.num_peers)]
        self._segment, attached = share_segments(
            rdv, window.total_bytes, window.describe(), self._peer_world, connect_timeout
        )
        self._peer_segments = [attached[w] for w in self._peer_world]
        local = self._segment.tensor
        assert local is not None
        self._local = local
        self._flags = flag_words(local, window)
        self._aborts = abort_words(local, window)
        self._peer_windows = [s.tensor for s in self._peer_segments]
        self._peer_flags = [flag_words(t, window) for t in self._peer_windows if t is not None]
        self._peer_aborts = [abort_words(t, window) for t in self._peer_windows if t is not None]

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def local_window(self) -> torch.Tensor:
        self._check_open()
        return self._local

    def peer_window(self, peer: int) -> torch.Tensor:
        self._check_open()
        window = self._peer_windows[self.check_peer(peer)]
        assert window is not None
        return window

    def publish(self, peer: int, flag_index: int, value: int) -> None:
        # One aligned int32 element store, after the payload in program order (see above).
        self._check_open()
        self._peer_flags[self.check_peer(peer)][flag_index] = value

    def wait_any(
        self,
        flag_indices: Sequence[int],
        last_seen: Sequence[int],
        timeout: float,
        peers: Sequence[int],
    ) -> Arrivals:
        self._check_open()
        index = constant_index(tuple(flag_indices), self.device)
        last = torch.tensor(list(last_seen), dtype=torch.int32)
        watched = list(peers)
        watched_world = [self._peer_world[p] for p in watched]
        peer_index = constant_index(tuple(watched), self.device)
        start = time.monotonic()
        deadline = start + timeout
        next_liveness = start + self._liveness_interval
        polls = 0
        sleep = MIN_SLEEP
        while True:
            current = self._flags.index_select(0, index)
            if not torch.equal(current, last):
                return Arrivals([int(v) for v in current.tolist()])
            if watched and bool(self._aborts.index_select(0, peer_index).any()):
                bad = [p for p in watched if int(self._aborts[p]) != 0]
                raise PeerAborted(
                    f"{self._name}: {self.role.opposite.value} rank(s) {bad} aborted (see their "
                    f"own error for the cause)"
                )
            now = time.monotonic()
            if now >= next_liveness:
                try:
                    self._rendezvous.check_alive(watched_world)
                except PeerAborted:
                    # A peer may publish (its last message, or its shutdown) and exit
                    # between the flag read and this check: what it sent has arrived.
                    current = self._flags.index_select(0, index)
                    if not torch.equal(current, last):
                        return Arrivals([int(v) for v in current.tolist()])
                    raise
                next_liveness = now + self._liveness_interval
            if now >= deadline:
                raise PeerTimeout(f"{self._name}: nothing arrived within {timeout:g} s")
            polls += 1
            if polls > self._spin_polls:
                time.sleep(sleep)
                sleep = min(sleep * 2, MAX_SLEEP)

    def abort(self) -> None:
        """Set this rank's abort word in every peer window (best effort, idempotent)."""
        if self._closed or self._aborted:
            return
        self._aborted = True
        for aborts in getattr(self, "_peer_aborts", []):
            aborts[self.rank] = 1

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._segment is not None:
            self._segment.close()
        for segment in self._peer_segments:
            segment.close()
        for name in ("_local", "_flags", "_aborts", "_peer_windows", "_peer_flags", "_peer_aborts"):
            self.__dict__.pop(name, None)

    def _check_open(self) -> None:
        if self._closed:
            raise InvalidArgument(f"{self._name}: the shared-memory transport is closed")
