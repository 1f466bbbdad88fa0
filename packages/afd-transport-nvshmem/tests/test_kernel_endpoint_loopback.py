"""The kernel attention endpoint (and the FFN endpoint with the kernels' reduce) driven step
by step in one process over afd_protocol's loopback transport, with the torch references
of :mod:`afd_transport_nvshmem.kernel_specs` standing in for the Triton kernels: the same
outputs as the portable path and the float64 reference, every refusal, and the paths
through the device pack. (The Triton kernels against these references: the interpreter
test; on a GPU: the suite.)"""

from __future__ import annotations

import pytest
import torch

from afd_protocol import (
    InvalidArgument,
    Role,
    SlotLayout,
    Topology,
    reference_reduce_partials,
)
from afd_protocol.testing import LinearExperts, random_routing
from afd_protocol.window import (
    LoopbackWorld,
    WindowAttentionEndpoint,
    WindowConnection,
    WindowFFNEndpoint,
    WindowOptions,
)
from afd_transport_nvshmem.kernel_attention import KernelAttentionEndpoint, KernelWindowConnection
from afd_transport_nvshmem.kernel_specs import (
    WindowKernels,
    reference_device_pack,
    reference_fused_combine,
)

HIDDEN = 8
FAST = WindowOptions(timeout=0.05)
FORMATS = [
    ("per_choice", "attention"),
    ("per_rank", "attention"),
    ("per_rank", "ffn"),
]


def make_world(
    a: int = 2,
    f: int = 2,
    experts: int = 7,
    topk: int = 3,
    ring_depth: int = 1,
    shared: str = "attention",
    tokens: int = 32,
) -> LoopbackWorld:
    topo = Topology(a, f, experts)
    layout = SlotLayout(topo, HIDDEN, tokens, topk, dtype="float32", shared_placement=shared)
    return LoopbackWorld(layout.window(ring_depth=ring_depth))


def layout_of(
    wire: str, reduce: str, a: int = 2, f: int = 2, tokens: int = 32, shared: str = "attention"
) -> SlotLayout:
    topo = Topology(a, f, 7)
    return SlotLayout(
        topo,
        HIDDEN,
        tokens,
        3,
        dtype="float32",
        shared_placement=shared,
        wire_format=wire,
        combine_reduce=reduce,
        routed_cap_multiplier=2.0,
    )


def linear_experts(world: LoopbackWorld, layers: int = 4) -> LinearExperts:
    return LinearExperts(layers, world.window.slot.topology.num_experts, HIDDEN, seed=0)


def route(num_tokens: int, topk: int, experts: list[int], seed: int) -> tuple[torch.Tensor, ...]:
    return random_routing(num_tokens, HIDDEN, topk, experts, torch.Generator().manual_seed(seed))


def drain(ffns: list[WindowFFNEndpoint], experts: LinearExperts) -> list[tuple[int, int, int]]:
    return experts.drain(ffns)


class CountingKernels:
    """The reference kernels, counting their calls (and optionally failing once)."""

    def __init__(self, device_pack: bool = True, fail_combine: Exception | None = None) -> None:
        self.combines = 0
        self.packs = 0
        self.fail_combine = fail_combine
        self.kernels = WindowKernels(self._combine, self._pack if device_pack else None)

    def _combine(self, inputs):  # type: ignore[no-untyped-def]
        self.combines += 1
        if self.fail_combine is not None:
            failure, self.fail_combine = self.fail_combine, None
            raise failure
        return reference_fused_combine(inputs)

    def _pack(self, inputs):  # type: ignore[no-untyped-def]
        self.packs += 1
        reference_device_pack(inputs)


def kernel_endpoint(
    world: LoopbackWorld, kernels: CountingKernels, **options: object
) -> KernelAttentionEndpoint:
    transport = world.transport(Role.ATTENTION, 0)
    return KernelAttentionEndpoint(
        transport,
        WindowOptions(timeout=0.05, **options),
        kernels.kernels,  # type: ignore[arg-type]
    )


@pytest.mark.parametrize("shared", ["attention", "ffn"])
def test_fused_combine_agrees_with_the_per_rank_combine(shared: str) -> None:
    """The endpoint's window offsets, segment bounds and wire positions, fed to the reference
    fused combine, give the same outputs as the portable path -- including an FFN rank that
    received nothing, a second ring, and fewer tokens than FFN ranks (shared rows)."""
    world = make_world(a=1, f=3, experts=7, shared=shared, ring_depth=2)
    experts = linear_experts(world)
    transport = world.transport(Role.ATTENTION, 0)
    counting = CountingKernels()
    ffns = [world.connection(Role.FFN, r).ffn_endpoint(FAST) for r in range(3)]
    ffn0_and_1 = [e for r in (0, 1) for e in world.window.slot.topology.local_experts(r)]
    jobs = [
        (1, *route(20, 3, list(range(7)), 11)),
        (3, *route(9, 3, ffn0_and_1, 12)),  # FFN rank 2 gets no routed rows
        (0, *route(2, 3, list(range(7)), 13)),  # 2 tokens, 3 FFN ranks
    ]
    results: dict[str, list[torch.Tensor]] = {}
    for combine in ("fused", "portable"):
        attention = KernelAttentionEndpoint(
            transport, WindowOptions(timeout=0.05, combine=combine), counting.kernels
        )
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
        results[combine] = outputs
        attention.close()
    assert counting.combines == len(jobs)  # the fused kernel ran for the fused endpoint only
    for a, b in zip(results["fused"], results["portable"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("shared", ["attention", "ffn"])
def test_device_packed_dispatch_matches_the_reference_and_serves_empty_parts(shared: str) -> None:
    """Dispatches packed from a device-side plan (headers, counts and checksums written by the
    pack) decode on the FFN side and combine to the reference. Every FFN rank is sent to: one
    whose experts got nothing serves an empty part. A batch that could overflow a rank takes
    the portable path; expert ids out of range fail the combine, naming the id."""
    world = make_world(a=1, f=3, experts=7, shared=shared, ring_depth=2, tokens=32)
    experts = linear_experts(world)
    counting = CountingKernels()
    attention = kernel_endpoint(world, counting, device_pack=True)
    ffns = [world.connection(Role.FFN, r).ffn_endpoint(FAST) for r in range(3)]
    topo = world.window.slot.topology
    ffn0_and_1 = [e for r in (0, 1) for e in topo.local_experts(r)]
    routed_cap = world.window.slot.routed_cap
    jobs = [
        (1, *route(20, 3, list(range(7)), 21)),
        (2, *route(9, 3, ffn0_and_1, 22)),  # FFN rank 2's experts get nothing
        (0, *route(2, 3, list(range(7)), 23)),
        (3, *route(32, 3, list(range(7)), 24)),  # 96 rows > routed_cap: the host plan
    ]
    assert 32 * 3 > routed_cap >= 20 * 3
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
    assert counting.packs == 3
    # FFN rank 2 served layer 2 (an empty part) because the packed path sends to everyone.
    assert (2, 0, 2) in served
    x, ids, w = route(4, 3, list(range(7)), 25)
    handle = attention.dispatch(0, x, ids.masked_fill(ids == ids[0, 0], 9), w)
    drain(ffns, experts)
    with pytest.raises(InvalidArgument, match="expert id 9, outside \\[0, 7\\)"):
        attention.combine(handle)
    assert attention.in_flight == 0  # the ring came back


def test_device_pack_is_the_default_where_the_kernels_have_one() -> None:
    world = make_world(a=1, f=3, experts=7)
    experts = linear_experts(world)
    ffns = [world.connection(Role.FFN, r).ffn_endpoint(FAST) for r in range(3)]
    x, ids, w = route(5, 3, list(range(7)), 26)
    expected = experts.reference(0, x, ids, w, False)
    cases = [
        ({}, CountingKernels(), (1, 1)),  # the defaults: packed, fused combine
        ({"device_pack": False}, CountingKernels(), (0, 1)),  # planned on the host
        ({"combine": "portable"}, CountingKernels(), (0, 0)),  # no kernel at all
        ({}, CountingKernels(device_pack=False), (0, 1)),  # kernels without a pack
    ]
    for options, counting, calls in cases:
        attention = kernel_endpoint(world, counting, **options)
        handle = attention.dispatch(0, x, ids, w)
        drain(ffns, experts)
        out = attention.combine(handle)
        torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-4)
        assert (counting.packs, counting.combines) == calls, options
        attention.close()
    with pytest.raises(InvalidArgument, match="have no device pack"):
        kernel_endpoint(world, CountingKernels(device_pack=False), device_pack=True)


def test_a_packed_dispatch_combine_can_be_retried_after_the_kernel_failed() -> None:
    world = make_world(a=1, f=3, experts=7)
    experts = linear_experts(world)
    counting = CountingKernels(fail_combine=RuntimeError("out of memory (simulated)"))
    attention = kernel_endpoint(world, counting, device_pack=True)
    ffns = [world.connection(Role.FFN, r).ffn_endpoint(FAST) for r in range(3)]
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


@pytest.mark.parametrize("shape", [(6,), (2, 3, 3)])
def test_topk_ids_of_the_wrong_rank_are_an_invalid_argument_on_every_path(
    shape: tuple[int, ...],
) -> None:
    world = make_world(a=1, f=3, experts=7)
    transport = world.transport(Role.ATTENTION, 0)
    counting = CountingKernels()
    makers = [
        lambda: KernelAttentionEndpoint(transport, FAST, counting.kernels),
        lambda: KernelAttentionEndpoint(
            transport, WindowOptions(timeout=0.05, device_pack=True), counting.kernels
        ),
    ]
    for make in makers:
        attention = make()
        ids = torch.zeros(shape, dtype=torch.long)
        with pytest.raises(InvalidArgument, match="topk_ids"):
            attention.dispatch(0, torch.zeros(shape[0], HIDDEN), ids, torch.zeros(shape))
        assert attention.in_flight == 0
        attention.close()


def test_a_kernel_window_connection_makes_the_kernel_endpoints() -> None:
    world = make_world(a=1, f=1, experts=4)
    counting = CountingKernels()
    connection = KernelWindowConnection(world.transport(Role.ATTENTION, 0), counting.kernels)
    assert (connection.role, connection.rank) == (Role.ATTENTION, 0)
    assert (connection.layout, connection.device) == (world.window.slot, torch.device("cpu"))
    attention = connection.attention_endpoint(FAST)
    assert type(attention) is KernelAttentionEndpoint  # the kernels the backend declared
    attention.close()
    ffn = KernelWindowConnection(world.transport(Role.FFN, 0), counting.kernels).ffn_endpoint(FAST)
    assert type(ffn) is WindowFFNEndpoint
    ffn.close()
    # The portable connection of afd_protocol makes the portable endpoints.
    assert type(WindowConnection(world.transport(Role.ATTENTION, 0)).attention_endpoint(FAST)) is (
        WindowAttentionEndpoint
    )
    bare = KernelWindowConnection(world.transport(Role.ATTENTION, 0))
    with pytest.raises(InvalidArgument, match="was given no kernels: pass them, or override"):
        bare.attention_endpoint(FAST)


def test_a_fused_combine_of_replies_already_reduced_is_refused() -> None:
    layout = layout_of("per_rank", "ffn")
    world = LoopbackWorld(layout.window())
    kernels = WindowKernels(
        fused_combine=reference_fused_combine, device_pack=reference_device_pack
    )
    transport = world.transport(Role.ATTENTION, 0)
    with pytest.raises(InvalidArgument, match="with combine_reduce='ffn' the FFN side already did"):
        KernelAttentionEndpoint(transport, WindowOptions(combine="fused"), kernels)
    # The defaults work: the portable sum of the reduced replies (and the pack, on request).
    KernelAttentionEndpoint(transport, FAST, kernels).close()
    KernelAttentionEndpoint(transport, WindowOptions(device_pack=True), kernels).close()


class Calls:
    """Reference kernels that count their calls."""

    def __init__(self) -> None:
        self.counts = {"pack": 0, "combine": 0, "reduce": 0}

    def kernels(self) -> WindowKernels:
        def count(name: str, kernel):  # type: ignore[no-untyped-def]
            def counted(inputs):  # type: ignore[no-untyped-def]
                self.counts[name] += 1
                return kernel(inputs)

            return counted

        return WindowKernels(
            fused_combine=count("combine", reference_fused_combine),
            device_pack=count("pack", reference_device_pack),
            reduce_partials=count("reduce", reference_reduce_partials),
        )


@pytest.mark.parametrize(("wire", "reduce"), FORMATS[1:])
@pytest.mark.parametrize("shared", ["attention", "ffn"])
def test_per_rank_packs_on_the_device_and_matches_the_reference(
    wire: str, reduce: str, shared: str
) -> None:
    """A per_rank dispatch packed from the device plan (token rows, local ids, weights and
    headers written by the pack) is served and combined to the float64 reference, including
    an FFN rank whose experts got nothing and a second ring in flight. The FFN side reduces
    with the endpoint's kernel. Reduced on the FFN, every batch within token_cap packs
    (a rank never gets more rows than tokens); reduced on the attention side a batch whose
    partials could overflow a rank takes the host plan."""
    layout = layout_of(wire, reduce, a=1, f=3, shared=shared, tokens=32)
    world = LoopbackWorld(layout.window(ring_depth=2))
    calls = Calls()
    kernels = calls.kernels()
    attention = KernelAttentionEndpoint(
        world.transport(Role.ATTENTION, 0), WindowOptions(timeout=0.05, device_pack=True), kernels
    )
    ffns = [
        WindowFFNEndpoint(world.transport(Role.FFN, r), FAST, kernels.reduce_partials)
        for r in range(3)
    ]
    experts = LinearExperts(4, 7, HIDDEN, seed=5)
    topo = layout.topology
    ffn0_and_1 = [e for r in (0, 1) for e in topo.local_experts(r)]
    gen = torch.Generator().manual_seed(5)
    jobs = [
        (1, *random_routing(20, HIDDEN, 3, range(7), gen)),
        (2, *random_routing(9, HIDDEN, 3, ffn0_and_1, gen)),  # FFN rank 2 gets nothing
        (0, *random_routing(1, HIDDEN, 3, range(7), gen)),
        (3, *random_routing(32, HIDDEN, 3, range(7), gen)),  # 96 partials > routed_cap 64
    ]
    served = []
    for batch in (jobs[:2], jobs[2:]):
        handles = [
            attention.dispatch(layer, x, ids, w, stage=stage)
            for stage, (layer, x, ids, w) in enumerate(batch)
        ]
        served += experts.drain(ffns)
        for (layer, x, ids, w), handle in zip(batch, handles, strict=True):
            out = attention.combine(handle)
            expected = experts.reference(layer, x, ids, w, shared == "ffn")
            torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-4)
    packed = 4 if reduce == "ffn" else 3
    assert calls.counts["pack"] == packed
    assert (2, 0, 2) in served  # the packed path sends to every rank
    # Replies per partial are weighted by the fused kernel; reduced ones summed by it only
    # when packed (the host plan's portable sum needs no kernel).
    assert calls.counts["combine"] == (packed if reduce == "ffn" else 4)
    # Every part with a row reduced with the kernel on the FFN side.
    assert (calls.counts["reduce"] > 0) == (reduce == "ffn")
    x, ids, w = random_routing(4, HIDDEN, 3, range(7), gen)
    handle = attention.dispatch(0, x, ids.masked_fill(ids == ids[0, 0], 9), w)
    experts.drain(ffns)
    with pytest.raises(InvalidArgument, match="expert id 9, outside \\[0, 7\\)"):
        attention.combine(handle)
    assert attention.in_flight == 0


@pytest.mark.parametrize(("wire", "reduce"), FORMATS[1:])
def test_the_kernel_endpoint_serves_per_rank_with_what_applies(wire: str, reduce: str) -> None:
    layout = layout_of(wire, reduce, a=1, f=2, shared="ffn")
    world = LoopbackWorld(layout.window())
    kernels = WindowKernels(fused_combine=reference_fused_combine, device_pack=None)
    attention = KernelAttentionEndpoint(world.transport(Role.ATTENTION, 0), FAST, kernels)
    ffns = [world.connection(Role.FFN, r).ffn_endpoint(FAST) for r in range(2)]
    experts = LinearExperts(2, 7, HIDDEN, seed=3)
    x, ids, w = random_routing(20, HIDDEN, 3, range(7), torch.Generator().manual_seed(3))
    handle = attention.dispatch(1, x, ids, w)
    experts.drain(ffns)
    out = attention.combine(handle)
    torch.testing.assert_close(
        out.double(), experts.reference(1, x, ids, w, True), rtol=1e-5, atol=1e-4
    )


@pytest.mark.parametrize(
    ("tokens", "ffn", "shared"), [(0, 1, False), (1, 3, True), (23, 3, False), (9, 2, True)]
)
def test_reference_fused_combine_matches_a_naive_loop(tokens: int, ffn: int, shared: bool) -> None:
    """The fused-combine specification, checked one token and one choice at a time."""
    from afd_protocol import plan_dispatch
    from afd_transport_nvshmem.kernel_specs import CombineInputs

    hidden, experts, topk = 5, 8, 3
    gen = torch.Generator().manual_seed(tokens + ffn)
    choices = [torch.randperm(experts, generator=gen)[:topk] for _ in range(tokens)]
    ids = torch.stack(choices) if choices else torch.empty(0, topk, dtype=torch.long)
    plan = plan_dispatch(ids, Topology(1, ffn, experts), "ffn" if shared else "attention")
    rows = torch.randn(4000, generator=gen, dtype=torch.float64)
    routed = [17 + 600 * d for d in range(ffn)]
    shared_at = [r + 300 for r in routed]
    weights = torch.rand(tokens, topk, generator=gen, dtype=torch.float64)
    got = reference_fused_combine(
        CombineInputs(
            rows=rows,
            routed_starts=torch.tensor(routed),
            shared_starts=torch.tensor(shared_at) if shared else None,
            segment_offsets=torch.tensor(plan.segment_offsets),
            wire_position=plan.wire_position,
            topk_weights=weights,
            hidden_size=hidden,
            out_dtype=torch.float64,
        )
    )
    want = torch.zeros(tokens, hidden, dtype=torch.float64)
    wire_order = plan.order.tolist()
    for t in range(tokens):
        for j in range(topk):
            wire = wire_order.index(t * topk + j)
            dest = max(d for d in range(ffn) if plan.segment_offsets[d] <= wire)
            start = routed[dest] + (wire - plan.segment_offsets[dest]) * hidden
            want[t] += weights[t, j] * rows[start : start + hidden]
        if shared:
            start = shared_at[t % ffn] + (t // ffn) * hidden
            want[t] += rows[start : start + hidden]
    torch.testing.assert_close(got, want)
