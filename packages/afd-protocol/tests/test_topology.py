"""Topology and expert placement: rank numbering, replicas and validation."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from afd_protocol import ExpertPlacement, Role, Topology, TopologyError


@given(num_experts=st.integers(1, 300), num_ffn=st.integers(1, 17))
def test_contiguous_placement_partitions_experts_evenly(num_experts: int, num_ffn: int) -> None:
    if num_experts < num_ffn:
        with pytest.raises(TopologyError, match="at least one routed expert"):
            ExpertPlacement.contiguous(num_experts, num_ffn)
        return
    p = ExpertPlacement.contiguous(num_experts, num_ffn)
    counts = p.experts_per_rank
    assert sum(counts) == num_experts
    assert max(counts) - min(counts) <= 1
    assert list(counts) == sorted(counts, reverse=True)  # the larger ranks come first
    flat = [e for rank in p.experts_of_rank for e in rank]
    assert flat == list(range(num_experts))  # contiguous blocks in order
    for e in range(num_experts):
        assert p.experts_of_rank[p.owner[e]][p.local_id[e]] == e
        assert p.wire_position[e] == e  # contiguous placement: wire order == expert id


def test_custom_placement_table_defines_owner_local_id_and_wire_order() -> None:
    p = ExpertPlacement.from_table([[5, 0], [3, 1, 4], [2]])
    assert p.num_experts == 6
    assert p.owner == (0, 1, 2, 1, 1, 0)
    assert p.local_id == (1, 1, 0, 0, 2, 0)
    # wire order is rank-major then local id: 5,0 | 3,1,4 | 2
    assert [p.wire_position[e] for e in (5, 0, 3, 1, 4, 2)] == [0, 1, 2, 3, 4, 5]
    assert p.rank_wire_offsets == (0, 2, 5, 6)


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ([[0, 1], [1, 2]], "placed on FFN rank 0 and on FFN rank 1"),
        ([[0, 3], [1]], "outside"),
        ([[0, 1], []], "FFN rank 1 owns no routed expert"),
        ([], "at least one FFN rank"),
    ],
)
def test_invalid_placement_tables_are_rejected(table: list[list[int]], message: str) -> None:
    with pytest.raises(TopologyError, match=message):
        ExpertPlacement.from_table(table)


def test_world_ranks_put_attention_first() -> None:
    topo = Topology(num_attention_ranks=4, num_ffn_ranks=2, num_experts=8, attn_ranks_per_dp=2)
    assert topo.world_size == 6
    assert topo.num_regions == 4
    assert topo.num_dp_replicas == 2
    assert [topo.world_rank(Role.ATTENTION, i) for i in range(4)] == [0, 1, 2, 3]
    assert [topo.world_rank(Role.FFN, j) for j in range(2)] == [4, 5]
    for w in range(6):
        role, r = topo.role_of(w)
        assert topo.world_rank(role, r) == w
    assert topo.participants(1) == (2, 3)
    assert topo.dp_replica_of(3) == 1
    assert topo.local_experts(1) == (4, 5, 6, 7)
    assert Role.ATTENTION.opposite is Role.FFN


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_attention_ranks": 0, "num_ffn_ranks": 1, "num_experts": 4}, "num_attention_ranks"),
        ({"num_attention_ranks": 1, "num_ffn_ranks": 0, "num_experts": 4}, "num_ffn_ranks"),
        (
            {
                "num_attention_ranks": 3,
                "num_ffn_ranks": 1,
                "num_experts": 4,
                "attn_ranks_per_dp": 2,
            },
            "not a multiple of attn_ranks_per_dp",
        ),
        ({"num_attention_ranks": 2, "num_ffn_ranks": 5, "num_experts": 4}, "num_experts \\(4\\)"),
        (
            {
                "num_attention_ranks": 1,
                "num_ffn_ranks": 2,
                "num_experts": 4,
                "placement": ExpertPlacement.contiguous(4, 1),
            },
            "covers 1 FFN ranks",
        ),
        (
            {
                "num_attention_ranks": 1,
                "num_ffn_ranks": 1,
                "num_experts": 5,
                "placement": ExpertPlacement.contiguous(4, 1),
            },
            "covers 4 experts",
        ),
    ],
)
def test_invalid_topologies_say_why(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(TopologyError, match=message):
        Topology(**kwargs)  # type: ignore[arg-type]


def test_out_of_range_ranks_are_rejected() -> None:
    topo = Topology(num_attention_ranks=2, num_ffn_ranks=2, num_experts=4)
    with pytest.raises(TopologyError, match="ffn rank 2 is outside"):
        topo.world_rank(Role.FFN, 2)
    with pytest.raises(TopologyError, match="world rank 4"):
        topo.role_of(4)
    with pytest.raises(TopologyError, match="DP replica 2"):
        topo.participants(2)
