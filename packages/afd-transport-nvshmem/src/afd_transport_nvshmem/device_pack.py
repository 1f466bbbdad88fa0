# Triton kernels take untyped compile-time arguments:
# mypy: disable-error-code="no-untyped-def,untyped-decorator"
"""The device pack (:mod:`afd_transport_nvshmem.kernel_specs`) as two Triton launches.

``_pack_rows_kernel``: one program per tile of wire positions and columns finds each row's
FFN rank from the segment bounds (on the device), and copies the source token's hidden
state straight into that rank's window -- a gather-and-write over NVLink for every
destination in one launch -- plus the row's source token (first column tile only).

``_pack_token_rows_kernel`` (the ``per_rank`` format): one program per tile of tokens
and columns loads the tokens' hidden states once and writes them into every FFN rank
where the plan placed them (``token_rows[t, d] >= 0``), and, from the first column tile,
each row's source token, local expert ids (-1 for a choice on another rank) and fp32
weights (0 there).

``_pack_headers_kernel``: one program per FFN rank completes its header: ROUTED_ROWS from
the segment bounds, the rank's expert counts, and the CRC-32 checksum of
:func:`afd_protocol.core.header.checksum`, computed in parallel from its linear form: the
XOR of one precomputed column per set bit of every word, then the CRC of the all-zero
header (:func:`afd_protocol.core.header.crc_columns`). ``_crc_of`` is that XOR for one
tile of words.

Destinations are passed as tables of raw addresses (peer windows are separate mappings
with no common base), built once per set of views and cached. The rows are read from
``hidden``, or (``hidden_address``: a graph-replayed dispatch) from the address held in a
device word, where the caller left them, so the graph does not copy them first.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from afd_protocol import HEADER_FIXED_WORDS, Word, constant_index
from afd_transport_nvshmem.kernel_specs import PackInputs, TokenRowInputs

ROWS = 4
BLOCK_H = 1024
COUNT_BLOCK = 128


@triton.jit
def _rows_source(hidden, hidden_at, INDIRECT: tl.constexpr):
    """Where the rows are read: ``hidden``, or (``INDIRECT``) the address in ``hidden_at``'s
    first word, rows laid out as ``hidden``'s (a graph-replayed dispatch's caller's rows)."""
    if INDIRECT:
        source = tl.load(hidden_at).to(hidden.dtype)
    else:
        source = hidden
    return source


@triton.jit
def _pack_rows_kernel(
    hidden,
    hidden_at,
    row_token,
    segment_offsets,
    rows_at,
    index_at,
    total,
    hidden_size,
    num_ffn,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
    FFN_BLOCK: tl.constexpr,
    INDIRECT: tl.constexpr,
):
    source = _rows_source(hidden, hidden_at, INDIRECT)
    wire = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    live = wire < total
    ranks = tl.arange(0, FFN_BLOCK)
    bounds = tl.load(segment_offsets + 1 + ranks, mask=ranks < num_ffn - 1, other=1 << 62)
    dest = tl.sum((bounds[None, :] <= wire[:, None]).to(tl.int32), axis=1)
    row = wire - tl.load(segment_offsets + dest, mask=live, other=0)
    token = tl.load(row_token + wire, mask=live, other=0)
    columns = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    take = live[:, None] & (columns < hidden_size)[None, :]
    values = tl.load(source + token[:, None] * hidden_size + columns[None, :], mask=take)
    base = tl.load(rows_at + dest, mask=live, other=0).to(tl.pointer_type(values.dtype))
    tl.store(base[:, None] + (row * hidden_size)[:, None] + columns[None, :], values, mask=take)
    if tl.program_id(1) == 0:
        index_base = tl.load(index_at + dest, mask=live, other=0).to(tl.pointer_type(tl.int32))
        tl.store(index_base + row, token.to(tl.int32), mask=live)


@triton.jit
def _pack_token_rows_kernel(
    hidden,
    hidden_at,
    token_rows,
    topk_ids,
    topk_weights,
    expert_owner,
    expert_local_id,
    rows_at,
    index_at,
    ids_at,
    weights_at,
    num_tokens,
    hidden_size,
    num_experts,
    NUM_FFN: tl.constexpr,
    TOPK: tl.constexpr,
    TOPK_BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
    INDIRECT: tl.constexpr,
):
    source = _rows_source(hidden, hidden_at, INDIRECT)
    token = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    live = token < num_tokens
    columns = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    take = live[:, None] & (columns < hidden_size)[None, :]
    values = tl.load(source + token[:, None] * hidden_size + columns[None, :], mask=take)
    choices = tl.arange(0, TOPK_BLOCK)
    in_k = live[:, None] & (choices < TOPK)[None, :]
    first_tile = tl.program_id(1) == 0
    # A few words per token, loaded by every column tile (Triton keeps no value defined
    # under a runtime branch); only the first tile stores them.
    chosen = tl.load(topk_ids + token[:, None] * TOPK + choices[None, :], mask=in_k, other=0)
    chosen = tl.minimum(tl.maximum(chosen.to(tl.int64), 0), num_experts - 1)
    owner = tl.load(expert_owner + chosen, mask=in_k, other=-1)
    local = tl.load(expert_local_id + chosen, mask=in_k, other=-1)
    weight = tl.load(
        topk_weights + token[:, None] * TOPK + choices[None, :], mask=in_k, other=0.0
    ).to(tl.float32)
    for dest in tl.static_range(NUM_FFN):
        row = tl.load(token_rows + token * NUM_FFN + dest, mask=live, other=-1)
        sent = row >= 0
        base = tl.load(rows_at + dest).to(tl.pointer_type(values.dtype))
        tl.store(
            base + (row * hidden_size)[:, None] + columns[None, :],
            values,
            mask=take & sent[:, None],
        )
        if first_tile:
            index_base = tl.load(index_at + dest).to(tl.pointer_type(tl.int32))
            tl.store(index_base + row, token.to(tl.int32), mask=sent)
            here = owner == dest
            at = (row * TOPK)[:, None] + choices[None, :]
            put = in_k & sent[:, None]
            ids_base = tl.load(ids_at + dest).to(tl.pointer_type(tl.int32))
            tl.store(ids_base + at, tl.where(here, local, -1).to(tl.int32), mask=put)
            weights_base = tl.load(weights_at + dest).to(tl.pointer_type(tl.float32))
            tl.store(weights_base + at, tl.where(here, weight, 0.0), mask=put)


@triton.jit
def _crc_of(words, rows, present, table):
    """XOR of the CRC columns of every set bit of ``words`` (int32, at header rows ``rows``)."""
    bits = tl.arange(0, 32)
    columns = tl.load(table + rows[:, None] * 32 + bits[None, :], mask=present[:, None], other=0)
    set_bit = ((words[:, None] >> bits[None, :]) & 1) != 0
    return tl.xor_sum(tl.xor_sum(tl.where(set_bit, columns, 0), axis=1), axis=0)


@triton.jit
def _pack_headers_kernel(
    fixed_words,
    expert_counts,
    segment_offsets,
    rank_offsets,
    headers_at,
    crc_base,
    crc_columns,
    MAX_WORDS: tl.constexpr,
    FIXED: tl.constexpr,
    FIXED_BLOCK: tl.constexpr,
    ROUTED_WORD: tl.constexpr,
    CHECKSUM_WORD: tl.constexpr,
    COUNTS: tl.constexpr,
):
    dest = tl.program_id(0)
    first = tl.load(rank_offsets + dest)
    num_counts = tl.load(rank_offsets + dest + 1) - first
    routed = tl.load(segment_offsets + dest + 1) - tl.load(segment_offsets + dest)
    header = tl.load(headers_at + dest).to(tl.pointer_type(tl.int32))
    table = crc_columns + dest * MAX_WORDS * 32
    slots = tl.arange(0, FIXED_BLOCK)
    in_fixed = slots < FIXED
    words = tl.load(fixed_words + dest * FIXED + slots, mask=in_fixed, other=0)
    words = tl.where(slots == ROUTED_WORD, routed.to(tl.int32), words)
    words = tl.where(slots == CHECKSUM_WORD, 0, words)
    crc = _crc_of(words, slots, in_fixed, table)
    # Bounded by the longest header (fixed per topology), each rank masking its own count.
    for start in range(0, MAX_WORDS - FIXED, COUNTS):
        index = start + tl.arange(0, COUNTS)
        present = index < num_counts
        counts = tl.load(expert_counts + first + index, mask=present, other=0).to(tl.int32)
        crc ^= _crc_of(counts, FIXED + index, present, table)
        tl.store(header + FIXED + index, counts, mask=present)
    crc ^= tl.load(crc_base + dest)
    words = tl.where(slots == CHECKSUM_WORD, crc, words)
    tl.store(header + slots, words, mask=in_fixed)


def triton_device_pack(inputs: PackInputs) -> None:
    """:data:`~afd_transport_nvshmem.kernel_specs.DevicePack` on a CUDA device, on the current
    stream."""
    plan = inputs.plan
    hidden = inputs.hidden.contiguous()
    device = hidden.device
    # The rows at an address (the caller's own, in a graph-replayed dispatch) or in hidden.
    hidden_at = hidden if inputs.hidden_address is None else inputs.hidden_address
    indirect = hidden_at is not hidden
    num_ffn = len(inputs.headers)
    total = plan.row_token.numel()
    hidden_size = hidden.shape[1]
    if inputs.token_row_inputs is not None:
        if plan.num_tokens:
            _pack_token_rows(inputs, inputs.token_row_inputs, hidden, hidden_at, indirect)
    elif total:
        rows_at = constant_index(tuple(t.data_ptr() for t in inputs.routed_rows), device)
        index_at = constant_index(tuple(t.data_ptr() for t in inputs.route_index), device)
        block = min(BLOCK_H, triton.next_power_of_2(hidden_size))
        _pack_rows_kernel[(triton.cdiv(total, ROWS), triton.cdiv(hidden_size, block))](
            hidden,
            hidden_at,
            plan.row_token,
            plan.segment_offsets,
            rows_at,
            index_at,
            total,
            hidden_size,
            num_ffn,
            ROWS=ROWS,
            BLOCK=block,
            FFN_BLOCK=triton.next_power_of_2(max(1, num_ffn)),
            INDIRECT=indirect,
        )
    _pack_headers_kernel[(num_ffn,)](
        inputs.fixed_words,
        plan.expert_counts,
        inputs.row_offsets,
        constant_index(inputs.rank_wire_offsets, device),
        constant_index(tuple(t.data_ptr() for t in inputs.headers), device),
        inputs.crc_base,
        inputs.crc_columns,
        MAX_WORDS=inputs.crc_columns.shape[1],
        FIXED=HEADER_FIXED_WORDS,
        FIXED_BLOCK=triton.next_power_of_2(HEADER_FIXED_WORDS),
        ROUTED_WORD=int(Word.ROUTED_ROWS),
        CHECKSUM_WORD=int(Word.CHECKSUM),
        COUNTS=COUNT_BLOCK,
    )


def _pack_token_rows(
    inputs: PackInputs,
    extra: TokenRowInputs,
    hidden: torch.Tensor,
    hidden_at: torch.Tensor,
    indirect: bool,
) -> None:
    """The ``per_rank`` rows: ``_pack_token_rows_kernel`` over every token (read from
    ``hidden``, or with ``indirect`` from the address in ``hidden_at``)."""
    plan = inputs.plan
    assert plan.token_rows is not None
    device = hidden.device
    num_tokens, hidden_size = hidden.shape
    topk = extra.topk_ids.shape[1]

    def addresses(tensors: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return constant_index(tuple(t.data_ptr() for t in tensors), device)

    block = min(BLOCK_H, triton.next_power_of_2(hidden_size))
    _pack_token_rows_kernel[(triton.cdiv(num_tokens, ROWS), triton.cdiv(hidden_size, block))](
        hidden,
        hidden_at,
        plan.token_rows.contiguous(),
        extra.topk_ids.contiguous(),
        extra.topk_weights.contiguous(),
        extra.expert_owner,
        extra.expert_local_id,
        addresses(inputs.routed_rows),
        addresses(inputs.route_index),
        addresses(extra.route_ids),
        addresses(extra.route_weights),
        num_tokens,
        hidden_size,
        extra.expert_owner.numel(),
        NUM_FFN=len(inputs.headers),
        TOPK=topk,
        TOPK_BLOCK=triton.next_power_of_2(topk),
        ROWS=ROWS,
        BLOCK=block,
        INDIRECT=indirect,
    )
