"""The slot header: int32 words that carry every piece of metadata in band.

The receiver knows nothing about a message in advance; everything it needs (which
layer and stage, how many tokens and rows, how rows are grouped by local expert, and
which request a reply answers) comes in the header::

    word  0  MAGIC         0x41464447 ("AFDG" read as a big-endian int32)
    word  1  VERSION       PROTOCOL_VERSION
    word  2  KIND          1 = dispatch (attention -> FFN), 2 = reply (FFN -> attention)
    word  3  SRC_RANK      sender's role rank (equals the region it writes)
    word  4  LAYER         model layer index
    word  5  STAGE         micro-batch stage index
    word  6  NUM_TOKENS    tokens in the sender's batch
    word  7  ROUTED_ROWS   routed rows in this slot: the sum of the expert counts, or with
                           the rows-per-token flag one row per token (see below)
    word  8  SHARED_ROWS   shared-expert rows in this slot
    word  9  FLAGS         bit 0 shutdown, bit 1 abort, bit 2 rows per token
    word 10  SEQ           sender's sequence number for this message, in [1, 2**31)
    word 11  ANSWER_SEQ    on replies, the dispatch SEQ it answers; 0 on dispatch
    word 12  NUM_COUNTS    number of per-local-expert count words that follow
    word 13  CHECKSUM      CRC-32 of the whole header with this word zero (see below)
    word 14+ EXPERT_COUNTS rows per local expert, ascending local id

The sequence numbers make arrival detection ABA-safe (a flag word holds the sender's SEQ,
and consecutive messages into one slot never carry the same one) and let the attention
side reject a stale or misdirected reply. A sender counts 1, 2, ..., 2**31 - 1 and then
wraps to 1 (:func:`next_seq`): arrival is "differs from the value last seen", never
"greater than", so the wrap is invisible to receivers, and a value comes back only after
two billion messages, long after any reply it could be confused with was consumed.

The checksum is the CRC-32 of IEEE 802.3 (``zlib.crc32``) over the header's words as
little-endian int32 bytes, with the CHECKSUM word itself zero. Its Hamming distance is at
least 3 for any message up to 91,607 bits (a header has at most 14 + 65,536 words, but
DeepSeek-sized ones under 300 words, 9,600 bits): every corruption of one or two bits, and
every burst of up to 32 bits, is caught. A CRC is linear over GF(2), so a device can compute
it without a serial loop (:func:`crc_columns`): XOR together one precomputed column per set
bit, and the CRC of the all-zero header of that length.

Rows come in one of two granularities, which the rows-per-token flag states (and the
receiver's geometry requires, :attr:`HeaderLimits.rows_per_token`). Without it there is one
row per (token, expert) partial, grouped by local expert: the counts sum to ROUTED_ROWS.
With it (the ``per_rank`` wire format) there is one row per token that has at least one of
its experts on the FFN rank, with that token's local expert ids and weights beside it: then
ROUTED_ROWS is at most NUM_TOKENS, every count at most ROUTED_ROWS, and the counts -- the
partials the FFN rank computes -- sum to between ROUTED_ROWS and ``ROUTED_ROWS * topk``.

Beyond the checksum, :func:`decode_header` checks every invariant a header of this layout
must satisfy -- ranges from the receiver's :class:`HeaderLimits`, the counts against the
rows as above, no expert count and no shared count above the token count, at most
``num_tokens * topk`` partials, empty shutdown messages -- so a buggy sender that computes a
valid checksum over wrong numbers is still refused, naming the field.
"""

from __future__ import annotations

import enum
import functools
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from afd_protocol.core.errors import ProtocolError

MAGIC = 0x41464447  # b"AFDG"
PROTOCOL_VERSION = 3
"""Version 3: the rows-per-token flag (the ``per_rank`` wire format). Version 2 brought the
CRC-32 checksum and the invariant checks; version 1 had a weighted-sum checksum."""
MAX_COUNT_WORDS = 1 << 16
INT32_MIN = -(1 << 31)
INT32_MAX = (1 << 31) - 1
SEQ_LIMIT = 1 << 31
"""Sequence numbers are in ``[1, SEQ_LIMIT)`` (positive int32); they wrap to 1."""

FLAG_SHUTDOWN = 1 << 0
FLAG_ABORT = 1 << 1
FLAG_ROWS_PER_TOKEN = 1 << 2
"""The routed rows are one per token (``per_rank`` wire format), not one per partial."""
KNOWN_FLAGS = FLAG_SHUTDOWN | FLAG_ABORT | FLAG_ROWS_PER_TOKEN


def next_seq(seq: int) -> int:
    """The sequence number after ``seq``: ``seq + 1``, wrapping from ``2**31 - 1`` to 1.

    0 is never used: a fresh window's flags are 0, so a first message must differ from it.
    """
    return seq + 1 if 0 <= seq < SEQ_LIMIT - 1 else 1


class Word(enum.IntEnum):
    """Index of each fixed header word."""

    MAGIC = 0
    VERSION = 1
    KIND = 2
    SRC_RANK = 3
    LAYER = 4
    STAGE = 5
    NUM_TOKENS = 6
    ROUTED_ROWS = 7
    SHARED_ROWS = 8
    FLAGS = 9
    SEQ = 10
    ANSWER_SEQ = 11
    NUM_COUNTS = 12
    CHECKSUM = 13


HEADER_FIXED_WORDS = len(Word)


class MessageKind(enum.IntEnum):
    DISPATCH = 1
    REPLY = 2


@dataclass(frozen=True)
class Header:
    """Decoded header of one slot."""

    kind: MessageKind
    src_rank: int
    layer: int
    stage: int
    num_tokens: int
    routed_rows: int
    shared_rows: int
    seq: int
    answer_seq: int = 0
    flags: int = 0
    expert_counts: tuple[int, ...] = field(default=())

    @property
    def shutdown(self) -> bool:
        return bool(self.flags & FLAG_SHUTDOWN)

    @property
    def abort(self) -> bool:
        return bool(self.flags & FLAG_ABORT)

    @property
    def rows_per_token(self) -> bool:
        return bool(self.flags & FLAG_ROWS_PER_TOKEN)

    @property
    def num_partials(self) -> int:
        """(token, expert) partials this message is about: the sum of the expert counts."""
        return sum(self.expert_counts)

    @property
    def num_words(self) -> int:
        return HEADER_FIXED_WORDS + len(self.expert_counts)


@dataclass(frozen=True)
class HeaderLimits:
    """What a receiver knows in advance and checks every decoded header against.

    ``None`` leaves a bound unchecked (for example ``num_layers`` on a generic decoder).
    """

    token_cap: int
    routed_cap: int
    shared_cap: int
    num_counts: int | None = None
    num_src_ranks: int | None = None
    num_layers: int | None = None
    num_stages: int | None = None
    topk: int | None = None
    """Experts per token: a message is about at most ``num_tokens * topk`` partials."""
    rows_per_token: bool | None = None
    """Whether this receiver's geometry sends one row per token (the rows-per-token flag
    must then be set on every message with rows) or one per partial (clear)."""


def checksum(words: Sequence[int]) -> int:
    """CRC-32 (unsigned) of header words, the CHECKSUM word taken as zero.

    ``words`` are int32 values (Python ints in int32 range).
    """
    zeroed = list(words)
    zeroed[Word.CHECKSUM] = 0
    return zlib.crc32(struct.pack(f"<{len(zeroed)}i", *zeroed))


@functools.lru_cache(maxsize=64)
def crc_columns(num_words: int) -> tuple[int, tuple[int, ...]]:
    """The CRC-32 of ``num_words`` header words as an XOR of precomputed columns.

    Returns ``(base, columns)``: ``base`` is the CRC of ``num_words`` zero words and
    ``columns[32 * i + j]`` what bit ``j`` of word ``i`` flips in it, so that
    ``checksum(words) == base ^ XOR(columns[32 * i + j] for every set bit)`` (the CHECKSUM
    word, zero when checksummed, gets zero columns). Both are unsigned. This is how a
    device computes the checksum in parallel; built once per header length.
    """
    zeros = [0] * num_words
    base = checksum(zeros)
    columns = []
    for i in range(num_words):
        for j in range(32):
            if i == Word.CHECKSUM:
                columns.append(0)
                continue
            words = list(zeros)
            words[i] = _to_int32(1 << j)
            columns.append(checksum(words) ^ base)
    return base, tuple(columns)


def _to_int32(value: int) -> int:
    """``value`` modulo ``2**32`` as a signed int32 (how an unsigned word is stored)."""
    value &= 0xFFFFFFFF
    return value - (1 << 32) if value >= (1 << 31) else value


def encode_fixed_words(header: Header) -> list[int]:
    """The header's fixed words (everything before the counts), the CHECKSUM word 0: what
    a device that appends the counts and computes the checksum itself needs (a packed
    dispatch's pack kernel), without the counts and the CRC on the host."""
    words = [
        MAGIC,
        PROTOCOL_VERSION,
        int(header.kind),
        header.src_rank,
        header.layer,
        header.stage,
        header.num_tokens,
        header.routed_rows,
        header.shared_rows,
        header.flags,
        header.seq,
        header.answer_seq,
        len(header.expert_counts),
        0,
    ]
    outside = _first_outside_int32(words)
    if outside is not None:
        raise ProtocolError(
            f"header word {_word_name(outside[0])}={outside[1]} does not fit in int32"
        )
    return words


def encode_words(header: Header) -> list[int]:
    """Header -> int32 word values (as Python ints in int32 range)."""
    words = encode_fixed_words(header) + list(header.expert_counts)
    outside = _first_outside_int32(words[HEADER_FIXED_WORDS:])
    if outside is not None:
        index = HEADER_FIXED_WORDS + outside[0]
        raise ProtocolError(f"header word {_word_name(index)}={outside[1]} does not fit in int32")
    words[Word.CHECKSUM] = _to_int32(checksum(words))
    return words


def encode_header(header: Header) -> torch.Tensor:
    """Header -> a CPU int32 tensor ready to copy into a slot's header field."""
    return torch.tensor(encode_words(header), dtype=torch.int32)


def _first_outside_int32(values: Sequence[int]) -> tuple[int, int] | None:
    """``(index, value)`` of the first value outside int32, None if all fit.

    ``min``/``max`` first: on the hot path every value fits, and they run in C.
    """
    if not values or (min(values) >= INT32_MIN and max(values) <= INT32_MAX):
        return None
    return next((i, v) for i, v in enumerate(values) if not INT32_MIN <= v <= INT32_MAX)


def _word_name(i: int) -> str:
    return Word(i).name if i < HEADER_FIXED_WORDS else f"EXPERT_COUNTS[{i - HEADER_FIXED_WORDS}]"


def _bad(name: str, value: int, expected: str) -> ProtocolError:
    return ProtocolError(f"bad slot header: {name}={value}, expected {expected}")


def _check_rows(
    flags: int,
    num_tokens: int,
    routed_rows: int,
    counts: tuple[int, ...],
    lim: HeaderLimits | None,
) -> None:
    """The routed rows against the counts, at the granularity the flag states."""
    per_token = bool(flags & FLAG_ROWS_PER_TOKEN)
    partials = sum(counts)
    expected = lim.rows_per_token if lim is not None else None
    # A shutdown carries no rows, so its granularity is moot.
    if expected is not None and per_token != expected and not flags & FLAG_SHUTDOWN:
        want = "set" if expected else "clear"
        layout = "per_rank" if expected else "per_choice"
        raise _bad(
            "FLAGS",
            flags,
            f"the rows-per-token bit {FLAG_ROWS_PER_TOKEN:#b} {want} (this geometry's wire "
            f"format is {layout})",
        )
    if not per_token:
        if partials != routed_rows:
            raise _bad("ROUTED_ROWS", routed_rows, f"the sum of EXPERT_COUNTS ({partials})")
    elif routed_rows > num_tokens:
        raise _bad(
            "ROUTED_ROWS", routed_rows, f"at most NUM_TOKENS={num_tokens} (one row per token)"
        )
    elif counts and max(counts) > routed_rows:
        i, c = next((i, c) for i, c in enumerate(counts) if c > routed_rows)
        raise _bad(f"EXPERT_COUNTS[{i}]", c, f"at most ROUTED_ROWS={routed_rows} (one per row)")
    elif partials < routed_rows:
        raise _bad(
            "ROUTED_ROWS",
            routed_rows,
            f"at most the sum of EXPERT_COUNTS ({partials}): every row has an expert here",
        )
    topk = lim.topk if lim is not None else None
    if topk is None:
        return
    if not per_token and routed_rows > num_tokens * topk:
        raise _bad(
            "ROUTED_ROWS",
            routed_rows,
            f"at most NUM_TOKENS * topk = {num_tokens} * {topk} (one row per token and choice)",
        )
    if per_token and partials > routed_rows * topk:
        # Rows are at most NUM_TOKENS, so this also bounds the partials by NUM_TOKENS * topk.
        raise _bad(
            "EXPERT_COUNTS",
            partials,
            f"a sum of at most ROUTED_ROWS * topk = {routed_rows} * {topk} (each row's token "
            f"chose topk experts)",
        )


def decode_header(
    words: Sequence[int] | torch.Tensor, limits: HeaderLimits | None = None
) -> Header:
    """Validate and decode header words; raise :class:`ProtocolError` naming the field.

    ``words`` may be longer than the header (a whole header field); it may not be shorter.
    """
    if isinstance(words, torch.Tensor):
        if words.dtype != torch.int32 or words.dim() != 1:
            raise ProtocolError(
                f"header must be a 1-D int32 tensor, got {words.dtype} of shape "
                f"{tuple(words.shape)}"
            )
        values: list[int] = words.tolist()
    else:
        values = [int(v) for v in words]
        outside = _first_outside_int32(values)
        if outside is not None:
            raise _bad(_word_name(outside[0]), outside[1], "a value that fits in int32")
    if len(values) < HEADER_FIXED_WORDS:
        raise ProtocolError(
            f"truncated slot header: {len(values)} words, the fixed part alone has "
            f"{HEADER_FIXED_WORDS}"
        )

    def word(w: Word) -> int:
        return values[w]

    if word(Word.MAGIC) != MAGIC:
        raise _bad("MAGIC", word(Word.MAGIC), f"{MAGIC:#x} ('AFDG'); not an afd slot")
    if word(Word.VERSION) != PROTOCOL_VERSION:
        raise _bad(
            "VERSION",
            word(Word.VERSION),
            f"{PROTOCOL_VERSION}; both roles must run the same afd-protocol version",
        )
    kind_value = word(Word.KIND)
    if kind_value not in (k.value for k in MessageKind):
        raise _bad("KIND", kind_value, "1 (dispatch) or 2 (reply)")
    kind = MessageKind(kind_value)

    num_counts = word(Word.NUM_COUNTS)
    expected_counts = limits.num_counts if limits is not None else None
    if not 0 <= num_counts <= MAX_COUNT_WORDS or (
        expected_counts is not None and num_counts != expected_counts
    ):
        want = f"{expected_counts}" if expected_counts is not None else f"0..{MAX_COUNT_WORDS}"
        raise _bad("NUM_COUNTS", num_counts, want)
    if len(values) < HEADER_FIXED_WORDS + num_counts:
        raise ProtocolError(
            f"truncated slot header: {len(values)} words, NUM_COUNTS={num_counts} needs "
            f"{HEADER_FIXED_WORDS + num_counts}"
        )
    values = values[: HEADER_FIXED_WORDS + num_counts]

    def in_range(w: Word, low: int, high: int | None) -> int:
        v = word(w)
        if v < low or (high is not None and v >= high):
            span = f"[{low}, {high})" if high is not None else f">= {low}"
            raise _bad(w.name, v, span)
        return v

    lim = limits
    src_rank = in_range(Word.SRC_RANK, 0, lim.num_src_ranks if lim else None)
    layer = in_range(Word.LAYER, 0, lim.num_layers if lim else None)
    stage = in_range(Word.STAGE, 0, lim.num_stages if lim else None)
    num_tokens = in_range(Word.NUM_TOKENS, 0, lim.token_cap + 1 if lim else None)
    routed_rows = in_range(Word.ROUTED_ROWS, 0, lim.routed_cap + 1 if lim else None)
    shared_rows = in_range(Word.SHARED_ROWS, 0, lim.shared_cap + 1 if lim else None)
    flags = word(Word.FLAGS)
    if flags & ~KNOWN_FLAGS:
        raise _bad("FLAGS", flags, f"only bits {KNOWN_FLAGS:#b} (shutdown, abort, rows per token)")
    seq = in_range(Word.SEQ, 1, SEQ_LIMIT)
    answer_seq = word(Word.ANSWER_SEQ)
    if kind is MessageKind.DISPATCH and answer_seq != 0:
        raise _bad("ANSWER_SEQ", answer_seq, "0 on a dispatch")
    if kind is MessageKind.REPLY and answer_seq < 1:
        raise _bad("ANSWER_SEQ", answer_seq, ">= 1 on a reply")
    counts = tuple(values[HEADER_FIXED_WORDS:])
    if counts and (min(counts) < 0 or max(counts) > num_tokens):
        i, c = next((i, c) for i, c in enumerate(counts) if not 0 <= c <= num_tokens)
        raise _bad(
            f"EXPERT_COUNTS[{i}]",
            c,
            f"[0, NUM_TOKENS={num_tokens}] (a token is routed to an expert at most once)",
        )
    _check_rows(flags, num_tokens, routed_rows, counts, lim)
    if shared_rows > num_tokens:
        raise _bad("SHARED_ROWS", shared_rows, f"at most NUM_TOKENS={num_tokens}")
    # Rows are bounded by tokens above, so an empty shutdown is one with no tokens.
    if flags & FLAG_SHUTDOWN and num_tokens:
        raise _bad("NUM_TOKENS", num_tokens, "0 on a shutdown message, with no rows")
    stored = word(Word.CHECKSUM) & 0xFFFFFFFF
    computed = checksum(values)
    if stored != computed:
        raise _bad(
            "CHECKSUM", stored, f"{computed:#x}; the header was corrupted or written concurrently"
        )
    return Header(
        kind=kind,
        src_rank=src_rank,
        layer=layer,
        stage=stage,
        num_tokens=num_tokens,
        routed_rows=routed_rows,
        shared_rows=shared_rows,
        seq=seq,
        answer_seq=answer_seq,
        flags=flags,
        expert_counts=counts,
    )
