"""The whole device path on one GPU, in one process, without NVSHMEM: the loopback world's
windows live in CUDA memory and its transport offers the Triton device pack and fused
combine, so dispatch -> FFN -> combine runs through both kernels and the real endpoints."""

from __future__ import annotations

import pytest
import torch

from afd_protocol import (
    AttentionEndpoint,
    DevicePlan,
    FFNEndpoint,
    LoopbackTransport,
    LoopbackWorld,
    PeerTimeout,
    Role,
    SlotLayout,
    Topology,
    TopologyError,
)
from afd_protocol.testing import LinearExperts, random_routing, relative_error

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


class CudaWorld(LoopbackWorld):
    def __init__(self, window) -> None:  # type: ignore[no-untyped-def]
        super().__init__(window)
        self.windows = {key: w.cuda() for key, w in self.windows.items()}


class CudaTransport(LoopbackTransport):
    @property
    def device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device())

    def fused_combine(self):  # type: ignore[no-untyped-def]
        from afd_transport_nvshmem.fused_combine import triton_fused_combine

        return triton_fused_combine

    def device_pack(self):  # type: ignore[no-untyped-def]
        from afd_transport_nvshmem.device_pack import triton_device_pack

        return triton_device_pack


def _drain(ffns: list[FFNEndpoint], experts: LinearExperts) -> list[tuple[int, int]]:
    served = []
    for ffn in ffns:
        while True:
            try:
                item = ffn.next_work_item(timeout=0.01)
            except PeerTimeout:
                break
            experts.serve(ffn, item)
            served.append((ffn.rank, item.layer))
    return served


@pytest.mark.parametrize("shared", ["attention", "ffn"])
def test_packed_dispatch_and_fused_combine_on_one_gpu(shared: str) -> None:
    hidden, layers = 128, 4
    topo = Topology(1, 3, 12)
    layout = SlotLayout(topo, hidden, 64, 4, dtype="bfloat16", shared_placement=shared)
    world = CudaWorld(layout.window(ring_depth=2))
    attention = AttentionEndpoint(
        CudaTransport(world, Role.ATTENTION, 0), timeout=0.5, device_pack=True
    )
    ffns = [FFNEndpoint(CudaTransport(world, Role.FFN, r), timeout=0.5) for r in range(3)]
    experts = LinearExperts(layers, 12, hidden, seed=3)
    serving = LinearExperts(layers, 12, hidden, seed=3).to("cuda")
    gen = torch.Generator().manual_seed(4)
    only_first_two = [e for r in (0, 1) for e in topo.local_experts(r)]
    jobs = [(0, 48, range(12)), (2, 9, only_first_two), (3, 64, range(12)), (1, 1, range(12))]
    served = []
    for layer, tokens, pool in jobs:
        x, ids, w = random_routing(tokens, hidden, 4, list(pool), gen, torch.bfloat16)
        handle = attention.dispatch(layer, x.cuda(), ids.cuda(), w.cuda())
        packed = isinstance(handle.plan, DevicePlan)
        served += _drain(ffns, serving)
        out = attention.combine(handle)
        error = relative_error(out, experts.reference(layer, x, ids, w, shared == "ffn"))
        assert error <= 2e-2, (layer, tokens, packed, error)
        # 64 tokens x top-4 can overflow a rank (routed_cap is smaller): the portable path.
        assert packed == (tokens * 4 <= layout.routed_cap)
    assert (2, 2) in served  # an empty part for the rank whose experts got nothing
    x, ids, w = random_routing(3, hidden, 4, list(range(12)), gen, torch.bfloat16)
    handle = attention.dispatch(0, x.cuda(), ids.masked_fill(ids == ids[0, 0], 40).cuda(), w.cuda())
    _drain(ffns, serving)
    with pytest.raises(TopologyError, match="expert id 40"):
        attention.combine(handle)
