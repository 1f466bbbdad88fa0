"""The Triton fused combine against afd_protocol's reference on one GPU (no NVSHMEM needed)."""

from __future__ import annotations

import pytest
import torch

from afd_protocol import Topology, plan_dispatch
from afd_transport_nvshmem.kernel_specs import CombineInputs, reference_fused_combine

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _case(tokens: int, hidden: int, ffn: int, shared: bool, dtype: torch.dtype) -> dict:
    gen = torch.Generator().manual_seed(tokens * 31 + hidden + ffn)
    experts, topk = 16, 4
    choices = [torch.randperm(experts, generator=gen)[:topk] for _ in range(tokens)]
    ids = torch.stack(choices) if choices else torch.empty(0, topk, dtype=torch.long)
    ids = ids.cuda()
    plan = plan_dispatch(ids, Topology(1, ffn, experts), "ffn" if shared else "attention")
    # Reply areas at scattered, non-overlapping places of one flat buffer (like a window).
    per_rank = tokens * topk + 8
    shared_rows = -(-tokens // ffn)
    area = (per_rank + shared_rows + 3) * hidden
    rows = torch.randn(ffn * area, generator=gen).to(dtype).cuda()
    routed = torch.tensor([d * area + 3 * hidden for d in range(ffn)], device="cuda")
    shared_at = routed + per_rank * hidden if shared else None
    return {
        "rows": rows,
        "routed_starts": routed,
        "shared_starts": shared_at,
        "segment_offsets": torch.tensor(plan.segment_offsets, device="cuda"),
        "wire_position": plan.wire_position,
        "topk_weights": torch.rand(tokens, topk, generator=gen).cuda(),
        "hidden_size": hidden,
        "out_dtype": dtype,
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("tokens", "hidden", "ffn", "shared"),
    [
        (0, 64, 1, False),
        (1, 64, 3, True),
        (37, 2048, 3, False),
        (37, 7168, 2, True),
        (1000, 2048, 1, False),
        (5, 100, 4, True),
    ],
)
def test_triton_fused_combine_matches_the_reference(
    tokens: int, hidden: int, ffn: int, shared: bool, dtype: torch.dtype
) -> None:
    from afd_transport_nvshmem.fused_combine import triton_fused_combine

    case = CombineInputs(**_case(tokens, hidden, ffn, shared, dtype))
    got = triton_fused_combine(case)
    want = reference_fused_combine(case)
    assert got.shape == (tokens, hidden)
    assert got.dtype == dtype
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("tokens", "hidden", "ffn", "only_first"),
    [(1, 64, 1, False), (37, 2048, 3, False), (37, 100, 3, True), (700, 2048, 2, False)],
)
def test_triton_device_pack_matches_the_reference(
    tokens: int, hidden: int, ffn: int, only_first: bool, dtype: torch.dtype
) -> None:
    """Rows, source tokens and headers written by the Triton pack equal the torch
    reference's, byte for byte, and every header decodes (checksum computed on the device)."""
    from afd_protocol import (
        HEADER_FIXED_WORDS,
        Header,
        MessageKind,
        SharedPlacement,
        decode_header,
        encode_words,
        plan_on_device,
    )
    from afd_transport_nvshmem.device_pack import triton_device_pack
    from afd_transport_nvshmem.kernel_specs import PackInputs, crc_tables, reference_device_pack

    experts, topk = 16, 4
    topo = Topology(1, ffn, experts)
    gen = torch.Generator().manual_seed(tokens + ffn)
    pool = list(topo.local_experts(0)) if only_first else list(range(experts))
    choices = [
        torch.tensor(pool)[torch.randperm(len(pool), generator=gen)[:topk]] for _ in range(tokens)
    ]
    ids = torch.stack(choices).cuda()
    hidden_states = torch.randn(tokens, hidden, generator=gen).to(dtype).cuda()
    plan = plan_on_device(ids, topo, SharedPlacement.ATTENTION)
    fixed = []
    for d in range(ffn):
        header = Header(
            MessageKind.DISPATCH,
            0,
            5,
            1,
            tokens,
            0,
            0,
            seq=10 + d,
            expert_counts=(0,) * len(topo.local_experts(d)),
        )
        fixed += encode_words(header)[:HEADER_FIXED_WORDS]
    fixed_words = torch.tensor(fixed, dtype=torch.int32).view(ffn, -1).cuda()
    cap = tokens * topk
    crc_base, crc_columns = crc_tables(topo.expert_placement, torch.device("cuda"))
    outputs = []
    for pack in (reference_device_pack, triton_device_pack):
        rows = tuple(
            torch.full((cap, hidden), -3.0, dtype=dtype, device="cuda") for _ in range(ffn)
        )
        index = tuple(torch.full((cap,), -1, dtype=torch.int32, device="cuda") for _ in range(ffn))
        headers = tuple(torch.full((64,), -1, dtype=torch.int32, device="cuda") for _ in range(ffn))
        pack(
            PackInputs(
                hidden=hidden_states,
                plan=plan,
                rank_wire_offsets=topo.expert_placement.rank_wire_offsets,
                fixed_words=fixed_words,
                routed_rows=rows,
                route_index=index,
                headers=headers,
                crc_base=crc_base,
                crc_columns=crc_columns,
            )
        )
        outputs.append((rows, index, headers))
    (want_rows, want_index, want_headers), (rows, index, headers) = outputs
    for d in range(ffn):
        assert torch.equal(rows[d], want_rows[d])
        assert torch.equal(index[d], want_index[d])
        assert torch.equal(headers[d], want_headers[d])
        decoded = decode_header(headers[d].cpu())  # the CRC the kernel computed checks out
        assert decoded.seq == 10 + d
        assert decoded.routed_rows == sum(decoded.expert_counts)
    routed = [decode_header(h.cpu()).routed_rows for h in headers]
    assert sum(routed) == tokens * topk
    if only_first:
        assert routed[1:] == [0] * (ffn - 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "hidden", "topk"), [(1, 64, 1), (37, 2048, 6), (1000, 7168, 8)])
def test_triton_ffn_side_reduce_matches_the_reference(
    rows: int, hidden: int, topk: int, dtype: torch.dtype
) -> None:
    from afd_protocol import PartialsToReduce, reference_reduce_partials
    from afd_transport_nvshmem.reduce_partials import triton_reduce_partials

    gen = torch.Generator().manual_seed(rows + hidden + topk)
    owned = torch.rand(rows, topk, generator=gen) < 0.6
    owned[:, 0] |= ~owned.any(dim=1)
    route_ids = torch.where(owned, torch.randint(0, 8, (rows, topk), generator=gen), -1)
    slots = torch.nonzero(owned.reshape(-1)).squeeze(1)
    slots = slots[torch.randperm(slots.numel(), generator=gen)]
    inputs = PartialsToReduce(
        out=torch.randn(slots.numel(), hidden, generator=gen).to(dtype).cuda(),
        slots=slots.cuda(),
        route_ids=route_ids.to(torch.int32).cuda(),
        route_weights=torch.rand(rows, topk, generator=gen).cuda(),
    )
    got = triton_reduce_partials(inputs)
    want = reference_reduce_partials(inputs)
    assert got.dtype == dtype
    assert got.shape == (rows, hidden)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tolerance, atol=tolerance)
