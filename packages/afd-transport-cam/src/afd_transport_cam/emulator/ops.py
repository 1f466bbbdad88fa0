"""The four compact routed-only CAM operators (generation G2), emulated on the CPU.

Same names, positional arguments and results as ``torch.ops.afd_ascend.afd_async_*``;
the semantics are those documented for the NPU kernels (dispatch-send de-duplicates each
token per FFN rank and publishes a ready word last; dispatch-receive serves whichever
attention replica has all its members ready, scanning round robin from a pointer kept in
the FFN window, and hands out whole experts up to its fixed capacity, over several calls
when a replica's rows exceed it; combine-send writes each reply row where the attention
rank expects it and raises one status word per attention rank after the last chunk;
combine-receive waits for every FFN rank and sums the weighted replies in fp32, top-k
order). Where the NPU would spin forever the emulator raises :class:`PeerTimeout`, and
where it would silently corrupt (a second dispatch in flight, a receive never answered, a
combine that does not match the dispatch) it raises :class:`ProtocolError`.

What it cannot reproduce: timing and device asynchrony (each call blocks the caller until
done), NPU memory ordering and the cores' work split, HCCL buffer and tiling limits other
than the window size, bit-exact NPU numerics of the expert GEMMs, and graph replay (the
layer index is returned in a tensor as on the NPU, but nothing is captured).
"""

from __future__ import annotations

import torch

from afd_protocol import CapacityError, InvalidArgument, ProtocolError
from afd_transport_cam.emulator.views import Region, ffn_region, home, scan_pointer
from afd_transport_cam.emulator.world import CamWorld, spin_until, world_for
from afd_transport_cam.geometry import (
    ADDRESS_LIMIT,
    HEADER_WORDS,
    STATS_DIGEST,
    STATS_IN_FLIGHT,
    CamGeometry,
    receive_capacity,
)
from afd_transport_cam.quant import quantize_per_token

POISON_ROWS = 64
"""Rows past a receive's valid prefix filled with NaN (or 0x7F): the NPU returns
uninitialised memory there, and poison makes an over-read visible."""

_PRIME = (1 << 31) - 1

_PENDING: dict[tuple[str, int], torch.Tensor] = {}
"""Per (communicator, FFN world rank): the batch info of the work item not yet answered."""


def _placeholder() -> torch.Tensor:
    """What the send operators return: a stream-dependency handle, not a completion."""
    return torch.zeros(1, dtype=torch.int8)


def _world(group_name: str, world_size: int, geo: CamGeometry) -> CamWorld:
    world = world_for(group_name)
    if world_size != geo.world_size:
        raise InvalidArgument(
            f"world_size={world_size} but attn_rank_num + moe_rank_num = {geo.world_size}"
        )
    if world.world_size != world_size:
        raise InvalidArgument(
            f"world_size={world_size} but communicator {group_name!r} has {world.world_size} ranks"
        )
    return world


def _check_inference(*tensors: torch.Tensor) -> None:
    for tensor in tensors:
        if tensor.requires_grad:
            raise InvalidArgument("the CAM operators are inference-only: pass tensors without grad")


def routing_digest(expert_ids: torch.Tensor) -> int:
    """A 63-bit digest of a batch's routing, kept at home by dispatch-send and checked by
    combine-receive (the NPU would combine a different routing silently)."""
    flat = expert_ids.reshape(-1).long()
    # A position-weighted sum mod 2^31 - 1 (torch only: NumPy is not a dependency).
    weights = (torch.arange(flat.numel(), dtype=torch.long) * 1_000_003 + 12_345) % _PRIME
    mixed = int(((flat + 1) * weights).remainder(_PRIME).sum().remainder(_PRIME))
    return (expert_ids.shape[0] << 32) | mixed


# ---- dispatch-send (attention rank) -------------------------------------------------------


def afd_async_dispatch_send(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    comm_args: torch.Tensor,
    comm_id: int,
    max_seq_len: int,
    batch_size: int,
    hidden_size: int,
    top_k: int,
    moe_rank_num: int,
    attn_rank_num: int,
    route_expert_num_per_moe: int,
    attn_rank_id: int,
    world_size: int,
    layer_index: int,
    tp_size: int,
    dynamic_quant: int,
    group_name: str,
) -> torch.Tensor:
    """Send one layer's batch of ``attn_rank_id`` to every FFN rank; returns int8[1]."""
    del comm_args, comm_id  # ABI placeholders, unused by the kernels
    geo = CamGeometry(
        attn_rank_num,
        moe_rank_num,
        route_expert_num_per_moe,
        top_k,
        hidden_size,
        max_seq_len,
        tp_size,
        bool(dynamic_quant),
        x.dtype,
    )
    geo.check_attention_rank(attn_rank_id)
    _check_inference(x)
    if x.dim() != 2 or tuple(x.shape) != (batch_size, hidden_size):
        raise InvalidArgument(
            f"x must be [batch_size={batch_size}, hidden_size={hidden_size}], got {tuple(x.shape)}"
        )
    if not 1 <= batch_size <= geo.rows_per_rank:
        raise InvalidArgument(
            f"batch_size={batch_size} must be in [1, max_seq_len / tp_size = "
            f"{geo.rows_per_rank}] (a batch of 0 is illegal: send one dummy token)"
        )
    if expert_ids.dtype != torch.int32 or tuple(expert_ids.shape) != (batch_size, top_k):
        raise InvalidArgument(
            f"expert_ids must be int32 [{batch_size}, {top_k}], got {expert_ids.dtype} "
            f"{tuple(expert_ids.shape)}"
        )
    if layer_index < 0:
        raise InvalidArgument(f"layer_index={layer_index} must be >= 0")
    world = _world(group_name, world_size, geo)
    ids = expert_ids.long()
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= geo.num_experts:
        raise InvalidArgument(
            f"expert_ids holds {low if low < 0 else high}, outside [0, moe_rank_num * "
            f"route_expert_num_per_moe = {geo.num_experts})"
        )
    mine = home(world.window(attn_rank_id), geo)
    if int(mine.words[STATS_IN_FLIGHT]):
        raise ProtocolError(
            f"attention rank {attn_rank_id} dispatched again before combine_recv of its "
            f"previous dispatch: CAM keeps one dispatch in flight per attention rank"
        )
    regions = [
        ffn_region(world.window(geo.num_attention + m), geo, attn_rank_id)
        for m in range(geo.num_ffn)
    ]
    for m, region in enumerate(regions):
        if int(region.header[0]):
            raise ProtocolError(
                f"FFN rank {m} has not taken attention rank {attn_rank_id}'s previous "
                f"dispatch yet; a dispatch must be received before the next one is sent"
            )
    rows = _token_rows(x, geo)
    pairs = []
    for m, region in enumerate(regions):
        pairs.append(_write_region(region, rows, ids, m, geo, attn_rank_id))
        mine.counts[m].copy_(region.counts)
    mine.words[STATS_DIGEST] = routing_digest(expert_ids)
    mine.words[STATS_IN_FLIGHT] = 1
    offset = 0
    for region, count in zip(regions, pairs, strict=True):
        region.header[1:HEADER_WORDS].copy_(
            torch.tensor([attn_rank_id, layer_index, offset, 0], dtype=torch.int64)
        )
        region.header[0] = count + 1  # ready, written last; nonzero even with no pairs
        offset += count
    return _placeholder()


def _token_rows(x: torch.Tensor, geo: CamGeometry) -> torch.Tensor:
    """uint8 ``[B, row_bytes]``: each token as the token store holds it."""
    if not geo.dynamic_quant:
        return x.contiguous().view(torch.uint8).view(x.shape[0], geo.row_bytes)
    q, scale = quantize_per_token(x)
    rows = torch.zeros(x.shape[0], geo.row_bytes, dtype=torch.uint8)
    rows[:, : geo.hidden_size] = q.view(torch.uint8)
    trailer = geo.hidden_size
    rows[:, trailer : trailer + 4] = scale.contiguous().view(torch.uint8).view(-1, 4)
    return rows


def _write_region(
    region: Region, rows: torch.Tensor, ids: torch.Tensor, m: int, geo: CamGeometry, rank: int
) -> int:
    """Write FFN rank ``m``'s token store, address table and counts; returns its pairs."""
    r, num_tokens = geo.experts_per_rank, ids.shape[0]
    owner, local = torch.div(ids, r, rounding_mode="floor"), ids % r
    hit = owner == m
    tokens = hit.any(dim=1).nonzero().squeeze(1)
    send_index = torch.full((num_tokens,), -1, dtype=torch.long)
    send_index[tokens] = torch.arange(tokens.numel())
    region.store[: tokens.numel()].copy_(rows[tokens])
    token_of = torch.arange(num_tokens).unsqueeze(1).expand_as(ids)
    # Grouped by local expert, ascending tokens (and choices) within an expert.
    key = (local * num_tokens + token_of) * geo.top_k + torch.arange(geo.top_k)
    picked = key[hit].sort().values
    counts = torch.bincount(local[hit], minlength=r)
    if counts.numel() and int(counts.max()) > ADDRESS_LIMIT:
        raise CapacityError(
            f"attention rank {rank} routes {int(counts.max())} pairs to one expert of FFN "
            f"rank {m}; the uint16 counters hold {ADDRESS_LIMIT}"
        )
    token_rows = torch.div(picked, geo.top_k, rounding_mode="floor") % num_tokens
    region.table[: picked.numel()].copy_(send_index[token_rows].to(torch.int32))
    region.counts.copy_(counts.to(torch.int32))
    region.flags.zero_()
    return int(picked.numel())


# ---- dispatch-receive (FFN rank) ------------------------------------------------------------


def afd_async_dispatch_recv(
    x: torch.Tensor,
    comm_args: torch.Tensor,
    comm_id: int,
    max_seq_len: int,
    hidden_size: int,
    top_k: int,
    moe_rank_num: int,
    attn_rank_num: int,
    route_expert_num_per_moe: int,
    moe_rank_id: int,
    world_size: int,
    tp_size: int,
    dynamic_quant: int,
    group_name: str,
) -> list[torch.Tensor]:
    """The next work item of FFN rank ``moe_rank_id``: ``[rows [N, H], scales [N] or [1],
    batch_info int64 [5 + tp + R * tp], counts int64 [R]]`` (module docstring)."""
    del comm_args, comm_id
    if x.dim() != 1 or x.numel() != 1:
        raise InvalidArgument(
            f"x is the one-element anchor whose dtype is the output dtype, got shape "
            f"{tuple(x.shape)} (the 16-element graph stop buffer is not emulated)"
        )
    geo = CamGeometry(
        attn_rank_num,
        moe_rank_num,
        route_expert_num_per_moe,
        top_k,
        hidden_size,
        max_seq_len,
        tp_size,
        bool(dynamic_quant),
        x.dtype,
    )
    m = geo.ffn_index(moe_rank_id)
    world = _world(group_name, world_size, geo)
    if (group_name, moe_rank_id) in _PENDING:
        raise ProtocolError(
            f"FFN rank {m} received again before combine_send answered its previous work "
            f"item: every work item needs its combine_send, even one with no rows"
        )
    window = world.window(moe_rank_id)
    pointer = scan_pointer(window, geo)
    chosen: list[int] = []

    def ready() -> bool:
        group = _ready_group(window, geo, int(pointer[0]) // geo.tp_size)
        if group is not None:
            chosen.append(group)
        return group is not None

    spin_until(
        ready,
        world,
        f"FFN rank {m}: an attention replica with every member dispatched",
        lambda: _describe_ffn(window, geo),
    )
    group = chosen[-1]
    regions = [ffn_region(window, geo, group * geo.tp_size + t) for t in range(geo.tp_size)]
    regions[0].header[4] = 1  # selected
    counts = torch.stack([r.counts.long() for r in regions])  # [tp, R]
    totals = counts.sum(dim=0)
    start, end = _chunk(regions[0].flags, totals, group, geo)
    capacity = receive_capacity()
    out_dtype = torch.int8 if geo.dynamic_quant else geo.dtype
    payload = torch.empty(capacity, hidden_size, dtype=out_dtype)
    scales = torch.empty(capacity if geo.dynamic_quant else 1, dtype=torch.float32)
    filled = 0
    for expert in range(start, end + 1):
        for t, region in enumerate(regions):
            n = int(counts[t, expert])
            first = int(counts[t, :expert].sum())
            raw = region.store[region.table[first : first + n].long()]
            if geo.dynamic_quant:
                payload[filled : filled + n] = raw[:, :hidden_size].view(torch.int8)
                scale_bytes = raw[:, hidden_size : hidden_size + 4].contiguous()
                scales[filled : filled + n] = scale_bytes.view(torch.float32).view(-1)
            else:
                payload[filled : filled + n] = raw.view(geo.dtype).view(n, hidden_size)
            filled += n
    guard = slice(filled, min(capacity, filled + POISON_ROWS))
    payload[guard] = 127 if geo.dynamic_quant else float("nan")
    q_words = [int(r.header[3]) for r in regions]
    info = [int(totals.sum()), group * geo.tp_size, int(regions[0].header[2]), start, end]
    batch_info = torch.tensor(info + q_words + counts.reshape(-1).tolist(), dtype=torch.int64)
    chunk_counts = torch.zeros(route_expert_num_per_moe, dtype=torch.int64)
    chunk_counts[start : end + 1] = totals[start : end + 1]
    for region in regions:
        region.flags[start : end + 1] = 1
    if end == geo.experts_per_rank - 1:  # the replica is done: free its regions, move on
        for region in regions:
            region.header[1:].zero_()
            region.header[0] = 0
        pointer[0] = ((group + 1) % geo.num_groups) * geo.tp_size
    _PENDING[(group_name, moe_rank_id)] = batch_info.clone()
    return [payload, scales, batch_info, chunk_counts]


def _ready_group(window: torch.Tensor, geo: CamGeometry, first: int) -> int | None:
    """The first replica, in rotation from ``first``, whose members all dispatched."""
    for step in range(geo.num_groups):
        group = (first + step) % geo.num_groups
        members = range(group * geo.tp_size, (group + 1) * geo.tp_size)
        if all(int(ffn_region(window, geo, a).header[0]) for a in members):
            return group
    return None


def _chunk(
    flags: torch.Tensor, totals: torch.Tensor, group: int, geo: CamGeometry
) -> tuple[int, int]:
    """Whole experts from the first one not yet taken, while they fit the capacity."""
    pending = (flags == 0).nonzero()
    if not pending.numel():
        raise ProtocolError(f"attention replica {group} is ready but every expert was taken")
    start = int(pending[0])
    capacity = receive_capacity()
    end, rows = start - 1, 0
    for expert in range(start, geo.experts_per_rank):
        if rows + int(totals[expert]) > capacity:
            break
        rows += int(totals[expert])
        end = expert
    if end < start:
        raise CapacityError(
            f"local expert {start} of attention replica {group} has {int(totals[start])} rows, "
            f"more than the receive capacity of {capacity} (262144 x BATCH_SIZE_FACTOR); "
            f"raise BATCH_SIZE_FACTOR or lower max_num_batched_tokens"
        )
    return start, end


def _describe_ffn(window: torch.Tensor, geo: CamGeometry) -> str:
    ready = [int(ffn_region(window, geo, a).header[0]) for a in range(geo.num_attention)]
    pointer = int(scan_pointer(window, geo)[0])
    return f"ready words per attention rank {ready} (0 = nothing sent), scan pointer {pointer}"


# ---- combine-send (FFN rank) --------------------------------------------------------------


def afd_async_combine_send(
    expand_x: torch.Tensor,
    comm_args: torch.Tensor,
    batch_info: torch.Tensor,
    comm_id: int,
    max_seq_len: int,
    hidden_size: int,
    top_k: int,
    moe_rank_num: int,
    attn_rank_num: int,
    route_expert_num_per_moe: int,
    moe_rank_id: int,
    world_size: int,
    tp_size: int,
    group_name: str,
) -> torch.Tensor:
    """Write the work item's expert outputs back to its attention ranks; int8[1]."""
    del comm_args, comm_id
    if expand_x.dtype == torch.int8:
        raise InvalidArgument(
            "expand_x is int8: the combine direction carries bf16/fp16 expert outputs (pass a "
            "[1, hidden_size] zero row when the work item has none)"
        )
    geo = CamGeometry(
        attn_rank_num,
        moe_rank_num,
        route_expert_num_per_moe,
        top_k,
        hidden_size,
        max_seq_len,
        tp_size,
        False,
        expand_x.dtype,
    )
    m = geo.ffn_index(moe_rank_id)
    world = _world(group_name, world_size, geo)
    _check_inference(expand_x)
    pending = _PENDING.get((group_name, moe_rank_id))
    if pending is None or not torch.equal(pending, batch_info.cpu()):
        raise ProtocolError(
            f"FFN rank {m}: batch_info is not the one its latest dispatch_recv returned (or "
            f"that work item was already answered)"
        )
    info = batch_info.tolist()
    tp, r = geo.tp_size, geo.experts_per_rank
    first, start, end = info[1], info[3], info[4]
    offsets = info[5 : 5 + tp]
    counts = [info[5 + tp + t * r : 5 + tp + (t + 1) * r] for t in range(tp)]
    needed = sum(counts[t][e] for t in range(tp) for e in range(start, end + 1))
    if expand_x.dim() != 2 or expand_x.shape[1] != hidden_size or expand_x.shape[0] < needed:
        raise InvalidArgument(
            f"expand_x must be [>= {needed}, {hidden_size}] (one row per received row), got "
            f"{tuple(expand_x.shape)}"
        )
    homes = [home(world.window(first + t), geo) for t in range(tp)]
    row = 0
    for expert in range(start, end + 1):
        for t in range(tp):
            n = counts[t][expert]
            at = offsets[t] + sum(counts[t][:expert])
            homes[t].rows[at : at + n].copy_(expand_x[row : row + n])
            row += n
    if end == r - 1:  # after the last chunk only: each attention rank learns its Q + 1
        for t in range(tp):
            homes[t].status[m] = offsets[t] + 1
    del _PENDING[(group_name, moe_rank_id)]
    return _placeholder()


# ---- combine-receive (attention rank) -------------------------------------------------------


def afd_async_combine_recv(
    expand_x: torch.Tensor,
    expert_ids: torch.Tensor,
    expert_scales: torch.Tensor,
    comm_args: torch.Tensor,
    comm_id: int,
    batch_size: int,
    hidden_size: int,
    top_k: int,
    moe_rank_num: int,
    attn_rank_num: int,
    route_expert_num_per_moe: int,
    attn_rank_id: int,
    world_size: int,
    group_name: str,
) -> torch.Tensor:
    """Wait for every FFN rank and return ``sum_k w[t, k] * reply(t, k)`` as ``[B, H]`` in
    ``expand_x``'s dtype (routed experts only; the shared expert is the caller's)."""
    del comm_args, comm_id
    geo = CamGeometry(
        attn_rank_num,
        moe_rank_num,
        route_expert_num_per_moe,
        top_k,
        hidden_size,
        # Not among this operator's arguments, and not needed: the combine area starts at a
        # fixed offset, and this batch's replies fill its first batch_size * top_k rows.
        batch_size,
        1,
        False,
        expand_x.dtype,
    )
    geo.check_attention_rank(attn_rank_id)
    if expert_ids.dtype != torch.int32 or tuple(expert_ids.shape) != (batch_size, top_k):
        raise InvalidArgument(
            f"expert_ids must be int32 [{batch_size}, {top_k}], got {expert_ids.dtype} "
            f"{tuple(expert_ids.shape)}"
        )
    if expert_scales.dtype != torch.float32 or expert_scales.shape != expert_ids.shape:
        raise InvalidArgument(
            f"expert_scales must be float32 [{batch_size}, {top_k}], got {expert_scales.dtype} "
            f"{tuple(expert_scales.shape)}"
        )
    if batch_size < 1:
        raise InvalidArgument(f"batch_size={batch_size} must be >= 1")
    world = _world(group_name, world_size, geo)
    mine = home(world.window(attn_rank_id), geo)
    if not int(mine.words[STATS_IN_FLIGHT]):
        raise ProtocolError(
            f"attention rank {attn_rank_id}: combine_recv without a dispatch in flight"
        )
    if int(mine.words[STATS_DIGEST]) != routing_digest(expert_ids):
        raise ProtocolError(
            f"attention rank {attn_rank_id}: expert_ids are not the ones dispatched (combine "
            f"must use the routing of the dispatch it answers)"
        )
    spin_until(
        lambda: bool((mine.status != 0).all()),
        world,
        f"attention rank {attn_rank_id}: replies from every FFN rank",
        lambda: f"status words {mine.status.tolist()} (0 = not yet sent)",
    )
    ids = expert_ids.long()
    r = geo.experts_per_rank
    owner, local = torch.div(ids, r, rounding_mode="floor"), ids % r
    offsets = mine.status.long() - 1
    counts = mine.counts.long()
    before = counts.cumsum(dim=1) - counts  # pairs of earlier experts on the same FFN rank
    rows = offsets[owner] + before[owner, local] + _occurrence(ids, geo.num_experts)
    replies = mine.rows[rows.reshape(-1)].float().view(batch_size, top_k, hidden_size)
    weights = expert_scales.float()
    out = torch.zeros(batch_size, hidden_size, dtype=torch.float32)
    for k in range(top_k):  # fp32, in top-k order, as the kernel accumulates
        out += weights[:, k, None] * replies[:, k]
    mine.status.zero_()
    mine.words[STATS_IN_FLIGHT] = 0
    return out.to(expand_x.dtype)


def _occurrence(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """For each (token, choice), how many earlier (token, choice) pairs chose its expert:
    its place among the expert's rows, which the address table lists in that order."""
    flat = ids.reshape(-1)
    order = torch.sort(flat, stable=True).indices
    per_expert = torch.bincount(flat, minlength=num_experts)
    starts = per_expert.cumsum(0) - per_expert
    place = torch.empty_like(flat)
    place[order] = torch.arange(flat.numel()) - starts[flat[order]]
    return place.view_as(ids)
