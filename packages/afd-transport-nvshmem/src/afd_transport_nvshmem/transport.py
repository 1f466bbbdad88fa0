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
``NvshmemOptions(wait="device")`` (the default): a Triton program polls the flags on the
GPU and reports the flag values, and the header of every slot whose flag changed, to
pinned host memory (see :mod:`afd_transport_nvshmem.device_wait`); ``wait_any`` hands
those headers to the endpoints in its :class:`~afd_protocol.window.Arrivals`, so an
arrival costs no device-to-host copy. The wait is a replay of a captured CUDA graph
(``wait_graph=False``: a Triton launch per wait). ``wait="host"``: one device-to-host copy
of the watched flags per check, the fallback and the baseline. Both check the watched
peers' abort words and, between poll slices, that the peer processes are alive; both raise
:class:`PeerTimeout` after the timeout.

Endpoints
---------
:class:`NvshmemConnection` is the :class:`~afd_protocol.Connection` over this transport.
The attention endpoint it makes is the window layer's
:class:`~afd_transport_nvshmem.kernel_attention.KernelAttentionEndpoint` with the Triton kernels
(:mod:`afd_transport_nvshmem.kernels`, loaded when an endpoint is made): a fused combine,
and a device pack on request; the FFN endpoint's ``per_rank`` parts reduce with the Triton
reduce kernel.

Start-up and teardown
---------------------
Through :class:`~afd_protocol.Rendezvous`: every rank publishes its geometry, pid, GPU and
CUDA MPS share, checks every other rank's (the geometry; ranks sharing a GPU must all be
MPS clients with shares adding up to at most 100: :func:`~afd_transport_nvshmem.mps.
check_gpu_sharing`), and waits at a ``ready`` barrier before the collective NVSHMEM
start-up, so a mismatch fails every rank at once instead of leaving peers inside NVSHMEM.
The barriers after that (windows zeroed; everyone at ``close()``) are the rendezvous's,
not ``nvshmem_barrier_all``: they end when a peer fails or dies, and several PEs on one
GPU ("MPG") need no NVSHMEM call beyond those MPG supports. ``nvshmem_free`` and
finalisation are collective: they run only when every rank reached ``close()``. After a
failure a rank skips them rather than hang on a dead peer; the process exit reclaims the
GPU memory.

Several ranks per GPU
---------------------
One GPU per rank is the default and the production layout. Under CUDA MPS (every rank of
a GPU a client of one MPS server, active-thread percentages adding up to at most 100)
NVSHMEM runs in full MPG mode and so does this transport: ``nvshmem_ptr`` maps the other
process's heap on the same GPU, and rows move through HBM instead of NVLink.
:class:`~afd_transport_nvshmem.mps.MpsDaemon` starts and stops such a server; without MPS
the transport refuses at start-up, saying how to start it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch

from afd_protocol import (
    AFDError,
    EndpointOptions,
    InvalidArgument,
    KeyValueStore,
    PeerAborted,
    PeerTimeout,
    Rendezvous,
    Role,
    TcpStore,
    TopologyError,
    WindowLayout,
    constant_index,
)
from afd_protocol.window import (
    Arrivals,
    PublishBlock,
    WindowTransport,
    abort_words,
    flag_words,
)
from afd_transport_nvshmem.binding import NvshmemLibrary
from afd_transport_nvshmem.bootstrap import apply_single_node_defaults, bootstrap
from afd_transport_nvshmem.cuda_memory import (
    device_bytes,
    stream_memops_available,
    stream_write_value32,
)
from afd_transport_nvshmem.graphed_attention import (
    GraphedAttentionEndpoint,
    device_combine_wait,
)
from afd_transport_nvshmem.kernel_attention import KernelAttentionEndpoint, KernelWindowConnection
from afd_transport_nvshmem.kernel_specs import WindowKernels
from afd_transport_nvshmem.mps import check_gpu_sharing, client_share

if TYPE_CHECKING:
    from pathlib import Path

    from afd_transport_nvshmem.device_wait import DeviceWaiter
    from afd_transport_nvshmem.flag_publish import FlagBlock, FlagPublisher
    from afd_transport_nvshmem.put_path import PutBlock

WaitMode = Literal["device", "host"]
PublishMode = Literal["stream", "kernel"]
DataPath = Literal["mapped", "put"]
_ABANDONED_WAITERS: list[DeviceWaiter] = []
"""Device waiters whose kernel may still write their pinned buffers (see ``_abandon``)."""
POLL_SLICE = 20000
"""Device polls per wait slice; between slices the host checks liveness and the deadline."""


@dataclass(frozen=True)
class NvshmemOptions:
    """How an :class:`NvshmemTransport` waits, fixed when it is opened."""

    wait: WaitMode = "device"
    """``device``: a Triton poll on the GPU reporting flags and headers to pinned memory;
    ``host``: one device-to-host copy of the watched flags per check (the baseline)."""
    wait_graph: bool = True
    """Device waits replay a captured CUDA graph (False: one Triton launch per wait)."""
    publish: PublishMode = "stream"
    """How a dispatch's flags are set: ``stream``, one ``cuStreamWriteValue32`` per FFN
    rank; ``kernel``, one Triton launch for all of them with the values in pinned memory
    (:mod:`afd_transport_nvshmem.flag_publish`; what a CUDA graph can hold)."""
    exchange_graphs: int = 0
    """Attention endpoints replay each layer's packed dispatch and fused combine from CUDA
    graphs, holding up to this many token counts
    (:class:`~afd_transport_nvshmem.graphed_attention.GraphedAttentionEndpoint`); 0: eager."""
    data_path: DataPath = "mapped"
    """``mapped``: rows are stored straight into peers' windows through ``nvshmem_ptr``
    (one node, NVLink or P2P). ``put``: slots are composed in local staging and sent with
    NVSHMEM device puts, then the flag (:mod:`afd_transport_nvshmem.put_path`): what GPUs
    without peer mapping need; every rank must use the same. The graph-replayed FFN loop
    stores into peers' windows and needs ``mapped``."""

    def __post_init__(self) -> None:
        if self.exchange_graphs < 0:
            raise InvalidArgument(
                f"exchange_graphs is how many token counts are held as CUDA graphs (0: none), "
                f"got {self.exchange_graphs}"
            )
        if self.wait not in ("device", "host"):
            raise InvalidArgument(f"wait must be 'device' or 'host', got {self.wait!r}")
        if self.publish not in ("stream", "kernel"):
            raise InvalidArgument(f"publish must be 'stream' or 'kernel', got {self.publish!r}")
        if self.data_path not in ("mapped", "put"):
            raise InvalidArgument(f"data_path must be 'mapped' or 'put', got {self.data_path!r}")


def staging_stride(window: WindowLayout) -> int:
    """Bytes between consecutive peers' staging windows on the put path: one region's slots
    (``ring_depth`` of them). A sender writes only its own region of a peer's window, so
    the staging windows may overlap everywhere else: peer ``p``'s starts ``p`` strides in,
    and the regions this rank writes lie end to end, none inside another."""
    return window.ring_depth * window.slot.slot_bytes


def staging_bytes(window: WindowLayout) -> int:
    """The put path's staging allocation: a window for the last peer of the role with the
    most ranks (``num_regions``; the allocation is collective, so the same on every PE),
    ``num_regions - 1`` strides in."""
    return (window.num_regions - 1) * staging_stride(window) + window.total_bytes


def symmetric_bytes(window: WindowLayout, data_path: DataPath) -> int:
    """What a rank allocates in NVSHMEM's symmetric heap: its window, and on the put path
    the staging (:func:`staging_bytes`)."""
    return window.total_bytes + (staging_bytes(window) if data_path == "put" else 0)


class _CapturedHeaders(Mapping[int, torch.Tensor]):
    """The headers a device wait captured, by flag index, copied out of the waiter's pinned
    buffer only when an endpoint reads one (valid until the next wait reuses the buffer)."""

    def __init__(self, waiter: DeviceWaiter, positions: dict[int, int]) -> None:
        self._waiter = waiter
        self._positions = positions

    def __getitem__(self, index: int) -> torch.Tensor:
        return self._waiter.header(self._positions[index])

    def __iter__(self) -> Iterator[int]:
        return iter(self._positions)

    def __len__(self) -> int:
        return len(self._positions)


class NvshmemTransport(WindowTransport):
    """One rank's NVSHMEM windows; see the module docstring."""

    def __init__(
        self,
        window: WindowLayout,
        role: Role | str,
        rank: int,
        store: KeyValueStore | None = None,
        *,
        device: int | None = None,
        options: NvshmemOptions | None = None,
        connect_timeout: float = 60.0,
        liveness_interval: float = 0.05,
        library: NvshmemLibrary | None = None,
    ) -> None:
        super().__init__(window, Role(role), rank)
        self.options = options or NvshmemOptions()
        if not torch.cuda.is_available():
            raise TopologyError("the NVSHMEM transport needs a CUDA device; none is visible")
        topo = self.topology
        world = topo.world_rank(self.role, rank)
        count = torch.cuda.device_count()
        index = world % count if device is None else device
        self._device = torch.device("cuda", index)
        torch.cuda.set_device(self._device)
        torch.empty(1, device=self._device)  # create the context NVSHMEM will use
        self._name = f"{self.role.value} rank {rank}"
        if store is None:
            store = TcpStore(world, topo.world_size, connect_timeout)
        self._closed = False
        self._aborted = False
        self._heap_address = 0
        self.environment = apply_single_node_defaults(
            symmetric_bytes(window, self.options.data_path)
        )
        self._lib = library or NvshmemLibrary()
        rdv = Rendezvous(store, topo, self.role, rank, liveness_interval=liveness_interval)
        self._rendezvous = rdv
        everyone = list(range(topo.world_size))
        others = [w for w in everyone if w != world]
        peer_role = self.role.opposite
        self._peer_world = [topo.world_rank(peer_role, r) for r in range(self.num_peers)]
        self._liveness_interval = liveness_interval

        # Agree on the geometry and the GPUs with *every* rank before any collective call,
        # so that a mismatch fails every rank at once instead of leaving peers in NVSHMEM.
        gpu = str(torch.cuda.get_device_properties(self._device).uuid)
        share = client_share()
        self.mps_share = share
        """This rank's CUDA MPS share in percent (None: not an MPS client)."""
        data_path = self.options.data_path
        records = rdv.join(
            window.describe(), others, connect_timeout, gpu=gpu, mps=share, data_path=data_path
        )
        try:
            gpus = {w: str(r.extra["gpu"]) for w, r in records.items()} | {world: gpu}
            shares = {w: r.extra.get("mps") for w, r in records.items()} | {world: share}
            check_gpu_sharing(gpus, shares, topo.rank_name)
            self._device_library: Path | None = None
            if data_path == "put":  # before any collective call: a rank without it fails all
                from afd_transport_nvshmem.put_path import find_device_library

                self._device_library = find_device_library(self._lib.path)
            for w, r in records.items():
                theirs = r.extra.get("data_path", "mapped")
                if theirs != data_path:
                    raise TopologyError(
                        f"{self._name} uses data_path={data_path!r} but {topo.rank_name(w)} "
                        f"uses {theirs!r}: the put path allocates staging memory collectively, "
                        f"so every rank must use the same NvshmemOptions.data_path"
                    )
        except AFDError as exc:
            rdv.fail(str(exc))
            raise
        self.shares_gpu = len([g for g in gpus.values() if g == gpu]) > 1
        """Another rank runs on this rank's GPU (MPG under MPS)."""
        rdv.barrier("ready", others, connect_timeout)
        bootstrap(self._lib, store, world, topo.world_size, "afd/nvshmem/uid")

        self._heap_address = self._lib.malloc(window.total_bytes)
        self._local = device_bytes(self._heap_address, window.total_bytes, self._device)
        self._local.zero_()
        self._staging_address = 0
        self._staging: list[torch.Tensor] = []
        self._put_blocks: dict[tuple[tuple[int, ...], int, bool], PutBlock] = {}
        if data_path == "put":
            # Collective: the same size on every PE (the most peers either role has).
            self._staging_address = self._lib.malloc(staging_bytes(window))
            device_bytes(self._staging_address, staging_bytes(window), self._device).zero_()
            for p in range(self.num_peers):  # overlapping views (staging_stride)
                start = self._staging_address + p * staging_stride(window)
                self._staging.append(device_bytes(start, window.total_bytes, self._device))
        if self._staging:  # the abort's put, compiled now rather than on the failure path
            self._put_block(range(self.num_peers), window.abort_word_offset(rank), False).prepare()
        torch.cuda.synchronize(self._device)
        rdv.barrier("zeroed", others, connect_timeout)  # every window is zeroed before writes
        self._peer_windows: list[torch.Tensor] = []
        for w in self._peer_world:
            address = self._lib.peer_address(self._heap_address, w)
            if address == 0 and data_path == "mapped":
                raise TopologyError(
                    f"{self._name}: nvshmem_ptr returned NULL for world rank {w}: that GPU is not "
                    f"peer-to-peer reachable from cuda:{index}; the NVSHMEM transport supports "
                    f"a single node with NVLink/P2P between all GPUs (afd starts NVSHMEM "
                    f"without a network transport, so data_path='put' does not reach it either)"
                )
            if address:
                self._peer_windows.append(device_bytes(address, window.total_bytes, self._device))
        self._flags = flag_words(self._local, window)
        self._aborts = abort_words(self._local, window)
        self._peer_flags = [flag_words(t, window) for t in self._peer_windows]
        self._peer_aborts = [abort_words(t, window) for t in self._peer_windows]
        self._memops = stream_memops_available()
        self._poll_stream = torch.cuda.Stream(device=self._device)  # type: ignore[no-untyped-call]
        self._abort_stream = torch.cuda.Stream(device=self._device)  # type: ignore[no-untyped-call]
        self._waiter: DeviceWaiter | None = None
        if self.options.wait == "device":
            self._waiter = self._new_waiter()
        self._publisher: FlagPublisher | None = None
        self._block_publisher: FlagPublisher | None = None
        if self.options.publish == "kernel":
            from afd_transport_nvshmem.flag_publish import FlagPublisher

            self._publisher = FlagPublisher(self._device, self.num_peers)

    # ---- the WindowTransport interface ----------------------------------------------------

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def wait_mode(self) -> WaitMode:
        """How waits run now: as configured, or ``host`` after a device wait was abandoned."""
        return "device" if self._waiter is not None else "host"

    def _new_waiter(self) -> DeviceWaiter:
        from afd_transport_nvshmem.device_wait import DeviceWaiter, header_offsets

        window = self.window
        return DeviceWaiter(
            self._flags,
            self._aborts,
            self._local[: window.total_bytes // 4 * 4].view(torch.int32),
            header_offsets(window, self._device),
            window.slot.header_words,
            max_peers=self.num_peers,
            use_graph=self.options.wait_graph,
        )

    def local_window(self) -> torch.Tensor:
        return self._local

    @property
    def data_path(self) -> DataPath:
        """How rows reach peers (:attr:`NvshmemOptions.data_path`)."""
        return self.options.data_path

    def peer_window(self, peer: int) -> torch.Tensor:
        """``peer``'s window mapped into this process; on the put path, this rank's staging
        copy of it, which a publish puts to the peer."""
        if self._staging:
            return self._staging[self.check_peer(peer)]
        return self._peer_windows[self.check_peer(peer)]

    def _put_block(self, peers: Sequence[int], word_offset: int, slot: bool) -> PutBlock:
        """The put path's block publishing this rank's slot of flag ``word_offset`` (or, with
        ``slot=False``, only setting the int32 word at ``word_offset``) to ``peers``."""
        from afd_transport_nvshmem.put_path import PutBlock

        assert self._device_library is not None  # found at start-up on the put path
        wanted = tuple(self.check_peer(p) for p in peers)
        key = (wanted, word_offset, slot)
        block = self._put_blocks.get(key)
        if block is None:
            slot_offset = None
            if slot:
                region, ring = divmod(
                    (word_offset - self.window.flags_offset) // 4, self.window.ring_depth
                )
                slot_offset = self.window.slot_offset(region, ring)
            block = PutBlock(
                self._lib,
                self._device_library,
                self._device,
                [self._staging[p].data_ptr() for p in wanted],
                self._heap_address,
                [self._peer_world[p] for p in wanted],
                self.window,
                slot_offset,
                word_offset,
            )
            self._put_blocks[key] = block
        return block

    def _flag_offset(self, flag_index: int) -> int:
        return self.window.flags_offset + 4 * flag_index

    def publish(self, peer: int, flag_index: int, value: int) -> None:
        if self._staging:
            self._put_block([peer], self._flag_offset(flag_index), True).publish([value])
            return
        flags = self._peer_flags[self.check_peer(peer)]
        if self._memops:
            address = flags.data_ptr() + 4 * flag_index
            stream_write_value32(address, value, torch.cuda.current_stream(self._device))
        else:
            flags[flag_index : flag_index + 1].fill_(value)

    def publish_all(self, peers: Sequence[int], flag_index: int, values: Sequence[int]) -> None:
        if self._staging and len(peers) == len(values):
            self._put_block(peers, self._flag_offset(flag_index), True).publish(values)
            return
        if self._publisher is None or len(peers) != len(values):
            super().publish_all(peers, flag_index, values)  # (which names a length mismatch)
            return
        self._flag_block(self._publisher, peers, flag_index).publish(values)

    def publish_block(self, peers: Sequence[int], flag_index: int) -> PublishBlock:
        """One Triton launch with a release store at system scope per flag, values read from
        pinned memory when it runs (:class:`~afd_transport_nvshmem.flag_publish.FlagBlock`;
        the graph-replayed exchange captures it). Shares the ``publish="kernel"`` blocks.
        On the put path: the slot's puts, then the flag (:class:`~afd_transport_nvshmem.
        put_path.PutBlock`), as capturable."""
        if self._staging:
            return self._put_block(peers, self._flag_offset(flag_index), True)
        publisher = self._publisher or self._block_publisher
        if publisher is None:  # publish="stream": blocks of their own, publish_all unchanged
            from afd_transport_nvshmem.flag_publish import FlagPublisher

            publisher = self._block_publisher = FlagPublisher(self._device, self.num_peers)
        return self._flag_block(publisher, peers, flag_index)

    def _flag_block(
        self, publisher: FlagPublisher, peers: Sequence[int], flag_index: int
    ) -> FlagBlock:
        """``publisher``'s block for flag ``flag_index`` of ``peers`` (made on first use)."""
        wanted = [self.check_peer(p) for p in peers]

        def addresses() -> list[int]:
            return [self._peer_flags[p].data_ptr() + 4 * flag_index for p in wanted]

        return publisher.block((tuple(wanted), flag_index), addresses)

    def wait_any(
        self,
        flag_indices: Sequence[int],
        last_seen: Sequence[int],
        timeout: float,
        peers: Sequence[int],
    ) -> Arrivals:
        indices, last, watched = tuple(flag_indices), tuple(last_seen), tuple(peers)
        deadline = time.monotonic() + timeout
        if self._waiter is not None:
            return self._wait_device(self._waiter, indices, last, watched, deadline, timeout)
        return self._wait_host(indices, last, watched, deadline, timeout)

    def _wait_device(
        self,
        waiter: DeviceWaiter,
        indices: tuple[int, ...],
        last: tuple[int, ...],
        peers: tuple[int, ...],
        deadline: float,
        timeout: float,
    ) -> Arrivals:
        next_liveness = time.monotonic() + self._liveness_interval
        while True:
            waiter.launch(indices, last, peers, POLL_SLICE)
            try:
                status = waiter.status()
                while status == 0:
                    now = time.monotonic()
                    if now >= next_liveness:
                        self.check_alive(peers)
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
                positions = {
                    index: position
                    for position, (index, value, old) in enumerate(
                        zip(indices, values, last, strict=True)
                    )
                    if value != old
                }
                return Arrivals(values, _CapturedHeaders(waiter, positions))
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
        self._waiter = None

    def _wait_host(
        self,
        indices: tuple[int, ...],
        last: tuple[int, ...],
        peers: tuple[int, ...],
        deadline: float,
        timeout: float,
    ) -> Arrivals:
        index = constant_index(indices, self._device)
        peer_index = constant_index(peers or (0,), self._device)
        expected = list(last)
        next_liveness = time.monotonic() + self._liveness_interval
        with torch.cuda.stream(self._poll_stream):
            while True:
                current = self._flags.index_select(0, index).tolist()  # one D2H per check
                if current != expected:
                    return Arrivals([int(v) for v in current])
                if peers and any(self._aborts.index_select(0, peer_index).tolist()):
                    self._raise_aborted(peers)
                now = time.monotonic()
                if now >= next_liveness:
                    self.check_alive(peers)
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

    def check_alive(self, peers: Sequence[int]) -> None:
        """Raise :class:`PeerAborted` when one of ``peers`` or the launcher exited (the
        rendezvous's process checks)."""
        self._rendezvous.check_alive([self._peer_world[p] for p in peers])

    def abort(self) -> None:
        if self._closed or self._aborted:
            return
        self._aborted = True
        if self._heap_address:
            with torch.cuda.stream(self._abort_stream):  # not behind a stuck compute stream
                if self._staging:
                    offset = self.window.abort_word_offset(self.rank)
                    everyone = range(self.num_peers)
                    self._put_block(everyone, offset, False).publish([1] * self.num_peers)
                else:
                    for aborts in self._peer_aborts:
                        aborts[self.rank : self.rank + 1].fill_(1)
            self._abort_stream.synchronize()
        # Peers waiting at a barrier (close) stop waiting for this rank.
        self._rendezvous.fail("aborted")

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
        others = [w for w in range(self.topology.world_size) if w != self._rendezvous.world_rank]
        try:
            self._rendezvous.barrier("close", others, timeout=None)
        except PeerAborted:
            return
        torch.cuda.synchronize(self._device)
        for name in ("_local", "_flags", "_aborts", "_peer_windows", "_peer_flags", "_peer_aborts"):
            self.__dict__.pop(name, None)
        self._waiter = None
        self._staging = []
        self._put_blocks.clear()
        if self._staging_address:
            from afd_transport_nvshmem.put_path import release_modules

            release_modules(self._lib)
            self._lib.free(self._staging_address)  # collective, in the reverse order of malloc
            self._staging_address = 0
        self._lib.free(self._heap_address)
        self._heap_address = 0
        self._lib.finalize()


class NvshmemConnection(KernelWindowConnection):
    """An :class:`NvshmemTransport` as a :class:`~afd_protocol.Connection`: the kernel
    attention endpoint with the Triton kernels (fused combine, device pack), and the FFN
    window endpoint whose ``per_rank`` parts reduce with the Triton kernel."""

    transport: NvshmemTransport

    def __init__(self, transport: NvshmemTransport) -> None:
        super().__init__(transport)

    def endpoint_kernels(self) -> WindowKernels:
        """The Triton kernels, imported (with Triton) when the first endpoint is made."""
        from afd_transport_nvshmem.kernels import triton_kernels

        return triton_kernels()

    def attention_endpoint(self, options: EndpointOptions | None = None) -> KernelAttentionEndpoint:
        """This attention rank's endpoint with the Triton kernels, graph-replayed when the
        transport was opened with ``NvshmemOptions(exchange_graphs=N)``."""
        graphs = self.transport.options.exchange_graphs
        if graphs:
            return self.graphed_attention_endpoint(options, graphs)
        return super().attention_endpoint(options)

    def graphed_attention_endpoint(
        self,
        options: EndpointOptions | None = None,
        max_token_counts: int = 8,
        wait_in_graph: bool = True,
        kernels: WindowKernels | None = None,
        defer_checks: bool = False,
    ) -> GraphedAttentionEndpoint:
        """This attention rank's endpoint with its exchange replayed from CUDA graphs, up to
        ``max_token_counts`` token counts held (whatever the transport's options say);
        ``wait_in_graph``: each combine graph waits for its replies on the device (False:
        the host waits first, then replays the combine); ``kernels``: instead of the
        connection's (``afd bench transport`` swaps in the torch device plan, say);
        ``defer_checks``: replayed combines return without the host waiting, their replies
        checked at the ring's next combine or ``flush()``."""
        kernels = kernels if kernels is not None else self.endpoint_kernels()
        wait = device_combine_wait if wait_in_graph else None
        return GraphedAttentionEndpoint(
            self.transport,
            options,
            kernels,
            max_token_counts,
            combine_wait=wait,
            defer_checks=defer_checks,
        )
