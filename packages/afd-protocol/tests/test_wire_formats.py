"""The two wire formats: ``per_choice`` (a row per (token, expert) partial) and ``per_rank``
(a row per token and FFN rank, with its local expert ids and weights), reduced on either
side. Every partial is counted exactly once, every combination gives the float64 reference
and the ``per_choice`` result, and ``per_rank`` moves the bytes it promises."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from afd_protocol import (
    FLAG_ROWS_PER_TOKEN,
    CapacityError,
    CombineReduce,
    Header,
    HeaderLimits,
    InvalidArgument,
    MessageKind,
    PeerTimeout,
    ProtocolError,
    Role,
    SharedPlacement,
    SlotLayout,
    Topology,
    TopologyError,
    WireFormat,
    WorkItemPart,
    check_same_geometry,
    decode_header,
    encode_words,
    plan_dispatch,
    plan_on_device,
)
from afd_protocol.testing import LinearExperts, random_routing
from afd_protocol.window import (
    LoopbackWorld,
    WindowOptions,
)

HIDDEN = 8
FAST = WindowOptions(timeout=0.05)
FORMATS = [
    ("per_choice", "attention"),
    ("per_rank", "attention"),
    ("per_rank", "ffn"),
]


def layout_of(
    wire: str,
    reduce: str,
    a: int = 2,
    f: int = 2,
    experts: int = 7,
    topk: int = 3,
    tokens: int = 32,
    shared: str = "attention",
    per_dp: int = 1,
    multiplier: float = 2.0,
) -> SlotLayout:
    topo = Topology(a, f, experts, attn_ranks_per_dp=per_dp)
    return SlotLayout(
        topo,
        HIDDEN,
        tokens,
        topk,
        dtype="float32",
        shared_placement=shared,
        wire_format=wire,
        combine_reduce=reduce,
        routed_cap_multiplier=multiplier,
    )


# ---- geometry ---------------------------------------------------------------------------


def test_each_format_sizes_its_slot_and_both_roles_must_agree_on_it() -> None:
    choice = layout_of("per_choice", "attention", tokens=16, f=3)
    rank_attn = layout_of("per_rank", "attention", tokens=16, f=3)
    rank_ffn = layout_of("per_rank", "ffn", tokens=16, f=3)
    assert choice.wire_format is WireFormat.PER_CHOICE
    assert rank_ffn.combine_reduce is CombineReduce.FFN
    # per_choice: ceil(16 * 3 / 3) * 2 = 32 rows; per_rank reduced on the FFN: one row per
    # token, whatever the routing; reduced on the attention side: the larger of the two.
    assert (choice.routed_cap, rank_ffn.routed_cap, rank_attn.routed_cap) == (32, 16, 32)
    assert choice.field("route_ids").shape == (0, 3)
    assert rank_ffn.field("route_ids").shape == (16, 3)
    assert rank_ffn.field("route_weights").shape == (16, 3)
    assert rank_ffn.field("route_weights").dtype == "float32"
    mine = choice.window().describe()
    with pytest.raises(TopologyError, match="wire_format"):
        check_same_geometry(mine, rank_ffn.window().describe(), peer="ffn rank 0")
    with pytest.raises(TopologyError, match="combine_reduce"):
        check_same_geometry(
            rank_attn.window().describe(), rank_ffn.window().describe(), peer="ffn rank 0"
        )


def test_a_format_that_cannot_work_is_refused_naming_the_fix() -> None:
    with pytest.raises(TopologyError, match=r"^combine_reduce='ffn' needs wire_format='per_rank'"):
        layout_of("per_choice", "ffn")
    with pytest.raises(
        TopologyError, match=r"^wire_format 'per_token' must be 'per_choice' or 'per_rank'$"
    ):
        layout_of("per_token", "attention")
    with pytest.raises(TopologyError, match=r"^combine_reduce 'gpu' must be 'attention' or 'ffn'"):
        layout_of("per_rank", "gpu")


def test_per_rank_reduced_on_the_ffn_never_overflows_where_per_choice_does() -> None:
    # Every token's three experts on FFN rank 0: 3 * 16 partials there, routed_cap 24.
    ids = torch.tensor([[0, 1, 2]] * 16)
    choice = layout_of("per_choice", "attention", tokens=16, multiplier=1.0)
    with pytest.raises(CapacityError, match="48 routed rows for FFN rank 0 exceed routed_cap=24"):
        plan_dispatch(ids, choice.topology, layout=choice)
    rank_ffn = layout_of("per_rank", "ffn", tokens=16, multiplier=1.0)
    plan = plan_dispatch(ids, rank_ffn.topology, layout=rank_ffn)
    assert (plan.rank_rows(0), plan.routed_rows(0)) == (16, 48)
    rank_attn = layout_of("per_rank", "attention", tokens=16, multiplier=1.0)
    with pytest.raises(CapacityError, match="48 routed rows for FFN rank 0 exceed routed_cap=24"):
        plan_dispatch(ids, rank_attn.topology, layout=rank_attn)  # the replies would not fit


# ---- plans ------------------------------------------------------------------------------


@st.composite
def routings(draw: st.DrawFn) -> tuple[Topology, torch.Tensor]:
    f = draw(st.integers(1, 4))
    experts = draw(st.integers(f, 12))
    topk = draw(st.integers(1, min(4, experts)))
    tokens = draw(st.integers(0, 24))
    ids = [draw(st.permutations(range(experts)))[:topk] for _ in range(tokens)]
    topo = Topology(1, f, experts)
    return topo, torch.tensor(ids, dtype=torch.long).view(tokens, topk)


@given(routings())
def test_every_partial_is_counted_exactly_once_and_in_the_per_choice_order(
    case: tuple[Topology, torch.Tensor],
) -> None:
    topo, ids = case
    tokens, topk = ids.shape
    plan = plan_dispatch(ids, topo, wire_format="per_rank")
    placement = topo.expert_placement
    seen: list[tuple[int, int]] = []
    for d in range(topo.num_ffn_ranks):
        segment = plan.rank_segment(d)
        assert plan.rank_tokens is not None
        assert plan.rank_local_ids is not None
        rank_tokens = plan.rank_tokens[segment].tolist()
        local_ids = plan.rank_local_ids[segment].tolist()
        # The tokens with any expert on d, ascending, once each.
        expected = [t for t in range(tokens) if any(placement.owner[e] == d for e in ids[t])]
        assert rank_tokens == expected
        assert plan.rank_rows(d) == len(expected)
        partials = []
        for t, row in zip(rank_tokens, local_ids, strict=True):
            for j, local in enumerate(row):
                e = int(ids[t, j])
                if placement.owner[e] == d:
                    assert local == placement.local_id[e]
                    partials.append((local, t, j))
                else:
                    assert local == -1
        seen += [(t, j) for _, t, j in partials]
        # Expanded by local expert (stably) they are the per_choice rows for d, in order.
        expansion = [t for _, t, _ in sorted(partials, key=lambda p: p[0])]
        assert expansion == plan.tokens_for(d).tolist()
        assert sum(plan.host_group_list(d)) == len(partials)
    assert sorted(seen) == [(t, j) for t in range(tokens) for j in range(topk)]


def test_rank_weights_zero_the_choices_held_elsewhere() -> None:
    topo = Topology(1, 2, 4)  # rank 0: experts 0, 1; rank 1: experts 2, 3
    ids = torch.tensor([[0, 3], [2, 1], [1, 0]])
    weights = torch.tensor([[0.5, 0.25], [0.125, 2.0], [1.0, 3.0]], dtype=torch.bfloat16)
    plan = plan_dispatch(ids, topo, wire_format="per_rank")
    assert plan.rank_token_offsets == (0, 3, 5)
    assert plan.rank_tokens is not None
    assert plan.rank_local_ids is not None
    assert plan.rank_tokens.tolist() == [0, 1, 2, 0, 1]
    assert plan.rank_local_ids.tolist() == [[0, -1], [-1, 1], [1, 0], [-1, 1], [0, -1]]
    rank_weights = plan.rank_weights(weights)
    assert rank_weights.dtype == torch.float32
    assert rank_weights.tolist() == [[0.5, 0], [0, 2.0], [1.0, 3.0], [0, 0.25], [0.125, 0]]
    with pytest.raises(InvalidArgument, match="plan with wire_format='per_rank'"):
        plan_dispatch(ids, topo).rank_rows(0)


# ---- endpoints --------------------------------------------------------------------------


def run_layer(
    layout: SlotLayout,
    jobs: list[tuple[int, int]],
    seed: int = 0,
    world: LoopbackWorld | None = None,
    stages: int = 1,
) -> tuple[list[torch.Tensor], list[torch.Tensor], dict[str, int]]:
    """Dispatch one layer from every attention rank (``jobs``: (tokens, layer) per rank;
    with ``stages`` > 1, that many in flight per rank, stage ``s`` at layer + ``s``), serve
    it with linear experts, combine; returns outputs, references and the routed rows that
    travelled each way. ``world``: the windows (default: a loopback world, one ring)."""
    world = world if world is not None else LoopbackWorld(layout.window(ring_depth=1))
    topo = layout.topology
    attention = [
        world.connection(Role.ATTENTION, r).attention_endpoint(FAST)
        for r in range(topo.num_attention_ranks)
    ]
    ffns = [world.connection(Role.FFN, r).ffn_endpoint(FAST) for r in range(topo.num_ffn_ranks)]
    experts = LinearExperts(4, topo.num_experts, HIDDEN, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    inputs, handles, senders = [], [], []
    for stage in range(stages):
        for ep, (tokens, layer) in zip(attention, jobs, strict=True):
            x, ids, w = random_routing(tokens, HIDDEN, layout.topk, range(topo.num_experts), gen)
            inputs.append((layer + stage, x, ids, w))
            handles.append(ep.dispatch(layer + stage, x, ids, w, stage=stage))
            senders.append(ep)
    moved = {"dispatch": 0, "reply": 0}
    for ffn in ffns:
        while True:
            try:
                item = ffn.next_work_item(timeout=0.01)
            except PeerTimeout:  # nothing more is ready
                break
            moved["dispatch"] += sum(int(p.routed_rows.shape[0]) for p in item.parts)
            moved["reply"] += item.num_routed_rows
            experts.reply_to(ffn, item)
    outputs = [ep.combine(h) for ep, h in zip(senders, handles, strict=True)]
    shared_on_ffn = layout.shared_cap > 0
    references = [experts.reference(layer, x, ids, w, shared_on_ffn) for layer, x, ids, w in inputs]
    return outputs, references, moved


@pytest.mark.parametrize(("wire", "reduce"), FORMATS)
@pytest.mark.parametrize("shared", ["attention", "ffn"])
@pytest.mark.parametrize("per_dp", [1, 2])
def test_every_format_matches_the_reference(
    wire: str, reduce: str, shared: str, per_dp: int
) -> None:
    layout = layout_of(wire, reduce, a=2, f=3, experts=7, topk=3, shared=shared, per_dp=per_dp)
    jobs = [(30, 2), (5, 2)] if per_dp == 2 else [(30, 3), (5, 0)]
    outputs, references, _ = run_layer(layout, jobs, seed=1)
    for out, ref in zip(outputs, references, strict=True):
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-4)


def test_the_formats_agree_with_each_other_and_per_rank_moves_fewer_rows() -> None:
    results = {}
    for wire, reduce in FORMATS:
        layout = layout_of(wire, reduce, a=1, f=1, experts=8, topk=6, tokens=64)
        outputs, _, moved = run_layer(layout, [(64, 1)], seed=2)
        results[(wire, reduce)] = (outputs[0], moved)
    base, base_moved = results[("per_choice", "attention")]
    for out, _ in results.values():
        torch.testing.assert_close(out, base, rtol=1e-5, atol=1e-5)
    # One FFN rank, top-6: per_choice sends 6 rows per token each way; per_rank sends one,
    # and replies one when the FFN side reduces.
    assert base_moved == {"dispatch": 6 * 64, "reply": 6 * 64}
    assert results[("per_rank", "attention")][1] == {"dispatch": 64, "reply": 6 * 64}
    assert results[("per_rank", "ffn")][1] == {"dispatch": 64, "reply": 64}


def test_a_message_in_the_other_format_is_refused_naming_the_flag() -> None:
    limits = layout_of("per_rank", "ffn").header_limits(MessageKind.DISPATCH, 0)
    assert limits.rows_per_token is True
    per_choice = Header(MessageKind.DISPATCH, 0, 0, 0, 4, 5, 0, seq=1, expert_counts=(2, 2, 1, 0))
    with pytest.raises(
        ProtocolError,
        match=re.escape(
            "FLAGS=0, expected the rows-per-token bit 0b100 set (this geometry's wire format "
            "is per_rank)"
        ),
    ):
        decode_header(encode_words(per_choice), limits)
    reply_limits = layout_of("per_rank", "attention").header_limits(MessageKind.REPLY, 0)
    assert reply_limits.rows_per_token is False  # replies per partial
    per_token = Header(
        MessageKind.REPLY,
        0,
        0,
        0,
        4,
        3,
        0,
        seq=1,
        answer_seq=1,
        flags=FLAG_ROWS_PER_TOKEN,
        expert_counts=(2, 2, 1, 0),
    )
    with pytest.raises(
        ProtocolError, match=r"FLAGS=4, expected the rows-per-token bit 0b100 clear"
    ):
        decode_header(encode_words(per_token), reply_limits)


PER_TOKEN = Header(
    MessageKind.DISPATCH, 0, 3, 0, 10, 3, 0, seq=7, flags=FLAG_ROWS_PER_TOKEN, expert_counts=(2, 3)
)


@pytest.mark.parametrize(
    ("changes", "topk", "message"),
    [
        (
            {"routed_rows": 11},
            8,
            "ROUTED_ROWS=11, expected at most NUM_TOKENS=10 (one row per token)",
        ),
        (
            {"expert_counts": (4, 1)},
            8,
            "EXPERT_COUNTS[0]=4, expected at most ROUTED_ROWS=3 (one per row)",
        ),
        (
            {"expert_counts": (1, 1)},
            8,
            "ROUTED_ROWS=3, expected at most the sum of EXPERT_COUNTS (2): every row has an "
            "expert here",
        ),
        (
            {},
            1,
            "EXPERT_COUNTS=5, expected a sum of at most ROUTED_ROWS * topk = 3 * 1 (each row's "
            "token chose topk experts)",
        ),
    ],
)
def test_per_token_rows_that_contradict_their_counts_are_refused(
    changes: dict[str, object], topk: int, message: str
) -> None:
    decode_header(encode_words(PER_TOKEN), HeaderLimits(16, 16, 0, topk=8, rows_per_token=True))
    header = dataclasses.replace(PER_TOKEN, **changes)  # type: ignore[arg-type]
    limits = HeaderLimits(16, 16, 0, num_counts=2, topk=topk, rows_per_token=True)
    with pytest.raises(ProtocolError, match=re.escape(f"bad slot header: {message}")):
        decode_header(encode_words(header), limits)


def test_the_device_plan_places_token_rows_as_the_host_plan_lists_them() -> None:
    topo = Topology(1, 3, 7)
    gen = torch.Generator().manual_seed(8)
    _, ids, _ = random_routing(25, HIDDEN, 3, range(7), gen)
    host = plan_dispatch(ids, topo, wire_format="per_rank")
    device = plan_on_device(ids, topo, SharedPlacement.ATTENTION, WireFormat.PER_RANK)
    assert device.token_rows is not None
    assert device.token_row_offsets is not None
    assert tuple(device.token_row_offsets.tolist()) == host.rank_token_offsets
    assert host.rank_tokens is not None
    for d in range(3):
        column = device.token_rows[:, d]
        tokens = (column >= 0).nonzero().squeeze(1)
        assert torch.equal(tokens, host.rank_tokens[host.rank_segment(d)])
        assert column[tokens].tolist() == list(range(host.rank_rows(d)))
    positions = device.token_row_positions.view(25, 3)
    for t in range(25):
        for d in range(3):
            row = int(device.token_rows[t, d])
            want = -1 if row < 0 else host.rank_token_offsets[d] + row  # type: ignore[index]
            assert int(positions[t, d]) == want
    # Without the per-partial order (replies reduced on the FFN): no sort, same token rows.
    unsorted = plan_on_device(
        ids, topo, SharedPlacement.ATTENTION, WireFormat.PER_RANK, per_partial_order=False
    )
    assert unsorted.order.numel() == 0
    assert unsorted.token_rows is not None
    assert torch.equal(unsorted.token_rows, device.token_rows)
    assert torch.equal(unsorted.expert_counts, device.expert_counts)
    empty = plan_on_device(ids[:0], topo, SharedPlacement.ATTENTION, WireFormat.PER_RANK)
    assert empty.token_row_offsets is not None
    assert empty.token_row_offsets.tolist() == [0, 0, 0, 0]


@given(routings(), st.integers(1, 5))
def test_the_reduce_reference_matches_a_float64_sum(
    case: tuple[Topology, torch.Tensor], hidden: int
) -> None:
    """finish() with the reference reduce: each token row's owned partials, weighted, summed
    -- against a float64 loop over the plan's own lists."""
    topo, ids = case
    tokens, topk = ids.shape
    plan = plan_dispatch(ids, topo, wire_format="per_rank")
    gen = torch.Generator().manual_seed(tokens)
    weights = torch.rand(tokens, topk, generator=gen)
    all_weights = plan.rank_weights(weights)
    assert plan.rank_local_ids is not None
    assert plan.rank_tokens is not None
    for d in range(topo.num_ffn_ranks):
        segment = plan.rank_segment(d)
        route_ids, route_weights = plan.rank_local_ids[segment], all_weights[segment]
        part = WorkItemPart(
            src_rank=0,
            num_tokens=tokens,
            routed_rows=torch.zeros(plan.rank_rows(d), hidden),
            shared_rows=torch.zeros(0, hidden),
            group_list=plan.group_list(d),
            layer_index=torch.zeros(1, dtype=torch.int32),
            route_ids=route_ids,
            route_weights=route_weights,
            reduce_on_ffn=True,
        )
        rows, _ = part.grouped()
        out = torch.randn(rows.shape[0], hidden, generator=gen)
        reduced = part.finish(out)
        slots, _ = part._expansion
        expected = torch.zeros(plan.rank_rows(d), hidden, dtype=torch.float64)
        for p, slot in enumerate(slots.tolist()):
            r, j = divmod(slot, topk)
            expected[r] += float(route_weights[r, j]) * out[p].double()
        torch.testing.assert_close(reduced.double(), expected, rtol=1e-5, atol=1e-5)
