"""The NVSHMEM transport: AFD windows in the symmetric heap, mapped peer to peer.

Each rank allocates its window with ``nvshmem_malloc`` (collective, same size on every PE)
and maps every opposite-role peer's window with ``nvshmem_ptr``; writing to a peer is a
``copy_``/``index_select(out=...)`` into that mapped view -- one-sided, over NVLink. A
NULL ``nvshmem_ptr`` means the peer is not P2P reachable (another node): a hard error, as
only a single node is supported.

Why a visible flag implies a complete payload
---------------------------------------------
The payload writes and the flag write are issued on the same CUDA stream, payload first.
The flag is written with ``cuStreamWriteValue32`` in its default mode, which puts a
memory fence with ``__threadfence_system()`` semantics for the stream's earlier work
before the write; without ``cuda-bindings`` a one-element fill kernel follows the copy
kernels on the stream (a kernel boundary; the ordering every NVLink peer-mapped
connector relies on). A receiver loads the flag with acquire semantics at system scope
(device waits) or through a device-to-host copy issued after it (host polls) before it
reads the payload. A cross-node transport (IB/RDMA) would need an explicit fence between
payload and flag, since these orderings do not extend over a network.

Waits
-----
``wait="device"`` (the default): a Triton program polls the flags on the GPU and reports
the flag values, and the header of every slot whose flag changed, to pinned host memory
(see :mod:`afd_transport_nvshmem.device_wait`); :meth:`NvshmemTransport.read_header` hands
those headers to the endpoints, so an arrival costs no device-to-host copy. The wait is a
replay of a captured CUDA graph (``wait_graph=False``: a Triton launch per wait).
``wait="host"``: one device-to-host copy of the watched flags per check, the fallback and
the baseline. Both check the watched peers' abort words and, between poll slices, that the
peer processes are alive; both raise :class:`PeerTimeout` after the timeout.

Kernels the endpoints use
-------------------------
:meth:`NvshmemTransport.fused_combine` (one Triton pass per layer's combine) and
:meth:`NvshmemTransport.device_pack` (the dispatch written from a device-side plan, used
when the attention endpoint opts in).

Teardown
--------
``nvshmem_free`` and finalisation are collective: they run only when every rank reached
``close()`` (checked through the store with a timeout). After a failure a rank skips
them rather than hang on a dead peer; the process exit reclaims the GPU memory.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from afd_protocol import (
    PeerAborted,
    PeerTimeout,
    Role,
    Topology,
    TopologyError,
    Transport,
    WindowLayout,
)
from afd_protocol.device_pack import DevicePack
from afd_protocol.fused import FusedCombine
from afd_protocol.host.rendezvous import (
    check_peers_alive,
    process_alive,
    process_start_time,
)
from afd_protocol.layout import check_same_geometry
from afd_protocol.staging import constant_index
from afd_protocol.views import abort_words, flag_words
from afd_transport_nvshmem.binding import NvshmemLibrary
from afd_transport_nvshmem.bootstrap import (
    KeyValueStore,
    TcpStore,
    apply_single_node_defaults,
    bootstrap,
)
from afd_transport_nvshmem.cuda_memory import (
    device_bytes,
    stream_memops_available,
    stream_write_value32,
)

if TYPE_CHECKING:
    from afd_transport_nvshmem.device_wait import DeviceWaiter

WAIT_MODES = ("device", "host")
_ABANDONED_WAITERS: list[DeviceWaiter] = []
"""Device waiters whose kernel may still write their pinned buffers (see ``_abandon``)."""
POLL_SLICE = 20000
"""Device polls per wait slice; between slices the host checks liveness and the deadline."""


def check_one_rank_per_gpu(gpus: Mapping[int, str], topology: Topology, visible: int) -> None:
    """Refuse two ranks on one GPU (``gpus``: world rank -> GPU UUID) before NVSHMEM starts.

    Without CUDA MPS, two NVSHMEM PEs on one GPU hung at start-up on our test host rather
    than fail, so this is checked by every rank from the same data, and all of them raise.
    """
    by_gpu: dict[str, list[int]] = {}
    for world, gpu in sorted(gpus.items()):
        by_gpu.setdefault(gpu, []).append(world)
    shared = [ranks for ranks in by_gpu.values() if len(ranks) > 1]
    if not shared:
        return
    names = ", ".join(
        " and ".join("{} rank {}".format(*_describe(topology, w)) for w in ranks)
        for ranks in shared
    )
    raise TopologyError(
        f"the NVSHMEM transport needs one GPU per rank, but {names} would share a GPU "
        f"({topology.world_size} ranks, {visible} GPUs visible to this process); use fewer "
        f"ranks, more GPUs, or pass device= so that every rank gets its own"
    )


def _describe(topology: Topology, world: int) -> tuple[str, int]:
    role, rank = topology.role_of(world)
    return role.value, rank


class NvshmemTransport(Transport):
    """One rank's NVSHMEM windows; see the module docstring."""

    def __init__(
        self,
        window: WindowLayout,
        role: Role | str,
        rank: int,
        store: KeyValueStore | None = None,
        *,
        device: int | None = None,
        wait: str = "device",
        wait_graph: bool = True,
        connect_timeout: float = 60.0,
        liveness_interval: float = 0.05,
        library: NvshmemLibrary | None = None,
    ) -> None:
        super().__init__(window, Role(role), rank)
        if wait not in WAIT_MODES:
            raise TopologyError(f"wait must be one of {WAIT_MODES}, got {wait!r}")
        if not torch.cuda.is_available():
            raise TopologyError("the NVSHMEM transport needs a CUDA device; none is visible")
        topo = self.topology
        self._world = topo.world_rank(self.role, rank)
        count = torch.cuda.device_count()
        index = self._world % count if device is None else device
        self._device = torch.device("cuda", index)
        torch.cuda.set_device(self._device)
        torch.empty(1, device=self._device)  # create the context NVSHMEM will use
        self._name = f"{self.role.value} rank {rank}"
        self._wait_mode = wait
        if store is None:
            store = TcpStore(self._world, topo.world_size, connect_timeout)
        self._store = store
        self._liveness_interval = liveness_interval
        self._closed = False
        self._aborted = False
        self._heap_address = 0
        self.environment = apply_single_node_defaults(window.total_bytes)
        self._lib = library or NvshmemLibrary()

        # Agree on the geometry with *every* rank before any collective call, so that a
        # mismatch fails every rank at once instead of leaving peers inside NVSHMEM.
        me = {
            "geometry": window.describe(),
            "pid": os.getpid(),
            "start_time": process_start_time(os.getpid()),
            "gpu": str(torch.cuda.get_device_properties(self._device).uuid),
        }
        store.set(f"afd/rank/{self._world}", json.dumps(me).encode())
        self._pids: dict[int, tuple[int, int]] = {}
        gpus: dict[int, str] = {}
        try:
            for w in range(topo.world_size):
                info = json.loads(store.get(f"afd/rank/{w}"))
                self._pids[w] = (int(info["pid"]), int(info["start_time"]))
                gpus[w] = info["gpu"]
                if w == self._world:
                    continue
                role, r = topo.role_of(w)
                check_same_geometry(
                    window.describe(), info["geometry"], peer=f"{role.value} rank {r}"
                )
            check_one_rank_per_gpu(gpus, topo, count)
        except TopologyError as exc:
            store.set(f"afd/failed/{self._world}", str(exc).encode())
            raise
        store.set(f"afd/ready/{self._world}", b"1")
        self._wait_for_all("afd/ready", deadline=time.monotonic() + connect_timeout)
        bootstrap(self._lib, store, self._world, topo.world_size, "afd/nvshmem/uid")
        peer_role = self.role.opposite
        peers = [topo.world_rank(peer_role, r) for r in range(self.num_peers)]
        self._peer_pids = [self._pids[w] for w in peers]

        self._heap_address = self._lib.malloc(window.total_bytes)
        self._local = device_bytes(self._heap_address, window.total_bytes, self._device)
        self._local.zero_()
        torch.cuda.synchronize(self._device)
        self._lib.barrier_all()  # every window is zeroed before anyone writes
        self._peer_windows: list[torch.Tensor] = []
        for w in peers:
            address = self._lib.peer_address(self._heap_address, w)
            if address == 0:
                raise TopologyError(
                    f"{self._name}: nvshmem_ptr returned NULL for world rank {w}: that GPU is not "
                    f"peer-to-peer reachable from cuda:{index}; the NVSHMEM transport supports "
                    f"a single node with NVLink/P2P between all GPUs"
                )
            self._peer_windows.append(device_bytes(address, window.total_bytes, self._device))
        self._flags = flag_words(self._local, window)
        self._aborts = abort_words(self._local, window)
        self._peer_flags = [flag_words(t, window) for t in self._peer_windows]
        self._peer_aborts = [abort_words(t, window) for t in self._peer_windows]
        self._memops = stream_memops_available()
        self._waiter: DeviceWaiter | None = None
        self._wait_graph = wait_graph
        self._captured: dict[int, tuple[int, int]] = {}
        self.capture_headers = True
        """Use the headers device waits capture (False: copy each one, for comparison)."""
        self.header_reads: collections.Counter[str] = collections.Counter()
        """How arrived headers reached the host: ``captured`` by the device wait (no copy)
        or ``copied`` out of the window (one device-to-host copy each)."""
        self.wait_mode = wait
        self._poll_stream = torch.cuda.Stream(device=self._device)  # type: ignore[no-untyped-call]
        self._abort_stream = torch.cuda.Stream(device=self._device)  # type: ignore[no-untyped-call]

    # ---- the Transport interface ----------------------------------------------------

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def wait_mode(self) -> str:
        """``device`` (Triton poll reporting to pinned memory) or ``host`` (D2H per poll)."""
        return self._wait_mode

    @wait_mode.setter
    def wait_mode(self, mode: str) -> None:
        if mode not in WAIT_MODES:
            raise TopologyError(f"wait must be one of {WAIT_MODES}, got {mode!r}")
        if mode == "device" and self._waiter is None:
            self._waiter = self._new_waiter()
        self._wait_mode = mode

    @property
    def wait_graph(self) -> bool:
        """Device waits replay a captured CUDA graph (False: one Triton launch per wait)."""
        return self._wait_graph

    @wait_graph.setter
    def wait_graph(self, enabled: bool) -> None:
        if enabled != self._wait_graph:
            self._wait_graph = enabled
            if self._waiter is not None:
                self._waiter = self._new_waiter()

    def _new_waiter(self) -> DeviceWaiter:
        from afd_transport_nvshmem.device_wait import DeviceWaiter

        window = self.window
        slots = window.num_regions * window.ring_depth
        header_at = window.slot.field("header").offset
        offsets = [
            (window.slot_offset(*divmod(i, window.ring_depth)) + header_at) // 4
            for i in range(slots)
        ]
        return DeviceWaiter(
            self._flags,
            self._aborts,
            self._local[: window.total_bytes // 4 * 4].view(torch.int32),
            torch.tensor(offsets, dtype=torch.int64, device=self._device),
            window.slot.header_words,
            max_peers=self.num_peers,
            use_graph=self._wait_graph,
        )

    def local_window(self) -> torch.Tensor:
        return self._local

    def peer_window(self, peer: int) -> torch.Tensor:
        return self._peer_windows[self._check_peer(peer)]

    def publish(self, peer: int, flag_index: int, value: int) -> None:
        flags = self._peer_flags[self._check_peer(peer)]
        if self._memops:
            address = flags.data_ptr() + 4 * flag_index
            stream_write_value32(address, value, torch.cuda.current_stream(self._device))
        else:
            flags[flag_index : flag_index + 1].fill_(value)

    def wait_any(
        self,
        flag_indices: Sequence[int],
        last_seen: Sequence[int],
        timeout: float,
        peers: Sequence[int],
    ) -> list[int]:
        indices, last, watched = tuple(flag_indices), tuple(last_seen), tuple(peers)
        self._captured = {}
        deadline = time.monotonic() + timeout
        if self._wait_mode == "device":
            return self._wait_device(indices, last, watched, deadline, timeout)
        return self._wait_host(indices, last, watched, deadline, timeout)

    def device_pack(self) -> DevicePack | None:
        """The Triton device pack (:mod:`afd_transport_nvshmem.device_pack`)."""
        from afd_transport_nvshmem.device_pack import triton_device_pack

        return triton_device_pack

    def fused_combine(self) -> FusedCombine | None:
        """The Triton fused combine (:mod:`afd_transport_nvshmem.fused_combine`)."""
        from afd_transport_nvshmem.fused_combine import triton_fused_combine

        return triton_fused_combine

    def read_header(self, flag_index: int, value: int, header: torch.Tensor) -> torch.Tensor:
        """The header the last device wait captured with this flag, else a copy from the window."""
        captured = self._captured.get(flag_index) if self.capture_headers else None
        if captured is not None and captured[0] == value and self._waiter is not None:
            self.header_reads["captured"] += 1
            return self._waiter.header(captured[1])
        self.header_reads["copied"] += 1
        return super().read_header(flag_index, value, header)

    def _wait_device(
        self,
        indices: tuple[int, ...],
        last: tuple[int, ...],
        peers: tuple[int, ...],
        deadline: float,
        timeout: float,
    ) -> list[int]:
        waiter = self._waiter
        assert waiter is not None
        next_liveness = time.monotonic() + self._liveness_interval
        while True:
            waiter.launch(indices, last, peers, POLL_SLICE)
            try:
                status = waiter.status()
                while status == 0:
                    now = time.monotonic()
                    if now >= next_liveness:
                        self._check_alive(peers)
                        next_liveness = now + self._liveness_interval
                    if now >= deadline + 1.0:
                        raise PeerTimeout(f"{self._name}: the device wait did not report in time")
                    status = waiter.status()
            except BaseException:
                if waiter.status() == 0:
                    self._abandon(waiter)
                raise
            if status == 1:
                values = waiter.values(len(indices))
                self._captured = {
                    index: (value, position)
                    for position, (index, value, old) in enumerate(
                        zip(indices, values, last, strict=True)
                    )
                    if value != old
                }
                return values
            if status == 3:
                self._raise_aborted(peers)
            if time.monotonic() >= deadline:
                raise PeerTimeout(f"{self._name}: nothing arrived within {timeout:g} s")

    def _abandon(self, waiter: DeviceWaiter) -> None:
        """Stop using ``waiter`` while its poll kernel may still run (a stalled GPU, or a wait
        left by an exception): the kernel holds raw pointers to its pinned buffers, so they
        are kept alive for the process's lifetime rather than handed back to the allocator
        for reuse, and this transport falls back to host waits."""
        _ABANDONED_WAITERS.append(waiter)
        self._waiter, self._wait_mode = None, "host"

    def _wait_host(
        self,
        indices: tuple[int, ...],
        last: tuple[int, ...],
        peers: tuple[int, ...],
        deadline: float,
        timeout: float,
    ) -> list[int]:
        index = constant_index(indices, self._device)
        peer_index = constant_index(peers or (0,), self._device)
        expected = list(last)
        next_liveness = time.monotonic() + self._liveness_interval
        with torch.cuda.stream(self._poll_stream):
            while True:
                current = self._flags.index_select(0, index).tolist()  # one D2H per check
                if current != expected:
                    return [int(v) for v in current]
                if peers and any(self._aborts.index_select(0, peer_index).tolist()):
                    self._raise_aborted(peers)
                now = time.monotonic()
                if now >= next_liveness:
                    self._check_alive(peers)
                    next_liveness = now + self._liveness_interval
                if now >= deadline:
                    raise PeerTimeout(f"{self._name}: nothing arrived within {timeout:g} s")

    def _raise_aborted(self, peers: Sequence[int]) -> None:
        words = self._aborts.tolist()
        bad = [p for p in peers if words[p] != 0]
        raise PeerAborted(
            f"{self._name}: {self.role.opposite.value} rank(s) {bad} aborted (see their own "
            f"error for the cause)"
        )

    def _check_alive(self, peers: Sequence[int]) -> None:
        check_peers_alive(self._name, self.role.opposite.value, peers, self._peer_pids)

    def _wait_for_all(self, prefix: str, deadline: float | None) -> bool:
        """Wait until every rank set ``{prefix}/{rank}``; False if a rank failed or died.

        A rank that published ``afd/failed/{rank}`` or whose process is gone ends the wait
        at once; ``deadline`` (None: none) bounds a wait on ranks that are alive but slow.
        """
        world = range(self.topology.world_size)
        keys = [f"{prefix}/{w}" for w in world]
        failed = [f"afd/failed/{w}" for w in world]
        next_check = 0.0
        while not self._store.check(keys):
            now = time.monotonic()
            if now >= next_check:
                gone = [
                    w
                    for w in world
                    if self._store.check([failed[w]]) or not process_alive(*self._pids[w])
                ]
                if gone:
                    if prefix == "afd/ready":
                        raise PeerAborted(
                            f"{self._name}: world rank(s) {gone} failed or exited during start-up"
                        )
                    return False
                next_check = now + self._liveness_interval
            if deadline is not None and now >= deadline:
                raise PeerTimeout(f"{self._name}: not every rank reached {prefix!r} in time")
            time.sleep(0.005)
        return True

    def abort(self) -> None:
        if self._closed or self._aborted:
            return
        self._aborted = True
        with torch.cuda.stream(self._abort_stream):  # not behind a stuck compute stream
            for aborts in self._peer_aborts:
                aborts[self.rank : self.rank + 1].fill_(1)
        self._abort_stream.synchronize()
        # Peers waiting in close() stop waiting for this rank. The store may be gone
        # already; the abort words went out above either way.
        with contextlib.suppress(Exception):
            self._store.set(f"afd/failed/{self._world}", b"aborted")

    def close(self) -> None:
        """Collective teardown when every rank gets here cleanly; otherwise leave it to exit.

        Waits (without a fixed deadline) for every rank to reach ``close()`` while they are
        alive; a rank that aborted or died makes the others skip ``nvshmem_free`` and
        finalisation, which would wait for it forever.
        """
        if self._closed:
            return
        self._closed = True
        if self._aborted or self._heap_address == 0:
            return
        self._store.set(f"afd/close/{self._world}", b"1")
        if not self._wait_for_all("afd/close", deadline=None):
            return
        torch.cuda.synchronize(self._device)
        for name in ("_local", "_flags", "_aborts", "_peer_windows", "_peer_flags", "_peer_aborts"):
            self.__dict__.pop(name, None)
        self._waiter = None
        self._lib.barrier_all()
        self._lib.free(self._heap_address)
        self._heap_address = 0
        self._lib.finalize()

    def _check_peer(self, peer: int) -> int:
        if not 0 <= peer < self.num_peers:
            raise TopologyError(
                f"{self._name}: peer {peer} is outside [0, {self.num_peers}) "
                f"{self.role.opposite.value} ranks"
            )
        return peer
