"""Dispatch packed on the device: no host read of the counts before the writes.

The portable dispatch (:func:`~afd_protocol.plan.plan_dispatch` then one ``index_select``
per FFN rank) reads the per-expert counts to the host, because the sender slices each
destination's rows with them. That read waits for the router's output, so the host cannot
run ahead of the device at any MoE layer. When the batch cannot overflow any destination
(``num_tokens * topk <= routed_cap``: even all rows to one rank fit), nothing on the host
needs the counts:

* :func:`plan_on_device` keeps the plan on the device -- the wire order, the counts, the
  segment bounds (``[F + 1]``) and the expert-id bounds for a range check made later;
* a :data:`DevicePack` kernel writes every destination's routed rows, their source tokens
  and the complete header (``ROUTED_ROWS``, the expert counts and the checksum computed on
  the device; every other word prepared on the host in ``fixed_words``) in one pass;
* every FFN rank is published to (one that got no rows sees an empty part and answers at
  once), and the expert-id range check is read back with the replies, at combine time.

:func:`reference_device_pack` is the computation in torch, the specification a kernel is
tested against.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from afd_protocol.header import CHECKSUM_SALT, Word
from afd_protocol.layout import SharedPlacement
from afd_protocol.plan import WireOrder, _one, _wire_table, shared_token_split
from afd_protocol.staging import constant_index
from afd_protocol.topology import Topology


@dataclass(frozen=True)
class DevicePlan(WireOrder):
    """A dispatch plan whose counts stay on the device (see the module docstring)."""

    segment_offsets: torch.Tensor
    """int64 ``[F + 1]`` on the device: FFN rank ``d`` gets wire positions
    ``[segment_offsets[d], segment_offsets[d + 1])``."""
    expert_bounds: torch.Tensor
    """int64 ``[2]``: the smallest and largest expert id routed to, for the range check."""


def plan_on_device(
    topk_ids: torch.Tensor, topology: Topology, shared_placement: SharedPlacement
) -> DevicePlan:
    """:func:`~afd_protocol.plan.plan_dispatch` without its device-to-host read.

    The caller has validated ``topk_ids`` (2-D, integer, on the window's device); ids out of
    range are clamped here and reported from ``expert_bounds`` later.
    """
    num_tokens, topk = topk_ids.shape
    placement = topology.expert_placement
    num_experts = placement.num_experts
    device = topk_ids.device
    flat = topk_ids.reshape(-1).long()
    keys = _wire_table(placement, device).index_select(0, flat.clamp(0, num_experts - 1))
    counts = torch.zeros(num_experts, dtype=torch.long, device=device)
    counts.index_add_(0, keys, _one(device).expand(keys.numel()))
    order = torch.sort(keys, stable=True).indices
    totals = torch.cat([torch.zeros(1, dtype=torch.long, device=device), counts.cumsum(0)])
    segments = totals.index_select(0, constant_index(placement.rank_wire_offsets, device))
    if flat.numel():
        bounds = torch.stack(torch.aminmax(flat))
    else:
        bounds = torch.zeros(2, dtype=torch.long, device=device)
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
    )


@dataclass(frozen=True)
class PackInputs:
    """What a device pack reads and writes; every per-destination view is in a peer window."""

    hidden: torch.Tensor
    """``[T, H]``: the rows to send."""
    plan: DevicePlan
    rank_wire_offsets: tuple[int, ...]
    """FFN rank ``d``'s experts are wire positions ``[o[d], o[d + 1])`` (host copy)."""
    fixed_words: torch.Tensor
    """int32 ``[F, HEADER_FIXED_WORDS]`` on the device: each destination's header words
    except ROUTED_ROWS and CHECKSUM, which the pack computes."""
    routed_rows: tuple[torch.Tensor, ...]
    """Per destination, ``[routed_cap, H]``: where its rows go."""
    route_index: tuple[torch.Tensor, ...]
    """Per destination, int32 ``[routed_cap]``: the source token of each row."""
    headers: tuple[torch.Tensor, ...]
    """Per destination, the int32 header field of the slot."""


DevicePack = Callable[[PackInputs], None]
"""Writes rows, source tokens and headers for every destination (module docstring)."""


def checksum_weights(num_words: int, device: torch.device) -> torch.Tensor:
    """int64 position weights of the header checksum (0 at CHECKSUM), as a tensor."""
    weights = torch.arange(num_words, dtype=torch.long, device=device) * 2 + 1
    weights[Word.CHECKSUM] = 0
    return weights


def reference_device_pack(inputs: PackInputs) -> None:
    """The device pack written with torch ops (see the module docstring)."""
    plan = inputs.plan
    segments = plan.segment_offsets
    wire = torch.arange(plan.row_token.numel(), device=segments.device)
    dest_of = torch.bucketize(wire, segments[1:-1], right=True)
    row_of = wire - segments[dest_of]
    offsets = inputs.rank_wire_offsets
    for dest in range(len(inputs.headers)):
        mine = (dest_of == dest).nonzero().squeeze(1)
        rows, tokens = row_of[mine], plan.row_token[mine]
        inputs.routed_rows[dest][rows] = inputs.hidden[tokens]
        inputs.route_index[dest][rows] = tokens.to(torch.int32)
        counts = plan.expert_counts[offsets[dest] : offsets[dest + 1]]
        words = torch.cat([inputs.fixed_words[dest].long(), counts])
        words[Word.ROUTED_ROWS] = segments[dest + 1] - segments[dest]
        words[Word.CHECKSUM] = 0
        total = (words * checksum_weights(words.numel(), words.device)).sum() + CHECKSUM_SALT
        unsigned = total & 0xFFFFFFFF
        words[Word.CHECKSUM] = unsigned - (unsigned >= (1 << 31)).long() * (1 << 32)
        inputs.headers[dest][: words.numel()] = words.to(torch.int32)
