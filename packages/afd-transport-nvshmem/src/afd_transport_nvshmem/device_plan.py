# Triton kernels take untyped compile-time arguments:
# mypy: disable-error-code="no-untyped-def,untyped-decorator"
""":func:`afd_protocol.plan_on_device` as three Triton launches instead of ~15-35 torch ops.

A counting sort over blocks, the same numbers bit for bit (the torch function is the
reference the tests compare against):

1. ``_count_kernel``, one program per block of ``FLATS`` partials (and of ``TOKENS``
   tokens): each partial's wire key (``wire_table[clamp(id)]``), the block's histogram of
   keys, its smallest and largest raw id, and (``per_rank``) its tokens' hits per FFN rank.
2. ``_scan_kernel``, one program: the exclusive prefix over blocks of every key's and every
   rank's count (each block's base), the expert counts, the segment offsets
   (``totals[rank_wire_offsets]``), the id bounds and (``per_rank``) the token-row offsets.
3. ``_place_kernel``, one program per block: each partial's wire position (its key's start,
   plus its block's base, plus the equal keys before it in its block: a stable sort), which
   gives ``order``, ``row_token`` and ``wire_position`` at once; and (``per_rank``) each
   token's row on each FFN rank it sends to, and the row counted across every rank's reply.

Why: inside a CUDA graph each torch op is a node, and past some tens of nodes a graph's
launch costs the host tens of microseconds (``docs/benchmarks.md``); three kernels also take
less device time than a chain of small ones. Scratch (per-block counts and bases) is
allocated per call from the caching allocator, so the function can be captured.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from afd_protocol import (
    DevicePlan,
    SharedPlacement,
    Topology,
    WireFormat,
    constant_index,
    shared_token_split,
    wire_table,
)

FLATS = 128
"""Partials per program: the in-block rank compares every pair (``[FLATS, FLATS]``)."""
TOKENS = 64
"""Tokens per program for the ``per_rank`` hits."""
CHUNK = 32
"""Blocks the scan reads per step."""


@triton.jit
def _keys_of(ids, wire_of, flat, live, num_experts):
    raw = tl.load(ids + flat, mask=live, other=0).to(tl.int64)
    clamped = tl.minimum(tl.maximum(raw, 0), num_experts - 1)
    key = tl.load(wire_of + clamped, mask=live, other=0)
    return raw, key


@triton.jit
def _hits_of(
    ids,
    owner_of,
    token,
    tlive,
    num_experts,
    num_ffn,
    TOPK: tl.constexpr,
    TOKENS: tl.constexpr,
    RANKS: tl.constexpr,
):
    """int32 ``[TOKENS, RANKS]``: whether each token has a choice on each FFN rank."""
    ranks = tl.arange(0, RANKS)
    hits = tl.zeros([TOKENS, RANKS], dtype=tl.int32)
    for j in tl.static_range(TOPK):
        raw = tl.load(ids + token * TOPK + j, mask=tlive, other=0).to(tl.int64)
        clamped = tl.minimum(tl.maximum(raw, 0), num_experts - 1)
        owner = tl.load(owner_of + clamped, mask=tlive, other=-1)
        hits = tl.maximum(hits, (owner[:, None] == ranks[None, :]).to(tl.int32))
    live = tlive[:, None] & (ranks < num_ffn)[None, :]
    return tl.where(live, hits, 0)


# The sizes are masks and loop bounds only: not specialised on (divisibility by 16, == 1),
# so one compiled kernel serves every token count (each new specialisation is a JIT compile
# of ~0.5 s inside a timed step otherwise).
_SIZES = ["num_flat", "num_tokens", "num_experts", "num_ffn"]


@triton.jit(do_not_specialize=_SIZES)
def _count_kernel(
    ids,
    wire_of,
    owner_of,
    num_flat,
    num_tokens,
    num_experts,
    num_ffn,
    block_keys,
    block_hits,
    block_min,
    block_max,
    TOPK: tl.constexpr,
    FLATS: tl.constexpr,
    TOKENS: tl.constexpr,
    KEYS: tl.constexpr,
    RANKS: tl.constexpr,
    PER_RANK: tl.constexpr,
):
    b = tl.program_id(0)
    flat = b * FLATS + tl.arange(0, FLATS)
    live = flat < num_flat
    raw, key = _keys_of(ids, wire_of, flat, live, num_experts)
    counts = tl.histogram(key.to(tl.int32), KEYS, mask=live)
    tl.store(block_keys + b * KEYS + tl.arange(0, KEYS), counts)
    tl.store(block_min + b, tl.min(tl.where(live, raw, 9223372036854775807)))
    tl.store(block_max + b, tl.max(tl.where(live, raw, -9223372036854775807)))
    if PER_RANK:
        token = b * TOKENS + tl.arange(0, TOKENS)
        tlive = token < num_tokens
        hits = _hits_of(ids, owner_of, token, tlive, num_experts, num_ffn, TOPK, TOKENS, RANKS)
        tl.store(block_hits + b * RANKS + tl.arange(0, RANKS), tl.sum(hits, axis=0))


@triton.jit(do_not_specialize=["num_blocks", *_SIZES])
def _scan_kernel(
    block_keys,
    block_hits,
    block_min,
    block_max,
    num_blocks,
    num_flat,
    num_experts,
    num_ffn,
    rank_wire_offsets,
    key_base,
    rank_base,
    expert_counts,
    key_start,
    segment_offsets,
    expert_bounds,
    token_row_offsets,
    KEYS: tl.constexpr,
    RANKS: tl.constexpr,
    CHUNK: tl.constexpr,
    PER_RANK: tl.constexpr,
):
    keys = tl.arange(0, KEYS)
    ranks = tl.arange(0, RANKS)
    key_total = tl.zeros([KEYS], dtype=tl.int64)
    rank_total = tl.zeros([RANKS], dtype=tl.int64)
    low = tl.full([CHUNK], 9223372036854775807, dtype=tl.int64)
    high = tl.full([CHUNK], -9223372036854775807, dtype=tl.int64)
    start = 0
    while start < num_blocks:  # (a runtime range() does not run in the interpreter)
        rows = start + tl.arange(0, CHUNK)
        live = rows < num_blocks
        counts = tl.load(
            block_keys + rows[:, None] * KEYS + keys[None, :], mask=live[:, None], other=0
        ).to(tl.int64)
        before = tl.cumsum(counts, axis=0) - counts + key_total[None, :]
        tl.store(key_base + rows[:, None] * KEYS + keys[None, :], before, mask=live[:, None])
        key_total += tl.sum(counts, axis=0)
        low = tl.minimum(low, tl.load(block_min + rows, mask=live, other=9223372036854775807))
        high = tl.maximum(high, tl.load(block_max + rows, mask=live, other=-9223372036854775807))
        if PER_RANK:
            hits = tl.load(
                block_hits + rows[:, None] * RANKS + ranks[None, :], mask=live[:, None], other=0
            ).to(tl.int64)
            rank_before = tl.cumsum(hits, axis=0) - hits + rank_total[None, :]
            tl.store(
                rank_base + rows[:, None] * RANKS + ranks[None, :], rank_before, mask=live[:, None]
            )
            rank_total += tl.sum(hits, axis=0)
        start += CHUNK
    tl.store(expert_counts + keys, key_total, mask=keys < num_experts)
    tl.store(key_start + keys, tl.cumsum(key_total, axis=0) - key_total)
    # segment_offsets[d] = the rows of every key before rank d's first (a sum, no gather).
    edges = tl.arange(0, RANKS)  # RANKS > num_ffn: every offset 0 .. num_ffn
    first_key = tl.load(rank_wire_offsets + edges, mask=edges <= num_ffn, other=0)
    below = keys[None, :] < first_key[:, None]
    tl.store(
        segment_offsets + edges,
        tl.sum(tl.where(below, key_total[None, :], 0), axis=1),
        mask=edges <= num_ffn,
    )
    some = num_flat > 0
    tl.store(expert_bounds, tl.where(some, tl.min(low), 0))
    tl.store(expert_bounds + 1, tl.where(some, tl.max(high), 0))
    if PER_RANK:
        earlier = ranks[None, :] < edges[:, None]
        tl.store(
            token_row_offsets + edges,
            tl.sum(tl.where(earlier, rank_total[None, :], 0), axis=1),
            mask=edges <= num_ffn,
        )


@triton.jit(do_not_specialize=_SIZES)
def _place_kernel(
    ids,
    wire_of,
    owner_of,
    num_flat,
    num_tokens,
    num_experts,
    num_ffn,
    key_base,
    rank_base,
    key_start,
    token_row_offsets,
    order,
    row_token,
    wire_position,
    token_rows,
    token_row_positions,
    TOPK: tl.constexpr,
    FLATS: tl.constexpr,
    TOKENS: tl.constexpr,
    KEYS: tl.constexpr,
    RANKS: tl.constexpr,
    ORDER: tl.constexpr,
    PER_RANK: tl.constexpr,
):
    b = tl.program_id(0)
    if ORDER:
        index = tl.arange(0, FLATS)
        flat = b * FLATS + index
        live = flat < num_flat
        _, key = _keys_of(ids, wire_of, flat, live, num_experts)
        # Equal keys earlier in this block: the stable part of the sort.
        same = (key[:, None] == key[None, :]) & (index[None, :] < index[:, None]) & live[None, :]
        rank_in_block = tl.sum(same.to(tl.int64), axis=1)
        base = tl.load(key_base + b * KEYS + key, mask=live, other=0)
        start = tl.load(key_start + key, mask=live, other=0)
        position = start + base + rank_in_block
        tl.store(order + position, flat.to(tl.int64), mask=live)
        tl.store(row_token + position, (flat // TOPK).to(tl.int64), mask=live)
        tl.store(wire_position + flat, position, mask=live)
    if PER_RANK:
        ranks = tl.arange(0, RANKS)
        token = b * TOKENS + tl.arange(0, TOKENS)
        tlive = token < num_tokens
        hits = _hits_of(ids, owner_of, token, tlive, num_experts, num_ffn, TOPK, TOKENS, RANKS)
        base = tl.load(rank_base + b * RANKS + ranks)
        rows = base[None, :] + (tl.cumsum(hits, axis=0) - hits).to(tl.int64)
        offsets = tl.load(token_row_offsets + ranks, mask=ranks < num_ffn, other=0)
        sent = hits > 0
        inside = tlive[:, None] & (ranks < num_ffn)[None, :]
        at = token[:, None] * num_ffn + ranks[None, :]
        tl.store(token_rows + at, tl.where(sent, rows, -1), mask=inside)
        tl.store(token_row_positions + at, tl.where(sent, rows + offsets[None, :], -1), mask=inside)


@functools.lru_cache(maxsize=64)
def _rank_tables(topology: Topology, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    placement = topology.expert_placement
    owner = constant_index(tuple(placement.owner), device)
    offsets = constant_index(tuple(placement.rank_wire_offsets), device)
    return owner, offsets


def triton_plan_on_device(
    topk_ids: torch.Tensor,
    topology: Topology,
    shared_placement: SharedPlacement,
    wire_format: WireFormat = WireFormat.PER_CHOICE,
    per_partial_order: bool = True,
) -> DevicePlan:
    """:func:`afd_protocol.plan_on_device` in three Triton launches on the current stream,
    equal to it in every field (``wire_position`` and ``token_row_positions`` included,
    computed here rather than on first use).

    ``topk_ids``: integer ``[T, k]`` on a CUDA device (or the CPU under
    ``TRITON_INTERPRET=1``), validated by the caller; ids out of range are clamped and
    reported through ``expert_bounds`` as the reference does.
    """
    num_tokens, topk = topk_ids.shape
    placement = topology.expert_placement
    num_experts = placement.num_experts
    num_ffn = placement.num_ffn_ranks
    device = topk_ids.device
    ids = topk_ids.contiguous()
    num_flat = num_tokens * topk
    per_rank = WireFormat(wire_format) is WireFormat.PER_RANK
    keys_block = triton.next_power_of_2(max(num_experts, 2))
    ranks_block = triton.next_power_of_2(max(num_ffn + 1, 2))
    blocks = max(triton.cdiv(num_flat, FLATS), triton.cdiv(num_tokens, TOKENS), 1)
    long = torch.int64
    block_keys = torch.empty(blocks, keys_block, dtype=torch.int32, device=device)
    block_hits = torch.empty(blocks, ranks_block, dtype=torch.int32, device=device)
    block_min = torch.empty(blocks, dtype=long, device=device)
    block_max = torch.empty(blocks, dtype=long, device=device)
    key_base = torch.empty(blocks, keys_block, dtype=long, device=device)
    rank_base = torch.empty(blocks, ranks_block, dtype=long, device=device)
    key_start = torch.empty(keys_block, dtype=long, device=device)
    counts = torch.empty(num_experts, dtype=long, device=device)
    segments = torch.empty(num_ffn + 1, dtype=long, device=device)
    bounds = torch.empty(2, dtype=long, device=device)
    row_offsets = torch.empty(num_ffn + 1, dtype=long, device=device)
    owner, rank_offsets = _rank_tables(topology, device)
    wire_of = wire_table(placement, device)
    shape = {"TOPK": topk, "FLATS": FLATS, "TOKENS": TOKENS, "KEYS": keys_block}
    _count_kernel[(blocks,)](
        ids, wire_of, owner, num_flat, num_tokens, num_experts, num_ffn,
        block_keys, block_hits, block_min, block_max,
        RANKS=ranks_block, PER_RANK=per_rank, **shape,
    )  # fmt: skip
    _scan_kernel[(1,)](
        block_keys, block_hits, block_min, block_max, blocks, num_flat, num_experts, num_ffn,
        rank_offsets, key_base, rank_base, counts, key_start, segments, bounds, row_offsets,
        KEYS=keys_block, RANKS=ranks_block, CHUNK=CHUNK, PER_RANK=per_rank,
    )  # fmt: skip
    flat_count = num_flat if per_partial_order else 0
    order = torch.empty(flat_count, dtype=long, device=device)
    row_token = torch.empty(flat_count, dtype=long, device=device)
    wire_position = torch.empty(flat_count, dtype=long, device=device)
    token_rows = torch.empty(num_tokens, num_ffn, dtype=long, device=device)
    token_row_positions = torch.empty(num_tokens * num_ffn, dtype=long, device=device)
    if per_partial_order or per_rank:
        _place_kernel[(blocks,)](
            ids, wire_of, owner, num_flat, num_tokens, num_experts, num_ffn,
            key_base, rank_base, key_start, row_offsets,
            order, row_token, wire_position, token_rows, token_row_positions,
            RANKS=ranks_block, ORDER=per_partial_order, PER_RANK=per_rank, **shape,
        )  # fmt: skip
    plan = DevicePlan(
        num_tokens=num_tokens,
        topk=topk,
        shared_placement=shared_placement,
        order=order,
        row_token=row_token,
        expert_counts=counts,
        segment_offsets=segments,
        expert_bounds=bounds,
        shared_tokens=shared_token_split(num_tokens, topology, shared_placement, device),
        token_rows=token_rows if per_rank else None,
        token_row_offsets=row_offsets if per_rank else None,
    )
    # The reference computes these two on first use; here the kernels already did.
    plan.__dict__["wire_position"] = wire_position
    if per_rank:
        plan.__dict__["token_row_positions"] = token_row_positions
    return plan
