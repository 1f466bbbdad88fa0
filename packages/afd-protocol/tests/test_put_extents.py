"""The used-extent rules a put path sends (afd_protocol.core.extents): hand-computed
cases, and every wire format's exchange through a transport that carries nothing else."""

from __future__ import annotations

import pytest
import torch
from staged_transport import StagedLoopbackWorld
from test_wire_formats import FORMATS, HIDDEN, layout_of, run_layer

from afd_protocol import (
    HEADER_FIXED_WORDS,
    SlotLayout,
    Word,
    extent_rules,
    used_extents,
)
from afd_protocol.core import extents as extents_module


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


def staged_layer(layout: SlotLayout, jobs: list[tuple[int, int]]) -> tuple[list, list, int, int]:
    """:func:`test_wire_formats.run_layer` with two stages in flight (both ring slots used)
    over a :class:`StagedLoopbackWorld`; also the bytes it put and the whole fields'."""
    world = StagedLoopbackWorld(layout.window(ring_depth=2))
    outputs, references, _ = run_layer(layout, jobs, seed=3, world=world, stages=2)
    return outputs, references, world.bytes_put, world.whole_fields


@pytest.mark.parametrize(("wire", "reduce"), FORMATS)
@pytest.mark.parametrize("shared", ["attention", "ffn"])
@pytest.mark.parametrize("per_dp", [1, 2])
def test_every_format_round_trips_through_the_used_extents_alone(
    wire: str, reduce: str, shared: str, per_dp: int
) -> None:
    layout = layout_of(wire, reduce, f=3, shared=shared, per_dp=per_dp)
    jobs = [(30, 0), (5, 0)] if per_dp == 2 else [(30, 2), (5, 0)]
    outputs, references, moved, whole = staged_layer(layout, jobs)
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
    outputs, _, _, _ = staged_layer(layout_of("per_choice", "attention", f=3), [(30, 2), (5, 0)])
    assert any(not torch.isfinite(out).all() for out in outputs)
