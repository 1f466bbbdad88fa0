"""The graphed FFN loop (:class:`GraphedFFNServer`) over afd_protocol's loopback transport on
the CPU, its Triton kernels run by Triton's interpreter and its graph by
:func:`replayed_calls` (each replay runs the captured steps again with the arguments of
capture time, so a per-item value that does not travel through device memory goes stale).

Run by ``test_graphed_ffn_interpreted.py`` in a subprocess with ``TRITON_INTERPRET=1``
(which must be set before Triton compiles anything); skipped when collected otherwise.

Checked: replies equal the eager window FFN endpoint's bitwise (float32, every wire format,
one and two attention and FFN ranks, two stages in flight, an FFN rank that gets no rows)
and a float64 reference; fairness across replicas; every header the device refuses is one
``decode_header`` (or the window endpoint) refuses too, named on the host; shutdown, abort,
idle and bad-input errors; sequence numbers and flags handed back to the transport.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

import afd_interpreter_xor
import pytest
import torch

from afd_protocol import (
    HEADER_FIXED_WORDS,
    InvalidArgument,
    PeerAborted,
    PeerTimeout,
    ProtocolError,
    Role,
    SlotLayout,
    Topology,
    Word,
    WorkItem,
    decode_header,
    expert_ids_from_counts,
)
from afd_protocol import checksum as header_checksum
from afd_protocol.testing import random_routing
from afd_protocol.window import (
    LoopbackWorld,
    WindowFFNEndpoint,
    WindowOptions,
    abort_words,
    flag_words,
    slot_view,
)
from afd_transport_nvshmem.device_plan import triton_plan_on_device
from afd_transport_nvshmem.graphed_attention import (
    GraphedAttentionEndpoint,
    kernel_combine_wait,
    replayed_calls,
)
from afd_transport_nvshmem.graphed_ffn import ExpertStep, GraphedFFNServer, ServeGraphOptions
from afd_transport_nvshmem.input_fetch import triton_fetch_inputs
from afd_transport_nvshmem.kernel_attention import KernelAttentionEndpoint
from afd_transport_nvshmem.kernel_specs import REFERENCE_KERNELS
from afd_transport_nvshmem.word_copy import triton_copy_words

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="runs in test_graphed_ffn_interpreted.py's interpreter subprocess",
)
if os.environ.get("TRITON_INTERPRET") == "1":
    afd_interpreter_xor.install()  # the header CRCs' XOR reductions in numpy

if TYPE_CHECKING:
    from afd_protocol import WindowLayout
    from afd_transport_nvshmem.device_wait import WaitBlock

HIDDEN = 8
EXPERTS = 7
TOPK = 3
LAYERS = 6
FAST = WindowOptions(timeout=0.5, num_layers=LAYERS, num_stages=2)
GRAPH = ServeGraphOptions(steps_per_graph=2, poll_slice=3, liveness_interval=0.01)
ONE_STEP = ServeGraphOptions(steps_per_graph=1, poll_slice=2)
FORMATS = [("per_choice", "attention"), ("per_rank", "attention"), ("per_rank", "ffn")]


class AffineExperts:
    """Expert ``e`` of layer ``l``: ``x * scale[l, e] + bias[l, e]`` -- elementwise, so the
    graphed step (over a static buffer) and the eager one (over the item's rows) compute
    the same bits, and a float64 loop over tokens is an independent reference."""

    def __init__(self, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.scale = torch.rand(LAYERS, EXPERTS, generator=gen) + 0.5
        self.bias = torch.randn(LAYERS, EXPERTS, HIDDEN, generator=gen)

    def step(self, local: Sequence[int]) -> ExpertStep:
        """The device expert step of an FFN rank holding ``local`` (global ids)."""
        table = torch.tensor(list(local), dtype=torch.long)

        def step(rows: torch.Tensor, counts: torch.Tensor, layer: torch.Tensor) -> torch.Tensor:
            ends = torch.cumsum(counts, 0)
            positions = torch.arange(rows.shape[0])
            local_ids = torch.searchsorted(ends, positions, right=True).clamp(max=len(table) - 1)
            experts = table[local_ids]
            scale = self.scale.index_select(0, layer.long())[0][experts]
            bias = self.bias.index_select(0, layer.long())[0][experts]
            return rows * scale[:, None] + bias

        return step

    def eager(self, item: WorkItem, local: Sequence[int]) -> torch.Tensor:
        """The eager FFN's routed reply to ``item`` (grouped, computed, finished)."""
        table = torch.tensor(list(local), dtype=torch.long)
        outputs = []
        for part in item.parts:
            rows, group_list = part.grouped()
            experts = table[expert_ids_from_counts(group_list, rows.shape[0])]
            out = rows * self.scale[item.layer][experts][:, None] + self.bias[item.layer][experts]
            outputs.append(part.finish(out))
        return torch.cat(outputs)

    def reference(self, layer: int, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor):  # type: ignore[no-untyped-def]
        out = torch.zeros(x.shape, dtype=torch.float64)
        for t in range(x.shape[0]):
            for j in range(ids.shape[1]):
                e = int(ids[t, j])
                expert = x[t].double() * float(self.scale[layer, e]) + self.bias[layer, e].double()
                out[t] += float(w[t, j]) * expert
        return out


def layout_of(wire: str, reduce: str, a: int = 1, f: int = 1, tokens: int = 16) -> SlotLayout:
    return SlotLayout(
        Topology(a, f, EXPERTS),
        HIDDEN,
        tokens,
        TOPK,
        dtype="float32",
        wire_format=wire,
        combine_reduce=reduce,
        routed_cap_multiplier=float(f),
    )


def server_of(
    world: LoopbackWorld,
    rank: int,
    experts: AffineExperts,
    graph: ServeGraphOptions = GRAPH,
    options: WindowOptions = FAST,
) -> GraphedFFNServer:
    transport = world.transport(Role.FFN, rank)
    step = experts.step(world.window.slot.topology.local_experts(rank))
    return GraphedFFNServer(transport, step, options, graph, capture=replayed_calls)


def eager_drain(
    ffns: list[WindowFFNEndpoint], experts: AffineExperts
) -> list[tuple[int, int, int]]:
    from afd_protocol import PeerTimeout as Idle

    served = []
    for ffn in ffns:
        while True:
            try:
                item = ffn.next_work_item(timeout=0.001)
            except Idle:
                break
            ffn.reply(item, experts.eager(item, ffn.local_experts))
            served.append((ffn.rank, item.replica, item.layer))
    return served


def jobs_of(rounds: int, a: int, stages: int, experts: list[int] | None = None) -> list:  # type: ignore[type-arg]
    """Per round, per attention rank, ``stages`` dispatches ``(layer, x, ids, w)``."""
    gen = torch.Generator().manual_seed(7)
    pool = experts if experts is not None else list(range(EXPERTS))
    out = []
    for r in range(rounds):
        per_rank = []
        for rank in range(a):
            per_rank.append(
                [
                    (
                        (r * stages + s + rank) % LAYERS,
                        *random_routing(5 + r + s, HIDDEN, TOPK, pool, gen),
                    )
                    for s in range(stages)
                ]
            )
        out.append(per_rank)
    return out


def attention_of(world: LoopbackWorld, rank: int, graphs: bool) -> KernelAttentionEndpoint:
    """The kernel endpoint, or (``graphs``) the graphed one whose dispatch graphs fetch their
    inputs and plan with the Triton kernels and whose combine graphs hold the Triton wait
    kernel (run by the
    interpreter, like the FFN side's kernels; the eager endpoint plans with the torch
    reference)."""
    transport = world.transport(Role.ATTENTION, rank)
    if not graphs:
        return KernelAttentionEndpoint(transport, FAST, REFERENCE_KERNELS)
    return GraphedAttentionEndpoint(
        transport,
        FAST,
        dataclasses.replace(
            REFERENCE_KERNELS,
            device_plan=triton_plan_on_device,
            fetch_inputs=triton_fetch_inputs,
            copy_words=triton_copy_words,
        ),
        capture=replayed_calls,
        combine_wait=kernel_combine_wait,
    )


def run(
    layout: SlotLayout, jobs: list, graphed: bool, stages: int = 2, attention_graphs: bool = False
):  # type: ignore[no-untyped-def]
    """Every round: each attention rank dispatches its stages, the FFN ranks serve, the
    attention ranks combine. Returns (outputs in order, items served per FFN rank)."""
    topo = layout.topology
    world = LoopbackWorld(layout.window(ring_depth=stages))
    experts = AffineExperts()
    attention = [attention_of(world, a, attention_graphs) for a in range(topo.num_attention_ranks)]
    from afd_transport_nvshmem.reduce_partials import triton_reduce_partials

    if graphed:
        servers = [server_of(world, f, experts) for f in range(topo.num_ffn_ranks)]
    else:
        eager = [
            WindowFFNEndpoint(world.transport(Role.FFN, f), FAST, triton_reduce_partials)
            for f in range(topo.num_ffn_ranks)
        ]
    outputs, served = [], [0] * topo.num_ffn_ranks
    for round_jobs in jobs:
        handles = []
        for a, rank_jobs in enumerate(round_jobs):
            for stage, (layer, x, ids, w) in enumerate(rank_jobs):
                handles.append((a, attention[a].dispatch(layer, x, ids, w, stage=stage)))
        if graphed:
            for f, server in enumerate(servers):
                stats = server.serve(while_idle="return")
                served[f] += len(stats.items)
        else:
            for f, _, _ in eager_drain(eager, experts):
                served[f] += 1
        outputs += [attention[a].combine(h) for a, h in handles]
    return outputs, served, world, (servers if graphed else eager), attention


@pytest.mark.parametrize(("wire", "reduce"), FORMATS)
@pytest.mark.parametrize(("a", "f"), [(1, 1), (2, 2)])
def test_replies_equal_the_eager_endpoint_bitwise(wire: str, reduce: str, a: int, f: int) -> None:
    layout = layout_of(wire, reduce, a, f)
    jobs = jobs_of(3, a, stages=2)
    eager, eager_served, *_ = run(layout, jobs, graphed=False)
    graphed, graph_served, _world, servers, _ = run(layout, jobs, graphed=True)
    assert graph_served == eager_served
    assert sum(graph_served) > 0
    experts = AffineExperts()
    flat = [job for round_jobs in jobs for rank_jobs in round_jobs for job in rank_jobs]
    for (layer, x, ids, w), want, got in zip(flat, eager, graphed, strict=True):
        assert torch.isfinite(got).all()
        assert torch.equal(want, got)
        want64 = experts.reference(layer, x, ids, w)
        torch.testing.assert_close(got.double(), want64, rtol=1e-5, atol=1e-5)
    for server in servers:
        assert server.replays >= 1
        assert server.capture_seconds > 0


@pytest.mark.parametrize(("wire", "reduce"), [FORMATS[0], FORMATS[2]])
def test_both_sides_replayed_equal_the_eager_pair_bitwise(wire: str, reduce: str) -> None:
    """The attention exchange replayed from graphs whose combine waits on the device (the
    Triton wait kernel), the FFN loop from its graph: the same outputs as both eager."""
    layout = layout_of(wire, reduce, a=1, f=1)
    gen = torch.Generator().manual_seed(21)
    jobs = [
        [[(r % LAYERS, *random_routing(6, HIDDEN, TOPK, list(range(EXPERTS)), gen))]]
        for r in range(5)
    ]
    eager, _, *_ = run(layout, jobs, graphed=False, stages=1)
    both, served, _, _, attention = run(layout, jobs, graphed=True, stages=1, attention_graphs=True)
    assert served == [5]
    endpoint = attention[0]
    assert isinstance(endpoint, GraphedAttentionEndpoint)
    assert endpoint.graph_waits == endpoint.replays == 4  # one eager, then captured: 4 replays
    for want, got in zip(eager, both, strict=True):
        assert torch.equal(want, got)


@pytest.mark.parametrize(("wire", "reduce"), FORMATS)
def test_an_ffn_rank_that_gets_no_rows_replies_empty(wire: str, reduce: str) -> None:
    """Two FFN ranks; every token routed to FFN rank 0's experts: rank 1 still gets the
    packed dispatch (zero rows) and its empty reply completes the combine."""
    layout = layout_of(wire, reduce, a=1, f=2)
    only_rank0 = list(layout.topology.local_experts(0))
    jobs = jobs_of(2, 1, stages=2, experts=only_rank0)
    eager, _, *_ = run(layout, jobs, graphed=False)
    graphed, served, *_ = run(layout, jobs, graphed=True)
    assert served == [4, 4]
    for want, got in zip(eager, graphed, strict=True):
        assert torch.equal(want, got)


def test_replicas_are_served_in_turn() -> None:
    """Two replicas with two stages each in flight: the scan start rotates over replicas,
    and within a replica the earlier dispatch (lower sequence number) goes first."""
    layout = layout_of("per_rank", "ffn", a=2, f=1)
    world = LoopbackWorld(layout.window(ring_depth=2))
    experts = AffineExperts()
    attention = [
        KernelAttentionEndpoint(world.transport(Role.ATTENTION, a), FAST, REFERENCE_KERNELS)
        for a in range(2)
    ]
    gen = torch.Generator().manual_seed(3)
    handles = []
    for a in range(2):
        for stage in range(2):
            x, ids, w = random_routing(4, HIDDEN, TOPK, list(range(EXPERTS)), gen)
            handles.append(attention[a].dispatch(a * 2 + stage, x, ids, w, stage=stage))
    server = server_of(world, 0, experts, ServeGraphOptions(steps_per_graph=4, poll_slice=3))
    stats = server.serve(while_idle="return")
    assert stats.served == [(0, 0, 0), (1, 2, 0), (0, 1, 1), (1, 3, 1)]
    for a, h in zip([0, 0, 1, 1], handles, strict=True):
        assert torch.isfinite(attention[a].combine(h)).all()


def test_shutdown_ends_serve_and_hands_back_sequence_numbers() -> None:
    layout = layout_of("per_rank", "ffn", a=2, f=1)
    jobs = jobs_of(2, 2, stages=2)
    _, served, world, servers, attention = run(layout, jobs, graphed=True)
    for endpoint in attention:
        endpoint.announce_shutdown()
    server = servers[0]
    stats = server.serve(while_idle="raise")
    assert server.finished
    assert stats.items == []
    transport = server._transport
    # Every reply took one sequence number, counted on the device and handed back.
    assert transport.sequence.last == served[0] == 8
    flags = flag_words(world.windows[(Role.FFN, 0)], world.window).tolist()
    assert transport.seen[: len(flags)] == flags[: len(transport.seen)]
    assert server.serve(while_idle="raise").items == []  # finished: returns at once
    server.close()
    # The window is free again, and an eager endpoint continues the sequence.
    WindowFFNEndpoint(transport, FAST).close()


def test_an_aborted_attention_rank_is_named() -> None:
    layout = layout_of("per_choice", "attention", a=2, f=1)
    world = LoopbackWorld(layout.window(ring_depth=1))
    server = server_of(world, 0, AffineExperts())
    world.transport(Role.ATTENTION, 1).abort()
    with pytest.raises(PeerAborted, match=r"attention rank\(s\) \[1\] aborted"):
        server.serve(while_idle="wait")


def test_a_dead_attention_rank_is_named_once_an_idle_slice_confirms_it() -> None:
    """The liveness check says attention rank 0 exited: the loop does not believe it until
    a whole poll slice saw nothing new from it (it may have sent its last items and exited),
    then raises PeerAborted naming it -- long before the timeout."""
    layout = layout_of("per_rank", "ffn")
    world = LoopbackWorld(layout.window(ring_depth=1))
    server = server_of(world, 0, AffineExperts())
    transport = server._transport
    checks = []

    def dead(peers: Sequence[int]) -> None:
        checks.append(list(peers))
        raise PeerAborted("attention rank 0 (pid 4242) exited")

    transport.check_alive = dead  # type: ignore[method-assign]
    with pytest.raises(PeerAborted, match=r"attention rank 0 \(pid 4242\) exited"):
        server.serve(while_idle="wait", timeout=30.0)
    assert checks[0] == [0]


def test_nothing_arriving_raises_after_the_timeout() -> None:
    layout = layout_of("per_choice", "attention")
    world = LoopbackWorld(layout.window(ring_depth=1))
    server = server_of(world, 0, AffineExperts())
    with pytest.raises(PeerTimeout, match=r"no work item became ready within 0\.05 s"):
        server.serve(while_idle="raise", timeout=0.05)
    # The stop word was cleared: the server still serves.
    attention = KernelAttentionEndpoint(world.transport(Role.ATTENTION, 0), FAST, REFERENCE_KERNELS)
    x, ids, w = random_routing(3, HIDDEN, TOPK, list(range(EXPERTS)), torch.Generator())
    handle = attention.dispatch(1, x, ids, w)
    assert len(server.serve(while_idle="return").items) == 1
    assert torch.isfinite(attention.combine(handle)).all()


def dispatched_world(wire: str = "per_rank", reduce: str = "ffn") -> LoopbackWorld:
    """One dispatch of layer 1 from attention rank 0, waiting in FFN rank 0's window."""
    layout = layout_of(wire, reduce)
    world = LoopbackWorld(layout.window(ring_depth=1))
    attention = KernelAttentionEndpoint(world.transport(Role.ATTENTION, 0), FAST, REFERENCE_KERNELS)
    x, ids, w = random_routing(6, HIDDEN, TOPK, list(range(EXPERTS)), torch.Generator())
    attention.dispatch(1, x, ids, w)
    return world


def rewrite(world: LoopbackWorld, word: int, value: int, checksum: bool = True) -> list[int]:
    """Set header ``word`` of the waiting dispatch to ``value`` (re-checksummed unless
    ``checksum`` is False); returns the header words as the FFN rank will see them."""
    view = slot_view(world.windows[(Role.FFN, 0)], world.window, 0, 0)
    words = view.header.tolist()
    length = HEADER_FIXED_WORDS + words[Word.NUM_COUNTS]
    header = words[:length]
    header[word] = value
    if checksum:
        header[Word.CHECKSUM] = 0
        crc = header_checksum(header)
        header[Word.CHECKSUM] = crc - (1 << 32) if crc >= 1 << 31 else crc
    view.header[:length] = torch.tensor(header, dtype=torch.int32)
    return header


def outcome(world: LoopbackWorld, options: ServeGraphOptions = GRAPH) -> str:
    """What the graphed server makes of the waiting dispatch: 'served' or the error text."""
    server = server_of(world, 0, AffineExperts(), options)
    try:
        stats = server.serve(while_idle="return")
    except ProtocolError as exc:
        return str(exc)
    finally:
        server.close()
    assert len(stats.items) == 1
    return "served"


@pytest.mark.parametrize(
    ("word", "value", "named"),
    [
        (Word.MAGIC, 7, "MAGIC=7"),
        (Word.VERSION, 99, "VERSION=99"),
        (Word.LAYER, LAYERS, f"LAYER={LAYERS}"),
        (Word.STAGE, 5, "STAGE=5"),
        (Word.NUM_TOKENS, 17, "NUM_TOKENS=17"),
        (Word.FLAGS, 0, "FLAGS=0"),
        (Word.NUM_COUNTS, 3, "NUM_COUNTS=3"),
        (Word.ANSWER_SEQ, 4, "ANSWER_SEQ=4"),
        (Word.SRC_RANK, 1, "SRC_RANK=1"),
    ],
)
def test_refused_headers_are_named_on_the_host(word: Word, value: int, named: str) -> None:
    world = dispatched_world()
    rewrite(world, word, value)
    assert named in outcome(world)


def test_a_corrupted_header_fails_its_checksum() -> None:
    world = dispatched_world()
    view = slot_view(world.windows[(Role.FFN, 0)], world.window, 0, 0)
    view.header[Word.SEQ] ^= 1 << 20  # still a valid sequence number: only the CRC sees it
    assert "CHECKSUM" in outcome(world)


FORMAT_WORDS = (Word.NUM_TOKENS, Word.ROUTED_ROWS, Word.FLAGS)
"""The fixed words whose rules differ between the wire formats."""


def test_the_device_refuses_exactly_what_decode_header_refuses() -> None:
    """Each header word, and each expert count, moved up and down by one and
    re-checksummed: the device serves the header iff the host's decoder (with this rank's
    limits) and the endpoint's own checks accept it (``per_choice``: the counts and the
    words whose rules differ from ``per_rank``'s)."""
    for wire, reduce in (("per_choice", "attention"), ("per_rank", "ffn")):
        base = dispatched_world(wire, reduce)
        view = slot_view(base.windows[(Role.FFN, 0)], base.window, 0, 0)
        length = HEADER_FIXED_WORDS + int(view.header[Word.NUM_COUNTS])
        limits = base.window.slot.header_limits(
            decode_header(view.header[:length]).kind, 0, num_layers=LAYERS, num_stages=2
        )
        for word in range(length):
            if word in (Word.CHECKSUM, Word.SEQ):
                continue  # the checksum itself; SEQ must equal the flag (the endpoint's check)
            if wire == "per_choice" and word < HEADER_FIXED_WORDS and word not in FORMAT_WORDS:
                continue  # the same rules as per_rank's (kept short: the interpreter is slow)
            for delta in (-1, 1):
                world = dispatched_world(wire, reduce)
                original = slot_view(world.windows[(Role.FFN, 0)], world.window, 0, 0)
                value = int(original.header[word]) + delta
                header = rewrite(world, word, value)
                try:
                    decoded = decode_header(header, limits)
                    accepted = decoded.src_rank == 0 and decoded.kind.value == 1
                except ProtocolError:
                    accepted = False
                if word >= HEADER_FIXED_WORDS or word == Word.ROUTED_ROWS:
                    # Counts and rows the route ids disagree with: refused on the device.
                    accepted = accepted and delta == 0
                result = outcome(world, ONE_STEP)
                assert (result == "served") == accepted, (wire, word, delta, result)


def test_a_layer_this_rank_does_not_serve_is_named() -> None:
    world = dispatched_world()
    options = ServeGraphOptions(steps_per_graph=2, poll_slice=3, served_layers=(0, 2, 3))
    assert "layer 1 is not one this FFN rank serves ([0, 2, 3])" in outcome(world, options)


def test_route_ids_that_disagree_with_the_counts_are_refused() -> None:
    world = dispatched_world("per_rank", "ffn")
    view = slot_view(world.windows[(Role.FFN, 0)], world.window, 0, 0)
    view.route_ids[0, 0] = view.route_ids[0, 1]  # one token routed twice to one expert
    assert "route_ids disagree with the header's EXPERT_COUNTS" in outcome(world)


def test_bad_configurations_are_refused() -> None:
    experts = AffineExperts()
    two_per_replica = SlotLayout(
        Topology(2, 1, EXPERTS, attn_ranks_per_dp=2), HIDDEN, 8, TOPK, dtype="float32"
    )
    world = LoopbackWorld(two_per_replica.window())
    with pytest.raises(InvalidArgument, match="attn_ranks_per_dp=2"):
        server_of(world, 0, experts)
    shared = SlotLayout(
        Topology(1, 1, EXPERTS), HIDDEN, 8, TOPK, dtype="float32", shared_placement="ffn"
    )
    with pytest.raises(InvalidArgument, match="shared_placement='attention'"):
        server_of(LoopbackWorld(shared.window()), 0, experts)
    plain = LoopbackWorld(layout_of("per_choice", "attention").window())
    with pytest.raises(InvalidArgument, match="served_layers needs num_layers"):
        server_of(
            plain, 0, experts, ServeGraphOptions(served_layers=(1,)), WindowOptions(timeout=1)
        )
    transport = plain.transport(Role.FFN, 0)
    with pytest.raises(InvalidArgument, match=r"must return a contiguous torch.float32 tensor"):
        GraphedFFNServer(
            transport, lambda rows, counts, layer: rows[:1], FAST, GRAPH, replayed_calls
        )
    # A failed construction leaves the window free.
    WindowFFNEndpoint(transport, FAST).close()
    with pytest.raises(InvalidArgument, match="steps_per_graph must be >= 1"):
        ServeGraphOptions(steps_per_graph=0)


def _attention_wait_block(all_flags: bool) -> tuple[WaitBlock, torch.Tensor, WindowLayout]:
    """A wait kernel over attention rank 0's window of a 1A2F loopback world (two
    peers): the block, that window's bytes and its layout."""
    from afd_transport_nvshmem.device_wait import WaitBlock, header_offsets

    layout = layout_of("per_choice", "attention", a=1, f=2)
    world = LoopbackWorld(layout.window(ring_depth=1))
    local = world.windows[(Role.ATTENTION, 0)]
    window = world.window
    block = WaitBlock(
        flag_words(local, window),
        abort_words(local, window),
        local.view(torch.int32),
        header_offsets(window, torch.device("cpu")),
        window.slot.header_words,
        max_peers=2,
        all_flags=all_flags,
    )
    return block, local, window


@pytest.mark.parametrize("all_flags", [True, False])
def test_a_wait_block_ends_at_the_first_change_or_when_all_changed(all_flags: bool) -> None:
    """The wait kernel behind both the combine wait (every flag) and the transport's
    DeviceWaiter (the first change): one of two watched flags changed."""
    block, local, window = _attention_wait_block(all_flags)
    flag_words(local, window)[window.flag_index(1, 0)] = 7
    block.write([window.flag_index(0, 0), window.flag_index(1, 0)], [0, 0], [0, 1], 3)
    block.launch()
    assert block.status() == (2 if all_flags else 1)  # budget spent / first change
    assert block.values(2) == [0, 7]
    abort_words(local, window)[0] = 1
    block.write([window.flag_index(0, 0)], [0], [0, 1], 3)
    block.launch()
    assert block.status() == 3


def test_a_cancelled_wait_block_says_so_and_the_next_write_clears_it() -> None:
    """A wait whose cancel word is set ends with STATUS_CANCELLED (the host's way to end a
    wait that would otherwise run to its deadline); the next write clears the word, and a
    deadline outside what the request holds is refused before anything is written."""
    from afd_transport_nvshmem.device_wait import (
        MAX_DEADLINE_US,
        STATUS_CANCELLED,
        STATUS_CHANGED,
    )

    block, local, window = _attention_wait_block(all_flags=True)
    watched = [window.flag_index(0, 0), window.flag_index(1, 0)]
    block.write(watched, [0, 0], [0, 1], 10_000, deadline_us=1_000_000)
    block.cancel()
    block.launch()  # nothing arrives: only the cancel word can end it before 10,000 polls
    assert block.status() == STATUS_CANCELLED
    flag_words(local, window)[watched[0]] = 3
    flag_words(local, window)[watched[1]] = 4
    block.write(watched, [0, 0], [0, 1], 10_000, deadline_us=1_000_000)
    block.launch()
    assert block.status() == STATUS_CHANGED
    assert block.values(2) == [3, 4]
    with pytest.raises(ValueError, match="deadline"):
        block.write(watched, [3, 4], [0, 1], 1, deadline_us=MAX_DEADLINE_US + 1)
    assert block.status() == STATUS_CHANGED  # the refused write changed nothing
