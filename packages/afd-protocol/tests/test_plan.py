"""plan_dispatch / combine: property tests against independent per-token references."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from afd_protocol import (
    CapacityError,
    ExpertPlacement,
    InvalidArgument,
    ProtocolError,
    SharedPlacement,
    SlotLayout,
    Topology,
    combine,
    combine_scatter,
    expert_ids_from_counts,
    new_accumulator,
    plan_dispatch,
)


@st.composite
def routing_cases(draw: st.DrawFn) -> tuple[Topology, torch.Tensor, torch.Tensor, torch.Generator]:
    """A topology (maybe a shuffled placement), topk ids (maybe from a subset of experts,
    so that some FFN ranks receive nothing) and topk weights."""
    num_ffn = draw(st.integers(1, 5), label="F")
    num_experts = draw(st.integers(num_ffn, 40), label="E")
    seed = draw(st.integers(0, 2**31 - 1), label="seed")
    gen = torch.Generator().manual_seed(seed)
    if draw(st.booleans(), label="shuffled placement"):
        perm = torch.randperm(num_experts, generator=gen).tolist()
        base = ExpertPlacement.contiguous(num_experts, num_ffn)
        table = [[perm[e] for e in rank] for rank in base.experts_of_rank]
        placement = ExpertPlacement.from_table(table)
    else:
        placement = ExpertPlacement.contiguous(num_experts, num_ffn)
    topo = Topology(
        num_attention_ranks=1, num_ffn_ranks=num_ffn, num_experts=num_experts, placement=placement
    )
    # Route only to a subset of experts sometimes, which leaves FFN ranks empty.
    subset_size = draw(st.integers(1, num_experts), label="experts used")
    allowed = torch.randperm(num_experts, generator=gen)[:subset_size]
    topk = draw(st.integers(1, subset_size), label="topk")
    num_tokens = draw(st.integers(0, 48), label="T")
    ids = (
        torch.stack(
            [allowed[torch.randperm(subset_size, generator=gen)[:topk]] for _ in range(num_tokens)]
        )
        if num_tokens
        else torch.empty(0, topk, dtype=torch.long)
    )
    weights = torch.rand(num_tokens, topk, generator=gen)
    return topo, ids, weights, gen


@given(routing_cases())
def test_every_partial_is_routed_exactly_once_and_grouped(case: tuple) -> None:
    topo, ids, _, _ = case
    plan = plan_dispatch(ids, topo)
    num_tokens, topk = ids.shape
    assert sorted(plan.order.tolist()) == list(range(num_tokens * topk))
    placement = topo.expert_placement
    flat = ids.reshape(-1).tolist()
    expected_dest = set()
    for d in range(topo.num_ffn_ranks):
        rows = plan.order[plan.segment(d)].tolist()
        experts = [flat[p] for p in rows]
        assert all(placement.owner[e] == d for e in experts)
        local = [placement.local_id[e] for e in experts]
        assert local == sorted(local), "segment must be grouped by ascending local expert"
        for lid in set(local):  # stable: within an expert, token order is kept
            tokens = [p // topk for p, le in zip(rows, local, strict=True) if le == lid]
            assert tokens == sorted(tokens)
        counts = plan.group_list(d).tolist()
        assert len(counts) == len(topo.local_experts(d))
        assert sum(counts) == plan.routed_rows(d) == len(rows)
        assert counts == [local.count(lid) for lid in range(len(counts))]
        assert list(plan.host_group_list(d)) == counts
        assert plan.tokens_for(d).tolist() == [p // topk for p in rows]
        if rows:
            expected_dest.add(d)
    assert set(plan.destinations) == expected_dest  # empty ranks are not waited on
    assert (plan.row_token * topk + plan.row_k).tolist() == plan.order.tolist()


def ffn_side(
    topo: Topology, rows: torch.Tensor, group_list: torch.Tensor, dest: int, weights: torch.Tensor
) -> torch.Tensor:
    """What an FFN rank computes: local expert id per row from the group list, no routing."""
    local_ids = expert_ids_from_counts(group_list, num_rows=rows.shape[0])
    global_ids = torch.tensor(topo.local_experts(dest), dtype=torch.long)[local_ids]
    return torch.bmm(rows.unsqueeze(1), weights[global_ids]).squeeze(1)


@settings(deadline=None)
@given(routing_cases(), st.sampled_from(list(SharedPlacement)), st.integers(1, 12))
def test_linear_experts_match_a_per_token_reference(
    case: tuple, shared: SharedPlacement, hidden: int
) -> None:
    topo, ids, topk_weights, gen = case
    num_tokens, topk = ids.shape
    x = torch.randn(num_tokens, hidden, generator=gen, dtype=torch.float64).float()
    expert_w = torch.randn(topo.num_experts, hidden, hidden, generator=gen)
    shared_w = torch.randn(hidden, hidden, generator=gen)

    plan = plan_dispatch(ids, topo, shared_placement=shared)
    replies = {}
    for d in plan.destinations:
        routed = ffn_side(topo, plan.gather(x, d), plan.group_list(d), d, expert_w)
        shared_out = plan.gather_shared(x, d) @ shared_w if plan.shared_rows(d) else None
        replies[d] = (routed, shared_out)
    out = combine(plan, replies, topk_weights, hidden, torch.float32)

    # Independent reference: per token, per selected expert, no batching.
    reference = torch.zeros(num_tokens, hidden, dtype=torch.float64)
    for t in range(num_tokens):
        for j in range(topk):
            e = int(ids[t, j])
            reference[t] += float(topk_weights[t, j]) * (x[t].double() @ expert_w[e].double())
        if shared is SharedPlacement.FFN:
            reference[t] += x[t].double() @ shared_w.double()
    torch.testing.assert_close(out.double(), reference, rtol=1e-5, atol=1e-4)


@given(routing_cases())
def test_identity_experts_recombine_to_the_weighted_sum(case: tuple) -> None:
    topo, ids, topk_weights, gen = case
    x = torch.randn(ids.shape[0], 5, generator=gen)
    plan = plan_dispatch(ids, topo, shared_placement="ffn")
    acc = new_accumulator(ids.shape[0], 5)
    for d in range(topo.num_ffn_ranks):  # empty destinations may reply with nothing
        combine_scatter(acc, plan, d, plan.gather(x, d), topk_weights, plan.gather_shared(x, d))
    expected = x * (topk_weights.sum(dim=1, keepdim=True) + 1.0)
    torch.testing.assert_close(acc, expected, rtol=1e-5, atol=1e-5)


@given(routing_cases())
def test_ffn_shared_split_is_round_robin_and_covers_every_token(case: tuple) -> None:
    topo, ids, _, _ = case
    plan = plan_dispatch(ids, topo, shared_placement=SharedPlacement.FFN)
    f = topo.num_ffn_ranks
    got = sorted(t for d in range(f) for t in plan.shared_tokens[d].tolist())
    assert got == list(range(ids.shape[0]))
    for d in range(f):
        assert all(t % f == d for t in plan.shared_tokens[d].tolist())
    attention_plan = plan_dispatch(ids, topo, shared_placement=SharedPlacement.ATTENTION)
    assert all(attention_plan.shared_rows(d) == 0 for d in range(f))


def test_capacity_overflow_raises_with_the_numbers_before_any_write() -> None:
    topo = Topology(num_attention_ranks=1, num_ffn_ranks=2, num_experts=4)
    layout = SlotLayout(
        topo, hidden_size=8, max_num_batched_tokens=8, topk=2, routed_cap_multiplier=1.0
    )
    assert layout.routed_cap == 8
    ids = torch.tensor([[0, 1]] * 8)  # all 16 partials land on FFN rank 0
    with pytest.raises(CapacityError, match=r"16 routed rows for FFN rank 0 exceed routed_cap=8"):
        plan_dispatch(ids, topo, layout=layout)
    with pytest.raises(CapacityError, match=r"multiplier of at least 2\.00"):
        plan_dispatch(ids, topo, layout=layout)
    with pytest.raises(CapacityError, match="9 tokens exceeds token_cap=8"):
        plan_dispatch(torch.tensor([[0, 2]] * 9), topo, layout=layout)
    plan_dispatch(torch.tensor([[0, 2]] * 8), topo, layout=layout)  # balanced: fits


def test_bad_router_output_is_a_clear_error() -> None:
    topo = Topology(num_attention_ranks=1, num_ffn_ranks=2, num_experts=4)
    with pytest.raises(InvalidArgument, match="expert id 4, outside"):
        plan_dispatch(torch.tensor([[0, 4]]), topo)
    with pytest.raises(InvalidArgument, match="expert id -1"):
        plan_dispatch(torch.tensor([[-1, 2]]), topo)
    with pytest.raises(InvalidArgument, match="shape"):
        plan_dispatch(torch.tensor([0, 1]), topo)
    with pytest.raises(InvalidArgument, match="integer"):
        plan_dispatch(torch.tensor([[0.0, 1.0]]), topo)
    # A token that picks one expert twice would make that expert's count exceed the token
    # count, which every receiver refuses: the sender says so first.
    with pytest.raises(InvalidArgument, match="chose an expert more than once"):
        plan_dispatch(torch.tensor([[1, 1], [1, 2]]), topo)


def test_combine_rejects_replies_that_do_not_match_the_plan() -> None:
    topo = Topology(num_attention_ranks=1, num_ffn_ranks=2, num_experts=4)
    ids = torch.tensor([[0, 2], [1, 3]])
    w = torch.ones(2, 2)
    plan = plan_dispatch(ids, topo)
    acc = new_accumulator(2, 3)
    with pytest.raises(ProtocolError, match=r"shape \(3, 3\), expected \[2, 3\]"):
        combine_scatter(acc, plan, 0, torch.zeros(3, 3), w)
    with pytest.raises(ProtocolError, match="no reply from FFN ranks \\[1\\]"):
        combine(plan, {0: (torch.zeros(2, 3), None)}, w, 3, torch.float32)
    with pytest.raises(ProtocolError, match="shared rows that were not sent"):
        combine_scatter(acc, plan, 0, torch.zeros(2, 3), w, torch.zeros(1, 3))
    with pytest.raises(TypeError, match="float32"):
        combine_scatter(acc.half(), plan, 0, torch.zeros(2, 3), w)


def test_bf16_combine_accumulates_in_fp32() -> None:
    """Many small bf16 partials: an fp32 accumulator keeps what bf16 summation would lose."""
    topo = Topology(num_attention_ranks=1, num_ffn_ranks=1, num_experts=64)
    ids = torch.arange(64).reshape(1, 64)
    w = torch.full((1, 64), 1.0)
    plan = plan_dispatch(ids, topo)
    rows = torch.full((64, 1), 1.0 / 256, dtype=torch.bfloat16)
    rows[0] = 256.0
    out = combine(plan, {0: (rows, None)}, w, 1, torch.float32)
    assert out.item() == pytest.approx(256.0 + 63 / 256)
