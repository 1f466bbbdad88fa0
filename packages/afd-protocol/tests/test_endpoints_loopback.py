"""The window endpoints driven step by step in one process over the loopback transport."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from afd_protocol import (
    AttentionEndpoint,
    CapacityError,
    ConnectorShutdown,
    DispatchHandle,
    FFNEndpoint,
    InvalidArgument,
    PeerAborted,
    PeerTimeout,
    ProtocolError,
    RingExhausted,
    Role,
    SlotLayout,
    Topology,
    TopologyError,
    Word,
    plan_dispatch,
    serve,
)
from afd_protocol.testing import LinearExperts, random_routing
from afd_protocol.window import (
    Arrivals,
    LoopbackTransport,
    LoopbackWorld,
    WindowAttentionEndpoint,
    WindowConnection,
    WindowFFNEndpoint,
    WindowOptions,
    abort_words,
    flag_words,
    slot_view,
)

HIDDEN = 8
FAST = WindowOptions(timeout=0.05)


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


def endpoints(
    world: LoopbackWorld,
) -> tuple[list[WindowAttentionEndpoint], list[WindowFFNEndpoint]]:
    topo = world.window.slot.topology
    attn = [
        world.connection(Role.ATTENTION, r).attention_endpoint(FAST)
        for r in range(topo.num_attention_ranks)
    ]
    ffn = [world.connection(Role.FFN, r).ffn_endpoint(FAST) for r in range(topo.num_ffn_ranks)]
    return attn, ffn


def linear_experts(world: LoopbackWorld, layers: int = 4) -> LinearExperts:
    topo = world.window.slot.topology
    return LinearExperts(layers, topo.num_experts, HIDDEN, seed=0)


def route(num_tokens: int, topk: int, experts: list[int], seed: int) -> tuple[torch.Tensor, ...]:
    return random_routing(num_tokens, HIDDEN, topk, experts, torch.Generator().manual_seed(seed))


def drain(ffns: Sequence[FFNEndpoint], experts: LinearExperts) -> list[tuple[int, int, int]]:
    """Serve every ready item on every FFN rank; returns (ffn, replica, layer) served."""
    return experts.drain(ffns)


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
    assert handle.ffn_ranks == (0,)
    with pytest.raises(PeerTimeout, match="FFN rank 1: no work item"):
        ffns[1].next_work_item(timeout=0.01)
    experts.reply_to(ffns[0], ffns[0].next_work_item())
    out = attn[0].combine(handle)
    torch.testing.assert_close(
        out.double(), experts.reference(0, x, ids, w, False), rtol=1e-5, atol=1e-4
    )


def test_scan_start_rotates_so_no_ready_replica_starves() -> None:
    world = make_world(a=3, f=1, experts=4, topk=2, ring_depth=4)
    attn, (ffn,) = endpoints(world)
    experts = linear_experts(world)

    def send(ep: WindowAttentionEndpoint, layer: int) -> None:
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
        experts.reply_to(ffn, item)
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
    assert h1.ffn_ranks == (0, 1)  # participants publish to every FFN rank
    for ffn in ffns:
        item = ffn.next_work_item()
        assert (item.replica, item.layer) == (0, 2)
        assert [p.src_rank for p in item.parts] == [0, 1]
        experts.reply_to(ffn, item)
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
    with pytest.raises(RingExhausted, match="ring exhausted: 1 dispatches are in flight"):
        attn[0].dispatch(1, x, ids, w)
    drain(ffns, experts)
    torch.testing.assert_close(
        attn[0].combine(handle).double(),
        experts.reference(0, x, ids, w, False),
        rtol=1e-5,
        atol=1e-4,
    )
    with pytest.raises(InvalidArgument, match="not in flight"):
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
    experts.reply_to(ffn, ffn.next_work_item())
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
    experts.reply_to(ffn, ffn.next_work_item())
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
    with pytest.raises(InvalidArgument, match=r"bfloat16 but the window carries torch\.float32"):
        attn[0].dispatch(0, x.bfloat16(), ids, w)
    with pytest.raises(InvalidArgument, match=r"must be \[num_tokens, 8\]"):
        attn[0].dispatch(0, x[:, :4], ids, w)
    with pytest.raises(InvalidArgument, match="must agree"):
        attn[0].dispatch(0, x, ids, w[:, :2])
    with pytest.raises(InvalidArgument, match="floating point"):
        attn[0].dispatch(0, x, ids, ids)
    with pytest.raises(InvalidArgument, match="role attention"):
        WindowAttentionEndpoint(world.transport(Role.FFN, 0))
    handle = attn[0].dispatch(0, x, ids, w)
    item = ffns[0].next_work_item()
    with pytest.raises(InvalidArgument, match="routed_out has shape"):
        ffns[0].reply(item, torch.zeros(1, HIDDEN))
    with pytest.raises(InvalidArgument, match=r"routed_out is torch\.float64"):
        ffns[0].reply(item, torch.zeros(item.num_routed_rows, HIDDEN, dtype=torch.float64))
    ffns[0].reply(item, torch.zeros(item.num_routed_rows, HIDDEN))
    with pytest.raises(InvalidArgument, match="not in service"):
        ffns[0].reply(item, torch.zeros(item.num_routed_rows, HIDDEN))
    del handle


def test_options_are_checked_when_made_and_fixed_afterwards() -> None:
    with pytest.raises(InvalidArgument, match="timeout must be > 0"):
        WindowOptions(timeout=0)
    with pytest.raises(InvalidArgument, match="combine must be"):
        WindowOptions(combine="fast")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="device_pack=True needs the fused combine"):
        WindowOptions(combine="portable", device_pack=True)
    options = WindowOptions()
    with pytest.raises(AttributeError):
        options.combine = "portable"  # type: ignore[misc]


def test_one_open_endpoint_per_transport_and_a_closed_one_refuses_work() -> None:
    world = make_world(a=1, f=1, experts=4)
    connection = world.connection(Role.ATTENTION, 0)
    first = connection.attention_endpoint(FAST)
    with pytest.raises(InvalidArgument, match="already has an open endpoint"):
        connection.attention_endpoint(FAST)
    with pytest.raises(InvalidArgument, match="already has an open endpoint"):
        WindowAttentionEndpoint(connection.transport, FAST)  # bound: the window, not the object
    first.close()
    first.close()  # idempotent
    with pytest.raises(InvalidArgument, match="was closed"):
        first.dispatch(0, *route(2, 3, list(range(4)), 40))
    connection.attention_endpoint(FAST)  # the window is free again
    with pytest.raises(InvalidArgument, match="role ffn"):
        connection.ffn_endpoint(FAST)


def test_closing_with_work_in_progress_aborts_and_shutdown_outlives_the_endpoint() -> None:
    world = make_world(a=1, f=1, experts=4)
    connection = world.connection(Role.ATTENTION, 0)
    attention = connection.attention_endpoint(FAST)
    ffn = world.connection(Role.FFN, 0).ffn_endpoint(FAST)
    attention.dispatch(0, *route(2, 3, list(range(4)), 41))
    attention.close()  # a dispatch in flight: its reply would reach nobody
    item = ffn.next_work_item()  # what was sent still arrives
    ffn.reply(item, torch.zeros(item.num_routed_rows, HIDDEN))
    with pytest.raises(PeerAborted, match=r"rank\(s\) \[0\] aborted"):
        ffn.next_work_item()

    world = make_world(a=1, f=1, experts=4)
    connection = world.connection(Role.ATTENTION, 0)
    first = connection.attention_endpoint(FAST)
    first.announce_shutdown()
    first.close()
    second = connection.attention_endpoint(FAST)
    with pytest.raises(ConnectorShutdown):  # the peers were told: no endpoint may send now
        second.dispatch(0, *route(2, 3, list(range(4)), 42))


def test_an_endpoint_reopened_on_the_same_window_continues_its_sequence() -> None:
    """The sequence counter and the values last seen live in the transport, so a second
    endpoint on the same window neither reuses a sequence number nor misses a reply."""
    world = make_world(a=1, f=1, experts=4, ring_depth=2)
    experts = linear_experts(world)
    connection = world.connection(Role.ATTENTION, 0)
    (ffn,) = [world.connection(Role.FFN, 0).ffn_endpoint(FAST)]
    for round_ in range(3):
        attention = connection.attention_endpoint(FAST)
        x, ids, w = route(4, 3, list(range(4)), 50 + round_)
        handle = attention.dispatch(round_, x, ids, w)
        experts.reply_to(ffn, ffn.next_work_item())
        out = attention.combine(handle)
        torch.testing.assert_close(
            out.double(), experts.reference(round_, x, ids, w, False), rtol=1e-5, atol=1e-4
        )
        attention.close()
    assert connection.transport.sequence.last == 3


def test_a_combine_retried_after_a_timeout_waits_only_for_the_missing_rank() -> None:
    world = make_world(a=1)
    attn, ffns = endpoints(world)
    experts = linear_experts(world)
    x, ids, w = route(6, 3, list(range(7)), 15)
    handle = attn[0].dispatch(1, x, ids, w)
    experts.reply_to(ffns[0], ffns[0].next_work_item())
    with pytest.raises(PeerTimeout, match=r"FFN ranks \[1\] did not reply"):
        attn[0].combine(handle, timeout=0.02)
    experts.reply_to(ffns[1], ffns[1].next_work_item())
    out = attn[0].combine(handle, timeout=1.0)
    expected = experts.reference(1, x, ids, w, False)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-4)


def test_a_dispatch_refused_before_any_write_keeps_its_ring() -> None:
    world = make_world(a=1, ring_depth=1)
    attn, _ffns = endpoints(world)
    x, ids, w = route(4, 3, list(range(7)), 16)
    with pytest.raises(InvalidArgument, match="requires grad"):
        attn[0].dispatch(0, x.clone().requires_grad_(), ids, w)
    with pytest.raises(InvalidArgument, match="topk=3"):
        attn[0].dispatch(0, x, ids[:, :2], w[:, :2])
    handle = attn[0].dispatch(0, x, ids, w)  # the ring is still free
    assert handle.ring == 0


def test_low_precision_payloads_are_refused_until_the_endpoints_send_them() -> None:
    topo = Topology(1, 1, 4)
    layout = SlotLayout(topo, HIDDEN, 8, 2, dtype="bfloat16", payload_dtype="float8_e4m3fn")
    world = LoopbackWorld(layout.window())
    with pytest.raises(TopologyError, match="low-precision payloads"):
        world.connection(Role.ATTENTION, 0).attention_endpoint()


class CapturingTransport(LoopbackTransport):
    """Like a device wait that brings headers to the host with the flag: the header is
    snapshotted when the flag is seen, then the window's copy is made undecodable."""

    def __init__(self, world: LoopbackWorld, role: Role, rank: int) -> None:
        super().__init__(world, role, rank)
        self.captures: list[tuple[int, int]] = []

    def wait_any(self, flag_indices, last_seen, timeout, peers):  # type: ignore[no-untyped-def]
        arrivals = super().wait_any(flag_indices, last_seen, timeout, peers)
        headers = {}
        for index, value, old in zip(flag_indices, arrivals.values, last_seen, strict=True):
            if value != old:
                region, ring = divmod(index, self.window.ring_depth)
                header = slot_view(self._local, self.window, region, ring).header
                headers[index] = header.clone()
                self.captures.append((index, value))
                header[Word.CHECKSUM] += 1  # decoding the window itself would now fail
        return Arrivals(arrivals.values, headers)


def test_endpoints_decode_the_header_the_transport_captured() -> None:
    world = make_world(a=1, f=2)
    capturing = WindowConnection(CapturingTransport(world, Role.ATTENTION, 0))
    attention = capturing.attention_endpoint(FAST)
    ffn_transports = [CapturingTransport(world, Role.FFN, r) for r in range(2)]
    ffns = [WindowConnection(t).ffn_endpoint(FAST) for t in ffn_transports]
    experts = linear_experts(world)
    x, ids, w = route(12, 3, list(range(7)), 9)
    handle = attention.dispatch(2, x, ids, w)
    drain(ffns, experts)
    out = attention.combine(handle)
    torch.testing.assert_close(
        out.double(), experts.reference(2, x, ids, w, False), rtol=1e-5, atol=1e-4
    )
    window = world.window
    # Each FFN rank took attention rank 0's ring-0 slot once, at the dispatch's sequence
    # number, and decoded the captured copy (the window's own copy no longer decodes).
    for t, ffn in zip(ffn_transports, ffns, strict=True):
        assert t.captures == [(window.flag_index(0, 0), 1 + t.rank)]
        assert ffn.header_reads == {"captured": 1}
    assert attention.header_reads == {"captured": 2}

    # With capture_headers=False the endpoint copies the window's header, which the
    # capturing transport corrupted: the copy is what gets decoded, and it fails.
    world = make_world(a=1, f=1, experts=4)
    attention = world.connection(Role.ATTENTION, 0).attention_endpoint(FAST)
    ffn = WindowFFNEndpoint(
        CapturingTransport(world, Role.FFN, 0), WindowOptions(timeout=0.05, capture_headers=False)
    )
    attention.dispatch(0, *route(2, 3, list(range(4)), 10))
    with pytest.raises(ProtocolError, match="CHECKSUM"):
        ffn.next_work_item()
    assert ffn.header_reads == {"copied": 1}


def test_the_portable_endpoint_refuses_options_that_need_device_kernels() -> None:
    world = make_world(a=1, f=3, experts=7)
    plain = world.connection(Role.ATTENTION, 0)
    plain.attention_endpoint(FAST).close()  # the defaults need none
    for options in (WindowOptions(device_pack=True), WindowOptions(combine="fused")):
        with pytest.raises(InvalidArgument, match="need device kernels"):
            plain.attention_endpoint(options)
    with pytest.raises(InvalidArgument, match="device_pack must be None \\(auto\\), True or"):
        WindowOptions(device_pack="yes")  # type: ignore[arg-type]


def test_wire_position_inverts_the_wire_order() -> None:
    topo = Topology(1, 3, 7)
    ids = torch.tensor([[6, 0, 3], [2, 5, 1], [0, 6, 4]])
    plan = plan_dispatch(ids, topo)
    position = plan.wire_position
    assert torch.equal(plan.order[position], torch.arange(ids.numel()))
    # Walking the wire order, the experts (mapped to wire positions) never decrease.
    wire_of = torch.tensor(topo.expert_placement.wire_position)
    assert torch.all(wire_of[ids.reshape(-1)[plan.order]].diff() >= 0)


@pytest.mark.parametrize("shape", [(6,), (2, 3, 3)])
def test_topk_ids_of_the_wrong_rank_are_an_invalid_argument_on_every_path(
    shape: tuple[int, ...],
) -> None:
    """(The kernel endpoint's paths: afd-transport-nvshmem's tests.)"""
    world = make_world(a=1, f=3, experts=7)
    attention = WindowConnection(world.transport(Role.ATTENTION, 0)).attention_endpoint(FAST)
    ids = torch.zeros(shape, dtype=torch.long)
    with pytest.raises(InvalidArgument, match="topk_ids"):
        attention.dispatch(0, torch.zeros(shape[0], HIDDEN), ids, torch.zeros(shape))
    assert attention.in_flight == 0
    attention.close()


class ClosingTransport(LoopbackTransport):
    """Counts its ``close`` calls."""

    def __init__(self, world: LoopbackWorld, role: Role, rank: int) -> None:
        super().__init__(world, role, rank)
        self.closes = 0

    def close(self) -> None:
        self.closes += 1


def test_a_window_connection_makes_the_portable_endpoints_and_owns_the_transport() -> None:
    world = make_world(a=1, f=1, experts=4)
    connection = world.connection(Role.ATTENTION, 0)
    assert (connection.role, connection.rank) == (Role.ATTENTION, 0)
    assert (connection.layout, connection.device) == (world.window.slot, torch.device("cpu"))
    portable = connection.attention_endpoint(FAST)
    assert type(portable) is WindowAttentionEndpoint
    assert type(world.connection(Role.FFN, 0).ffn_endpoint(FAST)) is WindowFFNEndpoint

    # abort() and close() reach the transport; `with` aborts on an exception (not on
    # Ctrl-C) and always closes.
    attention_aborts = abort_words(world.windows[(Role.ATTENTION, 0)], world.window)
    quiet = ClosingTransport(world, Role.FFN, 0)
    with pytest.raises(KeyboardInterrupt), WindowConnection(quiet):
        raise KeyboardInterrupt
    assert (quiet.closes, int(attention_aborts[0])) == (1, 0)
    failed = ClosingTransport(world, Role.FFN, 0)
    with pytest.raises(RuntimeError, match="rank program failed"), WindowConnection(failed):
        raise RuntimeError("rank program failed")
    assert (failed.closes, int(attention_aborts[0])) == (1, 1)  # FFN rank 0's word
    plain = WindowConnection(ClosingTransport(world, Role.ATTENTION, 0))
    plain.abort()
    plain.close()
    assert int(abort_words(world.windows[(Role.FFN, 0)], world.window)[0]) == 1
    assert isinstance(plain.transport, ClosingTransport)
    assert plain.transport.closes == 1


def run_layers_through_the_protocols(
    attention: AttentionEndpoint,
    ffns: Sequence[FFNEndpoint],
    experts: LinearExperts,
    layers: int,
) -> list[float]:
    """Dispatch, serve and combine through the endpoint protocols alone (no concrete type)."""
    from afd_protocol import relative_error

    errors = []
    for layer in range(layers):
        x, ids, w = route(6 + layer, 3, list(range(7)), 60 + layer)
        handle = attention.dispatch(layer, x, ids, w)
        assert isinstance(handle, DispatchHandle)
        assert (handle.layer, handle.stage) == (layer, 0)
        experts.drain(ffns)
        out = attention.combine(handle)
        errors.append(relative_error(out, experts.reference(layer, x, ids, w, False)))
    attention.announce_shutdown()
    return errors


def test_both_roles_run_through_the_endpoint_protocols_and_the_serving_loop() -> None:
    world = make_world(a=1, f=2)
    experts = linear_experts(world)
    connections = [
        world.connection(Role.ATTENTION, 0),
        *(world.connection(Role.FFN, r) for r in (0, 1)),
    ]
    attention: AttentionEndpoint = connections[0].attention_endpoint(FAST)
    ffns: list[FFNEndpoint] = [c.ffn_endpoint(FAST) for c in connections[1:]]
    errors = run_layers_through_the_protocols(attention, ffns, experts, layers=3)
    assert max(errors) <= 1e-6
    # After the attention rank's shutdown the one serving loop returns at once, cleanly.
    for ffn in ffns:
        stats = serve(ffn, experts.compute_for(ffn))
        assert stats.items == []


def test_publish_all_sets_each_peers_flag_and_refuses_a_value_count_that_differs() -> None:
    world = make_world(f=3)
    transport = world.transport(Role.ATTENTION, 0)
    flag = world.window.flag_index(0, 0)
    transport.publish_all([2, 0], flag, [11, 5])
    got = [int(flag_words(world.windows[(Role.FFN, r)], world.window)[flag]) for r in range(3)]
    assert got == [5, 0, 11]
    with pytest.raises(InvalidArgument, match="one value per peer: 1 values for 2 peers"):
        transport.publish_all([0, 1], flag, [3])
    after = [int(flag_words(world.windows[(Role.FFN, r)], world.window)[flag]) for r in range(3)]
    assert after == got  # nothing published
