"""The NVSHMEM transport's waits, abort and teardown, driven on the CPU by a fake library.

CI has no GPU, so the transport's constructor (CUDA context, NVSHMEM heap) cannot run
here; but what it decides afterwards -- when a host wait returns, times out or reports an
aborted peer, what ``abort`` tells the peers, and whether ``close`` may call NVSHMEM's
collective teardown (only when every rank reached ``close``; never after an abort or when
a peer failed, which would wait forever) -- depends only on the window words, the
rendezvous and the library. :func:`transport` builds the object the constructor would
leave behind, on CPU tensors, with a recording fake library and a scriptable rendezvous,
and the tests drive those methods. The GPU suite covers the same paths on real windows.
"""

from __future__ import annotations

import contextlib
import itertools
from typing import Any

import pytest
import torch

from afd_protocol import InvalidArgument, PeerAborted, PeerTimeout, Role, SlotLayout, Topology
from afd_protocol.window import LoopbackTransport, abort_words, flag_words
from afd_transport_nvshmem.transport import NvshmemOptions, NvshmemTransport


class FakeLibrary:
    """Records the NVSHMEM calls the transport makes."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def barrier_all(self) -> None:
        self.calls.append(("barrier_all",))

    def free(self, address: int) -> None:
        self.calls.append(("free", address))

    def finalize(self) -> None:
        self.calls.append(("finalize",))


class FakeRendezvous:
    """The rendezvous calls the transport makes after start-up, scriptable per test."""

    def __init__(self, world_rank: int) -> None:
        self.world_rank = world_rank
        self.failed: list[str] = []
        self.barriers: list[tuple[str, tuple[int, ...]]] = []
        self.alive_checks = 0
        self.barrier_error: BaseException | None = None
        self.dead: str | None = None

    def barrier(self, name: str, peers: list[int], timeout: float | None) -> None:
        self.barriers.append((name, tuple(peers)))
        if self.barrier_error is not None:
            raise self.barrier_error

    def check_alive(self, peers: list[int]) -> None:
        self.alive_checks += 1
        if self.dead is not None:
            raise PeerAborted(self.dead)

    def fail(self, reason: str) -> None:
        self.failed.append(reason)


class FakeStream:
    def synchronize(self) -> None:
        """Nothing is queued on a CPU."""


@pytest.fixture(autouse=True)
def cpu_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """Stream contexts and device syncs are no-ops for windows on the CPU."""
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)


def transport(role: Role = Role.ATTENTION, rank: int = 0) -> tuple[NvshmemTransport, dict]:  # type: ignore[type-arg]
    """What ``NvshmemTransport.__init__`` leaves behind, on CPU windows (module docstring);
    returns the transport and its fakes, with every rank's window."""
    topo = Topology(1, 2, 4)
    window = SlotLayout(topo, 8, 4, 2, dtype="float32").window()
    t = NvshmemTransport.__new__(NvshmemTransport)
    NvshmemTransport.__bases__[0].__init__(t, window, role, rank)  # WindowTransport
    world = topo.world_rank(role, rank)
    local = torch.zeros(window.total_bytes, dtype=torch.uint8)
    peers = [torch.zeros(window.total_bytes, dtype=torch.uint8) for _ in range(t.num_peers)]
    fakes = {"lib": FakeLibrary(), "rdv": FakeRendezvous(world), "local": local, "peers": peers}
    t.__dict__.update(
        options=NvshmemOptions(wait="host"),
        _device=torch.device("cpu"),
        _name=f"{role.value} rank {rank}",
        _closed=False,
        _aborted=False,
        _heap_address=0x1000,
        _lib=fakes["lib"],
        _rendezvous=fakes["rdv"],
        _peer_world=[topo.world_rank(role.opposite, p) for p in range(t.num_peers)],
        _liveness_interval=0.01,
        _local=local,
        _peer_windows=peers,
        _flags=flag_words(local, window),
        _aborts=abort_words(local, window),
        _peer_flags=[flag_words(p, window) for p in peers],
        _peer_aborts=[abort_words(p, window) for p in peers],
        _memops=False,
        _poll_stream=None,
        _abort_stream=FakeStream(),
        _waiter=None,
        _staging_address=0,  # the mapped path: no staging, no put blocks
        _staging=[],
        _put_blocks={},
    )
    return t, fakes


def test_a_host_wait_returns_what_changed_and_checks_liveness() -> None:
    t, fakes = transport()
    t._flags[1] = 7  # FFN rank 1's reply flag (one ring slot per FFN rank)
    arrivals = t.wait_any([0, 1], [0, 0], timeout=1.0, peers=[0, 1])
    assert arrivals.values == [0, 7]
    with pytest.raises(PeerTimeout, match=r"attention rank 0: nothing arrived within 0\.05 s"):
        t.wait_any([0, 1], [0, 7], timeout=0.05, peers=[0, 1])
    assert fakes["rdv"].alive_checks >= 1  # checked every liveness interval while waiting
    fakes["rdv"].dead = "ffn rank 1 (pid 42) exited"
    with pytest.raises(PeerAborted, match="pid 42"):  # within one interval, not the timeout
        t.wait_any([1], [7], timeout=30.0, peers=[1])


def test_an_aborted_peer_ends_a_wait_naming_it() -> None:
    t, _ = transport()
    t._aborts[1] = 1
    with pytest.raises(PeerAborted, match=r"ffn rank\(s\) \[1\] aborted"):
        t.wait_any([0], [0], timeout=1.0, peers=[0, 1])
    # A wait that does not watch the aborted peer is not ended by it.
    with pytest.raises(PeerTimeout):
        t.wait_any([0], [0], timeout=0.02, peers=[0])


def test_abort_reaches_every_peer_once_and_close_then_skips_the_teardown() -> None:
    t, fakes = transport(Role.FFN, 1)
    t.abort()
    t.abort()  # idempotent
    for peer in fakes["peers"]:
        assert abort_words(peer, t.window)[1] == 1  # this rank's word in every peer window
    assert fakes["rdv"].failed == ["aborted"]  # peers at a barrier stop waiting for it
    t.close()
    assert fakes["lib"].calls == []  # no collective teardown a dead peer would hang in
    assert fakes["rdv"].barriers == []


def test_a_clean_close_waits_for_everyone_then_tears_down_once() -> None:
    t, fakes = transport()
    t.close()
    t.close()  # idempotent
    assert fakes["rdv"].barriers == [("close", (1, 2))]  # every other world rank
    # nvshmem_free and finalisation after the rendezvous's close barrier; no
    # nvshmem_barrier_all (not supported when several PEs share a GPU without MPS, and
    # the rendezvous's barrier ends when a peer dies)
    assert fakes["lib"].calls == [("free", 0x1000), ("finalize",)]
    assert t._heap_address == 0
    t.abort()  # after close: nothing to tell, nothing raised
    assert fakes["rdv"].failed == []


def test_close_when_a_peer_failed_leaves_the_teardown_to_process_exit() -> None:
    t, fakes = transport()
    fakes["rdv"].barrier_error = PeerAborted("ffn rank 0 failed")
    t.close()  # returns instead of waiting in NVSHMEM for a rank that will never come
    assert fakes["lib"].calls == []


def test_the_connection_makes_kernel_endpoints_loading_the_kernels_late(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``NvshmemConnection``: the window layer's endpoints with the Triton kernels, loaded
    when an endpoint is made, not when the connection opens (stand-ins here: CI has no
    Triton); ``abort`` and ``close`` reach the transport."""
    from afd_protocol import EndpointOptions
    from afd_transport_nvshmem import kernels
    from afd_transport_nvshmem.kernel_attention import KernelAttentionEndpoint
    from afd_transport_nvshmem.kernel_specs import REFERENCE_KERNELS, WindowKernels
    from afd_transport_nvshmem.transport import NvshmemConnection

    loads: list[str] = []

    def triton_kernels() -> WindowKernels:
        loads.append("triton")
        return REFERENCE_KERNELS

    monkeypatch.setattr(kernels, "triton_kernels", triton_kernels)
    t, fakes = transport()
    connection = NvshmemConnection(t)
    assert connection.transport is t
    assert loads == []  # nothing loaded yet
    attention = connection.attention_endpoint(EndpointOptions(timeout=0.05))
    assert type(attention) is KernelAttentionEndpoint
    assert loads == ["triton"]
    attention.close()
    ffn_transport, _ = transport(Role.FFN, 0)
    NvshmemConnection(ffn_transport).ffn_endpoint(EndpointOptions(timeout=0.05)).close()
    assert loads == ["triton", "triton"]  # the FFN endpoint's per_rank reduce
    connection.abort()
    connection.close()
    assert [int(abort_words(peer, t.window)[0]) for peer in fakes["peers"]] == [1, 1]
    assert fakes["rdv"].failed == ["aborted"]
    assert fakes["lib"].calls == []  # closed after an abort: no collective teardown


def test_the_data_path_option_names_its_choices() -> None:
    assert NvshmemOptions().data_path == "mapped"
    assert NvshmemOptions(data_path="put").data_path == "put"
    with pytest.raises(InvalidArgument, match="data_path must be 'mapped' or 'put', got 'rdma'"):
        NvshmemOptions(data_path="rdma")  # type: ignore[arg-type]


def test_the_graphed_ffn_loop_refuses_the_put_path() -> None:
    """It stores replies straight into peers' windows, which the put path does not map."""
    from afd_protocol.window import LoopbackWorld

    pytest.importorskip("triton")
    from afd_transport_nvshmem.graphed_ffn import GraphedFFNServer

    class PutLoopback(LoopbackTransport):
        data_path = "put"

    window = SlotLayout(Topology(1, 1, 4), 8, 4, 2, dtype="float32").window()
    transport = PutLoopback(LoopbackWorld(window), Role.FFN, 0)
    with pytest.raises(InvalidArgument, match="data_path='mapped'"):
        GraphedFFNServer(transport, step=None)  # type: ignore[arg-type]


def test_the_symmetric_heap_holds_the_put_paths_staging() -> None:
    """NVSHMEM_SYMMETRIC_SIZE follows from this: on the put path the window and the staging,
    whose per-peer windows overlap but for the region each rank writes; those regions are
    disjoint and inside the allocation for every rank of either role."""
    from afd_transport_nvshmem.transport import staging_bytes, staging_stride, symmetric_bytes

    window = SlotLayout(Topology(2, 3, 6), 64, 32, 2, dtype="bfloat16").window(ring_depth=2)
    region = window.ring_depth * window.slot.slot_bytes
    assert symmetric_bytes(window, "mapped") == window.total_bytes
    assert staging_bytes(window) == 2 * region + window.total_bytes  # 3 regions
    assert symmetric_bytes(window, "put") == window.total_bytes + staging_bytes(window)
    assert staging_bytes(window) < 3 * window.total_bytes  # what whole windows would take
    for role in Role:
        for rank in range(window.slot.topology.num_role_ranks(role)):
            peers = window.slot.topology.num_role_ranks(role.opposite)
            used = []
            for p in range(peers):
                start = p * staging_stride(window) + window.slot_offset(rank, 0)
                used.append((start, start + region))
                assert p * staging_stride(window) + window.total_bytes <= staging_bytes(window)
            used.sort()
            assert all(a[1] <= b[0] for a, b in itertools.pairwise(used)), used
