"""Run the device plan's Triton kernels (afd_transport_nvshmem.device_plan) on the CPU
through Triton's interpreter and compare every field with afd_protocol.plan_on_device, the
torch reference (run by test_device_plan_interpreted.py in a subprocess with
TRITON_INTERPRET=1; the variable must be set before Triton compiles anything)."""

from __future__ import annotations

import os
import sys

import torch

from afd_protocol import (
    DevicePlan,
    ExpertPlacement,
    SharedPlacement,
    Topology,
    WireFormat,
    plan_on_device,
)

FIELDS = (
    "order",
    "row_token",
    "expert_counts",
    "segment_offsets",
    "expert_bounds",
    "token_rows",
    "token_row_offsets",
    "wire_position",
)


def routing(
    tokens: int, experts: int, topk: int, kind: str, dtype: torch.dtype, gen: torch.Generator
) -> torch.Tensor:
    """``[tokens, topk]`` ids: distinct per token ("random"), every token the same experts
    ("skewed": long runs of equal keys across blocks), or with ids outside the range
    ("outside": the bounds and the clamping)."""
    if not tokens:
        ids = torch.empty(0, topk, dtype=torch.long)
    elif kind == "skewed":
        ids = torch.arange(topk).repeat(tokens, 1)
    else:
        ids = torch.stack([torch.randperm(experts, generator=gen)[:topk] for _ in range(tokens)])
        ids = ids.reshape(tokens, topk)
        if kind == "outside" and tokens:
            ids[0, 0] = -3
            ids[-1, -1] = experts + 5
    return ids.to(dtype)


def check(
    topo: Topology,
    tokens: int,
    topk: int,
    wire_format: WireFormat,
    order: bool,
    kind: str = "random",
    dtype: torch.dtype = torch.int64,
    shared: SharedPlacement = SharedPlacement.ATTENTION,
) -> None:
    from afd_transport_nvshmem.device_plan import triton_plan_on_device

    gen = torch.Generator().manual_seed(tokens * 131 + topo.num_ffn_ranks * 7 + topk)
    ids = routing(tokens, topo.num_experts, topk, kind, dtype, gen)
    want = plan_on_device(ids, topo, shared, wire_format, order)
    got = triton_plan_on_device(ids, topo, shared, wire_format, order)
    assert isinstance(got, DevicePlan)
    where = f"{topo}, {tokens} tokens top-{topk}, {wire_format.value}, order={order}, {kind}"
    assert (got.num_tokens, got.topk, got.shared_placement) == (tokens, topk, shared), where
    names = list(FIELDS)
    if wire_format is WireFormat.PER_RANK:
        names.append("token_row_positions")
    for name in names:
        a, b = getattr(got, name), getattr(want, name)
        if a is None or b is None:
            assert (a is None) == (b is None), f"{where}: {name} {a} vs {b}"
            continue
        assert a.dtype == b.dtype, f"{where}: {name} {a.dtype} vs {b.dtype}"
        assert a.shape == b.shape, f"{where}: {name} {tuple(a.shape)} vs {tuple(b.shape)}"
        assert torch.equal(a, b), f"{where}: {name}\n{a}\n{b}"
    for a, b in zip(got.shared_tokens, want.shared_tokens, strict=True):
        assert torch.equal(a, b), f"{where}: shared_tokens"


def main() -> int:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    uneven = Topology(1, 3, 10, placement=ExpertPlacement.contiguous(10, 3))  # 4 + 3 + 3
    topologies = (Topology(1, 1, 8), Topology(1, 2, 16), uneven, Topology(2, 4, 64))
    cases = 0
    for topo in topologies:
        topk = min(4, topo.num_experts)
        for tokens in (0, 1, 5, 33, 130):
            for wire_format, order in (
                (WireFormat.PER_CHOICE, True),
                (WireFormat.PER_RANK, True),
                (WireFormat.PER_RANK, False),
            ):
                check(topo, tokens, topk, wire_format, order)
                cases += 1
        check(topo, 40, topk, WireFormat.PER_RANK, True, "outside", torch.int32)
        check(topo, 40, topk, WireFormat.PER_CHOICE, True, "skewed", torch.int32)
        ffn_shared = SharedPlacement.FFN
        check(topo, 9, topk, WireFormat.PER_CHOICE, True, "random", torch.int64, ffn_shared)
        cases += 3
    # V2-Lite and V3 shapes past one scan chunk (32 blocks of 128 partials): 64 experts
    # top-6 and 256 top-8 (a histogram of 256 keys), 1 and 2 FFN ranks; 8 FFN ranks.
    for topo, tokens, topk in (
        (Topology(1, 1, 64), 700, 6),
        (Topology(1, 2, 256), 600, 8),
        (Topology(1, 8, 64), 300, 6),
    ):
        for wire_format, order in ((WireFormat.PER_CHOICE, True), (WireFormat.PER_RANK, False)):
            check(topo, tokens, topk, wire_format, order)
            cases += 1
    check(Topology(1, 1, 64), 700, 6, WireFormat.PER_CHOICE, True, "skewed")
    cases += 1
    print(f"{cases} interpreted device plan cases equal plan_on_device")
    return 0


if __name__ == "__main__":
    sys.exit(main())
