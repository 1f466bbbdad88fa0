"""Slot and window geometry: disjoint aligned fields, capacities, and the handshake digest."""

from __future__ import annotations

import math
from itertools import pairwise

import pytest
from hypothesis import given
from hypothesis import strategies as st

from afd_protocol import (
    ALIGN,
    HEADER_FIXED_WORDS,
    MessageKind,
    SharedPlacement,
    SlotLayout,
    Topology,
    TopologyError,
    check_same_geometry,
)


@st.composite
def layouts(draw: st.DrawFn) -> SlotLayout:
    a = draw(st.integers(1, 8))
    f = draw(st.integers(1, 8))
    e = draw(st.integers(f, 300))
    topo = Topology(num_attention_ranks=a, num_ffn_ranks=f, num_experts=e)
    return SlotLayout(
        topo,
        hidden_size=draw(st.integers(1, 8192)),
        max_num_batched_tokens=draw(st.integers(1, 16384)),
        topk=draw(st.integers(1, min(e, 8))),
        dtype=draw(st.sampled_from(["bfloat16", "float16", "float32"])),
        payload_dtype=draw(st.sampled_from([None, "float8_e4m3fn", "int8"])),
        routed_cap_multiplier=draw(st.floats(1.0, float(f))),
        shared_placement=draw(st.sampled_from(list(SharedPlacement))),
    )


@given(layouts(), st.integers(1, 4))
def test_fields_are_disjoint_aligned_and_inside_the_slot(layout: SlotLayout, ring: int) -> None:
    spans = []
    for spec in layout.fields:
        assert spec.offset % 256 == 0, spec  # the contract says 256, whatever ALIGN holds
        assert spec.offset + spec.nbytes <= layout.slot_bytes, spec
        spans.append((spec.offset, spec.offset + spec.nbytes))
    spans.sort()
    for (_, end), (start, _) in pairwise(spans):
        assert end <= start
    assert layout.slot_bytes % 256 == 0
    assert layout.field("header").nbytes >= 4 * (HEADER_FIXED_WORDS + 1)
    assert layout.field("routed_rows").nbytes == layout.routed_cap * layout.row_bytes
    assert layout.field("shared_rows").nbytes == layout.shared_cap * layout.row_bytes
    with_scales = layout.payload_dtype is not None
    assert layout.field("routed_scales").nbytes == (4 * layout.routed_cap if with_scales else 0)

    window = layout.window(ring_depth=ring)
    assert window.num_regions == max(
        layout.topology.num_attention_ranks, layout.topology.num_ffn_ranks
    )
    control = [window.flag_offset(r, k) for r in range(window.num_regions) for k in range(ring)]
    control += [window.abort_word_offset(r) for r in range(window.num_regions)]
    assert len(set(control)) == len(control)
    assert all(off % 4 == 0 and off + 4 <= window.slots_offset for off in control)
    slots = sorted(window.slot_offset(r, k) for r in range(window.num_regions) for k in range(ring))
    assert slots[0] == window.slots_offset
    assert window.slots_offset % 256 == 0
    assert ALIGN == 256
    assert all(b - a == layout.slot_bytes for a, b in pairwise(slots))
    assert slots[-1] + layout.slot_bytes == window.total_bytes
    assert layout.window_bytes(window.num_regions, ring) == window.total_bytes


@given(layouts())
def test_capacities_follow_the_formula(layout: SlotLayout) -> None:
    topo = layout.topology
    t, k, f = layout.max_num_batched_tokens, layout.topk, topo.num_ffn_ranks
    even = math.ceil(t * k / f)
    assert layout.token_cap == t
    assert layout.routed_cap == min(math.ceil(even * layout.routed_cap_multiplier), t * k)
    assert layout.routed_cap >= even
    if layout.shared_placement is SharedPlacement.FFN:
        assert layout.shared_cap == math.ceil(t / f)
    else:
        assert layout.shared_cap == 0


def test_multiplier_of_f_fits_any_routing() -> None:
    topo = Topology(num_attention_ranks=1, num_ffn_ranks=4, num_experts=64)
    layout = SlotLayout(topo, 16, 1000, 6, routed_cap_multiplier=4.0)
    assert layout.routed_cap == 6000
    layout.check_capacity(1000, 6000, 0)


def test_digest_is_stable_and_the_handshake_names_the_first_difference() -> None:
    topo = Topology(num_attention_ranks=2, num_ffn_ranks=2, num_experts=8)
    a = SlotLayout(topo, 64, 256, 2).window(ring_depth=2)
    b = SlotLayout(topo, 64, 256, 2).window(ring_depth=2)
    assert a.digest() == b.digest()
    check_same_geometry(a.describe(), b.describe())

    c = SlotLayout(topo, 64, 512, 2).window(ring_depth=2)
    assert a.digest() != c.digest()
    with pytest.raises(TopologyError, match=r"max_num_batched_tokens is 256 here but 512 there"):
        check_same_geometry(a.describe(), c.describe(), peer="FFN rank 0")
    d = SlotLayout(topo, 64, 256, 2).window(ring_depth=1)
    with pytest.raises(TopologyError, match="ring_depth is 2 here but 1 there"):
        check_same_geometry(a.describe(), d.describe())
    with pytest.raises(TopologyError, match="extra is '<missing>' here but 1 there"):
        check_same_geometry(a.describe(), {**a.describe(), "extra": 1})


def test_header_limits_match_the_receiver() -> None:
    topo = Topology(num_attention_ranks=3, num_ffn_ranks=2, num_experts=5)
    layout = SlotLayout(topo, 8, 32, 2, shared_placement="ffn")
    dispatch = layout.header_limits(MessageKind.DISPATCH, ffn_rank=1)
    assert (dispatch.num_counts, dispatch.num_src_ranks) == (2, 3)
    reply = layout.header_limits(MessageKind.REPLY, ffn_rank=0)
    assert (reply.num_counts, reply.num_src_ranks) == (3, 2)
    assert reply.shared_cap == 16


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"hidden_size": 0}, "hidden_size"),
        ({"max_num_batched_tokens": 0}, "max_num_batched_tokens"),
        ({"topk": 9}, r"topk \(9\)"),
        ({"dtype": "int8"}, "dtype 'int8' is not supported"),
        ({"payload_dtype": "bfloat16"}, "not a low-precision payload"),
        ({"routed_cap_multiplier": 0.5}, "routed_cap_multiplier must be"),
        ({"routed_cap_multiplier": float("nan")}, "routed_cap_multiplier must be"),
        ({"shared_placement": "both"}, "must be 'attention' or 'ffn'"),
    ],
)
def test_invalid_layouts_say_what_to_change(kwargs: dict[str, object], message: str) -> None:
    topo = Topology(num_attention_ranks=1, num_ffn_ranks=2, num_experts=8)
    params: dict[str, object] = {"hidden_size": 16, "max_num_batched_tokens": 64, "topk": 2}
    params.update(kwargs)
    with pytest.raises(TopologyError, match=message):
        SlotLayout(topo, **params)  # type: ignore[arg-type]


def test_window_rejects_bad_geometry() -> None:
    topo = Topology(num_attention_ranks=4, num_ffn_ranks=2, num_experts=8)
    layout = SlotLayout(topo, 16, 64, 2)
    with pytest.raises(TopologyError, match="num_regions"):
        layout.window(ring_depth=1, num_regions=2)
    with pytest.raises(TopologyError, match="ring_depth must be >= 1"):
        layout.window(ring_depth=0)
    window = layout.window(ring_depth=2)
    with pytest.raises(TopologyError, match="ring 2 is outside"):
        window.slot_offset(0, 2)
    with pytest.raises(KeyError, match="no slot field"):
        layout.field("weights")
