"""The used-extent rules a put path sends (afd_protocol.core.extents): hand-computed
cases, and every wire format's exchange through a transport that carries nothing else."""

from __future__ import annotations

import pytest
import torch
from staged_transport import StagedLoopbackWorld

from afd_protocol import (
    HEADER_FIXED_WORDS,
    PeerTimeout,
    Role,
    SlotLayout,
    Topology,
    Word,
    extent_rules,
    used_extents,
)
from afd_protocol.core import extents as extents_module
from afd_protocol.testing import LinearExperts, random_routing
from afd_protocol.window import WindowOptions

HIDDEN = 8
FAST = WindowOptions(timeout=0.05)
FORMATS = [("per_choice", "attention"), ("per_rank", "attention"), ("per_rank", "ffn")]


def layout_of(wire: str, reduce: str, shared: str = "attention", **kw: int) -> SlotLayout:
    a, f, per_dp = kw.get("a", 2), kw.get("f", 3), kw.get("per_dp", 1)
    topo = Topology(a, f, kw.get("experts", 7), attn_ranks_per_dp=per_dp)
    return SlotLayout(
        topo,
        HIDDEN,
        kw.get("tokens", 32),
        kw.get("topk", 3),
        dtype="float32",
        shared_placement=shared,
        wire_format=wire,
        combine_reduce=reduce,
    )


def test_extents_follow_the_header_counts_field_by_field() -> None:
    layout = layout_of("per_rank", "attention", shared="ffn", tokens=32, topk=3)
    words = [0] * (HEADER_FIXED_WORDS + 3)
    words[Word.NUM_TOKENS], words[Word.ROUTED_ROWS], words[Word.SHARED_ROWS] = 10, 7, 4
    words[Word.NUM_COUNTS] = 3
    got = {e.field: (e.offset, e.nbytes) for e in used_extents(layout, words)}
    offset = {spec.name: spec.offset for spec in layout.fields}
    row = HIDDEN * 4
    assert got == {
        "header": (offset["header"], 4 * (HEADER_FIXED_WORDS + 3)),
        "route_index": (offset["route_index"], 4 * 7),
        "route_ids": (offset["route_ids"], 4 * 3 * 10),
        "route_weights": (offset["route_weights"], 4 * 3 * 10),
        "routed_rows": (offset["routed_rows"], row * 7),
        "shared_rows": (offset["shared_rows"], row * 4),
    }
    # Counts past a field's capacity are clipped to it; negative counts send nothing.
    words[Word.ROUTED_ROWS], words[Word.SHARED_ROWS] = 10**6, -5
    got = {e.field: e.nbytes for e in used_extents(layout, words)}
    assert got["routed_rows"] == layout.field("routed_rows").nbytes
    assert "shared_rows" not in got
    # per_choice slots have no route_ids/route_weights fields, so no rule for them.
    per_choice = layout_of("per_choice", "attention")
    assert [r.field for r in extent_rules(per_choice)] == ["header", "route_index", "routed_rows"]
    with pytest.raises(ValueError, match="at least 14 words"):
        used_extents(layout, [0] * 3)


def test_an_empty_message_sends_only_its_header() -> None:
    layout = layout_of("per_choice", "attention")
    words = [0] * HEADER_FIXED_WORDS
    assert [(e.field, e.nbytes) for e in used_extents(layout, words)] == [
        ("header", 4 * HEADER_FIXED_WORDS)
    ]


def run_layer(layout: SlotLayout, jobs: list[tuple[int, int]]) -> tuple[list, list, int]:
    world = StagedLoopbackWorld(layout.window(ring_depth=2))
    topo = layout.topology
    attention = [
        world.connection(Role.ATTENTION, r).attention_endpoint(FAST)
        for r in range(topo.num_attention_ranks)
    ]
    ffns = [world.connection(Role.FFN, r).ffn_endpoint(FAST) for r in range(topo.num_ffn_ranks)]
    experts = LinearExperts(4, topo.num_experts, HIDDEN, seed=3)
    gen = torch.Generator().manual_seed(3)
    inputs, handles = [], []
    for stage in range(2):  # two stages in flight, so both ring slots are used
        for ep, (tokens, layer) in zip(attention, jobs, strict=True):
            x, ids, w = random_routing(tokens, HIDDEN, layout.topk, range(topo.num_experts), gen)
            inputs.append((layer + stage, x, ids, w))
            handles.append(ep.dispatch(layer + stage, x, ids, w, stage=stage))
    for ffn in ffns:
        while True:
            try:
                item = ffn.next_work_item(timeout=0.01)
            except PeerTimeout:
                break
            experts.reply_to(ffn, item)
    eps = [ep for _ in range(2) for ep in attention]
    outputs = [ep.combine(h) for ep, h in zip(eps, handles, strict=True)]
    shared_on_ffn = layout.shared_cap > 0
    references = [experts.reference(layer, x, ids, w, shared_on_ffn) for layer, x, ids, w in inputs]
    return outputs, references, (world.bytes_put, world.whole_fields)


@pytest.mark.parametrize(("wire", "reduce"), FORMATS)
@pytest.mark.parametrize("shared", ["attention", "ffn"])
@pytest.mark.parametrize("per_dp", [1, 2])
def test_every_format_round_trips_through_the_used_extents_alone(
    wire: str, reduce: str, shared: str, per_dp: int
) -> None:
    layout = layout_of(wire, reduce, shared=shared, per_dp=per_dp)
    jobs = [(30, 0), (5, 0)] if per_dp == 2 else [(30, 2), (5, 0)]
    outputs, references, (moved, whole) = run_layer(layout, jobs)
    for out, ref in zip(outputs, references, strict=True):
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-4)
    # ... and well under whole fields: half the batches are 5 of the slots' 32 tokens.
    assert 0 < moved < 0.75 * whole


def test_dropping_one_used_row_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The round trip above can fail: send one routed row fewer and a NaN (0xFF bytes of
    the receiver's untouched slot) reaches an output."""
    real = extents_module.used_extents

    def one_row_short(slot: SlotLayout, header: list[int]) -> list[extents_module.Extent]:
        out = []
        for e in real(slot, header):
            if e.field == "routed_rows" and e.nbytes >= slot.row_bytes:
                e = extents_module.Extent(e.field, e.offset, e.nbytes - slot.row_bytes)
            out.append(e)
        return out

    import staged_transport

    monkeypatch.setattr(staged_transport, "used_extents", one_row_short)
    outputs, _, _ = run_layer(layout_of("per_choice", "attention"), [(30, 2), (5, 0)])
    assert any(not torch.isfinite(out).all() for out in outputs)
