"""``GraphedAttentionEndpoint(defer_checks=True)`` over afd_protocol's loopback transport,
on the CPU: a replayed combine is enqueued and returned without the host waiting, and its
replies and expert-id range are checked later -- at the next combine on its ring, at
``flush()``, at ``announce_shutdown()``. Outputs equal the eager endpoint's bitwise; every
problem the immediate check names is still named, only later; ``close()`` never raises and
cancels what is unchecked. (The polled stand-in looks at the flags once per launch, so the
FFN side serves before each combine here; the device wait itself: the GPU tests.)"""

from __future__ import annotations

import pytest
import torch
from test_graphed_endpoint_loopback import (
    CountingCapture,
    dispatch_a_replay,
    jobs_of,
    make_reply_stale,
    run_layers,
)
from test_kernel_endpoint_loopback import (
    FORMATS,
    drain,
    layout_of,
    linear_experts,
    make_world,
    route,
)

from afd_protocol import (
    InvalidArgument,
    PeerAborted,
    PeerTimeout,
    ProtocolError,
    Role,
    Word,
)
from afd_protocol.window import LoopbackWorld, WindowFFNEndpoint, WindowOptions, slot_view
from afd_transport_nvshmem.combine_wait import PolledCombineWait
from afd_transport_nvshmem.graphed_attention import GraphedAttentionEndpoint
from afd_transport_nvshmem.kernel_attention import KernelAttentionEndpoint
from afd_transport_nvshmem.kernel_specs import REFERENCE_KERNELS

FAST = WindowOptions(timeout=0.05)


def deferred_endpoint(
    world: LoopbackWorld, capture: CountingCapture | None = None
) -> GraphedAttentionEndpoint:
    return GraphedAttentionEndpoint(
        world.transport(Role.ATTENTION, 0),
        FAST,
        REFERENCE_KERNELS,
        capture=capture or CountingCapture(),
        combine_wait=PolledCombineWait,
        defer_checks=True,
    )


def ffns_of(world: LoopbackWorld, f: int = 3) -> list[WindowFFNEndpoint]:
    return [world.connection(Role.FFN, r).ffn_endpoint(FAST) for r in range(f)]


@pytest.mark.parametrize(("wire", "reduce"), FORMATS)
@pytest.mark.parametrize("stages", [1, 2])
def test_deferred_combines_equal_the_eager_endpoint_bitwise(
    wire: str, reduce: str, stages: int
) -> None:
    """Layer after layer, on one ring or two in flight, at two token counts: each output
    equals the eager endpoint's exactly; the replayed combines are left unchecked until
    the next combine on their ring or flush()."""
    layout = layout_of(wire, reduce, a=1, f=3, tokens=32)
    jobs = jobs_of([9] * 10 + [4] * 6, seed=200)
    results = []
    for deferred in (False, True):
        world = LoopbackWorld(layout.window(ring_depth=2))
        ffns = ffns_of(world)
        attention: KernelAttentionEndpoint
        if deferred:
            attention = deferred_endpoint(world)
        else:
            attention = KernelAttentionEndpoint(
                world.transport(Role.ATTENTION, 0), FAST, REFERENCE_KERNELS
            )
        results.append(run_layers(world, attention, ffns, jobs, stages=stages))
        if isinstance(attention, GraphedAttentionEndpoint):
            assert attention.replays > 0
            assert attention.graph_waits == attention.replays
            assert 1 <= attention.unchecked <= stages  # the last combine of each ring
            attention.flush()
            assert attention.unchecked == 0
            attention.flush()  # nothing left: returns at once
        attention.close()
    for eager, deferred_out in zip(*results, strict=True):
        assert torch.isfinite(deferred_out).all()
        assert torch.equal(eager, deferred_out)


def _deferred_in_flight(
    world: LoopbackWorld,
) -> tuple[GraphedAttentionEndpoint, object, list[WindowFFNEndpoint]]:
    """A deferred endpoint whose third dispatch at 6 tokens replays its graphs, in flight."""
    attention = deferred_endpoint(world)
    handle, ffns = dispatch_a_replay(world, attention, seed=210)
    return attention, handle, ffns


def test_a_stale_reply_is_named_at_flush_and_then_nothing_is_left_pending() -> None:
    world = make_world(a=1, f=3, experts=7, ring_depth=1)
    attention, handle, ffns = _deferred_in_flight(world)
    linear_experts(world, layers=8).drain(ffns)
    make_reply_stale(world, ffn_rank=2)
    attention.combine(handle)  # enqueued: no check yet
    assert (attention.unchecked, attention.in_flight) == (1, 0)
    with pytest.raises(ProtocolError, match="stale or misdirected reply from FFN rank 2"):
        attention.flush()
    assert attention.unchecked == 0
    attention.close()


def test_the_next_combine_on_the_ring_checks_the_previous_one_first() -> None:
    """One ring: combining layer 2 first checks layer 1's replies, so a bad reply of layer
    1 is raised there, before layer 2's wait is even written."""
    world = make_world(a=1, f=3, experts=7, ring_depth=1)
    attention, handle, ffns = _deferred_in_flight(world)
    experts = linear_experts(world, layers=8)
    experts.drain(ffns)
    header = slot_view(world.windows[(Role.ATTENTION, 0)], world.window, 0, 0).header
    header[Word.LAYER] += 1  # breaks the checksum too: a corrupted reply
    first = attention.combine(handle)
    assert torch.isfinite(first).all()
    x, ids, w = route(6, 3, list(range(7)), 212)
    second = attention.dispatch(2, x, ids, w)
    experts.drain(ffns)
    with pytest.raises(ProtocolError, match="FFN rank 0"):
        attention.combine(second)
    attention.close()


def test_no_reply_is_a_peer_timeout_at_flush_naming_the_layer() -> None:
    world = make_world(a=1, f=3, experts=7, ring_depth=1)
    attention, handle, _ = _deferred_in_flight(world)
    attention.combine(handle)  # the FFN ranks never serve it
    with pytest.raises(PeerTimeout, match=r"FFN ranks \[0, 1, 2\] did not reply to layer 1"):
        attention.flush()
    attention.close()


def test_an_aborted_ffn_rank_is_named_at_flush() -> None:
    world = make_world(a=1, f=3, experts=7, ring_depth=1)
    attention, handle, _ = _deferred_in_flight(world)
    world.transport(Role.FFN, 1).abort()
    attention.combine(handle)
    with pytest.raises(PeerAborted, match=r"FFN rank\(s\) \[1\] aborted"):
        attention.flush()
    attention.close()


def test_out_of_range_expert_ids_are_refused_at_flush() -> None:
    """The combine graph reads the expert-id range back per ring; the deferred check
    refuses it, naming the id."""
    world = make_world(a=1, f=3, experts=7, ring_depth=1)
    ffns = ffns_of(world)
    attention = deferred_endpoint(world)
    run_layers(world, attention, ffns, jobs_of([6, 6], seed=60), stages=1)
    x, ids, w = route(6, 3, list(range(7)), 61)
    handle = attention.dispatch(0, x, ids.masked_fill(ids == ids[0, 0], 9), w)
    assert attention.replays == 2
    drain(ffns, linear_experts(world))
    attention.combine(handle)
    with pytest.raises(InvalidArgument, match=r"expert id 9, outside \[0, 7\)"):
        attention.flush()
    attention.close()


def test_announce_shutdown_checks_what_is_pending() -> None:
    world = make_world(a=1, f=3, experts=7, ring_depth=1)
    attention, handle, _ = _deferred_in_flight(world)
    attention.combine(handle)
    with pytest.raises(PeerTimeout, match="did not reply to layer 1"):
        attention.announce_shutdown()
    attention.close()


def test_close_cancels_what_is_unchecked_and_never_raises() -> None:
    world = make_world(a=1, f=3, experts=7, ring_depth=1)
    attention, handle, _ = _deferred_in_flight(world)
    attention.combine(handle)
    wait = attention._waits[0]
    assert isinstance(wait, PolledCombineWait)
    attention.close()
    assert attention.unchecked == 0
    wait.launch()  # what a still-running device wait would see: the cancel word
    assert wait.status() == 4


def test_without_a_combine_wait_out_of_range_ids_are_still_refused() -> None:
    """Deferred but with no wait in the combine graph, a combine waits on the host and
    checks at once: the dispatch graph must then read the expert-id range back itself."""
    world = make_world(a=1, f=3, experts=7, ring_depth=1)
    ffns = ffns_of(world)
    attention = GraphedAttentionEndpoint(
        world.transport(Role.ATTENTION, 0),
        FAST,
        REFERENCE_KERNELS,
        capture=CountingCapture(),
        combine_wait=None,
        defer_checks=True,
    )
    run_layers(world, attention, ffns, jobs_of([6, 6], seed=70), stages=1)
    x, ids, w = route(6, 3, list(range(7)), 71)
    handle = attention.dispatch(0, x, ids.masked_fill(ids == ids[0, 0], 9), w)
    assert attention.replays == 2
    drain(ffns, linear_experts(world))
    with pytest.raises(InvalidArgument, match=r"expert id 9, outside \[0, 7\)"):
        attention.combine(handle)
    attention.close()


def test_an_endpoint_after_close_with_a_combine_unchecked_expects_the_next_replies() -> None:
    """close() with a combine whose replies arrived but were not checked: the transport
    records their flag values, so the next endpoint on it takes only new replies as its
    own, and its outputs equal a fresh world's."""
    layout = layout_of("per_choice", "attention", a=1, f=3, tokens=32)
    jobs = jobs_of([6, 6, 6, 5, 6], seed=230)
    world = LoopbackWorld(layout.window(ring_depth=1))
    transport = world.transport(Role.ATTENTION, 0)
    ffns = ffns_of(world)
    first = GraphedAttentionEndpoint(
        transport,
        FAST,
        REFERENCE_KERNELS,
        capture=CountingCapture(),
        combine_wait=PolledCombineWait,
        defer_checks=True,
    )
    run_layers(world, first, ffns, jobs[:3], stages=1)
    assert first.unchecked == 1  # the third layer's replies arrived; not yet checked
    first.close()
    second = KernelAttentionEndpoint(transport, FAST, REFERENCE_KERNELS)
    x, ids, w = jobs[3][1:]
    handle = second.dispatch(jobs[3][0], x, ids, w)
    # Before the FFN ranks serve it, no reply of this layer is there to take.
    with pytest.raises(PeerTimeout):
        second.combine(handle, timeout=0.05)
    drain(ffns, linear_experts(world, layers=8))
    later = [second.combine(handle)]
    later += run_layers(world, second, ffns, jobs[4:], stages=1)
    second.close()
    fresh_world = LoopbackWorld(layout.window(ring_depth=1))
    fresh = KernelAttentionEndpoint(
        fresh_world.transport(Role.ATTENTION, 0), FAST, REFERENCE_KERNELS
    )
    expected = run_layers(fresh_world, fresh, ffns_of(fresh_world), jobs[3:], stages=1)
    fresh.close()
    for got, want in zip(later, expected, strict=True):
        assert torch.equal(got, want)
