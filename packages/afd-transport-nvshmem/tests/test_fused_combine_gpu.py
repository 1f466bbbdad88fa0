"""The Triton fused combine against afd_protocol's reference on one GPU (no NVSHMEM needed)."""

from __future__ import annotations

import pytest
import torch

from afd_protocol import CombineInputs, Topology, plan_dispatch, reference_fused_combine

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
