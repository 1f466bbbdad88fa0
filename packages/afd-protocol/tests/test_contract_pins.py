"""The contract pinned to exact values: geometry, its description and digest, the header's
boundaries and every error message, and the device plan against the host plan.

Property tests elsewhere check that the pieces agree with each other; these check that they
agree with the documented contract itself, so that a change to a formula, a bound or a
message is a visible decision, not an accident (they are what `make mutation` found
missing)."""

from __future__ import annotations

import re

import pytest
import torch

from afd_protocol import (
    FLAG_SHUTDOWN,
    HEADER_FIXED_WORDS,
    MAGIC,
    PROTOCOL_VERSION,
    SEQ_LIMIT,
    CapacityError,
    EndpointOptions,
    ExpertPlacement,
    Header,
    HeaderLimits,
    InvalidArgument,
    MessageKind,
    ProtocolError,
    SharedPlacement,
    SlotLayout,
    Topology,
    TopologyError,
    WindowLayout,
    Word,
    check_same_geometry,
    checksum,
    combine,
    combine_scatter,
    decode_header,
    encode_words,
    expert_ids_from_counts,
    new_accumulator,
    next_seq,
    plan_dispatch,
    plan_on_device,
)
from afd_protocol.core.plan import inverse_order, shared_token_split


def geometry() -> tuple[Topology, SlotLayout, WindowLayout]:
    """The pinned geometry, built inside each test (mutation testing attributes the code a
    test runs to that test only when the test itself runs it, not at import)."""
    topo = Topology(2, 3, 7)
    layout = SlotLayout(topo, 8, 16, 2, dtype="float32")
    return topo, layout, layout.window(ring_depth=3)


# ---- geometry -------------------------------------------------------------------------


def test_the_geometry_description_and_digest_are_pinned() -> None:
    topo, layout, window = geometry()
    assert window.describe() == {
        "protocol_version": PROTOCOL_VERSION,
        "num_attention_ranks": 2,
        "num_ffn_ranks": 3,
        "attn_ranks_per_dp": 1,
        "num_experts": 7,
        "experts_of_rank": [[0, 1, 2], [3, 4], [5, 6]],
        "hidden_size": 8,
        "max_num_batched_tokens": 16,
        "topk": 2,
        "dtype": "float32",
        "payload_dtype": None,
        "routed_cap_multiplier": 2.0,
        "shared_placement": "attention",
        "wire_format": "per_choice",
        "combine_reduce": "attention",
        "routed_cap": 22,
        "shared_cap": 0,
        "slot_bytes": 1280,
        "num_regions": 3,
        "ring_depth": 3,
        "window_bytes": 12032,
    }
    # sha256 of the JSON with sorted keys and no spaces, 16 hex digits: both roles must
    # compute the same string from the same description.
    assert window.digest() == "65e0a5c8a5ef1b4c"
    assert [(f.name, f.offset, f.nbytes, f.dtype, f.shape) for f in layout.fields] == [
        ("header", 0, 68, "int32", (17,)),
        ("route_index", 256, 88, "int32", (22,)),
        ("route_ids", 512, 0, "int32", (0, 2)),
        ("route_weights", 512, 0, "float32", (0, 2)),
        ("routed_rows", 512, 704, "uint8", (22, 32)),
        ("routed_scales", 1280, 0, "float32", (0,)),
        ("shared_rows", 1280, 0, "uint8", (0, 32)),
        ("shared_scales", 1280, 0, "float32", (0,)),
    ]
    assert layout.header_words == HEADER_FIXED_WORDS + 3
    # Scale fields exist only with a low-precision payload, one float32 per row.
    for payload, scales in ((None, 0), ("float8_e4m3fn", 6)):
        fp8 = SlotLayout(topo, 8, 16, 2, shared_placement="ffn", payload_dtype=payload)
        assert fp8.field("shared_scales").shape == (scales,)
        assert fp8.field("routed_scales").shape == ((22 if payload else 0),)


def test_window_offsets_follow_the_documented_formulas() -> None:
    _topo, layout, window = geometry()
    assert (window.flags_offset, window.abort_offset, window.slots_offset) == (0, 256, 512)
    for region in range(3):
        assert window.abort_word_offset(region) == 256 + 4 * region
        for ring in range(3):
            index = region * 3 + ring
            assert window.flag_index(region, ring) == index
            assert window.flag_offset(region, ring) == 4 * index
            assert window.slot_offset(region, ring) == 512 + index * 1280
            assert window.field_offset(region, ring, "routed_rows") == 512 + index * 1280 + 512
    assert layout.window_bytes(5, 2) == layout.window(2, 5).total_bytes == 512 + 10 * 1280
    assert layout.window().ring_depth == 1
    # Four bytes per flag and per abort word, each array 256-byte aligned: 64 of them fill
    # exactly one alignment unit.
    wide = layout.window(ring_depth=1, num_regions=64)
    assert (wide.flags_offset, wide.abort_offset, wide.slots_offset) == (0, 256, 512)
    deep = layout.window(ring_depth=16, num_regions=4)
    assert (deep.flags_offset, deep.abort_offset, deep.slots_offset) == (0, 256, 512)
    for region, ring, message in [
        (3, 0, r"region 3 is outside \[0, 3\)"),
        (-1, 0, r"region -1 is outside \[0, 3\)"),
        (0, 3, r"ring 3 is outside \[0, 3\)"),
        (0, -1, r"ring -1 is outside \[0, 3\)"),
    ]:
        with pytest.raises(TopologyError, match=f"^{message}$"):
            window.slot_offset(region, ring)


def test_header_limits_and_capacity_messages_are_exact() -> None:
    _topo, layout, _window = geometry()
    assert layout.header_limits(MessageKind.DISPATCH, 1, 4, 2) == HeaderLimits(
        token_cap=16,
        routed_cap=22,
        shared_cap=0,
        num_counts=2,
        num_src_ranks=2,
        num_layers=4,
        num_stages=2,
        topk=2,
        rows_per_token=False,
    )
    assert layout.header_limits(MessageKind.REPLY, 0).num_src_ranks == 3
    assert layout.header_limits(MessageKind.REPLY, 0).num_counts == 3
    layout.check_capacity(16, 22, 0, dest=2)  # exactly at every limit: fits
    with pytest.raises(CapacityError) as caught:
        layout.check_capacity(16, 23, dest=2)
    assert str(caught.value) == (
        "23 routed rows for FFN rank 2 exceed routed_cap=22 (token_cap=16, topk=2, F=3, "
        "routed_cap_multiplier=2.0); this routing needs a multiplier of at least 2.09 (at "
        "most 3 is ever needed)"
    )
    with pytest.raises(CapacityError, match=r"^23 routed rows exceed"):
        layout.check_capacity(16, 23)  # no destination named
    with pytest.raises(CapacityError) as caught:
        layout.check_capacity(16, 0, 1, dest=0)
    assert str(caught.value) == (
        "1 shared rows for FFN rank 0 exceed shared_cap=0 (shared_placement=attention)"
    )
    with pytest.raises(CapacityError) as caught:
        layout.check_capacity(17)
    assert str(caught.value) == (
        "batch of 17 tokens exceeds token_cap=16 (max_num_batched_tokens); split the batch or "
        "raise max_num_batched_tokens"
    )


def test_a_geometry_mismatch_names_the_key_both_values_and_the_peer() -> None:
    _topo, _layout, window = geometry()
    mine = window.describe()
    theirs = {**mine, "topk": 3}
    with pytest.raises(TopologyError) as caught:
        check_same_geometry(mine, theirs)
    assert str(caught.value) == (
        "window geometry differs from peer's: topk is 2 here but 3 there; start both roles "
        "with the same AFD configuration"
    )
    with pytest.raises(TopologyError, match=r"^window geometry differs from ffn rank 1's: "):
        check_same_geometry(mine, theirs, peer="ffn rank 1")
    missing = dict(mine)
    del missing["dtype"]
    with pytest.raises(TopologyError, match="dtype is 'float32' here but '<missing>' there"):
        check_same_geometry(mine, missing)
    check_same_geometry(mine, dict(mine))


# ---- topology -------------------------------------------------------------------------


def test_topology_and_placement_are_pinned() -> None:
    topo, _layout, _window = geometry()
    placement = ExpertPlacement.contiguous(7, 3)
    assert placement.experts_of_rank == ((0, 1, 2), (3, 4), (5, 6))
    assert placement.owner == (0, 0, 0, 1, 1, 2, 2)
    assert placement.local_id == (0, 1, 2, 0, 1, 0, 1)
    assert placement.wire_position == (0, 1, 2, 3, 4, 5, 6)
    shuffled = ExpertPlacement.from_table([[4, 0], [6, 2, 5], [1, 3]])
    assert shuffled.owner == (0, 2, 1, 2, 0, 1, 1)
    assert shuffled.local_id == (1, 0, 1, 1, 0, 2, 0)
    assert shuffled.wire_position == (1, 5, 3, 6, 0, 4, 2)
    assert topo.describe() == {
        "num_attention_ranks": 2,
        "num_ffn_ranks": 3,
        "attn_ranks_per_dp": 1,
        "num_experts": 7,
        "experts_of_rank": [[0, 1, 2], [3, 4], [5, 6]],
    }
    assert [topo.local_experts(r) for r in range(3)] == [(0, 1, 2), (3, 4), (5, 6)]
    with pytest.raises(TopologyError, match=r"^ffn rank 3 is outside \[0, 3\)$"):
        topo.local_experts(3)
    replicas = Topology(4, 1, 2, attn_ranks_per_dp=2)
    assert replicas.participants(0) == (0, 1)
    assert replicas.participants(1) == (2, 3)
    for bad in (-1, 2):
        with pytest.raises(TopologyError, match=rf"^DP replica {bad} is outside \[0, 2\)$"):
            replicas.participants(bad)
    assert topo.rank_name(0) == "attention rank 0"
    assert topo.rank_name(4) == "ffn rank 2"


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: ExpertPlacement.contiguous(7, 0), "num_ffn_ranks must be >= 1, got 0"),
        (lambda: ExpertPlacement(()), "expert placement needs at least one FFN rank"),
        (
            lambda: ExpertPlacement.from_table([[0, 1], [3]]),
            "expert id 3 on FFN rank 1 is outside [0, 3); a placement table must list "
            "experts 0..2 once each",
        ),
        (lambda: Topology(1, 1, 2, attn_ranks_per_dp=0), "attn_ranks_per_dp must be >= 1, got 0"),
        (lambda: Topology(0, 1, 2), "num_attention_ranks must be >= 1, got 0"),
        (lambda: Topology(1, 0, 2), "num_ffn_ranks must be >= 1, got 0"),
    ],
)
def test_topology_errors_are_exact(make, message: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(TopologyError) as caught:
        make()
    assert str(caught.value) == message


# ---- header ---------------------------------------------------------------------------

INT32_MIN, INT32_MAX = -(1 << 31), (1 << 31) - 1
LIMITS = HeaderLimits(
    token_cap=10, routed_cap=12, shared_cap=4, num_counts=2, num_src_ranks=3, topk=2
)


def header(**changes: object) -> Header:
    fields: dict[str, object] = {
        "kind": MessageKind.DISPATCH,
        "src_rank": 2,
        "layer": 0,
        "stage": 0,
        "num_tokens": 10,
        "routed_rows": 12,
        "shared_rows": 4,
        "seq": 5,
        "expert_counts": (10, 2),
    }
    fields.update(changes)
    return Header(**fields)  # type: ignore[arg-type]


def test_every_limit_is_inclusive_where_documented_and_exclusive_just_beyond() -> None:
    decode_header(encode_words(header()), LIMITS)  # every field at its largest legal value
    decode_header(encode_words(header(seq=SEQ_LIMIT - 1)), LIMITS)
    decode_header(encode_words(header(expert_counts=(0, 0), routed_rows=0)), LIMITS)
    beyond = [
        (header(num_tokens=11, expert_counts=(11, 1)), "NUM_TOKENS=11, expected [0, 11)"),
        (header(routed_rows=13, expert_counts=(10, 3)), "ROUTED_ROWS=13, expected [0, 13)"),
        (header(shared_rows=5), "SHARED_ROWS=5, expected [0, 5)"),
        (header(src_rank=3), "SRC_RANK=3, expected [0, 3)"),
        (
            header(num_tokens=5, expert_counts=(5, 6), routed_rows=11),
            "EXPERT_COUNTS[1]=6, expected [0, NUM_TOKENS=5]",
        ),
        (
            header(num_tokens=5, expert_counts=(5, 5), routed_rows=10, shared_rows=0),
            None,  # exactly 5 * topk: fits
        ),
    ]
    for bad, message in beyond:
        words = encode_words(bad)
        if message is None:
            decode_header(words, LIMITS)
            continue
        with pytest.raises(ProtocolError, match=re.escape(message)):
            decode_header(words, LIMITS)


def test_the_int32_range_is_exact_on_encode_and_decode() -> None:
    for value in (INT32_MIN, INT32_MAX):
        words = encode_words(header())
        words[Word.ANSWER_SEQ] = value  # any word: the range check comes first
        with pytest.raises(ProtocolError, match=f"ANSWER_SEQ={value}, expected 0 on a dispatch"):
            decode_header(words)
    for value in (INT32_MIN - 1, INT32_MAX + 1):
        words = encode_words(header())
        words[Word.LAYER] = value
        with pytest.raises(ProtocolError) as caught:
            decode_header(words)
        assert str(caught.value) == (
            f"bad slot header: LAYER={value}, expected a value that fits in int32"
        )
        with pytest.raises(ProtocolError) as caught:
            encode_words(header(layer=value))
        assert str(caught.value) == f"header word LAYER={value} does not fit in int32"
    with pytest.raises(ProtocolError, match=r"^header word EXPERT_COUNTS\[1\]=2147483648 does"):
        encode_words(header(expert_counts=(0, INT32_MAX + 1)))
    encode_words(header(layer=INT32_MAX))  # the largest int32 encodes
    # The first word that does not fit is named, not the first extreme one that does.
    for extreme in (INT32_MIN, INT32_MAX):
        with pytest.raises(ProtocolError, match=r"^header word ANSWER_SEQ=-2147483649 does"):
            encode_words(header(layer=extreme, answer_seq=INT32_MIN - 1))
        words = encode_words(header())
        words[Word.LAYER], words[Word.ANSWER_SEQ] = extreme, INT32_MAX + 1
        with pytest.raises(ProtocolError, match=r"^bad slot header: ANSWER_SEQ=2147483648, exp"):
            decode_header(words)


def test_a_generic_decoder_states_open_ranges_and_names_the_first_bad_count() -> None:
    words = encode_words(header())
    words[Word.LAYER] = -1
    with pytest.raises(ProtocolError, match=r"^bad slot header: LAYER=-1, expected >= 0$"):
        decode_header(words)  # no limits: the range has no upper end
    words = encode_words(header(num_tokens=3, routed_rows=5, expert_counts=(0, 5)))
    with pytest.raises(
        ProtocolError,
        match=re.escape(
            "bad slot header: EXPERT_COUNTS[1]=5, expected [0, NUM_TOKENS=3] (a token is "
            "routed to an expert at most once)"
        ),
    ):
        decode_header(words)


def test_the_number_of_counts_is_bounded_at_exactly_65536() -> None:
    words = [MAGIC, PROTOCOL_VERSION, 1, 0, 0, 0, 0, 0, 0, 0, 1, 0, 65536, 0] + [0] * 65536
    words[Word.CHECKSUM] = checksum(words) - (1 << 32) * (checksum(words) >= 1 << 31)
    assert decode_header(words).expert_counts == (0,) * 65536
    words = [MAGIC, PROTOCOL_VERSION, 1, 0, 0, 0, 0, 0, 0, 0, 1, 0, 65537, 0]
    with pytest.raises(ProtocolError) as caught:
        decode_header(words)
    assert str(caught.value) == "bad slot header: NUM_COUNTS=65537, expected 0..65536"
    short = [MAGIC, PROTOCOL_VERSION, 1, 0, 0, 0, 0, 0, 0, 0, 1, 0, 3, 0, 0]
    with pytest.raises(ProtocolError) as caught:
        decode_header(short)
    assert str(caught.value) == "truncated slot header: 15 words, NUM_COUNTS=3 needs 17"


def reseal(words: list[int]) -> list[int]:
    crc = checksum(words)
    words[Word.CHECKSUM] = crc - (1 << 32) if crc >= 1 << 31 else crc
    return words


@pytest.mark.parametrize(
    ("word", "value", "message"),
    [
        (Word.MAGIC, 7, f"MAGIC=7, expected {MAGIC:#x} ('AFDG'); not an afd slot"),
        (
            Word.VERSION,
            1,
            f"VERSION=1, expected {PROTOCOL_VERSION}; both roles must run the same "
            f"afd-protocol version",
        ),
        (Word.KIND, 0, "KIND=0, expected 1 (dispatch) or 2 (reply)"),
        (Word.FLAGS, 8, "FLAGS=8, expected only bits 0b111 (shutdown, abort, rows per token)"),
        (Word.SEQ, 0, "SEQ=0, expected [1, 2147483648)"),
        (Word.ANSWER_SEQ, 9, "ANSWER_SEQ=9, expected 0 on a dispatch"),
        (Word.ROUTED_ROWS, 11, "ROUTED_ROWS=11, expected the sum of EXPERT_COUNTS (12)"),
        (Word.SHARED_ROWS, 11, "SHARED_ROWS=11, expected at most NUM_TOKENS=10"),
        (
            HEADER_FIXED_WORDS,
            -1,
            "EXPERT_COUNTS[0]=-1, expected [0, NUM_TOKENS=10] (a token is routed to an "
            "expert at most once)",
        ),
    ],
)
def test_every_header_error_says_the_field_the_value_and_what_was_expected(
    word: int, value: int, message: str
) -> None:
    words = encode_words(header())
    words[word] = value
    if word == HEADER_FIXED_WORDS:
        words[Word.ROUTED_ROWS] = 1  # keep the sum consistent
    with pytest.raises(ProtocolError) as caught:
        decode_header(reseal(words))
    assert str(caught.value) == f"bad slot header: {message}"


def test_reply_shutdown_and_checksum_errors_are_exact() -> None:
    reply = encode_words(header(kind=MessageKind.REPLY, answer_seq=3))
    reply[Word.ANSWER_SEQ] = 0
    with pytest.raises(ProtocolError) as caught:
        decode_header(reseal(reply))
    assert str(caught.value) == "bad slot header: ANSWER_SEQ=0, expected >= 1 on a reply"
    shut = encode_words(
        header(
            flags=FLAG_SHUTDOWN, num_tokens=0, routed_rows=0, shared_rows=0, expert_counts=(0, 0)
        )
    )
    decode_header(shut)  # an empty shutdown is fine
    shut = encode_words(
        header(
            flags=FLAG_SHUTDOWN, num_tokens=1, routed_rows=0, shared_rows=0, expert_counts=(0, 0)
        )
    )
    with pytest.raises(ProtocolError) as caught:
        decode_header(shut)
    assert str(caught.value) == (
        "bad slot header: NUM_TOKENS=1, expected 0 on a shutdown message, with no rows"
    )
    words = encode_words(header())
    words[Word.CHECKSUM] ^= 1
    stored = words[Word.CHECKSUM] & 0xFFFFFFFF
    with pytest.raises(ProtocolError) as caught:
        decode_header(words)
    assert str(caught.value) == (
        f"bad slot header: CHECKSUM={stored}, expected {checksum(words):#x}; the header was "
        f"corrupted or written concurrently"
    )
    with pytest.raises(ProtocolError) as caught:
        decode_header(words[:5])
    assert str(caught.value) == "truncated slot header: 5 words, the fixed part alone has 14"


def test_sequence_numbers_start_at_one_from_anything_out_of_range() -> None:
    assert [next_seq(s) for s in (-5, -1, 0, 1, SEQ_LIMIT - 1, SEQ_LIMIT)] == [1, 1, 1, 2, 1, 1]


# ---- plans ----------------------------------------------------------------------------


@pytest.mark.parametrize("shared", list(SharedPlacement))
@pytest.mark.parametrize("tokens", [0, 1, 5, 40])
def test_the_device_plan_equals_the_host_plan(shared: SharedPlacement, tokens: int) -> None:
    topo, _layout, _window = geometry()
    gen = torch.Generator().manual_seed(tokens)
    ids = (
        torch.stack([torch.randperm(7, generator=gen)[:2] for _ in range(tokens)])
        if tokens
        else torch.empty(0, 2, dtype=torch.long)
    )
    host = plan_dispatch(ids, topo, shared)
    device = plan_on_device(ids, topo, shared)
    assert (device.num_tokens, device.topk, device.shared_placement) == (tokens, 2, shared)
    for name in ("order", "row_token", "expert_counts"):
        assert torch.equal(getattr(device, name), getattr(host, name)), name
        assert getattr(device, name).dtype == torch.int64
    assert device.segment_offsets.tolist() == list(host.segment_offsets)
    assert device.expert_bounds.dtype == torch.int64
    expected_bounds = [int(ids.min()), int(ids.max())] if tokens else [0, 0]
    assert device.expert_bounds.tolist() == expected_bounds
    for a, b in zip(device.shared_tokens, host.shared_tokens, strict=True):
        assert torch.equal(a, b)
        assert a.dtype == torch.int64
    assert torch.equal(device.wire_position, host.wire_position)


def test_plan_helpers_are_exact() -> None:
    topo, layout, _window = geometry()
    splits = shared_token_split(7, topo, SharedPlacement.FFN, torch.device("cpu"))
    assert [s.tolist() for s in splits] == [[0, 3, 6], [1, 4], [2, 5]]
    assert all(s.dtype == torch.int64 for s in splits)
    none = shared_token_split(7, topo, SharedPlacement.ATTENTION, torch.device("cpu"))
    assert [(s.numel(), s.dtype) for s in none] == [(0, torch.int64)] * 3
    acc = new_accumulator(3, 4)
    assert (acc.shape, acc.dtype, float(acc.abs().sum())) == ((3, 4), torch.float32, 0.0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # a user's setting must not change the wire math
    try:
        assert new_accumulator(3, 4).dtype == torch.float32
    finally:
        torch.set_default_dtype(default)
    # The device plan never reads ids back: out-of-range ids are clamped for the sort and
    # reported through expert_bounds, for the caller to check after the fact.
    wild = plan_on_device(torch.tensor([[-1, 2], [9, 0]]), topo, SharedPlacement.ATTENTION)
    assert wild.expert_bounds.tolist() == [-1, 9]
    assert wild.expert_counts.tolist() == [2, 0, 1, 0, 0, 0, 1]
    assert inverse_order(torch.tensor([2, 0, 1])).tolist() == [1, 2, 0]
    counts = torch.tensor([2, 0, 3])
    assert expert_ids_from_counts(counts).tolist() == [0, 0, 2, 2, 2]
    assert expert_ids_from_counts(counts, 5).tolist() == [0, 0, 2, 2, 2]
    plan = plan_dispatch(torch.tensor([[6, 0], [3, 6]]), topo, layout=layout)
    assert plan.segment_offsets == (0, 1, 2, 4)
    assert plan.host_expert_counts == (1, 0, 0, 1, 0, 0, 2)
    assert plan.destinations == (0, 1, 2)
    empty = plan_dispatch(torch.empty(0, 2, dtype=torch.long), topo)
    assert empty.host_expert_counts == (0,) * 7
    assert empty.destinations == ()
    assert empty.row_token.numel() == 0
    assert plan.shared_placement is SharedPlacement.ATTENTION
    assert plan_dispatch(torch.tensor([[1, 2]]), topo, "ffn").shared_placement is (
        SharedPlacement.FFN
    )


def test_combine_checks_reply_shapes_and_never_writes_into_a_reply() -> None:
    topo, _layout, _window = geometry()
    plan = plan_dispatch(torch.tensor([[6, 0], [3, 6]]), topo, "ffn")
    weights = torch.tensor([[0.5, 0.25], [1.0, 2.0]])
    acc = new_accumulator(2, 4)
    with pytest.raises(ProtocolError) as caught:
        combine_scatter(acc, plan, 0, torch.ones(1, 4), weights[:1])
    assert str(caught.value) == "topk_weights has shape (1, 2) but the plan was made for [2, 2]"
    for shared, got in [(None, "None"), (torch.ones(2, 4), "(2, 4)")]:
        with pytest.raises(ProtocolError) as caught:
            combine_scatter(acc, plan, 0, torch.ones(1, 4), weights, shared)
        assert str(caught.value) == (
            f"reply from FFN rank 0 has shared rows of shape {got}, expected [1, 4]"
        )
    # The routed rows are weighted in a copy: a reply window holding float32 rows is read,
    # never scaled in place (a retried or re-read combine must see the rows as sent).
    routed = torch.arange(4.0).repeat(plan.routed_rows(2), 1)
    before = routed.clone()
    combine_scatter(acc, plan, 2, routed, weights, torch.ones(0, 4))
    assert torch.equal(routed, before)
    out = combine(
        plan,
        {
            d: (torch.ones(plan.routed_rows(d), 4), torch.ones(plan.shared_rows(d), 4))
            for d in range(3)
        },
        weights,
        4,
        torch.bfloat16,
    )
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), (weights.sum(1, keepdim=True) + 1).expand(2, 4))


# ---- options --------------------------------------------------------------------------


def test_endpoint_options_bounds_and_messages_are_exact() -> None:
    EndpointOptions(timeout=1e-3, num_layers=1, num_stages=1)  # the smallest legal values
    for name in ("num_layers", "num_stages"):
        with pytest.raises(InvalidArgument) as caught:
            EndpointOptions(**{name: 0})  # type: ignore[arg-type]
        assert str(caught.value) == f"{name} must be >= 1 or None, got 0"
    with pytest.raises(InvalidArgument) as caught:
        EndpointOptions(timeout=-1)
    assert str(caught.value) == "timeout must be > 0 seconds, got -1"
    assert re.fullmatch(r"EndpointOptions\(.*\)", repr(EndpointOptions()))
