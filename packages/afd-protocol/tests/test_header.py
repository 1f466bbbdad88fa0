"""Header codec: round trips; every corruption of one word, of one or two bits, and every
truncation is rejected; and a header resealed with a valid checksum over wrong numbers (a
buggy or malicious sender) is still rejected, naming the field."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from afd_protocol import (
    FLAG_ABORT,
    FLAG_ROWS_PER_TOKEN,
    FLAG_SHUTDOWN,
    HEADER_FIXED_WORDS,
    PROTOCOL_VERSION,
    Header,
    HeaderLimits,
    MessageKind,
    ProtocolError,
    Word,
    checksum,
    crc_columns,
    decode_header,
    encode_fixed_words,
    encode_header,
    encode_words,
)

INT32 = st.integers(-(2**31), 2**31 - 1)


TOPK = 8


@st.composite
def headers(draw: st.DrawFn) -> Header:
    """Valid headers: every invariant a receiver checks holds."""
    kind = draw(st.sampled_from(list(MessageKind)))
    flags = draw(st.sampled_from([0, FLAG_SHUTDOWN, FLAG_ABORT, FLAG_SHUTDOWN | FLAG_ABORT]))
    num_counts = draw(st.integers(0, 40))
    per_token = draw(st.booleans()) and not flags & FLAG_SHUTDOWN
    if flags & FLAG_SHUTDOWN:  # a shutdown message is empty
        tokens, counts, shared, rows = 0, (0,) * num_counts, 0, 0
    elif per_token:
        # One row per token, each with 1..TOPK distinct local experts (per_rank format).
        tokens = draw(st.integers(0, 5000))
        rows = draw(st.integers(0, min(tokens, 40))) if num_counts else 0
        counts_list = [0] * num_counts
        for _ in range(rows):
            experts = st.integers(0, num_counts - 1)
            for e in draw(st.sets(experts, min_size=1, max_size=min(TOPK, num_counts))):
                counts_list[e] += 1
        counts = tuple(counts_list)
        shared = draw(st.integers(0, tokens))
        flags |= FLAG_ROWS_PER_TOKEN
    else:
        tokens = draw(st.integers(0, 5000))
        # Each token is routed to at most TOPK experts: spread TOPK * tokens over the counts.
        budget = TOPK * tokens
        counts_list = []
        for _ in range(num_counts):
            count = draw(st.integers(0, min(tokens, budget)))
            counts_list.append(count)
            budget -= count
        counts = tuple(counts_list)
        shared = draw(st.integers(0, tokens))
        rows = sum(counts)
    return Header(
        kind=kind,
        src_rank=draw(st.integers(0, 63)),
        layer=draw(st.integers(0, 200)),
        stage=draw(st.integers(0, 7)),
        num_tokens=tokens,
        routed_rows=rows,
        shared_rows=shared,
        seq=draw(st.integers(1, 2**31 - 1)),
        answer_seq=draw(st.integers(1, 2**31 - 1)) if kind is MessageKind.REPLY else 0,
        flags=flags,
        expert_counts=counts,
    )


def limits_for(h: Header) -> HeaderLimits:
    return HeaderLimits(
        token_cap=5000,
        routed_cap=TOPK * 5000,
        shared_cap=5000,
        num_counts=len(h.expert_counts),
        num_src_ranks=64,
        num_layers=201,
        num_stages=8,
        topk=TOPK,
        rows_per_token=h.rows_per_token,
    )


def reseal(words: list[int]) -> list[int]:
    """Recompute the checksum, as a buggy sender would over wrong numbers."""
    crc = checksum(words)
    words[Word.CHECKSUM] = crc - (1 << 32) if crc >= 1 << 31 else crc
    return words


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


@given(headers())
def test_the_fixed_words_are_the_encoded_header_before_its_counts_unsealed(h: Header) -> None:
    """encode_fixed_words: what a pack kernel completes (it appends the counts and writes
    the checksum): the encoded header's first words with CHECKSUM 0."""
    words = encode_words(h)
    fixed = encode_fixed_words(h)
    assert fixed == [*words[: Word.CHECKSUM], 0]
    assert len(fixed) == HEADER_FIXED_WORDS


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
def test_any_one_or_two_flipped_bits_are_rejected(h: Header, data: st.DataObject) -> None:
    """The CRC's Hamming distance is at least 3: no one- or two-bit error gets through (the
    weighted sum of version 1 let 52 of 24,371 two-bit flips through)."""
    words = encode_words(h)
    bits = 32 * len(words)
    first = data.draw(st.integers(0, bits - 1), label="first bit")
    second = data.draw(st.one_of(st.none(), st.integers(0, bits - 1)), label="second bit")
    flipped = list(words)
    for bit in {first, second} - {None}:
        assert bit is not None
        i, j = divmod(bit, 32)
        value = (flipped[i] & 0xFFFFFFFF) ^ (1 << j)
        flipped[i] = value - (1 << 32) if value >= 1 << 31 else value
    for limits in (None, limits_for(h)):
        with pytest.raises(ProtocolError, match="slot header"):
            decode_header(flipped, limits)


def test_two_bits_that_cancelled_in_the_old_weighted_sum_are_caught() -> None:
    h = Header(MessageKind.DISPATCH, 0, 3, 0, 10, 4, 0, seq=7, expert_counts=(1, 3))
    words = encode_words(h)
    for a, b in ((Word.LAYER, Word.STAGE), (Word.SRC_RANK, Word.SEQ), (Word.KIND, 14)):
        flipped = list(words)
        flipped[a] ^= 1 << 30
        flipped[b] ^= 1 << 30
        with pytest.raises(ProtocolError, match="slot header"):
            decode_header(flipped)


@given(headers())
def test_the_device_form_of_the_checksum_equals_the_crc(h: Header) -> None:
    """base XOR the columns of every set bit == the CRC: what the device pack computes."""
    words = encode_words(h)
    base, columns = crc_columns(len(words))
    crc = base
    for i, word in enumerate(words):
        if i == Word.CHECKSUM:
            continue
        for j in range(32):
            if (word >> j) & 1:
                crc ^= columns[32 * i + j]
    assert crc == checksum(words) == words[Word.CHECKSUM] & 0xFFFFFFFF


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


RESEALED = [
    # (what the corrupt sender changed, the field the error must name)
    (lambda w: w.__setitem__(Word.VERSION, 0), "VERSION=0"),
    (lambda w: w.__setitem__(Word.VERSION, PROTOCOL_VERSION - 1), "VERSION"),
    (lambda w: w.__setitem__(Word.MAGIC, 0), "MAGIC"),
    (lambda w: w.__setitem__(Word.KIND, 3), "KIND=3"),
    (lambda w: w.__setitem__(Word.SRC_RANK, 64), "SRC_RANK=64"),
    (lambda w: w.__setitem__(Word.LAYER, 201), "LAYER=201"),
    (lambda w: w.__setitem__(Word.STAGE, 8), "STAGE=8"),
    (lambda w: w.__setitem__(Word.NUM_TOKENS, 5001), "NUM_TOKENS=5001"),
    (lambda w: w.__setitem__(Word.SHARED_ROWS, 5001), "SHARED_ROWS=5001"),
    (
        lambda w: w.__setitem__(Word.SHARED_ROWS, 11),
        "SHARED_ROWS=11, expected at most NUM_TOKENS=10",
    ),
    (lambda w: w.__setitem__(Word.FLAGS, 1 << 4), "FLAGS"),
    (lambda w: w.__setitem__(Word.SEQ, 0), "SEQ=0"),
    (lambda w: w.__setitem__(Word.ANSWER_SEQ, 3), "ANSWER_SEQ=3"),
    (lambda w: w.__setitem__(Word.NUM_COUNTS, 3), "NUM_COUNTS=3"),
    (lambda w: w.__setitem__(Word.ROUTED_ROWS, 5), "ROUTED_ROWS=5"),
    # An expert count above the token count, with ROUTED_ROWS kept consistent:
    (
        lambda w: (w.__setitem__(14, 11), w.__setitem__(Word.ROUTED_ROWS, 14)),
        "EXPERT_COUNTS\\[0\\]=11",
    ),
    (
        lambda w: (w.__setitem__(14, -1), w.__setitem__(Word.ROUTED_ROWS, 2)),
        "EXPERT_COUNTS\\[0\\]=-1",
    ),
    # Zero tokens with rows:
    (lambda w: w.__setitem__(Word.NUM_TOKENS, 0), "EXPERT_COUNTS\\[0\\]=1"),
    # Shutdown that carries rows:
    (lambda w: w.__setitem__(Word.FLAGS, FLAG_SHUTDOWN), "NUM_TOKENS=10, expected 0 on a shutdown"),
]


@pytest.mark.parametrize(("corrupt", "field"), RESEALED)
def test_a_resealed_header_with_wrong_numbers_is_rejected_naming_the_field(corrupt, field) -> None:
    h = Header(MessageKind.DISPATCH, 0, 3, 0, 10, 4, 0, seq=7, expert_counts=(1, 3))
    limits = HeaderLimits(
        5000, 8 * 5000, 5000, num_counts=2, num_src_ranks=64, num_layers=201, num_stages=8, topk=8
    )
    words = encode_words(h)
    corrupt(words)
    with pytest.raises(ProtocolError, match=field):
        decode_header(reseal(words), limits)


def test_more_routed_rows_than_tokens_times_topk_are_rejected() -> None:
    # 3 tokens, top-2, 4 local experts each with 2 rows: 8 > 3 * 2, though each count <= 3.
    h = Header(MessageKind.DISPATCH, 0, 0, 0, 3, 8, 0, seq=1, expert_counts=(2, 2, 2, 2))
    limits = HeaderLimits(16, 16, 0, num_counts=4, topk=2)
    with pytest.raises(ProtocolError, match=r"ROUTED_ROWS=8, expected at most NUM_TOKENS \* topk"):
        decode_header(encode_words(h), limits)
    decode_header(encode_words(h), HeaderLimits(16, 16, 0, num_counts=4, topk=3))


def test_words_outside_int32_are_rejected_on_decode_and_encode() -> None:
    h = Header(MessageKind.DISPATCH, 0, 3, 0, 10, 4, 0, seq=7, expert_counts=(1, 3))
    words = encode_words(h)
    words[Word.LAYER] = 1 << 32  # the same low 32 bits as 0: only the range check sees it
    with pytest.raises(ProtocolError, match="LAYER=4294967296, expected a value that fits"):
        decode_header(words)
    with pytest.raises(ProtocolError, match=r"EXPERT_COUNTS\[0\]=2147483648 does not fit"):
        encode_words(Header(MessageKind.DISPATCH, 0, 0, 0, 1, 0, 0, seq=1, expert_counts=(2**31,)))
    with pytest.raises(ProtocolError, match="header word SEQ=2147483648 does not fit in int32"):
        encode_fixed_words(Header(MessageKind.DISPATCH, 0, 0, 0, 1, 0, 0, seq=2**31))


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
