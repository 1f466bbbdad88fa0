"""Endpoint logic driven step by step in one process over the loopback transport."""

from __future__ import annotations

import pytest
import torch

from afd_protocol import (
    AttentionEndpoint,
    CapacityError,
    ConnectorShutdown,
    FFNEndpoint,
    LoopbackWorld,
    PeerAborted,
    PeerTimeout,
    ProtocolError,
    Role,
    SlotLayout,
    Topology,
    TopologyError,
    Word,
    flag_words,
    plan_dispatch,
    reference_device_pack,
    reference_fused_combine,
    slot_view,
)
from afd_protocol.loopback import LoopbackTransport
from afd_protocol.testing import LinearExperts, random_routing

HIDDEN = 8


def make_world(
    a: int = 2,
    f: int = 2,
    experts: int = 7,
    topk: int = 3,
    ring_depth: int = 1,
    shared: str = "attention",
    per_dp: int = 1,
    tokens: int = 32,
) -> LoopbackWorld:
    topo = Topology(a, f, experts, attn_ranks_per_dp=per_dp)
    layout = SlotLayout(topo, HIDDEN, tokens, topk, dtype="float32", shared_placement=shared)
    return LoopbackWorld(layout.window(ring_depth=ring_depth))


def endpoints(world: LoopbackWorld) -> tuple[list[AttentionEndpoint], list[FFNEndpoint]]:
    topo = world.window.slot.topology
    attn = [
        AttentionEndpoint(world.transport(Role.ATTENTION, r), timeout=0.05)
        for r in range(topo.num_attention_ranks)
    ]
    ffn = [
        FFNEndpoint(world.transport(Role.FFN, r), timeout=0.05) for r in range(topo.num_ffn_ranks)
    ]
    return attn, ffn


def linear_experts(world: LoopbackWorld, layers: int = 4) -> LinearExperts:
    topo = world.window.slot.topology
    return LinearExperts(layers, topo.num_experts, HIDDEN, seed=0)


def route(num_tokens: int, topk: int, experts: list[int], seed: int) -> tuple[torch.Tensor, ...]:
    return random_routing(num_tokens, HIDDEN, topk, experts, torch.Generator().manual_seed(seed))


def drain(ffns: list[FFNEndpoint], experts: LinearExperts) -> list[tuple[int, int, int]]:
    """Serve every ready item on every FFN rank; returns (ffn, replica, layer) served."""
    served = []
    for ffn in ffns:
        while True:
            try:
                item = ffn.next_work_item(timeout=0.001)
            except PeerTimeout:
                break
            experts.serve(ffn, item)
            served.append((ffn.rank, item.replica, item.layer))
    return served


@pytest.mark.parametrize("shared", ["attention", "ffn"])
def test_two_replicas_on_different_layers_match_the_reference(shared: str) -> None:
    world = make_world(shared=shared, ring_depth=2)
    attn, ffns = endpoints(world)
    experts = linear_experts(world)
    # Replica 0 is on layer 3 with 30 tokens while replica 1 is on layer 0 with 5 tokens,
    # and replica 1 also has a second stage in flight.
    jobs = [
        (attn[0], 3, *route(30, 3, list(range(7)), 1)),
        (attn[1], 0, *route(5, 3, list(range(7)), 2)),
        (attn[1], 1, *route(4, 3, list(range(7)), 3)),
    ]
    pending = [
        (ep, layer, x, ids, w, ep.dispatch(layer, x, ids, w, stage=i % 2))
        for i, (ep, layer, x, ids, w) in enumerate(jobs)
    ]
    drain(ffns, experts)
    for ep, layer, x, ids, w, handle in pending:
        out = ep.combine(handle)
        expected = experts.reference(layer, x, ids, w, shared == "ffn")
        torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-4)


def test_a_rank_that_receives_nothing_is_not_waited_on() -> None:
    world = make_world(a=1)
    attn, ffns = endpoints(world)
    experts = linear_experts(world)
    ffn0_experts = list(world.window.slot.topology.local_experts(0))
    x, ids, w = route(6, 3, ffn0_experts, 4)
    handle = attn[0].dispatch(0, x, ids, w)
    assert set(handle.expected_ffn) == {0}
    with pytest.raises(PeerTimeout, match="FFN rank 1: no work item"):
        ffns[1].next_work_item(timeout=0.01)
    experts.serve(ffns[0], ffns[0].next_work_item())
    out = attn[0].combine(handle)
    torch.testing.assert_close(
        out.double(), experts.reference(0, x, ids, w, False), rtol=1e-5, atol=1e-4
    )


def test_scan_start_rotates_so_no_ready_replica_starves() -> None:
    world = make_world(a=3, f=1, experts=4, topk=2, ring_depth=4)
    attn, (ffn,) = endpoints(world)
    experts = linear_experts(world)

    def send(ep: AttentionEndpoint, layer: int) -> None:
        x, ids, w = route(3, 2, [0, 1, 2, 3], layer)
        ep.dispatch(layer, x, ids, w, stage=layer)

    for layer in range(4):  # replicas 0 and 1 keep four items ready
        send(attn[0], layer)
        send(attn[1], layer)
    send(attn[2], 0)  # replica 2 publishes once, last
    picks = []
    for _ in range(6):
        item = ffn.next_work_item()
        picks.append(item.replica)
        experts.serve(ffn, item)
    assert picks[:3] == [0, 1, 2]
    assert picks.count(2) == 1
    assert picks[3:] == [0, 1, 0]


def test_a_replica_with_two_participants_is_ready_only_when_both_published() -> None:
    world = make_world(a=2, f=2, per_dp=2)
    attn, ffns = endpoints(world)
    topo = world.window.slot.topology
    experts = linear_experts(world)
    x0, ids0, w0 = route(5, 3, list(range(7)), 5)
    x1, ids1, w1 = route(4, 3, list(topo.local_experts(0)), 6)  # nothing for FFN rank 1
    h0 = attn[0].dispatch(2, x0, ids0, w0)
    with pytest.raises(PeerTimeout):
        ffns[0].next_work_item(timeout=0.01)  # only one participant has published
    h1 = attn[1].dispatch(2, x1, ids1, w1)
    assert set(h1.expected_ffn) == {0, 1}  # participants publish to every FFN rank
    for ffn in ffns:
        item = ffn.next_work_item()
        assert (item.replica, item.layer) == (0, 2)
        assert [p.src_rank for p in item.parts] == [0, 1]
        experts.serve(ffn, item)
    torch.testing.assert_close(
        attn[0].combine(h0).double(),
        experts.reference(2, x0, ids0, w0, False),
        rtol=1e-5,
        atol=1e-4,
    )
    torch.testing.assert_close(
        attn[1].combine(h1).double(),
        experts.reference(2, x1, ids1, w1, False),
        rtol=1e-5,
        atol=1e-4,
    )


def test_capacity_overflow_and_ring_exhaustion_write_nothing_and_lose_nothing() -> None:
    world = make_world(a=1, ring_depth=1, tokens=8)
    attn, ffns = endpoints(world)
    experts = linear_experts(world)
    before = [flag_words(world.windows[(Role.FFN, r)], world.window).clone() for r in range(2)]
    with pytest.raises(CapacityError, match="9 tokens exceeds token_cap=8"):
        attn[0].dispatch(0, *route(9, 3, list(range(7)), 7))
    for r in range(2):
        assert torch.equal(flag_words(world.windows[(Role.FFN, r)], world.window), before[r])
    x, ids, w = route(8, 3, list(range(7)), 8)
    handle = attn[0].dispatch(0, x, ids, w)
    with pytest.raises(TopologyError, match="ring exhausted: 1 dispatches are in flight"):
        attn[0].dispatch(1, x, ids, w)
    drain(ffns, experts)
    torch.testing.assert_close(
        attn[0].combine(handle).double(),
        experts.reference(0, x, ids, w, False),
        rtol=1e-5,
        atol=1e-4,
    )
    with pytest.raises(ProtocolError, match="not in flight"):
        attn[0].combine(handle)


def test_missing_reply_times_out_naming_the_ranks() -> None:
    world = make_world(a=1)
    attn, _ = endpoints(world)
    handle = attn[0].dispatch(4, *route(6, 3, list(range(7)), 9))
    with pytest.raises(PeerTimeout, match=r"FFN ranks \[0, 1\] did not reply to layer 4"):
        attn[0].combine(handle, timeout=0.02)


def test_stale_reply_is_rejected() -> None:
    world = make_world(a=1, f=1, experts=4)
    attn, (ffn,) = endpoints(world)
    experts = linear_experts(world)
    x, ids, w = route(4, 3, list(range(4)), 10)
    first = attn[0].dispatch(0, x, ids, w)
    experts.serve(ffn, ffn.next_work_item())
    attn[0].combine(first)
    second = attn[0].dispatch(1, x, ids, w)
    item = ffn.next_work_item()
    assert item.layer == 1
    # Bump the reply flag without writing a new reply: the slot still holds the reply to
    # the first dispatch (FFN seq 1, answering attention seq 1).
    flag = world.window.flag_index(0, 0)
    old = int(flag_words(world.windows[(Role.ATTENTION, 0)], world.window)[flag])
    world.transport(Role.FFN, 0).publish(0, flag, old + 100)
    with pytest.raises(ProtocolError, match="SEQ=1 but the flag says 101") as caught:
        attn[0].combine(second)
    assert "ANSWER_SEQ=1 but this dispatch was seq 2" in str(caught.value)


def test_garbage_in_a_slot_raises_protocol_error_and_the_endpoint_recovers() -> None:
    world = make_world(a=1, f=1, experts=4)
    attn, (ffn,) = endpoints(world)
    experts = linear_experts(world)
    window = world.windows[(Role.FFN, 0)]
    header_at = world.window.field_offset(0, 0, "header")
    window[header_at : header_at + 64] = torch.randint(0, 256, (64,), dtype=torch.uint8)
    world.transport(Role.ATTENTION, 0).publish(0, world.window.flag_index(0, 0), 999)
    with pytest.raises(ProtocolError, match="slot from attention rank 0 \\(ring 0\\)"):
        ffn.next_work_item()
    x, ids, w = route(4, 3, list(range(4)), 11)
    handle = attn[0].dispatch(0, x, ids, w)
    experts.serve(ffn, ffn.next_work_item())
    torch.testing.assert_close(
        attn[0].combine(handle).double(),
        experts.reference(0, x, ids, w, False),
        rtol=1e-5,
        atol=1e-4,
    )


def test_shutdown_reaches_the_other_role_after_pending_work() -> None:
    world = make_world()
    attn, ffns = endpoints(world)
    experts = linear_experts(world)
    x, ids, w = route(4, 3, list(range(7)), 12)
    handle = attn[0].dispatch(0, x, ids, w)
    with pytest.raises(Exception, match="dispatches in flight"):
        attn[0].announce_shutdown()
    drain(ffns, experts)
    attn[0].combine(handle)
    attn[0].announce_shutdown()
    with pytest.raises(PeerTimeout):
        ffns[0].next_work_item(timeout=0.01)  # attention rank 1 has not shut down yet
    attn[1].announce_shutdown()
    for ffn in ffns:
        with pytest.raises(ConnectorShutdown, match="every attention rank shut down"):
            ffn.next_work_item()
    with pytest.raises(ConnectorShutdown):
        attn[0].dispatch(0, x, ids, w)


def test_ffn_shutdown_and_abort_wake_a_waiting_attention_rank() -> None:
    world = make_world(a=1)
    attn, ffns = endpoints(world)
    handle = attn[0].dispatch(0, *route(4, 3, list(range(7)), 13))
    ffns[0].announce_shutdown()
    with pytest.raises(ConnectorShutdown, match="FFN rank 0 shut down while layer 0"):
        attn[0].combine(handle)

    world = make_world(a=1)
    attn, ffns = endpoints(world)
    handle = attn[0].dispatch(0, *route(4, 3, list(range(7)), 13))
    ffns[1].abort()
    with pytest.raises(PeerAborted, match=r"rank\(s\) \[1\] aborted"):
        attn[0].combine(handle)


def test_bad_inputs_say_what_to_change() -> None:
    world = make_world(a=1)
    attn, ffns = endpoints(world)
    x, ids, w = route(4, 3, list(range(7)), 14)
    with pytest.raises(TopologyError, match=r"bfloat16 but the window carries torch\.float32"):
        attn[0].dispatch(0, x.bfloat16(), ids, w)
    with pytest.raises(TopologyError, match=r"must be \[num_tokens, 8\]"):
        attn[0].dispatch(0, x[:, :4], ids, w)
    with pytest.raises(TopologyError, match="must agree"):
        attn[0].dispatch(0, x, ids, w[:, :2])
    with pytest.raises(TopologyError, match="role attention"):
        AttentionEndpoint(world.transport(Role.FFN, 0))
    handle = attn[0].dispatch(0, x, ids, w)
    item = ffns[0].next_work_item()
    with pytest.raises(ProtocolError, match="routed_out has shape"):
        ffns[0].reply(item, torch.zeros(1, HIDDEN))
    ffns[0].reply(item, torch.zeros(item.num_routed_rows, HIDDEN))
    with pytest.raises(ProtocolError, match="not in service"):
        ffns[0].reply(item, torch.zeros(item.num_routed_rows, HIDDEN))
    del handle


def test_a_combine_retried_after_a_timeout_waits_only_for_the_missing_rank() -> None:
    world = make_world(a=1)
    attn, ffns = endpoints(world)
    experts = linear_experts(world)
    x, ids, w = route(6, 3, list(range(7)), 15)
    handle = attn[0].dispatch(1, x, ids, w)
    experts.serve(ffns[0], ffns[0].next_work_item())
    with pytest.raises(PeerTimeout, match=r"FFN ranks \[1\] did not reply"):
        attn[0].combine(handle, timeout=0.02)
    experts.serve(ffns[1], ffns[1].next_work_item())
    out = attn[0].combine(handle, timeout=1.0)
    expected = experts.reference(1, x, ids, w, False)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-4)


def test_a_dispatch_refused_before_any_write_keeps_its_ring() -> None:
    world = make_world(a=1, ring_depth=1)
    attn, _ffns = endpoints(world)
    x, ids, w = route(4, 3, list(range(7)), 16)
    with pytest.raises(TopologyError, match="requires grad"):
        attn[0].dispatch(0, x.clone().requires_grad_(), ids, w)
    with pytest.raises(TopologyError, match="topk=3"):
        attn[0].dispatch(0, x, ids[:, :2], w[:, :2])
    handle = attn[0].dispatch(0, x, ids, w)  # the ring is still free
    assert handle.ring == 0


def test_low_precision_payloads_are_refused_until_the_endpoints_send_them() -> None:
    topo = Topology(1, 1, 4)
    layout = SlotLayout(topo, HIDDEN, 8, 2, dtype="bfloat16", payload_dtype="float8_e4m3fn")
    world = LoopbackWorld(layout.window())
    with pytest.raises(TopologyError, match="low-precision payloads"):
        AttentionEndpoint(world.transport(Role.ATTENTION, 0))


class CapturingTransport(LoopbackTransport):
    """Like a device wait that brings headers to the host with the flag: the header is
    snapshotted when the flag is seen, then the window's copy is made undecodable."""

    def __init__(self, world: LoopbackWorld, role: Role, rank: int) -> None:
        super().__init__(world, role, rank)
        self.reads: list[tuple[int, int]] = []
        self._snapshots: dict[int, tuple[int, torch.Tensor]] = {}

    def wait_any(self, flag_indices, last_seen, timeout, peers):  # type: ignore[no-untyped-def]
        values = super().wait_any(flag_indices, last_seen, timeout, peers)
        for index, value, old in zip(flag_indices, values, last_seen, strict=True):
            if value != old:
                region, ring = divmod(index, self.window.ring_depth)
                header = slot_view(self._local, self.window, region, ring).header
                self._snapshots[index] = (value, header.clone())
                header[Word.CHECKSUM] += 1  # decoding the window itself would now fail
        return values

    def read_header(self, flag_index: int, value: int, header: torch.Tensor) -> torch.Tensor:
        self.reads.append((flag_index, value))
        seen, words = self._snapshots[flag_index]
        assert seen == value
        return words


def test_endpoints_decode_the_header_the_transport_hands_them() -> None:
    world = make_world(a=1, f=2)
    attention = AttentionEndpoint(CapturingTransport(world, Role.ATTENTION, 0), timeout=0.05)
    ffn_transports = [CapturingTransport(world, Role.FFN, r) for r in range(2)]
    ffns = [FFNEndpoint(t, timeout=0.05) for t in ffn_transports]
    experts = linear_experts(world)
    x, ids, w = route(12, 3, list(range(7)), 9)
    handle = attention.dispatch(2, x, ids, w)
    drain(ffns, experts)
    out = attention.combine(handle)
    torch.testing.assert_close(
        out.double(), experts.reference(2, x, ids, w, False), rtol=1e-5, atol=1e-4
    )
    window = world.window
    # Each FFN rank read attention rank 0's ring-0 slot once, at the dispatch's sequence;
    # the attention rank read each FFN rank's reply once.
    for t in ffn_transports:
        assert t.reads == [(window.flag_index(0, 0), handle.expected_ffn[t.rank])]
    reads = attention._transport.reads  # type: ignore[attr-defined]
    assert sorted(i for i, _ in reads) == [window.flag_index(d, 0) for d in (0, 1)]


class FusedLoopbackTransport(LoopbackTransport):
    """A loopback transport that offers the reference fused combine, counting its calls."""

    calls = 0

    def fused_combine(self):  # type: ignore[no-untyped-def]
        def run(inputs):  # type: ignore[no-untyped-def]
            FusedLoopbackTransport.calls += 1
            return reference_fused_combine(inputs)

        return run


@pytest.mark.parametrize("shared", ["attention", "ffn"])
def test_fused_combine_agrees_with_the_per_rank_combine(shared: str) -> None:
    """The endpoint's window offsets, segment bounds and wire positions, fed to the reference
    fused combine, give the same outputs as the portable path -- including an FFN rank that
    received nothing, a second ring, and fewer tokens than FFN ranks (shared rows)."""
    world = make_world(a=1, f=3, experts=7, shared=shared, ring_depth=2)
    experts = linear_experts(world)
    attention = AttentionEndpoint(FusedLoopbackTransport(world, Role.ATTENTION, 0), timeout=0.05)
    ffns = [FFNEndpoint(world.transport(Role.FFN, r), timeout=0.05) for r in range(3)]
    ffn0_and_1 = [e for r in (0, 1) for e in world.window.slot.topology.local_experts(r)]
    jobs = [
        (1, *route(20, 3, list(range(7)), 11)),
        (3, *route(9, 3, ffn0_and_1, 12)),  # FFN rank 2 gets no routed rows
        (0, *route(2, 3, list(range(7)), 13)),  # 2 tokens, 3 FFN ranks
    ]
    FusedLoopbackTransport.calls = 0
    for fused in (True, False):
        attention.fused_combine = fused
        outputs = []
        # The first two jobs are in flight together, so both rings carry replies.
        for batch in (jobs[:2], jobs[2:]):
            handles = [
                attention.dispatch(layer, x, ids, w, stage=stage)
                for stage, (layer, x, ids, w) in enumerate(batch)
            ]
            assert sorted(h.ring for h in handles) == list(range(len(batch)))
            drain(ffns, experts)
            for (layer, x, ids, w), handle in zip(batch, handles, strict=True):
                out = attention.combine(handle)
                expected = experts.reference(layer, x, ids, w, shared == "ffn")
                torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-4)
                outputs.append(out)
        if fused:
            fused_outputs = outputs
    assert FusedLoopbackTransport.calls == len(jobs)
    for a, b in zip(fused_outputs, outputs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_wire_position_inverts_the_wire_order() -> None:
    topo = Topology(1, 3, 7)
    ids = torch.tensor([[6, 0, 3], [2, 5, 1], [0, 6, 4]])
    plan = plan_dispatch(ids, topo)
    position = plan.wire_position
    assert torch.equal(plan.order[position], torch.arange(ids.numel()))
    # Walking the wire order, the experts (mapped to wire positions) never decrease.
    wire_of = torch.tensor(topo.expert_placement.wire_position)
    assert torch.all(wire_of[ids.reshape(-1)[plan.order]].diff() >= 0)


class PackingLoopbackTransport(FusedLoopbackTransport):
    """Also offers the reference device pack, counting its calls."""

    packs = 0

    def device_pack(self):  # type: ignore[no-untyped-def]
        def run(inputs):  # type: ignore[no-untyped-def]
            PackingLoopbackTransport.packs += 1
            reference_device_pack(inputs)

        return run


@pytest.mark.parametrize("shared", ["attention", "ffn"])
def test_device_packed_dispatch_matches_the_reference_and_serves_empty_parts(shared: str) -> None:
    """Dispatches packed from a device-side plan (headers, counts and checksums written by the
    pack) decode on the FFN side and combine to the reference. Every FFN rank is sent to: one
    whose experts got nothing serves an empty part. A batch that could overflow a rank takes
    the portable path; expert ids out of range fail the combine, naming the id."""
    world = make_world(a=1, f=3, experts=7, shared=shared, ring_depth=2, tokens=32)
    experts = linear_experts(world)
    attention = AttentionEndpoint(
        PackingLoopbackTransport(world, Role.ATTENTION, 0), timeout=0.05, device_pack=True
    )
    ffns = [FFNEndpoint(world.transport(Role.FFN, r), timeout=0.05) for r in range(3)]
    topo = world.window.slot.topology
    ffn0_and_1 = [e for r in (0, 1) for e in topo.local_experts(r)]
    routed_cap = world.window.slot.routed_cap
    jobs = [
        (1, *route(20, 3, list(range(7)), 21)),
        (2, *route(9, 3, ffn0_and_1, 22)),  # FFN rank 2's experts get nothing
        (0, *route(2, 3, list(range(7)), 23)),
        (3, *route(32, 3, list(range(7)), 24)),  # 96 rows > routed_cap: the portable path
    ]
    assert 32 * 3 > routed_cap >= 20 * 3
    PackingLoopbackTransport.packs = 0
    served: list[tuple[int, int, int]] = []
    for batch in (jobs[:2], jobs[2:]):
        handles = [
            attention.dispatch(layer, x, ids, w, stage=stage)
            for stage, (layer, x, ids, w) in enumerate(batch)
        ]
        served += drain(ffns, experts)
        for (layer, x, ids, w), handle in zip(batch, handles, strict=True):
            out = attention.combine(handle)
            expected = experts.reference(layer, x, ids, w, shared == "ffn")
            torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-4)
    assert PackingLoopbackTransport.packs == 3
    # FFN rank 2 served layer 2 (an empty part) because the packed path sends to everyone.
    assert (2, 0, 2) in served
    x, ids, w = route(4, 3, list(range(7)), 25)
    handle = attention.dispatch(0, x, ids.masked_fill(ids == ids[0, 0], 9), w)
    drain(ffns, experts)
    with pytest.raises(TopologyError, match="expert id 9, outside \\[0, 7\\)"):
        attention.combine(handle)
    assert attention.in_flight == 0  # the ring came back


def test_device_pack_is_opt_in() -> None:
    world = make_world(a=1, f=3, experts=7)
    transport = PackingLoopbackTransport(world, Role.ATTENTION, 0)
    assert not AttentionEndpoint(transport, timeout=0.05).device_pack
    assert AttentionEndpoint(transport, timeout=0.05, device_pack=True).device_pack
    plain = world.transport(Role.ATTENTION, 0)  # no device pack to offer
    assert not AttentionEndpoint(plain, timeout=0.05, device_pack=True).device_pack


@pytest.mark.parametrize("shape", [(6,), (2, 3, 3)])
def test_topk_ids_of_the_wrong_rank_are_a_topology_error_on_every_path(
    shape: tuple[int, ...],
) -> None:
    world = make_world(a=1, f=3, experts=7)
    transport = PackingLoopbackTransport(world, Role.ATTENTION, 0)
    for device_pack in (False, True):
        attention = AttentionEndpoint(transport, timeout=0.05, device_pack=device_pack)
        ids = torch.zeros(shape, dtype=torch.long)
        with pytest.raises(TopologyError, match="topk_ids"):
            attention.dispatch(0, torch.zeros(shape[0], HIDDEN), ids, torch.zeros(shape))
        assert attention.in_flight == 0


def test_a_packed_dispatch_combine_can_be_retried_after_the_kernel_failed() -> None:
    world = make_world(a=1, f=3, experts=7)
    experts = linear_experts(world)
    failures = [RuntimeError("out of memory (simulated)")]

    class FlakyCombine(PackingLoopbackTransport):
        def fused_combine(self):  # type: ignore[no-untyped-def]
            def run(inputs):  # type: ignore[no-untyped-def]
                if failures:
                    raise failures.pop()
                return reference_fused_combine(inputs)

            return run

    attention = AttentionEndpoint(
        FlakyCombine(world, Role.ATTENTION, 0), timeout=0.05, device_pack=True
    )
    ffns = [FFNEndpoint(world.transport(Role.FFN, r), timeout=0.05) for r in range(3)]
    x, ids, w = route(5, 3, list(range(7)), 31)
    handle = attention.dispatch(1, x, ids, w)
    drain(ffns, experts)
    with pytest.raises(RuntimeError, match="simulated"):
        attention.combine(handle)
    assert attention.in_flight == 1  # still ours to combine
    out = attention.combine(handle)
    torch.testing.assert_close(
        out.double(), experts.reference(1, x, ids, w, False), rtol=1e-5, atol=1e-4
    )
    assert attention.in_flight == 0
