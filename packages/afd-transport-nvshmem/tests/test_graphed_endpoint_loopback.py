"""The graph-replayed attention endpoint over afd_protocol's loopback transport, on the CPU:
torch references for the kernels, and :func:`replayed_calls` for CUDA graphs (every replay
re-runs the captured calls with the arguments of capture time, so a per-layer value that
does not travel through memory goes stale and the FFN side sees no new flag, or a wrong
header). Outputs equal the eager kernel endpoint's bitwise, layer after layer, on every
ring, wire format and token count; the eager-first, then capture, then replay order; the
least-recently-used bound; the fallbacks. (CUDA graphs themselves: the GPU test.)"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from test_kernel_endpoint_loopback import (
    FORMATS,
    drain,
    layout_of,
    linear_experts,
    make_world,
    route,
)

from afd_protocol import (
    AFDError,
    InvalidArgument,
    PeerAborted,
    PeerTimeout,
    ProtocolError,
    Role,
    Word,
    checksum,
)
from afd_protocol.window import LoopbackWorld, WindowFFNEndpoint, WindowOptions, slot_view
from afd_transport_nvshmem.graphed_attention import (
    GraphedAttentionEndpoint,
    PolledCombineWait,
    Replay,
    replayed_calls,
)
from afd_transport_nvshmem.kernel_attention import KernelAttentionEndpoint
from afd_transport_nvshmem.kernel_specs import REFERENCE_KERNELS, WindowKernels

FAST = WindowOptions(timeout=0.05)


class CountingCapture:
    """:func:`replayed_calls`, counting captures and replays."""

    def __init__(self) -> None:
        self.captures = 0
        self.replays = 0

    def __call__(self, body: Callable[[], Any]) -> tuple[Replay, Any]:
        self.captures += 1
        replay, outputs = replayed_calls(body)

        def counted() -> None:
            self.replays += 1
            replay()

        return counted, outputs


def run_layers(
    world: LoopbackWorld,
    attention: KernelAttentionEndpoint,
    ffns: list[WindowFFNEndpoint],
    jobs: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]],
    stages: int,
) -> list[torch.Tensor]:
    """Dispatch ``jobs`` ``stages`` at a time, serve them, combine; the outputs in order."""
    experts = linear_experts(world, layers=8)
    outputs = []
    for first in range(0, len(jobs), stages):
        batch = jobs[first : first + stages]
        handles = [
            attention.dispatch(layer, x, ids, w, stage=stage)
            for stage, (layer, x, ids, w) in enumerate(batch)
        ]
        drain(ffns, experts)
        outputs += [attention.combine(h) for h in handles]
    return outputs


def jobs_of(counts: list[int], experts: int = 7, seed: int = 0) -> list[Any]:
    return [(i % 8, *route(n, 3, list(range(experts)), seed + i)) for i, n in enumerate(counts)]


@pytest.mark.parametrize(("wire", "reduce"), FORMATS)
@pytest.mark.parametrize("shared", ["attention", "ffn"])
def test_replayed_layers_equal_the_eager_kernel_endpoint_bitwise(
    wire: str, reduce: str, shared: str
) -> None:
    """Twelve layers at one token count on two rings (two stages in flight), then other
    counts: each output equals the eager kernel endpoint's exactly and the reference; the
    first use of each (count, ring) is eager, the second captures, the rest replay."""
    layout = layout_of(wire, reduce, a=1, f=3, tokens=32, shared=shared)
    counts = [9] * 12 + [4, 4, 4, 4, 9, 9]
    jobs = jobs_of(counts)
    results = []
    for graphed in (False, True):
        world = LoopbackWorld(layout.window(ring_depth=2))
        transport = world.transport(Role.ATTENTION, 0)
        ffns = [world.connection(Role.FFN, r).ffn_endpoint(FAST) for r in range(3)]
        capture = CountingCapture()
        attention: KernelAttentionEndpoint
        if graphed:
            attention = GraphedAttentionEndpoint(
                transport, FAST, REFERENCE_KERNELS, max_token_counts=4, capture=capture
            )
        else:
            attention = KernelAttentionEndpoint(transport, FAST, REFERENCE_KERNELS)
        results.append(run_layers(world, attention, ffns, jobs, stages=2))
        if graphed:
            assert isinstance(attention, GraphedAttentionEndpoint)
            # (9, ring 0/1) and (4, ring 0/1): eager once each, then a dispatch graph and
            # a combine graph each; 18 dispatches - 4 eager = 14 replayed.
            assert attention.captures == capture.captures == 8
            assert attention.capture_seconds > 0.0  # what the benchmark reports per capture
            assert attention.replays == 14
            assert attention.token_counts == (4, 9)
        attention.close()
    experts = linear_experts(make_world(), layers=8)
    for (layer, x, ids, w), eager, replayed in zip(jobs, *results, strict=True):
        assert torch.equal(eager, replayed)
        expected = experts.reference(layer, x, ids, w, shared == "ffn")
        torch.testing.assert_close(replayed.double(), expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("fetch", [True, False])
def test_inputs_are_fetched_by_address_or_copied_when_they_cannot_be(fetch: bool) -> None:
    """With a fetch kernel the dispatch graph reads each layer's inputs at their addresses:
    contiguous ones directly, a strided view of hidden states through a copy the host makes
    first; without one, the host copies all three. Either way every output equals the
    eager endpoint's."""
    layout = layout_of("per_rank", "ffn", a=1, f=2, tokens=32)
    base = jobs_of([9] * 8)
    jobs = []
    for i, (layer, x, ids, w) in enumerate(base):
        if i == 1:  # the captured one (the first use is eager): dense but column-major
            x = x.t().contiguous().t()
            assert not x.is_contiguous()
        elif i % 3 == 2:  # the same values as a strided view (every other column of a wider one)
            wide = torch.zeros(x.shape[0], 2 * x.shape[1], dtype=x.dtype)
            wide[:, ::2] = x
            x = wide[:, ::2]
            assert not x.is_contiguous()
        jobs.append((layer, x, ids, w))
    kernels = REFERENCE_KERNELS
    if not fetch:
        kernels = dataclasses.replace(REFERENCE_KERNELS, fetch_inputs=None)
    results = []
    for graphed in (False, True):
        world = LoopbackWorld(layout.window(ring_depth=1))
        transport = world.transport(Role.ATTENTION, 0)
        ffns = [world.connection(Role.FFN, r).ffn_endpoint(FAST) for r in range(2)]
        attention: KernelAttentionEndpoint
        if graphed:
            attention = GraphedAttentionEndpoint(transport, FAST, kernels, capture=replayed_calls)
        else:
            attention = KernelAttentionEndpoint(transport, FAST, REFERENCE_KERNELS)
        results.append(run_layers(world, attention, ffns, jobs, stages=1))
        if graphed:
            assert isinstance(attention, GraphedAttentionEndpoint)
            assert attention.replays >= 4
        attention.close()
    for eager, replayed in zip(*results, strict=True):
        assert torch.equal(eager, replayed)


def test_the_least_recently_used_token_count_is_dropped_and_captured_again() -> None:
    layout = layout_of("per_choice", "attention", a=1, f=2, tokens=32)
    world = LoopbackWorld(layout.window(ring_depth=1))
    ffns = [world.connection(Role.FFN, r).ffn_endpoint(FAST) for r in range(2)]
    capture = CountingCapture()
    attention = GraphedAttentionEndpoint(
        world.transport(Role.ATTENTION, 0), FAST, REFERENCE_KERNELS, 2, capture
    )
    counts = [3, 3, 5, 5, 3, 7, 7, 5, 5, 3]
    jobs = jobs_of(counts, seed=40)
    outputs = run_layers(world, attention, ffns, jobs, stages=1)
    experts = linear_experts(world, layers=8)
    for (layer, x, ids, w), out in zip(jobs, outputs, strict=True):
        torch.testing.assert_close(
            out.double(), experts.reference(layer, x, ids, w, False), rtol=1e-5, atol=1e-4
        )
    assert attention.token_counts == (5, 3)
    # Replayed: every use but the first of each count (3, 5, 7 eager once): 7. The second 7
    # drops 5 (3 was used since); the next 5 is captured again (its kernels are loaded, so
    # not eager) and drops 3; the last 3 is captured again and drops 7.
    assert attention.replays == 7
    # A dispatch graph and a combine graph per capture of a count: 3, 5, 7, 5, 3.
    assert capture.captures == attention.captures == 2 * 5
    attention.close()


def test_batches_the_device_pack_cannot_take_run_eagerly() -> None:
    """32 tokens x 3 choices overflow a slot's routed rows: the host plan, every time."""
    world = make_world(a=1, f=3, experts=7, ring_depth=1, tokens=32)
    ffns = [world.connection(Role.FFN, r).ffn_endpoint(FAST) for r in range(3)]
    capture = CountingCapture()
    attention = GraphedAttentionEndpoint(
        world.transport(Role.ATTENTION, 0), FAST, REFERENCE_KERNELS, capture=capture
    )
    jobs = jobs_of([32, 32, 32], seed=50)
    outputs = run_layers(world, attention, ffns, jobs, stages=1)
    experts = linear_experts(world, layers=8)
    for (layer, x, ids, w), out in zip(jobs, outputs, strict=True):
        torch.testing.assert_close(
            out.double(), experts.reference(layer, x, ids, w, False), rtol=1e-5, atol=1e-4
        )
    assert (attention.replays, capture.captures) == (0, 0)
    attention.close()


def test_out_of_range_expert_ids_fail_a_replayed_combine_and_free_the_ring() -> None:
    world = make_world(a=1, f=3, experts=7, ring_depth=1)
    ffns = [world.connection(Role.FFN, r).ffn_endpoint(FAST) for r in range(3)]
    attention = GraphedAttentionEndpoint(
        world.transport(Role.ATTENTION, 0), FAST, REFERENCE_KERNELS, capture=replayed_calls
    )
    run_layers(world, attention, ffns, jobs_of([6, 6], seed=60), stages=1)
    x, ids, w = route(6, 3, list(range(7)), 61)
    handle = attention.dispatch(0, x, ids.masked_fill(ids == ids[0, 0], 9), w)
    assert attention.replays == 2  # this one replayed the graph too
    drain(ffns, linear_experts(world))
    with pytest.raises(InvalidArgument, match=r"expert id 9, outside \[0, 7\)"):
        attention.combine(handle)
    assert attention.in_flight == 0


def test_a_capture_that_fails_is_a_named_error_and_the_ring_comes_back() -> None:
    def failing(body: Callable[[], Any]) -> tuple[Replay, Any]:
        raise RuntimeError("operation not permitted when stream is capturing (simulated)")

    world = make_world(a=1, f=3, experts=7, ring_depth=1)
    ffns = [world.connection(Role.FFN, r).ffn_endpoint(FAST) for r in range(3)]
    attention = GraphedAttentionEndpoint(
        world.transport(Role.ATTENTION, 0), FAST, REFERENCE_KERNELS, capture=failing
    )
    run_layers(world, attention, ffns, jobs_of([6], seed=70), stages=1)  # eager
    x, ids, w = route(6, 3, list(range(7)), 71)
    with pytest.raises(AFDError, match=r"capturing the dispatch of 6 tokens \(ring 0\) as a CUDA"):
        attention.dispatch(0, x, ids, w)
    assert attention.in_flight == 0


def test_graph_replay_refuses_what_it_cannot_replay() -> None:
    world = make_world(a=1, f=3, experts=7)
    transport = world.transport(Role.ATTENTION, 0)
    with pytest.raises(ValueError, match="max_token_counts must be >= 1"):
        GraphedAttentionEndpoint(transport, FAST, REFERENCE_KERNELS, 0, replayed_calls)
    no_pack = WindowKernels(REFERENCE_KERNELS.fused_combine)
    with pytest.raises(ValueError, match="graph replay needs the device pack"):
        GraphedAttentionEndpoint(transport, FAST, no_pack, capture=replayed_calls)
    with pytest.raises(ValueError, match="graph replay needs the device pack"):
        GraphedAttentionEndpoint(
            transport, WindowOptions(combine="portable"), REFERENCE_KERNELS, capture=replayed_calls
        )


def test_a_publish_block_sets_each_flag_from_the_values_written_last() -> None:
    world = make_world(a=1, f=3, experts=7, ring_depth=2)
    transport = world.transport(Role.ATTENTION, 0)
    block = transport.publish_block([0, 2], world.window.flag_index(0, 1))
    block.write([5, 6])
    block.launch()
    block.write([7, 8])  # nothing published until the next launch
    flags = [world.transport(Role.FFN, r) for r in range(3)]
    index = world.window.flag_index(0, 1)
    values = [int(t._flags[index]) for t in flags]  # type: ignore[attr-defined]
    assert values == [5, 0, 6]
    block.launch()
    assert [int(t._flags[index]) for t in flags] == [7, 0, 8]  # type: ignore[attr-defined]
    with pytest.raises(InvalidArgument, match="sets 2 flags, one value each; got 3"):
        block.write([1, 2, 3])
    with pytest.raises(InvalidArgument, match="peer 3 is outside"):
        transport.publish_block([3], 0)


def test_a_replayed_combine_that_failed_can_be_retried() -> None:
    """The combine graph's replay fails once (an out-of-memory, say): the dispatch stays in
    flight, and the retried combine replays again and checks the expert bounds again."""
    failures = [RuntimeError("CUDA error: out of memory (simulated)")]
    combined: list[bool] = []

    def failing_combines(body: Callable[[], Any]) -> tuple[Replay, Any]:
        replay, outputs = replayed_calls(body)
        if not isinstance(outputs, torch.Tensor):
            return replay, outputs  # a dispatch graph (a plan and wire positions)

        def flaky() -> None:
            if failures:
                raise failures.pop()
            replay()
            combined.append(True)

        return flaky, outputs

    world = make_world(a=1, f=3, experts=7, ring_depth=1)
    ffns = [world.connection(Role.FFN, r).ffn_endpoint(FAST) for r in range(3)]
    attention = GraphedAttentionEndpoint(
        world.transport(Role.ATTENTION, 0), FAST, REFERENCE_KERNELS, capture=failing_combines
    )
    experts = linear_experts(world, layers=8)
    run_layers(world, attention, ffns, jobs_of([6], seed=80), stages=1)  # eager
    x, ids, w = route(6, 3, list(range(7)), 81)
    handle = attention.dispatch(2, x, ids, w)
    assert attention.replays == 1
    experts.drain(ffns)
    with pytest.raises(RuntimeError, match="simulated"):
        attention.combine(handle)
    assert attention.in_flight == 1  # still ours to combine
    out = attention.combine(handle)
    expected = experts.reference(2, x, ids, w, False)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-4)
    assert combined == [True]  # the retry replayed the graph (not an eager fallback)
    assert attention.in_flight == 0


def test_another_id_or_weight_dtype_at_a_count_is_another_graph() -> None:
    """int64 ids, then int32 at the same count, then float64 weights: each runs eagerly
    once and is captured anew (the graphs' inputs have the dtypes they were made with)."""
    world = make_world(a=1, f=3, experts=7, ring_depth=1)
    ffns = [world.connection(Role.FFN, r).ffn_endpoint(FAST) for r in range(3)]
    capture = CountingCapture()
    attention = GraphedAttentionEndpoint(
        world.transport(Role.ATTENTION, 0), FAST, REFERENCE_KERNELS, capture=capture
    )
    experts = linear_experts(world, layers=8)
    jobs = jobs_of([6] * 9, seed=90)
    jobs = [
        (layer, x, ids.to(torch.int32) if 3 <= i < 6 else ids, w.double() if i >= 6 else w)
        for i, (layer, x, ids, w) in enumerate(jobs)
    ]
    outputs = run_layers(world, attention, ffns, jobs, stages=1)
    for (layer, x, ids, w), out in zip(jobs, outputs, strict=True):
        expected = experts.reference(layer, x, ids.long(), w.float(), False)
        torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-4)
    assert attention.replays == 2 * 3  # per dtype pair: eager, capture, replay
    assert capture.captures == 2 * 3
    attention.close()
    assert attention.token_counts == ()  # closing dropped the graphs


def test_a_weight_dtype_change_at_a_captured_count_plans_its_own_batch() -> None:
    """Float32 weights at a count until its graphs replay, then float64 at the same count:
    the first float64 dispatch runs eagerly, and on its own plan, not the graph's (whose
    tensors hold the previous layer's routing)."""
    world = make_world(a=1, f=3, experts=7, ring_depth=1)
    ffns = [world.connection(Role.FFN, r).ffn_endpoint(FAST) for r in range(3)]
    attention = GraphedAttentionEndpoint(
        world.transport(Role.ATTENTION, 0), FAST, REFERENCE_KERNELS, capture=replayed_calls
    )
    experts = linear_experts(world, layers=8)
    jobs = jobs_of([6] * 6, seed=95)
    jobs = [
        (layer, x, ids, w.double() if i >= 3 else w) for i, (layer, x, ids, w) in enumerate(jobs)
    ]
    outputs = run_layers(world, attention, ffns, jobs, stages=1)
    for (layer, x, ids, w), out in zip(jobs, outputs, strict=True):
        expected = experts.reference(layer, x, ids, w.float(), False)
        torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-4)
    assert attention.replays == 2 * 2


def polled_endpoint(world: LoopbackWorld) -> GraphedAttentionEndpoint:
    """A graphed endpoint whose combine graphs hold their wait (the polled stand-in)."""
    return GraphedAttentionEndpoint(
        world.transport(Role.ATTENTION, 0),
        FAST,
        REFERENCE_KERNELS,
        capture=replayed_calls,
        combine_wait=PolledCombineWait,
    )


@pytest.mark.parametrize(("wire", "reduce"), FORMATS)
@pytest.mark.parametrize("shared", ["attention", "ffn"])
def test_combines_that_wait_inside_their_graph_equal_the_eager_endpoint_bitwise(
    wire: str, reduce: str, shared: str
) -> None:
    """Every replayed dispatch is combined by one replay of a graph that waits for the
    replies first; the outputs equal the eager endpoint's exactly."""
    layout = layout_of(wire, reduce, a=1, f=3, tokens=32, shared=shared)
    jobs = jobs_of([9] * 8 + [4] * 4, seed=100)
    results = []
    for graphed in (False, True):
        world = LoopbackWorld(layout.window(ring_depth=2))
        ffns = [world.connection(Role.FFN, r).ffn_endpoint(FAST) for r in range(3)]
        attention: KernelAttentionEndpoint
        if graphed:
            attention = polled_endpoint(world)
        else:
            attention = KernelAttentionEndpoint(
                world.transport(Role.ATTENTION, 0), FAST, REFERENCE_KERNELS
            )
        results.append(run_layers(world, attention, ffns, jobs, stages=2))
        if graphed:
            assert isinstance(attention, GraphedAttentionEndpoint)
            assert attention.graph_waits == attention.replays == len(jobs) - 4
        attention.close()
    for eager, replayed in zip(*results, strict=True):
        assert torch.equal(eager, replayed)


def dispatch_a_replay(
    world: LoopbackWorld, attention: GraphedAttentionEndpoint, seed: int
) -> tuple[Any, list[WindowFFNEndpoint]]:
    """Two layers at 6 tokens through ``attention`` and three FFN ranks (options ``FAST``),
    then a third dispatch at 6 tokens, which replays its graphs: its handle, not yet
    answered, and the FFN endpoints."""
    ffns = [world.connection(Role.FFN, r).ffn_endpoint(FAST) for r in range(3)]
    run_layers(world, attention, ffns, jobs_of([6, 6], seed=seed), stages=1)
    x, ids, w = route(6, 3, list(range(7)), seed + 1)
    handle = attention.dispatch(1, x, ids, w)
    assert attention.replays == 2
    return handle, ffns


def _replayed_in_flight(world: LoopbackWorld) -> tuple[GraphedAttentionEndpoint, Any, Any]:
    """An endpoint whose third dispatch at 6 tokens replays its graphs, not yet answered."""
    attention = polled_endpoint(world)
    handle, ffns = dispatch_a_replay(world, attention, seed=110)
    return attention, handle, ffns


def test_a_late_reply_replays_the_wait_until_the_timeout_and_the_combine_can_be_retried() -> None:
    world = make_world(a=1, f=3, experts=7, ring_depth=1)
    attention, handle, ffns = _replayed_in_flight(world)
    wait = attention._waits[handle.ring]
    assert isinstance(wait, PolledCombineWait)
    before = wait.launches
    spun, began = attention.wait_seconds, time.perf_counter()
    with pytest.raises(PeerTimeout, match=r"FFN ranks \[0, 1, 2\] did not reply to layer 1"):
        attention.combine(handle, timeout=0.02)
    elapsed = time.perf_counter() - began
    assert wait.launches - before > 1  # the graph's wait ran out and was replayed
    # The host's spins on the wait are counted, a failed combine's too, and are part of it.
    assert 0 < attention.wait_seconds - spun < elapsed
    assert attention.in_flight == 1
    experts = linear_experts(world, layers=8)
    experts.drain(ffns)
    x, ids, w = route(6, 3, list(range(7)), 111)
    out = attention.combine(handle)
    torch.testing.assert_close(
        out.double(), experts.reference(1, x, ids, w, False), rtol=1e-5, atol=1e-4
    )
    assert attention.graph_waits == 2


def test_an_aborted_ffn_rank_ends_a_graph_wait_naming_it() -> None:
    world = make_world(a=1, f=3, experts=7, ring_depth=1)
    attention, handle, _ = _replayed_in_flight(world)
    world.transport(Role.FFN, 1).abort()
    with pytest.raises(PeerAborted, match=r"FFN rank\(s\) \[1\] aborted"):
        attention.combine(handle)


def make_reply_stale(world: LoopbackWorld, ffn_rank: int) -> None:
    """Rewrite the reply of ``ffn_rank`` on ring 0 of attention rank 0 as one answering
    another dispatch (its answered sequence number moved on, the checksum made right), so
    only the header check can tell."""
    header = slot_view(world.windows[(Role.ATTENTION, 0)], world.window, ffn_rank, 0).header
    words = header.tolist()
    length = 14 + words[Word.NUM_COUNTS]
    words[Word.ANSWER_SEQ] += 100
    words[Word.CHECKSUM] = 0
    crc = checksum(words[:length])
    words[Word.CHECKSUM] = crc - (1 << 32) if crc >= 1 << 31 else crc
    header[:length] = torch.tensor(words[:length], dtype=torch.int32)


def test_a_stale_reply_is_refused_after_the_graph_wait() -> None:
    """The wait in the graph only sees flags; the host still checks every reply's header
    before the output is returned."""
    world = make_world(a=1, f=3, experts=7, ring_depth=1)
    attention, handle, ffns = _replayed_in_flight(world)
    linear_experts(world, layers=8).drain(ffns)
    make_reply_stale(world, ffn_rank=2)
    with pytest.raises(ProtocolError, match="stale or misdirected reply from FFN rank 2"):
        attention.combine(handle)


def test_a_dead_ffn_rank_is_named_while_the_graph_wait_is_replayed_slice_after_slice() -> None:
    """Each slice of the wait ends at once (nothing arrived), far faster than the liveness
    interval: the peers are still checked on one clock across slices, so a dead FFN rank is
    a PeerAborted within a fraction of a second, not a PeerTimeout after the timeout."""
    world = make_world(a=1, f=3, experts=7, ring_depth=1)
    attention, handle, _ = _replayed_in_flight(world)
    checks: list[list[int]] = []

    def dead(peers: Any) -> None:
        checks.append(list(peers))
        raise PeerAborted("ffn rank 2 (pid 4242) exited")

    attention._transport.check_alive = dead  # type: ignore[method-assign]
    started = time.monotonic()
    with pytest.raises(PeerAborted, match=r"ffn rank 2 \(pid 4242\) exited"):
        attention.combine(handle, timeout=30.0)
    assert time.monotonic() - started < 5.0
    assert checks == [[0, 1, 2]]


@pytest.mark.parametrize("shared", ["attention", "ffn"])
def test_replayed_headers_equal_the_encoded_headers_of_each_dispatch(shared: str) -> None:
    """What a replay copies to the FFN ranks' headers (filled from the template the first
    replay kept) is, word for word, the encoding of the Header each FFN rank must see:
    this dispatch's layer, stage and its own new sequence number, the graph's token count
    and shared rows; a layer past int32 is still refused by the encoding, and its ring
    comes back."""
    from afd_protocol import FLAG_ROWS_PER_TOKEN, Header, MessageKind, ProtocolError
    from afd_protocol.core.header import encode_fixed_words

    layout = layout_of("per_rank", "ffn", a=1, f=3, tokens=32, shared=shared)
    world = LoopbackWorld(layout.window(ring_depth=1))
    transport = world.transport(Role.ATTENTION, 0)
    ffns = [world.connection(Role.FFN, r).ffn_endpoint(FAST) for r in range(3)]
    experts = linear_experts(world, layers=8)
    attention = GraphedAttentionEndpoint(transport, FAST, REFERENCE_KERNELS, capture=replayed_calls)
    x, ids, w = route(6, 3, list(range(7)), 70)
    for step, (layer, stage) in enumerate([(0, 0), (1, 0), (2, 1), (7, 3), (5, 2), (3, 0)]):
        before = transport.sequence.last
        handle = attention.dispatch(layer, x, ids, w, stage=stage)
        seqs = [before + 1 + dest for dest in range(3)]
        assert [handle.expected[d].seq for d in range(3)] == seqs
        if step == 0:  # eager: the graphs come with the second dispatch
            assert 6 not in attention.token_counts
            experts.drain(ffns)
            attention.combine(handle)
            continue
        entry = attention._graphs[6][0]
        wanted = []
        for dest in range(3):
            header = Header(
                MessageKind.DISPATCH,
                src_rank=0,
                layer=layer,
                stage=stage,
                num_tokens=6,
                routed_rows=0,
                shared_rows=handle.plan.shared_rows(dest),
                seq=seqs[dest],
                flags=FLAG_ROWS_PER_TOKEN,
                expert_counts=(0,) * layout.num_local_experts(dest),
            )
            wanted += encode_fixed_words(header)
        assert entry.fixed_host.tolist() == wanted, step
        assert [handle.expected[d].shared_rows for d in range(3)] == [
            handle.plan.shared_rows(d) for d in range(3)
        ]
        # Captured at step 1, first replayed (and the template kept) at 2, filled from it since.
        assert (entry.header_words is not None) == (step >= 2), step
        experts.drain(ffns)
        attention.combine(handle)
    with pytest.raises(ProtocolError, match="does not fit in int32"):
        attention.dispatch(2**31, x, ids, w)
    assert attention.in_flight == 0
    handle = attention.dispatch(4, x, ids, w)  # the ring came back
    experts.drain(ffns)
    torch.testing.assert_close(
        attention.combine(handle).double(),
        experts.reference(4, x, ids, w, shared == "ffn"),
        rtol=1e-5,
        atol=1e-4,
    )
    attention.close()
