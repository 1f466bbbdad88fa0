"""Header codec: round trips, and every single-word corruption or truncation is rejected."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from afd_protocol import (
    FLAG_ABORT,
    FLAG_SHUTDOWN,
    HEADER_FIXED_WORDS,
    Header,
    HeaderLimits,
    MessageKind,
    ProtocolError,
    Word,
    decode_header,
    encode_header,
    encode_words,
)

INT32 = st.integers(-(2**31), 2**31 - 1)


@st.composite
def headers(draw: st.DrawFn) -> Header:
    kind = draw(st.sampled_from(list(MessageKind)))
    counts = tuple(draw(st.lists(st.integers(0, 5000), max_size=40)))
    return Header(
        kind=kind,
        src_rank=draw(st.integers(0, 63)),
        layer=draw(st.integers(0, 200)),
        stage=draw(st.integers(0, 7)),
        num_tokens=draw(st.integers(0, 1 << 20)),
        routed_rows=sum(counts),
        shared_rows=draw(st.integers(0, 1 << 16)),
        seq=draw(st.integers(1, 2**31 - 1)),
        answer_seq=draw(st.integers(1, 2**31 - 1)) if kind is MessageKind.REPLY else 0,
        flags=draw(st.sampled_from([0, FLAG_SHUTDOWN, FLAG_ABORT, FLAG_SHUTDOWN | FLAG_ABORT])),
        expert_counts=counts,
    )


def limits_for(h: Header) -> HeaderLimits:
    return HeaderLimits(
        token_cap=1 << 20,
        routed_cap=max(h.routed_rows, 1),
        shared_cap=1 << 16,
        num_counts=len(h.expert_counts),
        num_src_ranks=64,
        num_layers=201,
        num_stages=8,
    )


@given(headers())
def test_encode_decode_round_trips(h: Header) -> None:
    words = encode_words(h)
    assert len(words) == HEADER_FIXED_WORDS + len(h.expert_counts) == h.num_words
    assert decode_header(words) == h
    assert decode_header(encode_header(h), limits_for(h)) == h
    # A whole header field (longer than the header, zero padded) decodes the same.
    field = torch.zeros(h.num_words + 7, dtype=torch.int32)
    field[: h.num_words] = encode_header(h)
    assert decode_header(field, limits_for(h)) == h


@given(headers(), st.data())
def test_any_single_corrupted_word_is_rejected(h: Header, data: st.DataObject) -> None:
    words = encode_words(h)
    index = data.draw(st.integers(0, len(words) - 1), label="index")
    value = data.draw(INT32.filter(lambda v: v != words[index]), label="value")
    words[index] = value
    for limits in (None, limits_for(h)):
        with pytest.raises(ProtocolError, match="slot header"):
            decode_header(words, limits)


@given(headers(), st.data())
def test_truncated_headers_are_rejected(h: Header, data: st.DataObject) -> None:
    words = encode_words(h)
    cut = data.draw(st.integers(0, len(words) - 1), label="cut")
    with pytest.raises(ProtocolError, match="truncated slot header"):
        decode_header(words[:cut])


def test_error_names_the_field_and_value() -> None:
    h = Header(MessageKind.DISPATCH, 0, 3, 0, 10, 4, 0, seq=7, expert_counts=(1, 3))
    words = encode_words(h)
    bad_magic = list(words)
    bad_magic[Word.MAGIC] = 0x12345678
    with pytest.raises(ProtocolError, match=r"MAGIC=305419896.*AFDG"):
        decode_header(bad_magic)
    limits = HeaderLimits(token_cap=8, routed_cap=16, shared_cap=0, num_counts=2)
    with pytest.raises(ProtocolError, match=r"NUM_TOKENS=10, expected \[0, 9\)"):
        decode_header(words, limits)
    limits = HeaderLimits(token_cap=16, routed_cap=16, shared_cap=0, num_counts=3)
    with pytest.raises(ProtocolError, match=r"NUM_COUNTS=2, expected 3"):
        decode_header(words, limits)


def test_semantic_checks_hold_even_with_a_valid_checksum() -> None:
    """A sender bug (not corruption) is caught by the field checks themselves."""
    cases = [
        (
            Header(MessageKind.DISPATCH, 0, 0, 0, 4, 5, 0, seq=1, expert_counts=(1, 3)),
            "ROUTED_ROWS",
        ),
        (Header(MessageKind.DISPATCH, 0, 0, 0, 4, 0, 0, seq=0), "SEQ=0"),
        (Header(MessageKind.REPLY, 0, 0, 0, 4, 0, 0, seq=2, answer_seq=0), "ANSWER_SEQ"),
        (Header(MessageKind.DISPATCH, 0, 0, 0, 4, 0, 0, seq=2, answer_seq=1), "ANSWER_SEQ"),
        (Header(MessageKind.DISPATCH, 0, 0, 0, 4, 0, 0, seq=1, flags=1 << 5), "FLAGS"),
        (Header(MessageKind.DISPATCH, 0, -1, 0, 4, 0, 0, seq=1), "LAYER=-1"),
    ]
    for header, field in cases:
        with pytest.raises(ProtocolError, match=field):
            decode_header(encode_words(header))


def test_flags_and_wrong_input_types() -> None:
    h = Header(MessageKind.DISPATCH, 1, 0, 0, 0, 0, 0, seq=9, flags=FLAG_SHUTDOWN)
    decoded = decode_header(encode_header(h))
    assert decoded.shutdown
    assert not decoded.abort
    with pytest.raises(ProtocolError, match="int32 tensor"):
        decode_header(encode_header(h).to(torch.int64))
    with pytest.raises(ProtocolError, match="does not fit in int32"):
        encode_words(Header(MessageKind.DISPATCH, 0, 0, 0, 2**31, 0, 0, seq=1))


def test_sequence_numbers_wrap_to_one_and_never_use_zero() -> None:
    from afd_protocol import SEQ_LIMIT, next_seq

    assert next_seq(0) == 1
    assert next_seq(41) == 42
    assert next_seq(SEQ_LIMIT - 2) == SEQ_LIMIT - 1
    assert next_seq(SEQ_LIMIT - 1) == 1  # the largest positive int32 wraps to 1, not 0
    header = Header(MessageKind.DISPATCH, 0, 0, 0, 0, 0, 0, seq=SEQ_LIMIT - 1)
    assert decode_header(encode_words(header)).seq == SEQ_LIMIT - 1
