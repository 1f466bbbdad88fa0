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
