"""The Triton device plan against afd_protocol.plan_on_device on one GPU (no NVSHMEM
needed): eager at V2-Lite and V3 shapes up to 16K tokens, and replayed from a CUDA graph
with new routing copied into its input (what the graphed dispatch does every layer)."""

from __future__ import annotations

import pytest
import torch

from afd_protocol import DevicePlan, SharedPlacement, Topology, WireFormat, plan_on_device

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

FIELDS = ("order", "row_token", "expert_counts", "segment_offsets", "expert_bounds")


def _routing(tokens: int, experts: int, topk: int, seed: int) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    scores = torch.rand(tokens, experts, generator=gen, device="cuda")
    return scores.topk(topk, dim=-1).indices


def _assert_equal(got: DevicePlan, want: DevicePlan, wire: WireFormat) -> None:
    for name in FIELDS:
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    if wire is WireFormat.PER_RANK:
        assert got.token_rows is not None
        assert want.token_rows is not None
        assert torch.equal(got.token_rows, want.token_rows)
        assert torch.equal(got.token_row_positions, want.token_row_positions)
    else:
        assert torch.equal(got.wire_position, want.wire_position)


CASES = [
    (Topology(1, 1, 64), 6, WireFormat.PER_CHOICE, True),
    (Topology(1, 1, 64), 6, WireFormat.PER_RANK, False),
    (Topology(1, 8, 256), 8, WireFormat.PER_RANK, True),
    (Topology(1, 2, 256), 8, WireFormat.PER_CHOICE, True),
]


@pytest.mark.parametrize(("topo", "topk", "wire", "order"), CASES)
@pytest.mark.parametrize("tokens", [1, 1000, 4096, 16384])
def test_the_triton_plan_equals_plan_on_device(
    topo: Topology, topk: int, wire: WireFormat, order: bool, tokens: int
) -> None:
    from afd_transport_nvshmem.device_plan import triton_plan_on_device

    ids = _routing(tokens, topo.num_experts, topk, tokens)
    got = triton_plan_on_device(ids, topo, SharedPlacement.ATTENTION, wire, order)
    want = plan_on_device(ids, topo, SharedPlacement.ATTENTION, wire, order)
    _assert_equal(got, want, wire)


@pytest.mark.parametrize(("topo", "topk", "wire", "order"), CASES[:2])
def test_a_graph_of_the_triton_plan_replays_new_routing(
    topo: Topology, topk: int, wire: WireFormat, order: bool
) -> None:
    from afd_transport_nvshmem.device_plan import triton_plan_on_device

    ids = _routing(2048, topo.num_experts, topk, 0)
    triton_plan_on_device(ids, topo, SharedPlacement.ATTENTION, wire, order)  # compile
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan = triton_plan_on_device(ids, topo, SharedPlacement.ATTENTION, wire, order)
    for seed in (1, 2, 3):
        ids.copy_(_routing(2048, topo.num_experts, topk, seed))
        graph.replay()
        torch.cuda.synchronize()
        _assert_equal(plan, plan_on_device(ids, topo, SharedPlacement.ATTENTION, wire, order), wire)


def test_one_compiled_kernel_serves_every_token_count() -> None:
    """The sizes are not specialised on: once a plan of one token compiled the three
    kernels, plans of 7 to 16,384 tokens (divisible by 16 or not) with the same flags add no
    compiled variant, so no new token count pays a JIT compile inside a timed step (the
    suite's prefill rows once did: 30-230 ms per layer of dispatch). Other tests in this
    process compile other flag sets, so the cache is compared before and after."""
    from afd_transport_nvshmem import device_plan

    topo = Topology(1, 2, 64)
    kernels = (device_plan._count_kernel, device_plan._scan_kernel, device_plan._place_kernel)
    device = torch.cuda.current_device()

    def plan(tokens: int) -> None:
        ids = _routing(tokens, 64, 6, tokens)
        device_plan.triton_plan_on_device(
            ids, topo, SharedPlacement.ATTENTION, WireFormat.PER_RANK, True
        )

    def compiled() -> dict[str, set[str]]:
        out = {}
        for kernel in kernels:
            caches = getattr(kernel, "device_caches", None)
            if caches is None:
                pytest.skip("this Triton keeps no device_caches (the compiled-kernel cache moved)")
            out[kernel.fn.__name__] = set(caches[device][0])
        return out

    plan(1)
    before = compiled()
    assert all(before.values()), before
    for tokens in (7, 16, 33, 1000, 1024, 4095, 16384):
        plan(tokens)
    assert compiled() == before
