"""Device kernels the kernel attention endpoint uses, as specifications with torch references.

A window endpoint does its work with portable torch ops. Hardware that can do better
supplies kernels for two steps, through :class:`WindowKernels`; each kernel is specified
here by its inputs and a reference implementation in torch that the kernel is tested
against, so a kernel never sees an endpoint and an endpoint never sees a kernel's code.

Fused combine
-------------
The portable combine (:func:`~afd_protocol.core.plan.combine_scatter`, once per FFN rank)
widens every reply row to fp32, weights it and adds it into an fp32 accumulator with
atomics: on a GPU that is several passes over the reply bytes and a dozen launches per
layer. A fused combine reads each token's ``k`` reply rows straight out of the window
where they landed, weights them in registers and writes the output once. Everything it
needs is described by positions in this rank's window (:class:`CombineInputs`):

* ``rows`` -- the local window viewed as a flat tensor of the activation dtype;
* ``routed_starts[d]`` -- the element offset in ``rows`` of FFN rank ``d``'s reply rows
  (``shared_starts[d]`` likewise for shared-expert rows, ``None`` when the attention side
  computes the shared experts);
* ``segment_offsets`` -- the plan's segment bounds (``[F + 1]``, int64, on the device): wire
  position ``i`` belongs to FFN rank ``d`` when ``segment_offsets[d] <= i < ...[d + 1]``
  and is that rank's reply row ``i - segment_offsets[d]``;
* ``wire_position`` -- the plan's wire position of each partial ``t * k + j``;
* shared rows follow the round-robin split of :func:`~afd_protocol.core.plan.plan_dispatch`:
  token ``t`` is FFN rank ``t % F``'s shared row ``t // F``;
* a wire position below zero contributes nothing (no read, no weight): replies reduced on
  the FFN side (``per_rank`` with ``combine_reduce="ffn"``) are combined as ``k = F``
  "choices" per token, one per FFN rank, -1 where the token sent nothing there
  (:attr:`~afd_protocol.core.plan.DevicePlan.token_row_positions`, weights all one).

Device pack
-----------
The portable dispatch (:func:`~afd_protocol.core.plan.plan_dispatch`, then one
``index_select`` per FFN rank) reads the per-expert counts to the host, because the sender
slices each destination's rows with them. That read waits for the router's output, so the
host cannot run ahead of the device at any MoE layer. When the batch cannot overflow any
destination (``num_tokens * topk <= routed_cap``: even all rows to one rank fit), nothing
on the host needs the counts: :func:`~afd_protocol.core.plan.plan_on_device` keeps the
plan on the device, and a device pack writes every destination's routed rows, their
source tokens and the complete header (``ROUTED_ROWS``, the expert counts and the CRC-32
checksum computed on the device, the CRC as an XOR of precomputed columns, see
:func:`~afd_protocol.core.header.crc_columns`; every other word prepared on the host in
``fixed_words``) in one pass (:class:`PackInputs`). In the ``per_rank`` format it writes
each token row once per FFN rank it has experts on, with the row's local expert ids and
weights (:class:`TokenRowInputs`); a rank's rows never exceed the batch, so a ``per_rank``
batch reduced on the FFN side can always be packed on the device.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from afd_protocol import (
    HEADER_FIXED_WORDS,
    DevicePlan,
    ExpertPlacement,
    PartialsReduce,
    SharedPlacement,
    Topology,
    WireFormat,
    Word,
    checksum,
    crc_columns,
    plan_on_device,
    reference_reduce_partials,
)


@dataclass(frozen=True)
class CombineInputs:
    """Everything a fused combine reads, as positions in the local window (module docstring)."""

    rows: torch.Tensor
    routed_starts: torch.Tensor
    shared_starts: torch.Tensor | None
    segment_offsets: torch.Tensor
    wire_position: torch.Tensor
    topk_weights: torch.Tensor
    hidden_size: int
    out_dtype: torch.dtype


FusedCombine = Callable[[CombineInputs], torch.Tensor]
"""``out[t] = sum_j w[t, j] * reply(t, j) (+ shared(t))``, accumulated in fp32."""


def reference_fused_combine(inputs: CombineInputs) -> torch.Tensor:
    """The fused combine written with torch ops (see the module docstring)."""
    rows, hidden = inputs.rows, inputs.hidden_size
    num_tokens, topk = inputs.topk_weights.shape
    num_ffn = inputs.routed_starts.numel()
    columns = torch.arange(hidden, device=rows.device)
    bounds = inputs.segment_offsets
    present = inputs.wire_position >= 0
    wire = inputs.wire_position.clamp(min=0)
    dest = torch.bucketize(wire, bounds[1:-1], right=True)
    starts = inputs.routed_starts[dest] + (wire - bounds[dest]) * hidden
    values = rows[starts[:, None] + columns].float()
    values = values.masked_fill(~present[:, None], 0.0).view(num_tokens, topk, hidden)
    weights = inputs.topk_weights.float().masked_fill(~present.view(num_tokens, topk), 0.0)
    out = (values * weights[..., None]).sum(dim=1)
    if inputs.shared_starts is not None:
        tokens = torch.arange(num_tokens, device=rows.device)
        shared = inputs.shared_starts[tokens % num_ffn] + (tokens // num_ffn) * hidden
        out += rows[shared[:, None] + columns].float()
    return out.to(inputs.out_dtype)


@dataclass(frozen=True)
class TokenRowInputs:
    """What a ``per_rank`` device pack needs beyond :class:`PackInputs` (the plan's
    ``token_rows`` say where each token row goes)."""

    topk_ids: torch.Tensor
    """``[T, k]`` integer: the router's choices (out-of-range ids are clamped; the endpoint
    reports them from the plan's ``expert_bounds``)."""
    topk_weights: torch.Tensor
    """``[T, k]`` floating point: travels as fp32, 0 where a choice is on another rank."""
    expert_owner: torch.Tensor
    """int32 ``[E]``: the FFN rank of each expert."""
    expert_local_id: torch.Tensor
    """int32 ``[E]``: each expert's id on its FFN rank."""
    route_ids: tuple[torch.Tensor, ...]
    """Per destination, int32 ``[cap, k]``: each row's local expert ids, -1 elsewhere."""
    route_weights: tuple[torch.Tensor, ...]
    """Per destination, fp32 ``[cap, k]``."""


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
    crc_base: torch.Tensor
    """int32 ``[F]``: the CRC of each destination's all-zero header (:func:`crc_tables`)."""
    crc_columns: torch.Tensor
    """int32 ``[F, max_words, 32]``: per destination, the CRC columns of its header length."""
    token_row_inputs: TokenRowInputs | None = None
    """``per_rank``: the pack writes token rows (the plan has ``token_rows``) instead of
    one row per partial."""
    hidden_address: torch.Tensor | None = None
    """int64 ``[1]`` on the device, or ``None``: the address of rows laid out as
    :attr:`hidden` (its shape, dtype and density), which the pack reads instead of
    :attr:`hidden` -- a graph-replayed dispatch's rows where its caller left them, so the
    graph copies only the ids and weights into its own buffers."""

    @property
    def row_offsets(self) -> torch.Tensor:
        """int64 ``[F + 1]`` on the device: destination ``d`` gets ``o[d + 1] - o[d]`` rows
        (its header's ROUTED_ROWS)."""
        if self.token_row_inputs is None:
            return self.plan.segment_offsets
        assert self.plan.token_row_offsets is not None
        return self.plan.token_row_offsets


DevicePack = Callable[[PackInputs], None]
"""Writes rows, source tokens and headers for every destination (module docstring)."""


class DevicePlanner(Protocol):
    """:func:`afd_protocol.plan_on_device`'s signature: a dispatch plan whose counts stay on
    the device."""

    def __call__(
        self,
        topk_ids: torch.Tensor,
        topology: Topology,
        shared_placement: SharedPlacement,
        wire_format: WireFormat = ...,
        per_partial_order: bool = ...,
    ) -> DevicePlan: ...


@functools.lru_cache(maxsize=16)
def crc_tables(
    placement: ExpertPlacement, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(crc_base [F], crc_columns [F, max_words, 32])`` as int32 tensors on ``device``.

    Destination ``d``'s header has ``HEADER_FIXED_WORDS + len(experts of d)`` words; its rows
    of ``crc_columns`` beyond that length are zero. Built once per placement and device.
    """
    lengths = [HEADER_FIXED_WORDS + n for n in placement.experts_per_rank]
    width = max(lengths)
    bases, tables = [], []
    for length in lengths:
        base, columns = crc_columns(length)
        bases.append(base)
        tables.append(list(columns) + [0] * (32 * (width - length)))
    signed = [[c - (1 << 32) if c >= 1 << 31 else c for c in t] for t in [bases, *tables]]
    base_tensor = torch.tensor(signed[0], dtype=torch.int32, device=device)
    columns_tensor = torch.tensor(signed[1:], dtype=torch.int32, device=device)
    return base_tensor, columns_tensor.view(len(lengths), width, 32)


def _rows_read(inputs: PackInputs) -> torch.Tensor:
    """The rows the pack reads: :attr:`PackInputs.hidden`, or a view of the memory at
    :attr:`PackInputs.hidden_address` with its shape and dtype (read back to the host: a
    specification may)."""
    hidden = inputs.hidden
    if inputs.hidden_address is None or hidden.numel() == 0:
        return hidden
    address = int(inputs.hidden_address[0].item())
    nbytes = hidden.numel() * hidden.element_size()
    if hidden.device.type == "cpu":
        raw = torch.frombuffer((ctypes.c_byte * nbytes).from_address(address), dtype=torch.uint8)
    else:
        from afd_transport_nvshmem.cuda_memory import device_bytes

        raw = device_bytes(address, nbytes, hidden.device)
    return raw.view(hidden.dtype).view(hidden.shape)


def reference_device_pack(inputs: PackInputs) -> None:
    """The device pack written with torch ops (see the module docstring)."""
    plan = inputs.plan
    source = _rows_read(inputs)
    segments = plan.segment_offsets
    wire = torch.arange(plan.row_token.numel(), device=segments.device)
    dest_of = torch.bucketize(wire, segments[1:-1], right=True)
    row_of = wire - segments[dest_of]
    offsets = inputs.rank_wire_offsets
    sent = inputs.row_offsets
    for dest in range(len(inputs.headers)):
        if inputs.token_row_inputs is None:
            mine = (dest_of == dest).nonzero().squeeze(1)
            rows, tokens = row_of[mine], plan.row_token[mine]
        else:
            rows, tokens = _reference_token_rows(inputs, inputs.token_row_inputs, dest)
        inputs.routed_rows[dest][rows] = source[tokens]
        inputs.route_index[dest][rows] = tokens.to(torch.int32)
        counts = plan.expert_counts[offsets[dest] : offsets[dest + 1]]
        words = torch.cat([inputs.fixed_words[dest].long(), counts])
        words[Word.ROUTED_ROWS] = sent[dest + 1] - sent[dest]
        # A specification may read back to the host: the checksum straight from its
        # definition (a kernel uses inputs.crc_columns, tested against this).
        crc = checksum(words.tolist())
        words[Word.CHECKSUM] = crc - (1 << 32) if crc >= 1 << 31 else crc
        inputs.headers[dest][: words.numel()] = words.to(torch.int32)


def _reference_token_rows(
    inputs: PackInputs, extra: TokenRowInputs, dest: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Write ``dest``'s ``per_rank`` route ids and weights; return its rows and tokens."""
    assert inputs.plan.token_rows is not None
    placed = inputs.plan.token_rows[:, dest]
    tokens = (placed >= 0).nonzero().squeeze(1)
    rows = placed[tokens]
    num_experts = extra.expert_owner.numel()
    chosen = extra.topk_ids[tokens].long().clamp(0, num_experts - 1)
    here = extra.expert_owner[chosen] == dest
    local = extra.expert_local_id[chosen]
    extra.route_ids[dest][rows] = torch.where(here, local, -1).to(torch.int32)
    weights = extra.topk_weights[tokens].float()
    extra.route_weights[dest][rows] = weights.masked_fill(~here, 0.0)
    return rows, tokens


InputFetch = Callable[[torch.Tensor, list[torch.Tensor]], None]
"""``fetch(sources, destinations)``: copy into each contiguous destination as many bytes
from the address in ``sources`` (int64 ``[len(destinations)]`` on the destinations'
device), on the current stream (:mod:`afd_transport_nvshmem.input_fetch`)."""


def reference_fetch_inputs(sources: torch.Tensor, destinations: list[torch.Tensor]) -> None:
    """:data:`InputFetch` on the CPU with ``memmove`` (the addresses must be host memory:
    the CPU tests' fetch; a GPU uses the Triton kernel's)."""
    if sources.device.type != "cpu":
        raise ValueError(
            "the reference fetch reads host addresses; on a GPU use the Triton kernels' "
            "fetch (afd_transport_nvshmem.kernels.triton_kernels)"
        )
    for address, destination in zip(sources.tolist(), destinations, strict=True):
        size = destination.numel() * destination.element_size()
        ctypes.memmove(destination.data_ptr(), address, size)


WordCopy = Callable[[torch.Tensor, torch.Tensor], None]
"""``copy(destination, source)``: copy a few contiguous words of one dtype (``source`` and
``destination`` of equal size, at most :data:`MAX_COPIED_WORDS`) between page-locked host
memory and the device, either way, on the current stream
(:mod:`afd_transport_nvshmem.word_copy`). Inside a CUDA graph a kernel node costs the
launch far less host time than a memcpy node touching host memory (about 5 µs each on
one H200)."""

MAX_COPIED_WORDS = 4096
"""The most words one :data:`WordCopy` moves (headers' fixed words, addresses, bounds)."""


def reference_copy_words(destination: torch.Tensor, source: torch.Tensor) -> None:
    """:data:`WordCopy` as torch's ``copy_`` (a memcpy; a memcpy node in a CUDA graph)."""
    destination.copy_(source, non_blocking=True)


@dataclass(frozen=True)
class WindowKernels:
    """The device kernels one kind of hardware offers the window endpoints.

    ``device_pack`` is used only together with ``fused_combine`` (a packed dispatch's
    counts never come to the host, so only the fused kernel can combine its replies).
    ``reduce_partials`` is the FFN side's: parts it hands out reduce with it in
    :meth:`~afd_protocol.core.workitem.WorkItemPart.finish`.
    """

    fused_combine: FusedCombine
    device_pack: DevicePack | None = None
    reduce_partials: PartialsReduce | None = None
    device_plan: DevicePlanner = plan_on_device
    """Plans a packed dispatch on the device (the torch reference by default; the Triton
    kernels' is three launches, where the reference is ~15-35 small ones)."""
    fetch_inputs: InputFetch | None = None
    """Copies a graphed dispatch's inputs from their addresses inside the graph (``None``:
    the graphed endpoint copies them with three host launches)."""
    copy_words: WordCopy = reference_copy_words
    """Moves a graphed dispatch's few words between page-locked host memory and the device
    (its header words and input addresses in, the expert-id bounds out)."""


REFERENCE_KERNELS = WindowKernels(
    reference_fused_combine,
    reference_device_pack,
    reference_reduce_partials,
    plan_on_device,
    reference_fetch_inputs,
)
"""The torch references as kernels: the kernel endpoint's logic, testable on any device."""
