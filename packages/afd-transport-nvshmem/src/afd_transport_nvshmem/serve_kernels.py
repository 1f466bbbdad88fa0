# Triton kernels take untyped compile-time arguments:
# mypy: disable-error-code="no-untyped-def,untyped-decorator"
"""The FFN serve step as device kernels: take a ready work item, lay out its rows, reply.

One serve step is five launches that read every per-item value from device memory, so a
CUDA graph holds any number of steps and each replay serves whatever arrives
(:mod:`afd_transport_nvshmem.graphed_ffn` captures them around the caller's expert step):

1. ``_take_kernel`` (one program): polls the flags of every (attention rank, ring) slot of
   this FFN rank's window with acquire loads at system scope until one differs from the
   value last seen (kept on the device), a watched attention rank's abort word is set, the
   host's stop word is set, or its poll budget is spent. Of the slots that changed it takes
   one -- the first attention rank at or after the rotating scan start (so no replica
   starves), and of that rank's slots the lowest sequence number (the earliest dispatch) --
   checks its header against everything :func:`afd_protocol.decode_header` checks plus
   what the window endpoint checks (kind, source, sequence equal to the flag, a served
   layer), and writes the item's values into the *item block* and the per-expert counts
   and the layer into the expert step's inputs. Every outcome is a *record* in page-locked
   host memory (a ring of records; the host reads them in order): the code, the item's
   numbers and a copy of the header, the code written last with a release store.
2. ``_expand_kernel`` (``per_rank`` only; one program per local expert): from the slot's
   ``route_ids``, the position of every (token row, choice) partial grouped by local
   expert in token order (what :class:`afd_protocol.WorkItemPart` computes with a stable
   sort), both ways: the token row of each partial and the partial of each (row, choice),
   -1 where the choice is on another rank. A partial count that disagrees with the header
   marks the item bad (no reply is published).
3. ``_gather_rows_kernel``: the partials' rows, copied from the slot into the expert
   step's static input.
4. The caller's expert step (rows, counts, layer -> outputs), captured between them.
5. ``_reply_rows_kernel``: the outputs into the source attention rank's window (its
   address from a table, by the source rank read on the device); with the reduce on the
   FFN side, each token row's partials weighted in fp32 in choice order, as the
   ``per_rank`` reduce kernel (:mod:`afd_transport_nvshmem.reduce_partials`) does.
6. ``_reply_header_kernel`` (one program): the reply's header (a fresh sequence number
   from the device's counter, the dispatch's sequence number as the answer, its counts,
   the CRC-32 from the precomputed columns) into the source's slot, then the flag with a
   release store at system scope -- after the rows, which an earlier launch on the same
   stream wrote -- then the record's ``DONE`` word.

Steps that find no item (the poll budget spent, a shutdown message consumed, an abort, a
bad header, the host's stop) zero the counts and mark the item invalid: the later kernels
do nothing. A bad header, an abort and the end of every attention rank also set the
*halt* word on the device, so the steps still queued end at once.

Grids are fixed by the capacities: the row kernels loop over the item's rows (a count read
on the device) in a persistent grid, so a small item costs a small amount of work.
"""

from __future__ import annotations

import triton
import triton.language as tl

from afd_transport_nvshmem.device_pack import _crc_of
from afd_transport_nvshmem.device_wait import pause, poll_flags

# Record codes (the ``CODE`` word of a record; 0: not yet written).
CODE_ITEM = 1
CODE_IDLE = 2
CODE_ABORTED = 3
CODE_BAD_HEADER = 4
CODE_SHUTDOWN = 5
CODE_HALTED = 6

# Why a header was refused (a record's ``PROBLEM`` word): DECODE for everything
# afd_protocol.decode_header checks (the host decodes the header copy for the message);
# the rest only the device checks.
PROBLEM_DECODE = 1
PROBLEM_KIND = 2
PROBLEM_SOURCE = 3
PROBLEM_SEQ = 4
PROBLEM_LAYER = 5
PROBLEM_EXPANSION = 6

# Words of a record (page-locked host memory).
R_CODE = 0
R_SLOT = 1
R_SRC = 2
R_RING = 3
R_LAYER = 4
R_STAGE = 5
R_TOKENS = 6
R_ROUTED = 7
R_SEQ = 8
R_PARTIALS = 9
R_PROBLEM = 10
R_FLAG = 11
R_REPLY_SEQ = 12
R_REPLY_ROWS = 13
R_DONE = 14
RECORD_FIXED = 16
"""Words before the header copy."""

# Words of the item block (device).
I_VALID = 0
I_SLOT = 1
I_SRC = 2
I_RING = 3
I_ROUTED = 4
I_PARTIALS = 5
I_REPLY_ROWS = 6
I_REPLY_SEQ = 7
I_RECORD = 8
I_ERROR = 9
I_CODE = 10
ITEM_WORDS = 16

# Words of the device state after the ``last seen`` value of every slot.
S_RR = 0
S_SEQ = 1
S_HALT = 2
S_FINISHED = 3
S_CURSOR = 4
S_FIRST_RANK = 8
"""``finished`` of attention rank ``a`` is word ``S_FIRST_RANK + a`` (after the slots)."""

SEQ_MAX = (1 << 31) - 1

# The same words as compile-time constants for the kernels (which see no plain globals).
_S_FIRST_RANK = tl.constexpr(S_FIRST_RANK)
_S_CURSOR = tl.constexpr(S_CURSOR)
_S_HALT = tl.constexpr(S_HALT)
_S_RR = tl.constexpr(S_RR)
_S_SEQ = tl.constexpr(S_SEQ)
_S_FINISHED = tl.constexpr(S_FINISHED)
_R_DONE = tl.constexpr(R_DONE)


@triton.jit
def _word(words, offs, index):
    """Word ``index`` of the vector ``words`` (as int64)."""
    return tl.sum(tl.where(offs == index, words, 0).to(tl.int64), axis=0)


@triton.jit
def _take_kernel(
    flags,
    aborts,
    window_words,
    state,
    item,
    counts_out,
    layer_out,
    records,
    control,
    served,
    crc_columns,
    crc_base,
    num_slots,
    ring_depth,
    num_attention,
    slots_word,
    slot_words,
    num_layers,
    num_stages,
    token_cap,
    routed_cap,
    shared_cap,
    topk,
    max_polls,
    num_records,
    SLOT_BLOCK: tl.constexpr,
    RANK_BLOCK: tl.constexpr,
    NUM_COUNTS: tl.constexpr,
    COUNT_BLOCK: tl.constexpr,
    FIXED: tl.constexpr,
    FIXED_BLOCK: tl.constexpr,
    RECORD_WORDS: tl.constexpr,
    ROWS_PER_TOKEN: tl.constexpr,
    REDUCE: tl.constexpr,
    CHECK_SERVED: tl.constexpr,
    MAGIC: tl.constexpr,
    VERSION: tl.constexpr,
    KNOWN_FLAGS: tl.constexpr,
    FLAG_SHUTDOWN: tl.constexpr,
    FLAG_ROWS: tl.constexpr,
    PAUSE_NS: tl.constexpr,
):
    slots = tl.arange(0, SLOT_BLOCK)
    in_slots = slots < num_slots
    src_of = slots // ring_depth
    ranks = tl.arange(0, RANK_BLOCK)
    in_ranks = ranks < num_attention
    first_rank = state + SLOT_BLOCK + _S_FIRST_RANK
    finished_slot = tl.load(first_rank + src_of, mask=in_slots, other=1)
    finished_rank = tl.load(first_rank + ranks, mask=in_ranks, other=1)
    watch = in_slots & (finished_slot == 0)
    watch_rank = in_ranks & (finished_rank == 0)
    seen = tl.load(state + slots, mask=watch, other=0)
    cursor = tl.load(state + SLOT_BLOCK + _S_CURSOR)
    record = records + (cursor % num_records) * RECORD_WORDS
    halted = tl.load(state + SLOT_BLOCK + _S_HALT) != 0
    stop = tl.load(control, volatile=True)
    code = tl.where(halted | (stop != 0), 6, 0)  # CODE_HALTED
    polls = 0
    current = seen
    while code == 0:
        current, changed, aborted = poll_flags(flags, slots, watch, seen, aborts, ranks, watch_rank)
        polls += 1
        if polls % 64 == 0:
            stop = tl.load(control, volatile=True)
        code = tl.where(
            changed > 0,
            1,  # CODE_ITEM (a header still to check)
            tl.where(
                aborted > 0,
                3,  # CODE_ABORTED
                tl.where(stop != 0, 6, tl.where(polls >= max_polls, 2, 0)),  # HALTED, IDLE
            ),
        )
        if PAUSE_NS > 0:  # (device_wait.POLL_PAUSE_NS: less contention with the other ranks)
            pause(tl.full([], PAUSE_NS, tl.int32))
    take = code == 1
    # Which slot: the first attention rank at or after the scan start, its lowest sequence.
    fresh = watch & (current != seen)
    start = tl.load(state + SLOT_BLOCK + _S_RR)
    distance = (src_of - start + num_attention) % num_attention
    key = distance.to(tl.int64) * 4294967296 + current.to(tl.int64)
    key = tl.where(fresh, key, 9223372036854775807)
    best = tl.min(key, axis=0)
    slot = tl.min(tl.where(fresh & (key == best), slots, SLOT_BLOCK), axis=0)
    slot = tl.where(take, slot, 0)
    flag = tl.sum(tl.where(slots == slot, current, 0), axis=0)
    src = slot // ring_depth
    ring = slot % ring_depth

    # The header, read after the acquire load that saw its flag.
    base = slots_word + slot.to(tl.int64) * slot_words
    offs = tl.arange(0, FIXED_BLOCK)
    in_fixed = offs < FIXED
    words = tl.load(window_words + base + offs, mask=take & in_fixed, other=0, volatile=True)
    count_offs = tl.arange(0, COUNT_BLOCK)
    in_counts = count_offs < NUM_COUNTS
    counts = tl.load(
        window_words + base + FIXED + count_offs, mask=take & in_counts, other=0, volatile=True
    )
    counts64 = counts.to(tl.int64)
    magic = _word(words, offs, 0)
    version = _word(words, offs, 1)
    kind = _word(words, offs, 2)
    sender = _word(words, offs, 3)
    layer = _word(words, offs, 4)
    stage = _word(words, offs, 5)
    tokens = _word(words, offs, 6)
    routed = _word(words, offs, 7)
    shared = _word(words, offs, 8)
    bits = _word(words, offs, 9)
    seq = _word(words, offs, 10)
    answer = _word(words, offs, 11)
    num_counts = _word(words, offs, 12)
    stored_crc = _word(words, offs, 13)
    partials = tl.sum(tl.where(in_counts, counts64, 0), axis=0)
    largest = tl.max(tl.where(in_counts, counts64, 0), axis=0)
    smallest = tl.min(tl.where(in_counts, counts64, 0), axis=0)
    shutdown = (bits & FLAG_SHUTDOWN) != 0
    per_token = (bits & FLAG_ROWS) != 0

    # Everything decode_header checks (afd_protocol.core.header), in any order.
    bad = (magic != MAGIC) | (version != VERSION) | ((kind != 1) & (kind != 2))
    bad |= num_counts != NUM_COUNTS
    bad |= (sender < 0) | (sender >= num_attention)
    bad |= (layer < 0) | (layer >= num_layers) | (stage < 0) | (stage >= num_stages)
    bad |= (tokens < 0) | (tokens > token_cap) | (routed < 0) | (routed > routed_cap)
    bad |= (shared < 0) | (shared > shared_cap) | ((bits & ~KNOWN_FLAGS) != 0) | (seq < 1)
    bad |= ((kind == 1) & (answer != 0)) | ((kind == 2) & (answer < 1))
    bad |= (smallest < 0) | (largest > tokens)
    if ROWS_PER_TOKEN:
        bad |= ~per_token & ~shutdown
    else:
        bad |= per_token & ~shutdown
    bad |= ~per_token & (partials != routed)
    bad |= per_token & ((routed > tokens) | (largest > routed) | (partials < routed))
    bad |= ~per_token & (routed > tokens * topk)
    bad |= per_token & (partials > routed * topk)
    bad |= (shared > tokens) | (shutdown & (tokens != 0))
    wrong_crc = bad & ~bad  # False (the CRC only of a header taken: most steps take none)
    if take:
        zeroed = tl.where(offs == 13, 0, words)
        crc = _crc_of(zeroed, offs, in_fixed, crc_columns)
        crc ^= _crc_of(counts, FIXED + count_offs, in_counts, crc_columns)
        crc ^= crc_base
        wrong_crc = crc.to(tl.int64) != stored_crc
    bad |= wrong_crc
    problem = tl.where(bad, 1, 0)  # PROBLEM_DECODE
    problem = tl.where((problem == 0) & (kind != 1), 2, problem)  # PROBLEM_KIND
    problem = tl.where((problem == 0) & (sender != src), 3, problem)  # PROBLEM_SOURCE
    problem = tl.where((problem == 0) & (seq != flag), 4, problem)  # PROBLEM_SEQ
    if CHECK_SERVED:
        layer_ok = tl.load(served + tl.maximum(tl.minimum(layer, num_layers - 1), 0))
        problem = tl.where((problem == 0) & ~shutdown & (layer_ok == 0), 5, problem)
    problem = tl.where(take, problem, 0)
    is_item = take & (problem == 0) & ~shutdown
    code = tl.where(take & (problem != 0), 4, tl.where(take & shutdown, 5, code))

    # The device state: the slot consumed, the scan start, sequence numbers, halting.
    lane = tl.arange(0, 2)
    first = lane == 0
    tl.store(state + slot + lane, flag, mask=first & take)
    reply_seq = tl.load(state + SLOT_BLOCK + _S_SEQ)
    reply_seq = tl.where((reply_seq >= 0) & (reply_seq < 2147483647), reply_seq + 1, 1)
    tl.store(state + SLOT_BLOCK + _S_SEQ + lane, reply_seq, mask=first & is_item)
    tl.store(state + SLOT_BLOCK + _S_RR + lane, (src + 1) % num_attention, mask=first & is_item)
    ended = take & shutdown & (problem == 0)
    tl.store(first_rank + src + lane, 1, mask=first & ended)
    done_ranks = tl.load(state + SLOT_BLOCK + _S_FINISHED) + tl.where(ended, 1, 0)
    tl.store(state + SLOT_BLOCK + _S_FINISHED + lane, done_ranks, mask=first)
    halt = (code == 3) | (code == 4) | (done_ranks >= num_attention)
    tl.store(state + SLOT_BLOCK + _S_HALT + lane, 1, mask=first & halt)
    tl.store(state + SLOT_BLOCK + _S_CURSOR + lane, cursor + 1, mask=first)

    # What the rest of the step reads.
    if not ROWS_PER_TOKEN:
        partials = routed
    reply_rows = partials
    if REDUCE:
        reply_rows = routed
    item_words = tl.arange(0, 16)
    values = tl.where(item_words == 0, is_item.to(tl.int64), 0)  # I_VALID
    values = tl.where(item_words == 1, slot.to(tl.int64), values)  # I_SLOT
    values = tl.where(item_words == 2, src.to(tl.int64), values)  # I_SRC
    values = tl.where(item_words == 3, ring.to(tl.int64), values)  # I_RING
    values = tl.where(item_words == 4, routed, values)  # I_ROUTED
    values = tl.where(item_words == 5, partials, values)  # I_PARTIALS
    values = tl.where(item_words == 6, reply_rows, values)  # I_REPLY_ROWS
    values = tl.where(item_words == 7, reply_seq.to(tl.int64), values)  # I_REPLY_SEQ
    values = tl.where(item_words == 8, cursor.to(tl.int64), values)  # I_RECORD
    values = tl.where(item_words == 10, code.to(tl.int64), values)  # I_CODE
    values = tl.where(is_item | (item_words >= 8), values, 0)
    tl.store(item + item_words, values.to(tl.int32))
    tl.store(counts_out + count_offs, tl.where(is_item, counts64, 0), mask=in_counts)
    tl.store(layer_out + lane, tl.where(is_item, layer, 0).to(tl.int32), mask=first)

    # The record: its numbers and the header copy, then its code (release).
    fields = tl.arange(0, 16)
    numbers = tl.where(fields == 1, slot.to(tl.int64), 0)  # R_SLOT
    numbers = tl.where(fields == 2, src.to(tl.int64), numbers)  # R_SRC
    numbers = tl.where(fields == 3, ring.to(tl.int64), numbers)  # R_RING
    numbers = tl.where(fields == 4, layer, numbers)  # R_LAYER
    numbers = tl.where(fields == 5, stage, numbers)  # R_STAGE
    numbers = tl.where(fields == 6, tokens, numbers)  # R_TOKENS
    numbers = tl.where(fields == 7, routed, numbers)  # R_ROUTED
    numbers = tl.where(fields == 8, seq, numbers)  # R_SEQ
    numbers = tl.where(fields == 9, partials, numbers)  # R_PARTIALS
    numbers = tl.where(fields == 10, problem.to(tl.int64), numbers)  # R_PROBLEM
    numbers = tl.where(fields == 11, flag.to(tl.int64), numbers)  # R_FLAG
    numbers = tl.where(fields == 12, reply_seq.to(tl.int64), numbers)  # R_REPLY_SEQ
    numbers = tl.where(fields == 13, reply_rows, numbers)  # R_REPLY_ROWS
    numbers = tl.where(take | (fields == 0), numbers, 0)
    tl.store(record + fields, numbers.to(tl.int32), mask=(fields > 0) & (fields != 14))
    tl.store(record + 16 + offs, words, mask=in_fixed)
    tl.store(record + 16 + FIXED + count_offs, counts, mask=in_counts)
    tl.debug_barrier()
    tl.atomic_xchg(record + lane, code, mask=first, sem="release", scope="sys")


@triton.jit
def _expand_kernel(
    window_words,
    item,
    counts,
    row_of_partial,
    partial_of_slot,
    slots_word,
    slot_words,
    ids_word,
    partials_cap,
    NUM_COUNTS: tl.constexpr,
    COUNT_BLOCK: tl.constexpr,
    TOPK: tl.constexpr,
    TOPK_BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
):
    expert = tl.program_id(0)
    valid = tl.load(item + 0) != 0  # I_VALID
    rows_total = tl.where(valid, tl.load(item + 4), 0)  # I_ROUTED
    slot = tl.load(item + 1)  # I_SLOT
    count_offs = tl.arange(0, COUNT_BLOCK)
    sizes = tl.load(counts + count_offs, mask=count_offs < NUM_COUNTS, other=0)
    start = tl.sum(tl.where(count_offs < expert, sizes, 0), axis=0)
    mine = tl.sum(tl.where(count_offs == expert, sizes, 0), axis=0)
    base = slots_word + slot.to(tl.int64) * slot_words + ids_word
    choices = tl.arange(0, TOPK_BLOCK)
    in_k = choices < TOPK
    run = start * 0
    wrong = 0
    first = 0
    while first < rows_total:  # (a while loop: the bound is read on the device)
        rows = first + tl.arange(0, ROWS)
        live = rows < rows_total
        at = rows.to(tl.int64)[:, None] * TOPK + choices[None, :]
        cell = live[:, None] & in_k[None, :]
        ids = tl.load(window_words + base + at, mask=cell, other=-1, volatile=True)
        hits = tl.where(ids == expert, 1, 0)
        per_row = tl.sum(hits, axis=1)
        choice = tl.sum(hits * choices[None, :], axis=1)
        hit = per_row > 0
        position = start + run + tl.cumsum(per_row, axis=0) - 1
        inside = hit & (position < start + mine) & (position < partials_cap)
        tl.store(row_of_partial + position, rows.to(tl.int64), mask=inside)
        slot_of = rows.to(tl.int64) * TOPK + choice
        tl.store(partial_of_slot + slot_of, position.to(tl.int64), mask=inside)
        run += tl.sum(per_row, axis=0)
        wrong += tl.sum(tl.where(per_row > 1, 1, 0), axis=0)
        # Program 0 also marks the choices on other ranks, and refuses ids out of range.
        elsewhere = cell & (ids < 0) & (expert == 0)
        tl.store(partial_of_slot + at, tl.zeros_like(at) - 1, mask=elsewhere)
        outside = cell & ((ids < -1) | (ids >= NUM_COUNTS)) & (expert == 0)
        wrong += tl.sum(tl.sum(tl.where(outside, 1, 0), axis=1), axis=0)
        first += ROWS
    wrong += tl.where(run != mine, 1, 0)
    lane = tl.arange(0, 2)
    tl.atomic_max(item + 9 + lane, 1, mask=(lane == 0) & (wrong > 0))  # I_ERROR


@triton.jit
def _gather_rows_kernel(
    window_rows,
    item,
    row_of_partial,
    out,
    slots_elem,
    slot_elems,
    rows_elem,
    hidden,
    EXPAND: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    valid = tl.load(item + 0) != 0  # I_VALID
    count = tl.where(valid, tl.load(item + 5), 0)  # I_PARTIALS
    slot = tl.load(item + 1)  # I_SLOT
    base = slots_elem + slot.to(tl.int64) * slot_elems + rows_elem
    columns = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_row = columns < hidden
    tile = tl.program_id(0)
    while tile < tl.cdiv(count, ROWS):  # a persistent grid over a count read on the device
        rows = tile * ROWS + tl.arange(0, ROWS)
        live = rows < count
        if EXPAND:
            source = tl.load(row_of_partial + rows, mask=live, other=0)
        else:
            source = rows.to(tl.int64)
        take = live[:, None] & in_row[None, :]
        values = tl.load(
            window_rows + base + source[:, None] * hidden + columns[None, :], mask=take
        )
        tl.store(out + rows.to(tl.int64)[:, None] * hidden + columns[None, :], values, mask=take)
        tile += tl.num_programs(0)


@triton.jit
def _reply_rows_kernel(
    out,
    window_floats,
    item,
    partial_of_slot,
    peer_windows,
    reply_rows_byte,
    slot_bytes,
    slots_float,
    slot_floats,
    weights_float,
    hidden,
    REDUCE: tl.constexpr,
    TOPK: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    valid = tl.load(item + 0) != 0  # I_VALID
    count = tl.where(valid, tl.load(item + 6), 0)  # I_REPLY_ROWS
    src = tl.load(item + 2)  # I_SRC
    ring = tl.load(item + 3)  # I_RING
    slot = tl.load(item + 1)  # I_SLOT
    where = tl.load(peer_windows + src, mask=valid, other=0)
    target = (where + reply_rows_byte + ring.to(tl.int64) * slot_bytes).to(
        tl.pointer_type(out.dtype.element_ty)
    )
    weights = slots_float + slot.to(tl.int64) * slot_floats + weights_float
    columns = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_row = columns < hidden
    tile = tl.program_id(0)
    while tile < tl.cdiv(count, ROWS):
        rows = (tile * ROWS + tl.arange(0, ROWS)).to(tl.int64)
        live = rows < count
        cell = live[:, None] & in_row[None, :]
        if REDUCE:
            acc = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
            for j in tl.static_range(TOPK):
                partial = tl.load(partial_of_slot + rows * TOPK + j, mask=live, other=-1)
                present = partial >= 0
                weight = tl.load(window_floats + weights + rows * TOPK + j, mask=live, other=0.0)
                weight = tl.where(present, weight.to(tl.float32), 0.0)
                start = tl.maximum(partial, 0) * hidden
                value = tl.load(
                    out + start[:, None] + columns[None, :],
                    mask=cell & present[:, None],
                    other=0.0,
                ).to(tl.float32)
                acc += weight[:, None] * value
            result = acc.to(out.dtype.element_ty)
        else:
            result = tl.load(out + rows[:, None] * hidden + columns[None, :], mask=cell)
        tl.store(target + rows[:, None] * hidden + columns[None, :], result, mask=cell)
        tile += tl.num_programs(0)


@triton.jit
def _reply_header_kernel(
    window_words,
    item,
    state,
    records,
    peer_windows,
    reply_header_byte,
    reply_flag_byte,
    slot_bytes,
    slots_word,
    slot_words,
    crc_columns,
    crc_base,
    rank,
    num_records,
    SLOT_BLOCK: tl.constexpr,
    NUM_COUNTS: tl.constexpr,
    COUNT_BLOCK: tl.constexpr,
    FIXED: tl.constexpr,
    FIXED_BLOCK: tl.constexpr,
    RECORD_WORDS: tl.constexpr,
    REPLY_FLAGS: tl.constexpr,
    MAGIC: tl.constexpr,
    VERSION: tl.constexpr,
):
    valid = tl.load(item + 0) != 0  # I_VALID
    failed = tl.load(item + 9) != 0  # I_ERROR
    publish = valid & ~failed
    slot = tl.load(item + 1)
    src = tl.load(item + 2)
    ring = tl.load(item + 3).to(tl.int64)
    record = records + (tl.load(item + 8) % num_records) * RECORD_WORDS  # I_RECORD
    # The dispatch's header is still in this rank's slot: the sender waits for this reply.
    base = slots_word + slot.to(tl.int64) * slot_words
    offs = tl.arange(0, FIXED_BLOCK)
    in_fixed = offs < FIXED
    sent = tl.load(window_words + base + offs, mask=publish & in_fixed, other=0)
    count_offs = tl.arange(0, COUNT_BLOCK)
    in_counts = count_offs < NUM_COUNTS
    counts = tl.load(window_words + base + FIXED + count_offs, mask=publish & in_counts, other=0)
    reply_seq = tl.load(item + 7).to(tl.int64)  # I_REPLY_SEQ
    words = tl.where(offs == 0, MAGIC, 0)
    words = tl.where(offs == 1, VERSION, words)
    words = tl.where(offs == 2, 2, words)  # KIND: reply
    words = tl.where(offs == 3, rank, words)
    words = tl.where((offs >= 4) & (offs <= 6), sent, words)  # LAYER, STAGE, NUM_TOKENS
    words = tl.where(offs == 7, tl.load(item + 6), words)  # ROUTED_ROWS: the reply's rows
    words = tl.where(offs == 9, REPLY_FLAGS, words)
    words = tl.where(offs == 10, reply_seq, words)
    words = tl.where(offs == 11, _word(sent, offs, 10), words)  # ANSWER_SEQ
    words = tl.where(offs == 12, NUM_COUNTS, words)
    words = words.to(tl.int32)
    if publish:  # (the CRC only of a reply: most steps serve nothing)
        crc = _crc_of(words, offs, in_fixed, crc_columns)
        crc ^= _crc_of(counts, FIXED + count_offs, in_counts, crc_columns)
        crc ^= crc_base
        words = tl.where(offs == 13, crc, words)
    where = tl.load(peer_windows + src, mask=publish, other=0)
    header = (where + reply_header_byte + ring * slot_bytes).to(tl.pointer_type(tl.int32))
    tl.store(header + offs, words, mask=publish & in_fixed)
    tl.store(header + FIXED + count_offs, counts, mask=publish & in_counts)
    tl.debug_barrier()
    lane = tl.arange(0, 2)
    first = lane == 0
    flag = (where + reply_flag_byte + ring * 4).to(tl.pointer_type(tl.int32))
    tl.atomic_xchg(
        flag + lane, reply_seq.to(tl.int32), mask=first & publish, sem="release", scope="sys"
    )
    # A bad item stops the steps still queued (the host raises once it reads the record).
    tl.store(state + SLOT_BLOCK + _S_HALT + lane, 1, mask=first & valid & failed)
    done = tl.where(valid & failed, 2, 1)
    tl.atomic_xchg(record + _R_DONE + lane, done, mask=first, sem="release", scope="sys")


def next_power(value: int) -> int:
    """The smallest power of two >= ``max(value, 1)``."""
    return int(triton.next_power_of_2(max(1, value)))
