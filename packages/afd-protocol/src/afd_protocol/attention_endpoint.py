"""The attention side of a layer: dispatch tokens to FFN ranks, then combine the replies.

Written once against :class:`~afd_protocol.transport.Transport`, so every backend shares
it. ``dispatch`` returns as soon as the writes are issued; several layers or stages may
be in flight, one per ring slot. ``combine`` waits only for the FFN ranks that received
rows (with one attention rank per DP replica; with several, every participant publishes
to every FFN rank so that readiness is decidable, and waits for all of them; a dispatch
packed on the device, whose counts the host never sees, is also sent to every FFN rank).
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import torch

from afd_protocol.device_pack import DevicePlan, PackInputs, plan_on_device
from afd_protocol.endpoint_base import EndpointBase
from afd_protocol.errors import (
    AFDError,
    ConnectorShutdown,
    PeerTimeout,
    ProtocolError,
    TopologyError,
)
from afd_protocol.fused import CombineInputs
from afd_protocol.header import HEADER_FIXED_WORDS, Header, MessageKind, decode_header, encode_words
from afd_protocol.plan import (
    DispatchPlan,
    WireOrder,
    check_expert_bounds,
    combine_scatter,
    new_accumulator,
    plan_dispatch,
)
from afd_protocol.staging import HostReadback, PinnedStaging
from afd_protocol.topology import Role
from afd_protocol.transport import Transport
from afd_protocol.views import SlotView, flag_words, slot_view
from afd_protocol.workitem import PendingDispatch


class AttentionEndpoint(EndpointBase):
    """Dispatch/combine for one attention rank (see the module docstring)."""

    role = Role.ATTENTION

    def __init__(
        self,
        transport: Transport,
        *,
        timeout: float = 30.0,
        num_layers: int | None = None,
        device_pack: bool = False,
    ) -> None:
        super().__init__(transport, timeout)
        self._reply_limits = [
            self._slot.header_limits(MessageKind.REPLY, d, num_layers=num_layers)
            for d in range(self._topology.num_ffn_ranks)
        ]
        ring_depth = self._window.ring_depth
        local = transport.local_window()
        ffn_ranks = range(self._topology.num_ffn_ranks)
        rings = range(ring_depth)
        self._send: list[list[SlotView]] = [
            [slot_view(transport.peer_window(d), self._window, self._rank, r) for r in rings]
            for d in ffn_ranks
        ]
        self._replies: list[list[SlotView]] = [
            [slot_view(local, self._window, d, r) for r in rings] for d in ffn_ranks
        ]
        self._flags = flag_words(local, self._window)
        self._reply_seen: dict[tuple[int, int], int] = {}
        self._free_rings = list(range(ring_depth))
        self._in_flight: dict[int, PendingDispatch] = {}
        self._publish_to_all = self._topology.attn_ranks_per_dp > 1
        self._fused = transport.fused_combine()
        self.fused_combine = self._fused is not None
        """Combine with the transport's fused kernel (when it has one); False: the portable
        per-FFN-rank path."""
        if self._fused is not None:
            dtype = self.dtype
            self._rows = local.view(dtype)
            itemsize = dtype.itemsize

            def starts(field: str, ring: int) -> torch.Tensor:
                offsets = [self._window.field_offset(d, ring, field) // itemsize for d in ffn_ranks]
                return torch.tensor(offsets, dtype=torch.int64, device=transport.device)

            self._small_copies = PinnedStaging(transport.device)
            self._segment_offsets = [
                torch.zeros(
                    self._topology.num_ffn_ranks + 1, dtype=torch.int64, device=transport.device
                )
                for _ in rings
            ]
            self._routed_starts = [starts("routed_rows", r) for r in rings]
            self._shared_starts = (
                [starts("shared_rows", r) for r in rings] if self._slot.shared_cap else None
            )
        self._pack = transport.device_pack() if self._fused is not None else None
        self.device_pack = device_pack and self._pack is not None
        """Pack a dispatch on the device when it cannot overflow (:mod:`afd_protocol.device_pack`:
        no host read of the counts). Off by default: on 2xH200 with the inputs ready it was
        0.2-0.35 ms per layer slower than the host plan (more, costlier launches); it pays
        only where the host read would wait behind queued compute."""
        if self._pack is not None:
            shape = (self._topology.num_ffn_ranks, HEADER_FIXED_WORDS)
            self._fixed_words = [
                torch.zeros(shape, dtype=torch.int32, device=transport.device) for _ in rings
            ]
            self._readback = HostReadback(transport.device)

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    def dispatch(
        self,
        layer_idx: int,
        hidden_states: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        stage: int = 0,
    ) -> PendingDispatch:
        """Write this layer's routed rows into the FFN ranks' windows and publish them.

        Raises :class:`CapacityError` (nothing written) if the batch does not fit, and
        :class:`TopologyError` if every ring slot already holds an un-combined dispatch.
        """
        if self._shutdown_announced:
            raise ConnectorShutdown("dispatch after announce_shutdown()")
        hidden = self._slot.hidden_size
        if hidden_states.dim() != 2 or hidden_states.shape[1] != hidden:
            raise TopologyError(
                f"hidden_states must be [num_tokens, {hidden}], got {tuple(hidden_states.shape)}"
            )
        if hidden_states.dtype != self.dtype:
            raise TopologyError(
                f"hidden_states are {hidden_states.dtype} but the window carries {self.dtype}; "
                f"cast them or configure dtype={str(hidden_states.dtype).removeprefix('torch.')}"
            )
        if (
            tuple(topk_weights.shape) != tuple(topk_ids.shape)
            or topk_ids.shape[:1] != hidden_states.shape[:1]
        ):
            raise TopologyError(
                f"topk_ids {tuple(topk_ids.shape)}, topk_weights {tuple(topk_weights.shape)} and "
                f"hidden_states {tuple(hidden_states.shape)} must agree on [num_tokens, topk]"
            )
        if layer_idx < 0 or stage < 0:
            raise TopologyError(f"layer_idx and stage must be >= 0, got {layer_idx}, {stage}")
        device = self._transport.device
        for name, tensor in (
            ("hidden_states", hidden_states),
            ("topk_ids", topk_ids),
            ("topk_weights", topk_weights),
        ):
            if tensor.device != device:
                raise TopologyError(
                    f"{name} is on {tensor.device} but this transport's window is on {device}; "
                    f"move the inputs there first"
                )
        if hidden_states.requires_grad:
            raise TopologyError(
                "hidden_states requires grad; dispatch under torch.inference_mode() or "
                "torch.no_grad() (the wire carries values, not autograd history)"
            )
        plan: DispatchPlan | DevicePlan
        if self._packs_on_device(topk_ids):
            plan = plan_on_device(topk_ids, self._topology, self._slot.shared_placement)
        else:
            plan = plan_dispatch(topk_ids, self._topology, self._slot.shared_placement, self._slot)
        if not self._free_rings:
            raise TopologyError(
                f"ring exhausted: {len(self._in_flight)} dispatches are in flight and ring_depth "
                f"is {self._window.ring_depth}; combine one first, or size ring_depth to the "
                f"number of stages in flight"
            )
        ring = self._free_rings.pop(0)
        pending = PendingDispatch(
            layer=layer_idx,
            stage=stage,
            ring=ring,
            plan=plan,
            topk_weights=topk_weights,
            dtype=hidden_states.dtype,
            hidden_size=hidden,
            issued_at=time.monotonic(),
        )
        try:
            if isinstance(plan, DevicePlan):
                self._write_packed(pending, plan, hidden_states)
                pending.device_segment_offsets = plan.segment_offsets
            else:
                destinations = (
                    range(self._topology.num_ffn_ranks)
                    if self._publish_to_all
                    else plan.destinations
                )
                self._write(pending, plan, hidden_states, destinations)
                if self._fused is not None and self.fused_combine:
                    segments = self._segment_offsets[ring]
                    self._small_copies.copy(segments, plan.segment_offsets, ring)
                    pending.device_segment_offsets = segments
            if pending.device_segment_offsets is not None:
                # Ready before the replies are: computed while the FFN ranks work.
                plan.wire_position  # noqa: B018 - computes and caches it now
        except BaseException:
            if pending.expected_ffn:
                # Some FFN ranks already have this layer: the endpoint cannot be trusted any
                # more, so tell every peer to fail fast rather than leave them waiting.
                self._transport.abort()
            else:
                self._free_rings.insert(0, ring)
            raise
        self._in_flight[ring] = pending
        return pending

    def _packs_on_device(self, topk_ids: torch.Tensor) -> bool:
        """Whether this dispatch can skip the host read of the counts: no destination can
        overflow even if every row goes to it (and there is something to send)."""
        if topk_ids.dim() != 2:
            return False  # the portable plan raises the TopologyError that says why
        num_tokens, topk = topk_ids.shape
        slot = self._slot
        return (
            self._pack is not None
            and self.device_pack
            and self.fused_combine
            and topk == slot.topk
            and 0 < num_tokens <= slot.token_cap
            and num_tokens * topk <= slot.routed_cap
            and not topk_ids.dtype.is_floating_point
            and topk_ids.dtype != torch.bool
        )

    def _write_packed(
        self, pending: PendingDispatch, plan: DevicePlan, hidden_states: torch.Tensor
    ) -> None:
        """Every FFN rank gets this layer: rows and headers written by the device pack."""
        assert self._pack is not None
        ring = pending.ring
        ffn_ranks = range(self._topology.num_ffn_ranks)
        fixed: list[int] = []
        seqs = []
        for dest in ffn_ranks:
            # ROUTED_ROWS, the counts and the checksum are left for the pack to write.
            counts = (0,) * self._slot.num_local_experts(dest)
            header = self._send_shared(pending, plan, hidden_states, dest, 0, counts)
            fixed += encode_words(header)[:HEADER_FIXED_WORDS]
            seqs.append(header.seq)
        self._small_copies.copy(self._fixed_words[ring].view(-1), fixed, ("fixed", ring))
        self._pack(
            PackInputs(
                hidden=hidden_states,
                plan=plan,
                rank_wire_offsets=self._topology.expert_placement.rank_wire_offsets,
                fixed_words=self._fixed_words[ring],
                routed_rows=tuple(self._send[d][ring].routed_rows for d in ffn_ranks),
                route_index=tuple(self._send[d][ring].route_index for d in ffn_ranks),
                headers=tuple(self._send[d][ring].header for d in ffn_ranks),
            )
        )
        self._readback.start(plan.expert_bounds, ring)
        for dest, seq in zip(ffn_ranks, seqs, strict=True):
            self._transport.publish(dest, self._window.flag_index(self._rank, ring), seq)
            pending.expected_ffn[dest] = seq

    def _write(
        self,
        pending: PendingDispatch,
        plan: DispatchPlan,
        hidden_states: torch.Tensor,
        destinations: Iterable[int],
    ) -> None:
        ring = pending.ring
        for dest in destinations:
            view = self._send[dest][ring]
            rows = plan.routed_rows(dest)
            if rows:
                tokens = plan.tokens_for(dest)
                torch.index_select(hidden_states, 0, tokens, out=view.routed_rows[:rows])
                view.route_index[:rows].copy_(tokens)
            counts = plan.host_group_list(dest)
            header = self._send_shared(pending, plan, hidden_states, dest, rows, counts)
            self._write_and_publish(view, header, dest, ring)
            pending.expected_ffn[dest] = header.seq

    def _send_shared(
        self,
        pending: PendingDispatch,
        plan: WireOrder,
        hidden_states: torch.Tensor,
        dest: int,
        routed_rows: int,
        counts: tuple[int, ...],
    ) -> Header:
        """Write ``dest``'s shared-expert rows; return the header that announces the part."""
        shared = plan.shared_rows(dest)
        if shared:
            out = self._send[dest][pending.ring].shared_rows[:shared]
            torch.index_select(hidden_states, 0, plan.shared_tokens[dest], out=out)
        return Header(
            MessageKind.DISPATCH,
            src_rank=self._rank,
            layer=pending.layer,
            stage=pending.stage,
            num_tokens=plan.num_tokens,
            routed_rows=routed_rows,
            shared_rows=shared,
            seq=self._next_seq(),
            expert_counts=counts,
        )

    def combine(self, pending: PendingDispatch, timeout: float | None = None) -> torch.Tensor:
        """Wait for the replies of ``pending`` and return the weighted sum ``[T, H]``.

        Accumulates in fp32 and returns the input dtype: in FFN-rank order on the portable
        path, in top-k choice order with the transport's fused kernel (deterministic
        either way). Safe to call again after a timeout: it then waits only for the FFN
        ranks that have not answered.
        """
        if self._in_flight.get(pending.ring) is not pending:
            raise ProtocolError(
                f"layer {pending.layer} stage {pending.stage} is not in flight on this endpoint "
                f"(already combined, or dispatched elsewhere)"
            )
        limit = self._timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        arrived = pending.arrived
        waiting = {d: s for d, s in pending.expected_ffn.items() if d not in arrived}
        ring = pending.ring
        while waiting:
            dests = sorted(waiting)
            indices = [self._window.flag_index(d, ring) for d in dests]
            last = [self._reply_seen.get((d, ring), 0) for d in dests]
            try:
                values = self._transport.wait_any(
                    indices, last, max(0.0, deadline - time.monotonic()), peers=dests
                )
            except PeerTimeout:
                raise PeerTimeout(
                    f"attention rank {self._rank}: FFN ranks {dests} did not reply to layer "
                    f"{pending.layer} stage {pending.stage} within {limit:g} s; they may be dead "
                    f"or overloaded (raise the timeout if they are merely slow)"
                ) from None
            for dest, value, old in zip(dests, values, last, strict=True):
                if value == old:
                    continue
                self._reply_seen[(dest, ring)] = value
                arrived[dest] = self._check_reply(dest, ring, value, waiting[dest], pending)
                del waiting[dest]
        plan = pending.plan
        if isinstance(plan, DevicePlan):
            # The range check the portable plan makes before writing: the bounds were read
            # back behind the pack, and the replies arriving means the stream got past it.
            low, high = self._readback.read(ring)
            if low < 0 or high >= self._topology.num_experts:
                self._release(ring)
                check_expert_bounds(low, high, self._topology.num_experts)
        if (
            self._fused is not None
            and pending.device_segment_offsets is not None
            and (self.fused_combine or isinstance(plan, DevicePlan))
        ):
            output = self._fused(
                CombineInputs(
                    rows=self._rows,
                    routed_starts=self._routed_starts[ring],
                    shared_starts=None
                    if self._shared_starts is None
                    else self._shared_starts[ring],
                    segment_offsets=pending.device_segment_offsets,
                    wire_position=plan.wire_position,
                    topk_weights=pending.topk_weights,
                    hidden_size=pending.hidden_size,
                    out_dtype=pending.dtype,
                )
            )
            self._release(ring)
            return output
        assert isinstance(plan, DispatchPlan)
        accumulator = new_accumulator(plan.num_tokens, pending.hidden_size, self._transport.device)
        for dest in sorted(arrived):
            header = arrived[dest]
            view = self._replies[dest][ring]
            shared = view.shared_rows[: header.shared_rows] if header.shared_rows else None
            combine_scatter(
                accumulator,
                plan,
                dest,
                view.routed_rows[: header.routed_rows],
                pending.topk_weights,
                shared,
            )
        self._release(ring)
        return accumulator.to(pending.dtype)

    def _release(self, ring: int) -> None:
        """The ring slot is free again: its replies have been read (or enqueued to be)."""
        del self._in_flight[ring]
        self._free_rings.append(ring)
        self._free_rings.sort()

    def _check_reply(
        self, dest: int, ring: int, flag: int, answers: int, pending: PendingDispatch
    ) -> Header:
        words = self._transport.read_header(
            self._window.flag_index(dest, ring), flag, self._replies[dest][ring].header
        )
        try:
            header = decode_header(words, self._reply_limits[dest])
        except ProtocolError as exc:
            raise ProtocolError(f"reply from FFN rank {dest} (ring {ring}): {exc}") from None
        if header.shutdown:
            raise ConnectorShutdown(
                f"FFN rank {dest} shut down while layer {pending.layer} stage {pending.stage} "
                f"was in flight"
            )
        problems = []
        if header.kind is not MessageKind.REPLY:
            problems.append(f"KIND={header.kind.name}")
        if header.src_rank != dest:
            problems.append(f"SRC_RANK={header.src_rank}")
        if header.seq != flag:
            problems.append(f"SEQ={header.seq} but the flag says {flag}")
        if header.answer_seq != answers:
            problems.append(f"ANSWER_SEQ={header.answer_seq} but this dispatch was seq {answers}")
        plan = pending.plan
        # A device-packed plan's counts never came to the host; SEQ and ANSWER_SEQ still
        # tie the reply to this dispatch.
        if isinstance(plan, DispatchPlan) and header.expert_counts != plan.host_group_list(dest):
            problems.append("EXPERT_COUNTS differ from what was sent")
        if header.shared_rows != plan.shared_rows(dest):
            problems.append(f"SHARED_ROWS={header.shared_rows}")
        if problems:
            raise ProtocolError(
                f"stale or misdirected reply from FFN rank {dest} (ring {ring}, layer "
                f"{pending.layer}): {'; '.join(problems)}"
            )
        return header

    def announce_shutdown(self) -> None:
        """Tell every FFN rank that this attention rank sends no more work."""
        if self._shutdown_announced:
            return
        if self._in_flight:
            raise AFDError(
                f"announce_shutdown() with {len(self._in_flight)} dispatches in flight; combine "
                f"them first"
            )
        for dest in range(self._topology.num_ffn_ranks):
            header = self._shutdown_header(MessageKind.DISPATCH, dest)
            self._write_and_publish(self._send[dest][0], header, dest, 0)
        self._shutdown_announced = True
