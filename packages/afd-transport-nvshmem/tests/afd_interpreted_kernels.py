"""Run the Triton kernels of the transport on the CPU through Triton's interpreter and compare
them with the torch references of afd_protocol.window.kernels (run by
test_kernels_interpreted.py in a subprocess with TRITON_INTERPRET=1; the variable must be set
before Triton compiles anything, so it cannot share the test process)."""

from __future__ import annotations

import os
import sys

import torch

from afd_protocol import (
    HEADER_FIXED_WORDS,
    ExpertPlacement,
    Header,
    MessageKind,
    SharedPlacement,
    Topology,
    decode_header,
    encode_words,
    plan_dispatch,
    plan_on_device,
)
from afd_protocol.window import (
    CombineInputs,
    PackInputs,
    reference_device_pack,
    reference_fused_combine,
)
from afd_protocol.window.kernels import crc_tables


def routing(tokens: int, experts: int, topk: int, gen: torch.Generator) -> torch.Tensor:
    if not tokens:
        return torch.empty(0, topk, dtype=torch.long)
    return torch.stack([torch.randperm(experts, generator=gen)[:topk] for _ in range(tokens)])


def check_pack(topo: Topology, tokens: int, hidden: int, topk: int, dtype: torch.dtype) -> None:
    from afd_transport_nvshmem.device_pack import triton_device_pack

    gen = torch.Generator().manual_seed(tokens * 31 + topo.num_ffn_ranks)
    ids = routing(tokens, topo.num_experts, topk, gen)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    plan = plan_on_device(ids, topo, SharedPlacement.ATTENTION)
    ffn = topo.num_ffn_ranks
    fixed = []
    for d in range(ffn):
        counts = (0,) * len(topo.local_experts(d))
        header = Header(
            MessageKind.DISPATCH, 0, 5, 1, tokens, 0, 0, seq=10 + d, expert_counts=counts
        )
        fixed += encode_words(header)[:HEADER_FIXED_WORDS]
    fixed_words = torch.tensor(fixed, dtype=torch.int32).view(ffn, -1)
    base, columns = crc_tables(topo.expert_placement, torch.device("cpu"))
    cap = max(1, tokens * topk)
    results = []
    for pack in (reference_device_pack, triton_device_pack):
        rows = tuple(torch.full((cap, hidden), -3.0, dtype=dtype) for _ in range(ffn))
        index = tuple(torch.full((cap,), -1, dtype=torch.int32) for _ in range(ffn))
        headers = tuple(
            torch.full((HEADER_FIXED_WORDS + 64,), -1, dtype=torch.int32) for _ in range(ffn)
        )
        pack(
            PackInputs(
                hidden=x,
                plan=plan,
                rank_wire_offsets=topo.expert_placement.rank_wire_offsets,
                fixed_words=fixed_words,
                routed_rows=rows,
                route_index=index,
                headers=headers,
                crc_base=base,
                crc_columns=columns,
            )
        )
        results.append((rows, index, headers))
    for expected, got in zip(*results, strict=True):
        for a, b in zip(expected, got, strict=True):
            assert torch.equal(a, b), (topo, tokens, a, b)
    host = plan_dispatch(ids, topo)
    for d, words in enumerate(results[1][2]):
        decoded = decode_header(words)  # the device-computed CRC checks out
        assert decoded.expert_counts == host.host_group_list(d)
        assert decoded.routed_rows == host.routed_rows(d)


def check_combine(topo: Topology, tokens: int, hidden: int, topk: int, shared: bool) -> None:
    from afd_transport_nvshmem.fused_combine import triton_fused_combine

    gen = torch.Generator().manual_seed(tokens * 7 + hidden)
    ids = routing(tokens, topo.num_experts, topk, gen)
    plan = plan_dispatch(ids, topo)
    ffn = topo.num_ffn_ranks
    stride = (tokens * topk + tokens + 1) * hidden
    rows = torch.randn(2 * ffn * stride, generator=gen)
    inputs = CombineInputs(
        rows=rows,
        routed_starts=torch.arange(ffn) * stride,
        shared_starts=(torch.arange(ffn) + ffn) * stride if shared else None,
        segment_offsets=torch.tensor(plan.segment_offsets),
        wire_position=plan.wire_position,
        topk_weights=torch.rand(tokens, topk, generator=gen),
        hidden_size=hidden,
        out_dtype=torch.float32,
    )
    torch.testing.assert_close(
        triton_fused_combine(inputs), reference_fused_combine(inputs), rtol=1e-5, atol=1e-5
    )


def main() -> int:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    uneven = Topology(1, 3, 10, placement=ExpertPlacement.contiguous(10, 3))  # 4 + 3 + 3
    cases = 0
    for topo in (Topology(1, 1, 8), Topology(1, 2, 16), uneven, Topology(1, 4, 64)):
        for tokens in (1, 5, 33):
            for dtype in (torch.float32, torch.bfloat16):
                check_pack(topo, tokens, 48, min(4, topo.num_experts), dtype)
                cases += 1
            for shared in (False, True):
                check_combine(topo, tokens, 70, min(3, topo.num_experts), shared)
                cases += 1
    print(f"{cases} interpreted kernel cases match their references")
    return 0


if __name__ == "__main__":
    sys.exit(main())
