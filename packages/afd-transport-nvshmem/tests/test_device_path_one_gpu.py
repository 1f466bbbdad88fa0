"""The whole device path on one GPU, in one process, without NVSHMEM: the loopback world's
windows live in CUDA memory and the kernel attention endpoint gets the Triton kernels, so
dispatch -> FFN -> combine runs through both kernels and the real endpoints."""

from __future__ import annotations

import pytest
import torch

from afd_protocol import (
    DevicePlan,
    InvalidArgument,
    Role,
    SlotLayout,
    Topology,
    relative_error,
)
from afd_protocol.testing import LinearExperts, random_routing
from afd_protocol.window import LoopbackWorld, WindowFFNEndpoint, WindowOptions
from afd_transport_nvshmem.kernel_attention import KernelAttentionEndpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("shared", ["attention", "ffn"])
def test_packed_dispatch_and_fused_combine_on_one_gpu(shared: str) -> None:
    hidden, layers = 128, 4
    topo = Topology(1, 3, 12)
    layout = SlotLayout(topo, hidden, 64, 4, dtype="bfloat16", shared_placement=shared)
    from afd_transport_nvshmem.kernels import triton_kernels

    world = LoopbackWorld(layout.window(ring_depth=2), device="cuda")
    options = WindowOptions(timeout=0.5, device_pack=True)
    attention = KernelAttentionEndpoint(
        world.transport(Role.ATTENTION, 0), options, triton_kernels()
    )
    ffns = [
        world.connection(Role.FFN, r).ffn_endpoint(WindowOptions(timeout=0.5)) for r in range(3)
    ]
    experts = LinearExperts(layers, 12, hidden, seed=3)
    serving = LinearExperts(layers, 12, hidden, seed=3).to("cuda")
    gen = torch.Generator().manual_seed(4)
    only_first_two = [e for r in (0, 1) for e in topo.local_experts(r)]
    jobs = [(0, 48, range(12)), (2, 9, only_first_two), (3, 64, range(12)), (1, 1, range(12))]
    served = []
    for layer, tokens, pool in jobs:
        x, ids, w = random_routing(tokens, hidden, 4, list(pool), gen, torch.bfloat16)
        handle = attention.dispatch(layer, x.cuda(), ids.cuda(), w.cuda())
        packed = isinstance(handle.plan, DevicePlan)  # which plan the endpoint chose
        served += serving.drain(ffns, poll=0.01)
        out = attention.combine(handle)
        error = relative_error(out, experts.reference(layer, x, ids, w, shared == "ffn"))
        assert error <= 2e-2, (layer, tokens, packed, error)
        # 64 tokens x top-4 can overflow a rank (routed_cap is smaller): the portable path.
        assert packed == (tokens * 4 <= layout.routed_cap)
    assert (2, 0, 2) in served  # an empty part for the rank whose experts got nothing
    x, ids, w = random_routing(3, hidden, 4, list(range(12)), gen, torch.bfloat16)
    handle = attention.dispatch(0, x.cuda(), ids.masked_fill(ids == ids[0, 0], 40).cuda(), w.cuda())
    serving.drain(ffns, poll=0.01)
    with pytest.raises(InvalidArgument, match="expert id 40"):
        attention.combine(handle)


@pytest.mark.parametrize("device_pack", [False, True])
@pytest.mark.parametrize("reduce", ["attention", "ffn"])
def test_per_rank_rows_through_the_kernel_endpoints_on_one_gpu(
    reduce: str, device_pack: bool
) -> None:
    """per_rank over CUDA windows, planned on the host or packed on the device (token rows,
    ids, weights, headers by the Triton pack), the FFN side reducing with the Triton reduce:
    every path equals the float64 reference, and a packed dispatch() never synchronises
    with the device."""
    hidden = 128
    topo = Topology(1, 3, 12)
    layout = SlotLayout(
        topo,
        hidden,
        64,
        4,
        dtype="bfloat16",
        shared_placement="ffn",
        wire_format="per_rank",
        combine_reduce=reduce,
    )
    from afd_transport_nvshmem.kernels import triton_kernels

    world = LoopbackWorld(layout.window(ring_depth=2), device="cuda")
    options = WindowOptions(timeout=0.5, device_pack=device_pack)
    kernels = triton_kernels()
    attention = KernelAttentionEndpoint(world.transport(Role.ATTENTION, 0), options, kernels)
    ffn_options = WindowOptions(timeout=0.5)
    ffns = [
        WindowFFNEndpoint(world.transport(Role.FFN, r), ffn_options, kernels.reduce_partials)
        for r in range(3)
    ]
    experts = LinearExperts(2, 12, hidden, seed=5)
    serving = LinearExperts(2, 12, hidden, seed=5).to("cuda")
    gen = torch.Generator().manual_seed(6)
    for step, (layer, tokens) in enumerate(((0, 64), (1, 7), (0, 1))):
        x, ids, w = random_routing(tokens, hidden, 4, list(range(12)), gen, torch.bfloat16)
        x, ids, w = x.cuda(), ids.cuda(), w.cuda()
        torch.cuda.synchronize()
        if device_pack and reduce == "ffn" and step > 0:
            # Reduced on the FFN side, every batch packs: no host read of the counts (after
            # the first dispatch, which builds the cached address tables once).
            torch.cuda.set_sync_debug_mode("error")
        try:
            handle = attention.dispatch(layer, x, ids, w)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        packed = isinstance(handle.plan, DevicePlan)
        assert packed == (device_pack and layout.slot_rows(tokens * 4, tokens) <= layout.routed_cap)
        serving.drain(ffns, poll=0.01)
        out = attention.combine(handle)
        assert out.device.type == "cuda"
        error = relative_error(out, experts.reference(layer, x.cpu(), ids.cpu(), w.cpu(), True))
        assert error <= 2e-2, (reduce, device_pack, layer, error)


def _graphed_or_eager(
    layout: SlotLayout,
    graphed: bool,
    max_token_counts: int,
    defer_checks: bool = False,
    timeout: float = 1.0,
) -> tuple[KernelAttentionEndpoint, list[WindowFFNEndpoint]]:
    """A loopback world in CUDA memory: its attention endpoint (graph-replayed or eager,
    with the Triton kernels) and its FFN endpoints."""
    from afd_transport_nvshmem.graphed_attention import GraphedAttentionEndpoint
    from afd_transport_nvshmem.kernels import triton_kernels

    world = LoopbackWorld(layout.window(ring_depth=2), device="cuda")
    transport = world.transport(Role.ATTENTION, 0)
    options = WindowOptions(timeout=timeout)
    attention = (
        GraphedAttentionEndpoint(
            transport, options, triton_kernels(), max_token_counts, defer_checks=defer_checks
        )
        if graphed
        else KernelAttentionEndpoint(transport, options, triton_kernels())
    )
    ffns = [
        world.connection(Role.FFN, r).ffn_endpoint(options)
        for r in range(layout.topology.num_ffn_ranks)
    ]
    return attention, ffns


@pytest.mark.parametrize("defer", [False, True])
@pytest.mark.parametrize(("wire", "reduce"), [("per_choice", "attention"), ("per_rank", "ffn")])
def test_graph_replayed_exchange_equals_the_eager_one_bitwise(
    wire: str, reduce: str, defer: bool
) -> None:
    """Real CUDA graphs and the Triton kernels: twenty layers at two token counts on two
    rings, graph-replayed and eager, give bitwise-equal float32 outputs, matching the
    reference; the host time of a replayed dispatch + combine is reported beside eager.
    ``defer``: the replayed combines are checked later (``defer_checks``, flush())."""
    import time

    from afd_transport_nvshmem.graphed_attention import GraphedAttentionEndpoint

    hidden, layers = 256, 4
    topo = Topology(1, 2, 16)
    layout = SlotLayout(
        topo, hidden, 128, 4, dtype="float32", wire_format=wire, combine_reduce=reduce
    )
    gen = torch.Generator().manual_seed(8)
    counts = [96] * 12 + [40] * 8
    jobs = [
        (i % layers, *random_routing(n, hidden, 4, list(range(16)), gen, torch.float32))
        for i, n in enumerate(counts)
    ]
    experts = LinearExperts(layers, 16, hidden, seed=5)
    outputs: dict[bool, list[torch.Tensor]] = {}
    host: dict[bool, list[float]] = {}
    for graphed in (False, True):
        attention, ffns = _graphed_or_eager(layout, graphed, 2, defer_checks=defer)
        serving = LinearExperts(layers, 16, hidden, seed=5).to("cuda")
        outputs[graphed], host[graphed] = [], []
        for first in range(0, len(jobs), 2):
            batch = jobs[first : first + 2]
            torch.cuda.synchronize()
            started = time.perf_counter()
            handles = [
                attention.dispatch(layer, x.cuda(), ids.cuda(), w.cuda(), stage=s)
                for s, (layer, x, ids, w) in enumerate(batch)
            ]
            issued = time.perf_counter() - started
            serving.drain(ffns, poll=0.01)
            started = time.perf_counter()
            outputs[graphed] += [attention.combine(h) for h in handles]
            host[graphed].append(issued + time.perf_counter() - started)
        if graphed:
            assert isinstance(attention, GraphedAttentionEndpoint)
            assert attention.replays == len(jobs) - 4  # 2 counts x 2 rings eager
            assert attention.unchecked == (2 if defer else 0)  # each ring's last combine
            attention.flush()
            assert attention.unchecked == 0
        attention.close()
    for (layer, x, ids, w), eager, replayed in zip(
        jobs, outputs[False], outputs[True], strict=True
    ):
        assert torch.equal(eager, replayed)
        error = relative_error(replayed, experts.reference(layer, x, ids, w, False))
        assert error <= 1e-5, error
    late = slice(len(host[True]) // 2, None)  # past the captures
    eager_ms = 1e3 * sorted(host[False][late])[len(host[False][late]) // 2] / 2
    replay_ms = 1e3 * sorted(host[True][late])[len(host[True][late]) // 2] / 2
    print(
        f"host ms per layer (dispatch + combine, loopback): eager {eager_ms:.3f}, "
        f"graph-replayed {replay_ms:.3f}"
    )


def test_graph_replays_survive_dropped_constants_and_graphs_dropped_in_flight() -> None:
    """Real CUDA graphs, each checked bitwise against the eager endpoint: (1) once the
    graphs are captured, 300 other constant tables push theirs out of ``constant_index``'s
    cache and many small allocations take freed memory, yet later replays are unchanged
    (the graphs keep their tables); (2) with one token count held and two stages in flight,
    a count's graphs are dropped while a dispatch that replayed them is in flight."""
    from afd_protocol import constant_index
    from afd_transport_nvshmem.graphed_attention import GraphedAttentionEndpoint

    hidden, layers = 128, 4
    layout = SlotLayout(Topology(1, 2, 16), hidden, 64, 4, dtype="float32")
    gen = torch.Generator().manual_seed(9)
    counts = [40] * 6 + [24] * 2 + [40] * 4 + [24, 40, 24, 40] + [40] * 6
    jobs = [
        (i % layers, *random_routing(n, hidden, 4, list(range(16)), gen, torch.float32))
        for i, n in enumerate(counts)
    ]
    outputs: dict[bool, list[torch.Tensor]] = {}
    for graphed in (False, True):
        attention, ffns = _graphed_or_eager(layout, graphed, 1)
        serving = LinearExperts(layers, 16, hidden, seed=6).to("cuda")
        outputs[graphed] = []
        for first in range(0, len(jobs), 2):
            handles = [
                attention.dispatch(layer, x.cuda(), ids.cuda(), w.cuda(), stage=s)
                for s, (layer, x, ids, w) in enumerate(jobs[first : first + 2])
            ]
            serving.drain(ffns, poll=0.01)
            outputs[graphed] += [attention.combine(h) for h in handles]
            if first == 4:  # the count-40 graphs are captured by now
                for j in range(300):
                    constant_index((j, 7, 7), torch.device("cuda"))
                litter = [torch.full((j % 64 + 1,), -1, device="cuda") for j in range(3000)]
                del litter
        if graphed:
            assert isinstance(attention, GraphedAttentionEndpoint)
            assert attention.replays >= 10
        attention.close()
    for eager, replayed in zip(outputs[False], outputs[True], strict=True):
        assert torch.equal(eager, replayed)


def test_word_copies_reach_page_locked_host_memory_both_ways() -> None:
    """The word-copy kernel between pinned host memory and the device, both directions and
    both word sizes, equal to the source; pageable host memory is refused by name."""
    from afd_transport_nvshmem.word_copy import triton_copy_words

    for dtype in (torch.int32, torch.int64):
        host = torch.arange(-5, 295, dtype=dtype).pin_memory()
        device = torch.full((300,), 7, dtype=dtype, device="cuda")
        triton_copy_words(device, host)
        back = torch.zeros(300, dtype=dtype).pin_memory()
        triton_copy_words(back, device * 3)
        torch.cuda.synchronize()
        assert torch.equal(device.cpu(), host)
        assert torch.equal(back, host * 3)
    with pytest.raises(ValueError, match="only when it is page-locked"):
        triton_copy_words(
            torch.zeros(4, dtype=torch.int32, device="cuda"), torch.zeros(4, dtype=torch.int32)
        )


def test_graphed_dispatch_moves_its_words_by_kernel_not_by_host_memcpy() -> None:
    """The dispatch graph's header words, input addresses and id bounds cross PCIe by the
    word-copy kernel (three nodes), not as memcpy nodes touching host memory, which cost a
    graph's launch about 5 us of host time each: the graph's only host memcpys are those of
    the loopback transport's own publish (at least one: the census sees them); the combine
    graph has none. The bounds really come back: a replay with an id past the experts is
    refused at its combine, naming the id."""
    pytest.importorskip("cuda.bindings")
    from cuda.bindings import driver

    if not hasattr(driver, "cuFuncGetName"):
        pytest.skip("kernel names need cuFuncGetName (CUDA >= 12.3)")
    from afd_transport_nvshmem.graph_census import graph_nodes
    from afd_transport_nvshmem.graphed_attention import CudaGraphCapture, GraphedAttentionEndpoint
    from afd_transport_nvshmem.kernels import triton_kernels

    hidden = 64
    topo = Topology(1, 2, 8)
    layout = SlotLayout(
        topo, hidden, 32, 2, dtype="float32", wire_format="per_rank", combine_reduce="ffn"
    )
    world = LoopbackWorld(layout.window(ring_depth=1), device="cuda")
    transport = world.transport(Role.ATTENTION, 0)
    options = WindowOptions(timeout=5.0)
    capture = CudaGraphCapture(torch.device("cuda"), keep_graphs=True)
    attention = GraphedAttentionEndpoint(transport, options, triton_kernels(), 2, capture=capture)
    ffns = [world.connection(Role.FFN, r).ffn_endpoint(options) for r in range(2)]
    serving = LinearExperts(1, 8, hidden, seed=3).to("cuda")
    x, ids, w = random_routing(32, hidden, 2, list(range(8)), torch.Generator(), torch.float32)
    for _ in range(3):  # eager, captured, replayed
        handle = attention.dispatch(0, x.cuda(), ids.cuda(), w.cuda())
        serving.drain(ffns, poll=0.01)
        out = attention.combine(handle)
    assert attention.replays == 2
    want = LinearExperts(1, 8, hidden, seed=3).reference(0, x, ids, w, False)
    assert relative_error(out.cpu(), want) <= 1e-5
    assert len(capture.graphs) == 2, "one dispatch and one combine graph"
    dispatch, combine = (graph_nodes(g.raw_cuda_graph()) for g in capture.graphs)
    copies = [n for n in dispatch if n.kind == "kernel" and "_copy_words_kernel" in n.detail]
    assert len(copies) == 3, dispatch
    publish = torch.cuda.CUDAGraph(keep_graph=True)
    block = transport.publish_block([0, 1], layout.window(ring_depth=1).flag_index(0, 0))
    with torch.cuda.graph(publish):
        block.launch()
    expected = sum(n.touches_host for n in graph_nodes(publish.raw_cuda_graph()))
    assert expected >= 1  # the census does see a host memcpy where there is one
    assert sum(n.touches_host for n in dispatch) == expected, dispatch
    assert not any(n.touches_host for n in combine), combine
    wrong = ids.clone()
    wrong[5, 1] = 8  # one past the last expert: clamped on the wire, refused at the combine
    handle = attention.dispatch(0, x.cuda(), wrong.cuda(), w.cuda())
    assert attention.replays == 3
    serving.drain(ffns, poll=0.01)
    with pytest.raises(InvalidArgument, match=r"topk_ids holds expert id 8, outside \[0, 8\)"):
        attention.combine(handle)
    attention.close()


def _deferred_unanswered(timeout: float) -> tuple[KernelAttentionEndpoint, float]:
    """A deferred graphed endpoint (1A2F, per_rank) whose fifth dispatch replays its graphs
    and whose combine is enqueued while the FFN ranks never serve it; (the endpoint, the
    perf_counter when that combine returned)."""
    import time

    layout = SlotLayout(
        Topology(1, 2, 16),
        256,
        128,
        4,
        dtype="float32",
        wire_format="per_rank",
        combine_reduce="ffn",
    )
    attention, ffns = _graphed_or_eager(layout, True, 2, defer_checks=True, timeout=timeout)
    serving = LinearExperts(4, 16, 256, seed=5).to("cuda")
    gen = torch.Generator().manual_seed(9)
    x, ids, w = (t.cuda() for t in random_routing(64, 256, 4, list(range(16)), gen, torch.float32))
    for layer in range(4):  # eager, capture, then replays on one ring
        handle = attention.dispatch(layer, x, ids, w)
        serving.drain(ffns, poll=0.01)
        attention.combine(handle)
    attention.flush()
    handle = attention.dispatch(0, x, ids, w)
    attention.combine(handle)  # nobody answers; the device wait spins
    return attention, time.perf_counter()


def test_a_deferred_wait_ends_at_its_clock_deadline_as_a_peer_timeout() -> None:
    """The device wait of a deferred combine is bounded by a clock deadline (the timeout),
    not by the host: flush() names the timeout about a timeout after the combine, and the
    GPU is free again by then."""
    import time

    from afd_protocol import PeerTimeout

    attention, returned = _deferred_unanswered(timeout=0.5)
    assert time.perf_counter() - returned < 0.4  # combine() did not wait
    with pytest.raises(PeerTimeout, match="did not reply to layer 0"):
        attention.flush()
    torch.cuda.synchronize()
    assert 0.4 <= time.perf_counter() - returned <= 5.0
    attention.close()


def test_close_cancels_a_deferred_wait_that_would_run_to_its_deadline() -> None:
    """close() with a deferred combine unchecked: the device wait (deadline 60 s) is
    cancelled, so the GPU is free again within moments, and close() does not raise."""
    import time

    attention, _ = _deferred_unanswered(timeout=60.0)
    began = time.perf_counter()
    attention.close()
    torch.cuda.synchronize()
    assert time.perf_counter() - began < 5.0
