"""Dispatch planning and the weighted combine, shared by every transport.

Two plans of one layer's dispatch, computed the same way:

* :func:`plan_dispatch` -> :class:`DispatchPlan`: the counts also come to the host (one
  device-to-host read), because a sender that slices each destination's rows needs them,
  and because capacities can then be checked before anything is written;
* :func:`plan_on_device` -> :class:`DevicePlan`: everything stays on the device, for a
  sender that packs every destination in one device pass and never needs the counts on
  the host (the host can then run ahead of the device).

``plan_dispatch`` turns the router's ``topk_ids [T, k]`` into the wire order with one
stable sort: each routed *partial* (token t, choice j) gets the wire position of its
expert (destination FFN rank first, local expert id second, see
:class:`~afd_protocol.topology.ExpertPlacement`), and sorting by that key groups the
partials by destination and, inside each destination's segment, by local expert in
ascending order -- exactly the order the FFN side computes in. A count of the keys
(``index_add_``; ``bincount`` would synchronise on CUDA) is the group list, its prefix sum
the segment offsets. Stability keeps the partials of one expert in token order, which
makes the plan deterministic.

In the ``per_choice`` wire format ``topk_weights`` never travel: the attention side keeps
them, and :func:`combine_scatter` applies them while accumulating replies into an fp32
accumulator (a weighted ``index_add_``). Summation order therefore does not depend on
which FFN rank answers first beyond fp32 rounding.

In the ``per_rank`` format the plan also lists, per FFN rank, the distinct tokens that
have any expert there (``rank_tokens``, ascending) with their local expert ids
(``rank_local_ids``, -1 where a choice is elsewhere); each such token's row travels once,
with its weights (:meth:`DispatchPlan.rank_weights`). Expanding those rows to partials by
local expert, stably, gives exactly the ``per_choice`` order, so a reply per partial is
combined by :func:`combine_scatter` either way; a reply already reduced on the FFN side
(one row per token) by :func:`combine_reduced`.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from afd_protocol.core.errors import InvalidArgument, ProtocolError
from afd_protocol.core.layout import SharedPlacement, SlotLayout, WireFormat
from afd_protocol.core.tensors import constant_index
from afd_protocol.core.topology import ExpertPlacement, Topology


@dataclass(frozen=True)
class WireOrder:
    """What every dispatch plan holds on the device: the wire order and the counts."""

    num_tokens: int
    topk: int
    shared_placement: SharedPlacement
    order: torch.Tensor
    """int64 ``[T * k]``: flat partial index ``t * k + j`` of each row, in wire order."""
    row_token: torch.Tensor
    """int64 ``[T * k]``: token of each row in wire order (``order // k``)."""
    expert_counts: torch.Tensor
    """int64 ``[E]``: rows per expert, indexed by wire position (rank-major)."""
    shared_tokens: tuple[torch.Tensor, ...]
    """Per FFN rank, the tokens whose shared-expert branch it computes (``ffn`` placement)."""

    @functools.cached_property
    def wire_position(self) -> torch.Tensor:
        """int64 ``[T * k]``: wire position of each partial ``t * k + j`` (inverse of ``order``)."""
        return inverse_order(self.order)

    def shared_rows(self, dest: int) -> int:
        return int(self.shared_tokens[dest].numel())


@dataclass(frozen=True)
class DispatchPlan(WireOrder):
    """Where each routed partial goes, and how to put the replies back together.

    Tensors live on the device of ``topk_ids``; the segment bounds and counts are also
    kept on the host (one device-to-host copy per plan) because the sender slices with
    them.
    """

    host_expert_counts: tuple[int, ...]
    rank_wire_offsets: tuple[int, ...]
    """Rank ``d`` owns wire positions ``[rank_wire_offsets[d], rank_wire_offsets[d + 1])``."""
    segment_offsets: tuple[int, ...]
    """Rows for FFN rank ``d`` are ``[segment_offsets[d], segment_offsets[d + 1])``."""
    rank_token_offsets: tuple[int, ...] | None = None
    """``per_rank`` plans: FFN rank ``d``'s token rows are ``rank_tokens[o[d]:o[d + 1]]``."""
    rank_tokens: torch.Tensor | None = None
    """``per_rank``: int64 ``[N]``, per FFN rank (rank-major) its tokens, ascending."""
    rank_local_ids: torch.Tensor | None = None
    """``per_rank``: int32 ``[N, k]``, each token row's local expert id per choice on that
    FFN rank, -1 where the choice is on another rank."""

    @property
    def per_rank(self) -> bool:
        """Whether this plan also lists the ``per_rank`` token rows."""
        return self.rank_token_offsets is not None

    def _rank_offsets(self) -> tuple[int, ...]:
        if self.rank_token_offsets is None:
            raise InvalidArgument(
                "this plan was made for the per_choice wire format; plan with "
                "wire_format='per_rank' for token rows"
            )
        return self.rank_token_offsets

    def rank_segment(self, dest: int) -> slice:
        """``dest``'s token rows within ``rank_tokens`` and ``rank_local_ids``."""
        offsets = self._rank_offsets()
        return slice(offsets[dest], offsets[dest + 1])

    def rank_rows(self, dest: int) -> int:
        """Token rows sent to ``dest`` in the ``per_rank`` format."""
        offsets = self._rank_offsets()
        return offsets[dest + 1] - offsets[dest]

    def rank_weights(self, topk_weights: torch.Tensor) -> torch.Tensor:
        """fp32 ``[N, k]``: each token row's routing weights, 0 where the choice is on another
        FFN rank (so a receiver that sums over all ``k`` adds nothing for them)."""
        offsets = self._rank_offsets()
        assert self.rank_tokens is not None
        assert self.rank_local_ids is not None
        if offsets[-1] == 0:
            return torch.zeros(0, self.topk, dtype=torch.float32, device=topk_weights.device)
        rows = topk_weights.index_select(0, self.rank_tokens).float()
        return rows.masked_fill(self.rank_local_ids < 0, 0.0)

    @property
    def num_ffn_ranks(self) -> int:
        return len(self.segment_offsets) - 1

    @property
    def row_k(self) -> torch.Tensor:
        """Which of its ``k`` choices each row is, in wire order (``order % k``)."""
        return self.order % self.topk

    def segment(self, dest: int) -> slice:
        return slice(self.segment_offsets[dest], self.segment_offsets[dest + 1])

    def routed_rows(self, dest: int) -> int:
        return self.segment_offsets[dest + 1] - self.segment_offsets[dest]

    def group_list(self, dest: int) -> torch.Tensor:
        """Rows per local expert of FFN rank ``dest`` (device tensor, ascending local id)."""
        return self.expert_counts[self.rank_wire_offsets[dest] : self.rank_wire_offsets[dest + 1]]

    def host_group_list(self, dest: int) -> tuple[int, ...]:
        lo, hi = self.rank_wire_offsets[dest], self.rank_wire_offsets[dest + 1]
        return self.host_expert_counts[lo:hi]

    @property
    def destinations(self) -> tuple[int, ...]:
        """FFN ranks that receive anything; only these are waited on at combine."""
        return tuple(
            d
            for d in range(self.num_ffn_ranks)
            if self.routed_rows(d) > 0 or self.shared_rows(d) > 0
        )

    def tokens_for(self, dest: int) -> torch.Tensor:
        """Source token of each routed row sent to ``dest``, in wire order."""
        return self.row_token[self.segment(dest)]

    def gather(self, hidden_states: torch.Tensor, dest: int) -> torch.Tensor:
        """The routed rows for ``dest``: ``hidden_states`` rows in wire order."""
        return hidden_states.index_select(0, self.tokens_for(dest))

    def gather_shared(self, hidden_states: torch.Tensor, dest: int) -> torch.Tensor:
        return hidden_states.index_select(0, self.shared_tokens[dest])

    def check_capacity(self, layout: SlotLayout) -> None:
        """Raise :class:`~afd_protocol.errors.CapacityError` if any destination overflows."""
        for d in range(self.num_ffn_ranks):
            token_rows = self.rank_rows(d) if self.per_rank else 0
            rows = layout.slot_rows(self.routed_rows(d), token_rows)
            layout.check_capacity(self.num_tokens, rows, self.shared_rows(d), dest=d)


def wire_table(placement: ExpertPlacement, device: torch.device) -> torch.Tensor:
    """Expert id -> wire position, built once per placement and device (not per layer)."""
    return constant_index(tuple(placement.wire_position), device)


def check_expert_bounds(low: int, high: int, num_experts: int) -> None:
    """Raise if the router chose an expert id outside ``[0, num_experts)``."""
    if low < 0 or high >= num_experts:
        bad = low if low < 0 else high
        raise InvalidArgument(
            f"topk_ids holds expert id {bad}, outside [0, {num_experts}): the router and the "
            f"topology disagree on the number of routed experts"
        )


def inverse_order(order: torch.Tensor) -> torch.Tensor:
    """The permutation that undoes ``order`` (``result[order[i]] = i``), on its device."""
    every = torch.arange(order.numel(), device=order.device)
    return torch.empty_like(order).scatter_(0, order, every)


def shared_token_split(
    num_tokens: int, topology: Topology, placement: SharedPlacement, device: torch.device
) -> tuple[torch.Tensor, ...]:
    """Per FFN rank, the tokens whose shared experts it computes: round robin with ``ffn``
    placement (token ``t`` goes to rank ``t % F``), none with ``attention`` placement."""
    f = topology.num_ffn_ranks
    if placement is SharedPlacement.FFN:
        return tuple(
            torch.arange(d, max(d, num_tokens), f, dtype=torch.long, device=device)
            for d in range(f)
        )
    empty = torch.empty(0, dtype=torch.long, device=device)
    return tuple(empty for _ in range(f))


@functools.lru_cache(maxsize=16)
def _one(device: torch.device) -> torch.Tensor:
    """A long 1 on ``device``; expanded, it is the all-ones source of a count (no launch)."""
    return torch.ones(1, dtype=torch.long, device=device)


def plan_dispatch(
    topk_ids: torch.Tensor,
    topology: Topology,
    shared_placement: SharedPlacement | str = SharedPlacement.ATTENTION,
    layout: SlotLayout | None = None,
    wire_format: WireFormat | str | None = None,
) -> DispatchPlan:
    """Plan one layer's dispatch from the router's choices (see the module docstring).

    With ``layout`` given, capacities are checked here, before anything is written.
    ``wire_format`` defaults to the layout's (``per_choice`` without a layout); a
    ``per_rank`` plan also lists each FFN rank's token rows.
    """
    placement_kind = SharedPlacement(shared_placement)
    if wire_format is None:
        wire_format = layout.wire_format if layout is not None else WireFormat.PER_CHOICE
    per_rank = WireFormat(wire_format) is WireFormat.PER_RANK
    check_topk_ids(topk_ids)
    num_tokens, topk = topk_ids.shape
    placement = topology.expert_placement
    num_experts = placement.num_experts
    device = topk_ids.device

    flat = topk_ids.reshape(-1).long()
    clamped = flat.clamp(0, num_experts - 1)
    wire_of_expert = wire_table(placement, device)
    keys = wire_of_expert.index_select(0, clamped)
    # index_add_ rather than bincount: on CUDA, bincount reads the largest key back to the
    # host to size its output, a second synchronisation per layer.
    counts = torch.zeros(num_experts, dtype=torch.long, device=device)
    counts.index_add_(0, keys, _one(device).expand(keys.numel()))
    order = torch.sort(keys, stable=True).indices
    num_ffn = placement.num_ffn_ranks
    hits = _rank_hits(clamped, placement, num_tokens, topk) if per_rank else None
    # One device-to-host copy carries the range check and the counts (each launch costs the
    # host several microseconds, so the bounds come from one aminmax and ride along).
    if flat.numel():
        low_t, high_t = torch.aminmax(flat)
        parts = [low_t.view(1), high_t.view(1), counts]
        if hits is not None:
            parts.append(hits.sum(0))
        host = torch.cat(parts).tolist()
        host_counts = tuple(host[2 : 2 + num_experts])
        host_rank_rows = tuple(host[2 + num_experts :])
        check_expert_bounds(host[0], host[1], num_experts)
    else:
        host_counts = (0,) * num_experts
        host_rank_rows = (0,) * num_ffn
    if host_counts and max(host_counts) > num_tokens:
        raise InvalidArgument(
            f"topk_ids route {max(host_counts)} rows of {num_tokens} tokens to one expert: some "
            f"token chose an expert more than once; a router's top-k ids are distinct per token"
        )

    rank_offsets = placement.rank_wire_offsets
    segments = [0]
    for d in range(placement.num_ffn_ranks):
        segments.append(segments[-1] + sum(host_counts[rank_offsets[d] : rank_offsets[d + 1]]))

    shared = shared_token_split(num_tokens, topology, placement_kind, device)
    rank_token_offsets: tuple[int, ...] | None = None
    rank_tokens = rank_local_ids = None
    if hits is not None:
        rank_token_offsets, rank_tokens, rank_local_ids = _rank_rows(
            topk_ids, hits, placement, host_rank_rows
        )

    plan = DispatchPlan(
        num_tokens=num_tokens,
        topk=topk,
        shared_placement=placement_kind,
        order=order,
        row_token=torch.div(order, topk, rounding_mode="floor"),
        expert_counts=counts,
        host_expert_counts=host_counts,
        rank_wire_offsets=rank_offsets,
        segment_offsets=tuple(segments),
        shared_tokens=shared,
        rank_token_offsets=rank_token_offsets,
        rank_tokens=rank_tokens,
        rank_local_ids=rank_local_ids,
    )
    if layout is not None:
        check_topk(topk, layout)
        plan.check_capacity(layout)
    return plan


def _rank_hits(
    clamped: torch.Tensor, placement: ExpertPlacement, num_tokens: int, topk: int
) -> torch.Tensor:
    """bool ``[T, F]``: whether token ``t`` has any expert on FFN rank ``d``."""
    device = clamped.device
    owner = constant_index(tuple(placement.owner), device).index_select(0, clamped)
    hits = torch.zeros(num_tokens, placement.num_ffn_ranks, dtype=torch.bool, device=device)
    return hits.scatter_(1, owner.view(num_tokens, topk), True)


def _rank_rows(
    topk_ids: torch.Tensor,
    hits: torch.Tensor,
    placement: ExpertPlacement,
    host_rank_rows: tuple[int, ...],
) -> tuple[tuple[int, ...], torch.Tensor, torch.Tensor]:
    """The ``per_rank`` fields of a plan: every FFN rank's token offsets, tokens and local
    ids."""
    num_tokens = topk_ids.shape[0]
    device = topk_ids.device
    offsets = [0]
    for rows in host_rank_rows:
        offsets.append(offsets[-1] + rows)
    # Rank-major, tokens ascending: a stable sort of the [F, T] misses puts every hit first,
    # in exactly that order (one sort, no second device-to-host read).
    misses = (~hits.T).reshape(-1).to(torch.int32)
    flat_hits = torch.sort(misses, stable=True).indices[: offsets[-1]]
    tokens = flat_hits % max(num_tokens, 1)
    dest_of_row = torch.div(flat_hits, max(num_tokens, 1), rounding_mode="floor")
    chosen = topk_ids.index_select(0, tokens).long().clamp(0, placement.num_experts - 1)
    owner = constant_index(tuple(placement.owner), device)[chosen]
    local = constant_index(tuple(placement.local_id), device)[chosen]
    local_ids = torch.where(owner == dest_of_row[:, None], local, -1).to(torch.int32)
    return tuple(offsets), tokens, local_ids


def check_topk_ids(topk_ids: torch.Tensor) -> None:
    """Raise :class:`InvalidArgument` unless ``topk_ids`` is a 2-D tensor of integer ids."""
    if topk_ids.dim() != 2:
        raise InvalidArgument(
            f"topk_ids must be [num_tokens, topk], got shape {tuple(topk_ids.shape)}"
        )
    if topk_ids.dtype.is_floating_point or topk_ids.dtype == torch.bool:
        raise InvalidArgument(f"topk_ids must hold integer expert ids, got {topk_ids.dtype}")


def check_topk(topk: int, layout: SlotLayout) -> None:
    """Raise :class:`InvalidArgument` when the router chose a different top-k than the layout."""
    if topk != layout.topk:
        raise InvalidArgument(
            f"topk_ids choose {topk} experts per token but the slot layout was sized for "
            f"topk={layout.topk}; the router and the AFD configuration disagree"
        )


@dataclass(frozen=True)
class DevicePlan(WireOrder):
    """A dispatch plan whose counts stay on the device (see :func:`plan_on_device`)."""

    segment_offsets: torch.Tensor
    """int64 ``[F + 1]`` on the device: FFN rank ``d`` gets wire positions
    ``[segment_offsets[d], segment_offsets[d + 1])``."""
    expert_bounds: torch.Tensor
    """int64 ``[2]``: the smallest and largest expert id routed to, for the range check."""
    token_rows: torch.Tensor | None = None
    """``per_rank`` plans: int64 ``[T, F]``, token ``t``'s row in FFN rank ``d``'s part
    (tokens ascending, as :func:`plan_dispatch` lists them), -1 when ``t`` has no expert
    there."""
    token_row_offsets: torch.Tensor | None = None
    """``per_rank``: int64 ``[F + 1]``, FFN rank ``d`` gets ``o[d + 1] - o[d]`` token rows."""

    @functools.cached_property
    def token_row_positions(self) -> torch.Tensor:
        """int64 ``[T * F]``: for each (token, FFN rank), the token's reply row counted across
        every rank's reply (``o[d] + token_rows[t, d]``), -1 where it sent nothing there --
        the wire positions of replies reduced on the FFN side, one per (token, rank)."""
        assert self.token_rows is not None
        assert self.token_row_offsets is not None
        starts = self.token_row_offsets[:-1].unsqueeze(0)
        return torch.where(self.token_rows >= 0, self.token_rows + starts, -1).reshape(-1)


def plan_on_device(
    topk_ids: torch.Tensor,
    topology: Topology,
    shared_placement: SharedPlacement,
    wire_format: WireFormat = WireFormat.PER_CHOICE,
    per_partial_order: bool = True,
) -> DevicePlan:
    """:func:`plan_dispatch` without its device-to-host read.

    The caller has validated ``topk_ids`` (2-D, integer, on the window's device); ids out of
    range are clamped here and reported from ``expert_bounds`` later. A ``per_rank`` plan
    also places every token row: a running count down the ``[T, F]`` hit matrix is each
    row's position (no sort, no host read). ``per_partial_order=False`` skips the sort that
    orders the partials (``order``, ``row_token`` and ``wire_position`` are then empty): a
    ``per_rank`` dispatch whose replies are reduced on the FFN side never needs it, and on a
    GPU the sort is the plan's costliest step (about 0.1 ms of host time).
    """
    num_tokens, topk = topk_ids.shape
    placement = topology.expert_placement
    num_experts = placement.num_experts
    device = topk_ids.device
    flat = topk_ids.reshape(-1).long()
    clamped = flat.clamp(0, num_experts - 1)
    keys = wire_table(placement, device).index_select(0, clamped)
    counts = torch.zeros(num_experts, dtype=torch.long, device=device)
    counts.index_add_(0, keys, _one(device).expand(keys.numel()))
    if per_partial_order:
        order = torch.sort(keys, stable=True).indices
    else:
        order = torch.empty(0, dtype=torch.long, device=device)
    totals = torch.cat([torch.zeros(1, dtype=torch.long, device=device), counts.cumsum(0)])
    segments = totals.index_select(0, constant_index(placement.rank_wire_offsets, device))
    if flat.numel():
        bounds = torch.stack(torch.aminmax(flat))
    else:
        bounds = torch.zeros(2, dtype=torch.long, device=device)
    token_rows = token_row_offsets = None
    if WireFormat(wire_format) is WireFormat.PER_RANK:
        hits = _rank_hits(clamped, placement, num_tokens, topk)
        running = hits.long().cumsum(0)
        token_rows = torch.where(hits, running - 1, -1)
        rows = (
            running[-1]
            if num_tokens
            else torch.zeros(placement.num_ffn_ranks, dtype=torch.long, device=device)
        )
        token_row_offsets = torch.cat([torch.zeros(1, dtype=torch.long, device=device), rows])
        token_row_offsets = token_row_offsets.cumsum(0)
    return DevicePlan(
        num_tokens=num_tokens,
        topk=topk,
        shared_placement=shared_placement,
        order=order,
        row_token=torch.div(order, topk, rounding_mode="floor"),
        expert_counts=counts,
        segment_offsets=segments,
        expert_bounds=bounds,
        shared_tokens=shared_token_split(num_tokens, topology, shared_placement, device),
        token_rows=token_rows,
        token_row_offsets=token_row_offsets,
    )


def new_accumulator(
    num_tokens: int, hidden_size: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """A zeroed fp32 ``[T, H]`` accumulator for :func:`combine_scatter`."""
    return torch.zeros(num_tokens, hidden_size, dtype=torch.float32, device=device)


def combine_scatter(
    accumulator: torch.Tensor,
    plan: DispatchPlan,
    dest: int,
    routed_out: torch.Tensor,
    topk_weights: torch.Tensor,
    shared_out: torch.Tensor | None = None,
) -> None:
    """Add FFN rank ``dest``'s reply into ``accumulator`` (fp32), weighting each routed row.

    ``routed_out`` holds one row per routed row sent to ``dest``, in wire order;
    ``shared_out`` one row per shared token assigned to ``dest``.
    """
    if accumulator.dtype != torch.float32:
        raise TypeError(f"the combine accumulator must be float32, got {accumulator.dtype}")
    if tuple(topk_weights.shape) != (plan.num_tokens, plan.topk):
        raise ProtocolError(
            f"topk_weights has shape {tuple(topk_weights.shape)} but the plan was made for "
            f"[{plan.num_tokens}, {plan.topk}]"
        )
    hidden = accumulator.shape[1]
    expected = plan.routed_rows(dest)
    if routed_out.dim() != 2 or routed_out.shape[0] != expected or routed_out.shape[1] != hidden:
        raise ProtocolError(
            f"reply from FFN rank {dest} has routed rows of shape {tuple(routed_out.shape)}, "
            f"expected [{expected}, {hidden}]"
        )
    segment = plan.segment(dest)
    if expected:
        weights = topk_weights.reshape(-1).index_select(0, plan.order[segment]).float()
        weighted = routed_out.to(torch.float32, copy=True).mul_(weights[:, None])
        accumulator.index_add_(0, plan.row_token[segment], weighted)
    _add_shared(accumulator, plan, dest, shared_out)


def combine_reduced(
    accumulator: torch.Tensor,
    plan: DispatchPlan,
    dest: int,
    reduced_out: torch.Tensor,
    shared_out: torch.Tensor | None = None,
) -> None:
    """Add FFN rank ``dest``'s reply reduced on the FFN side into ``accumulator`` (fp32).

    ``per_rank`` wire format with ``combine_reduce="ffn"``: ``reduced_out`` holds one row per
    token sent to ``dest`` (``plan.rank_tokens``' segment, ascending), each already the
    weighted sum of that token's partials there.
    """
    if accumulator.dtype != torch.float32:
        raise TypeError(f"the combine accumulator must be float32, got {accumulator.dtype}")
    hidden = accumulator.shape[1]
    expected = plan.rank_rows(dest)
    if reduced_out.dim() != 2 or tuple(reduced_out.shape) != (expected, hidden):
        raise ProtocolError(
            f"reply from FFN rank {dest} has reduced rows of shape {tuple(reduced_out.shape)}, "
            f"expected [{expected}, {hidden}] (one per token sent there)"
        )
    if expected:
        assert plan.rank_tokens is not None
        tokens = plan.rank_tokens[plan.rank_segment(dest)]
        accumulator.index_add_(0, tokens, reduced_out.float())
    _add_shared(accumulator, plan, dest, shared_out)


def _add_shared(
    accumulator: torch.Tensor, plan: WireOrder, dest: int, shared_out: torch.Tensor | None
) -> None:
    hidden = accumulator.shape[1]
    want_shared = plan.shared_rows(dest)
    if want_shared:
        if shared_out is None or tuple(shared_out.shape) != (want_shared, hidden):
            got = None if shared_out is None else tuple(shared_out.shape)
            raise ProtocolError(
                f"reply from FFN rank {dest} has shared rows of shape {got}, expected "
                f"[{want_shared}, {hidden}]"
            )
        accumulator.index_add_(0, plan.shared_tokens[dest], shared_out.float())
    elif shared_out is not None and shared_out.numel():
        raise ProtocolError(f"reply from FFN rank {dest} carries shared rows that were not sent")


def combine(
    plan: DispatchPlan,
    replies: Mapping[int, tuple[torch.Tensor, torch.Tensor | None]],
    topk_weights: torch.Tensor,
    hidden_size: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Combine every destination's ``(routed_out, shared_out)`` reply into ``[T, H]``.

    Every destination in :attr:`DispatchPlan.destinations` must have replied; others may
    be absent (they received nothing and are not waited on).
    """
    missing = [d for d in plan.destinations if d not in replies]
    if missing:
        raise ProtocolError(f"no reply from FFN ranks {missing}, which received rows")
    acc = new_accumulator(plan.num_tokens, hidden_size, topk_weights.device)
    for dest, (routed_out, shared_out) in sorted(replies.items()):
        combine_scatter(acc, plan, dest, routed_out, topk_weights, shared_out)
    return acc.to(dtype)


def expert_ids_from_counts(counts: torch.Tensor, num_rows: int | None = None) -> torch.Tensor:
    """Expand a group list into one local expert id per row (the FFN side's view).

    Passing ``num_rows`` avoids a device-to-host synchronisation on accelerators.
    """
    # With only the repeats, repeat_interleave repeats their indices: 0 counts[0] times, ...
    return torch.repeat_interleave(counts.long(), output_size=num_rows)
