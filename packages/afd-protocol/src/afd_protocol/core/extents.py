"""Which bytes of a slot a message uses, from its header: what a put path must send.

A sender on a peer-mapped window writes rows straight into the receiver's slot. A sender
that cannot map its peer's memory (NVSHMEM between nodes) composes the slot in a local
staging copy instead and then *puts* it; putting the whole slot would send every field at
capacity (a V3 slot is ~100 MB), so it puts, field by field, only the prefix the message
uses. That prefix follows from the header alone -- the receiver reads nothing else -- so a
device kernel can compute it from the header it just wrote, with no host round trip:

=================  ==============================================================
field              bytes used (each clipped to the field's size)
=================  ==============================================================
``header``         ``4 * (HEADER_FIXED_WORDS + NUM_COUNTS)``
``route_index``    ``4 * ROUTED_ROWS``
``route_ids``      ``4 * topk * max(NUM_TOKENS, ROUTED_ROWS)`` (``per_rank`` only)
``route_weights``  as ``route_ids``
``routed_rows``    ``row_bytes * ROUTED_ROWS`` (full activation width: a low-precision
                   payload row is shorter but sits at the same row stride)
``routed_scales``  ``4 * ROUTED_ROWS`` (low-precision payloads only)
``shared_rows``    ``row_bytes * SHARED_ROWS``
``shared_scales``  ``4 * SHARED_ROWS`` (low-precision payloads only)
=================  ==============================================================

Over-sending is harmless (the receiver reads by the header's counts); under-sending would
hand the receiver stale bytes, so every bound above is a superset of what any endpoint
writes. The loopback test transport that stages and copies only these extents
(``tests/staged_transport.py``) runs the endpoint suites against windows pre-filled with
NaN, which proves it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from afd_protocol.core.header import HEADER_FIXED_WORDS, Word
from afd_protocol.core.layout import SlotLayout


@dataclass(frozen=True)
class Extent:
    """``nbytes`` bytes at ``offset`` from the start of a slot."""

    field: str
    offset: int
    nbytes: int


@dataclass(frozen=True)
class ExtentRule:
    """How one field's used bytes follow from the header: ``unit_bytes`` times the largest
    of the header words ``count_words`` (for ``header``: fixed words plus NUM_COUNTS),
    clipped to ``capacity`` bytes. A device kernel evaluates the same rules."""

    field: str
    offset: int
    capacity: int
    unit_bytes: int
    count_words: tuple[int, ...]


def extent_rules(slot: SlotLayout) -> tuple[ExtentRule, ...]:
    """The rule of every non-empty field of ``slot``, in slot order (the table above)."""
    row_bytes = slot.row_bytes
    rules = {
        "header": (4, (int(Word.NUM_COUNTS),)),
        "route_index": (4, (int(Word.ROUTED_ROWS),)),
        "route_ids": (4 * slot.topk, (int(Word.NUM_TOKENS), int(Word.ROUTED_ROWS))),
        "route_weights": (4 * slot.topk, (int(Word.NUM_TOKENS), int(Word.ROUTED_ROWS))),
        "routed_rows": (row_bytes, (int(Word.ROUTED_ROWS),)),
        "routed_scales": (4, (int(Word.ROUTED_ROWS),)),
        "shared_rows": (row_bytes, (int(Word.SHARED_ROWS),)),
        "shared_scales": (4, (int(Word.SHARED_ROWS),)),
    }
    out = []
    for spec in slot.fields:
        if spec.nbytes == 0:
            continue
        unit, words = rules[spec.name]
        out.append(ExtentRule(spec.name, spec.offset, spec.nbytes, unit, words))
    return tuple(out)


def used_extents(slot: SlotLayout, header: Sequence[int]) -> list[Extent]:
    """The bytes of a slot that a message with ``header`` (its int32 words, at least the
    fixed ones) uses, one non-empty :class:`Extent` per field, in slot order."""
    if len(header) < HEADER_FIXED_WORDS:
        raise ValueError(f"a header has at least {HEADER_FIXED_WORDS} words, got {len(header)}")
    extents = []
    for rule in extent_rules(slot):
        count = max(max(int(header[w]), 0) for w in rule.count_words)
        if rule.field == "header":
            count += HEADER_FIXED_WORDS
        nbytes = min(rule.unit_bytes * count, rule.capacity)
        if nbytes > 0:
            extents.append(Extent(rule.field, rule.offset, nbytes))
    return extents
