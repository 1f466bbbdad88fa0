"""The attention side over a window transport: dispatch tokens to FFN ranks, combine replies.

Written once against :class:`~afd_protocol.window.transport.WindowTransport`, so every
window backend shares it; it implements
:class:`~afd_protocol.core.endpoints.AttentionEndpoint`. ``dispatch`` plans on the host
(:func:`~afd_protocol.core.plan.plan_dispatch`), writes each destination's rows with one
``index_select`` into its window, publishes, and returns as soon as the writes are
issued; several layers or stages may be in flight, one per ring slot. ``combine`` waits
only for the FFN ranks that received rows (with one attention rank per DP replica; with
several, every participant publishes to every FFN rank so that readiness is decidable,
and waits for all of them) and sums their replies with the top-k weights in fp32
(:func:`~afd_protocol.core.plan.combine_scatter`).

A backend with device kernels extends it in its own package (the NVSHMEM transport's
``afd_transport_nvshmem.kernel_attention.KernelAttentionEndpoint``). What a subclass may
override or call is this class's extension surface, kept stable within afd: the hooks
``_setup`` (call the base first), ``_check_kernel_options``, ``_plan``, ``_send`` and
``_combine_arrived``; and ``_dispatch_header`` (``_write_shared_rows`` then ``_header``),
``_next_ring``, ``_release``, ``_send_views``, ``_slot``,
``_topology``, ``_window``, ``_rank``, ``_transport``, ``_reduced_replies``, with
:class:`WindowDispatch` and :class:`ExpectedReply` (exported by :mod:`afd_protocol.window`).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from afd_protocol.core.endpoints import DispatchHandle, EndpointOptions, check_dispatch_inputs
from afd_protocol.core.errors import (
    AFDError,
    ConnectorShutdown,
    InvalidArgument,
    PeerTimeout,
    ProtocolError,
    RingExhausted,
)
from afd_protocol.core.header import FLAG_ROWS_PER_TOKEN, Header, MessageKind, decode_header
from afd_protocol.core.layout import CombineReduce
from afd_protocol.core.plan import (
    DispatchPlan,
    WireOrder,
    combine_reduced,
    combine_scatter,
    new_accumulator,
    plan_dispatch,
)
from afd_protocol.core.topology import Role
from afd_protocol.window.common import WindowEndpoint
from afd_protocol.window.transport import Arrivals, WindowTransport
from afd_protocol.window.views import SlotView, slot_view


@dataclass(frozen=True)
class ExpectedReply:
    """What the reply of one FFN rank must say."""

    seq: int
    """The dispatch's sequence number, which the reply's ANSWER_SEQ must carry."""
    counts: tuple[int, ...] | None
    """The expert counts sent (None: they never came to the host)."""
    shared_rows: int


@dataclass(eq=False)
class WindowDispatch:
    """The handle ``dispatch`` returns; pass it to ``combine``.

    Only ``layer``, ``stage``, ``ring`` and ``ffn_ranks`` are meant to be read; the rest
    is the endpoint's bookkeeping between the two calls.
    """

    layer: int
    stage: int
    ring: int
    plan: WireOrder
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    dtype: torch.dtype
    expected: dict[int, ExpectedReply] = field(default_factory=dict)
    arrived: dict[int, Header] = field(default_factory=dict)
    """Replies already received and checked (a retried combine waits only for the rest)."""
    device_segments: torch.Tensor | None = None
    """The plan's segment bounds on the device, for a fused combine (None: not used)."""

    @property
    def ffn_ranks(self) -> tuple[int, ...]:
        """The FFN ranks this dispatch was sent to, and whose replies combine waits for."""
        return tuple(sorted(self.expected))


class WindowAttentionEndpoint(WindowEndpoint):
    """Dispatch/combine for one attention rank (see the module docstring)."""

    role = Role.ATTENTION

    def __init__(self, transport: WindowTransport, options: EndpointOptions | None = None) -> None:
        super().__init__(transport, options)

    def _setup(self) -> None:
        self._reduced_replies = self._slot.per_rank and (
            self._slot.combine_reduce is CombineReduce.FFN
        )
        self._check_kernel_options()
        transport = self._transport
        self._reply_limits = [
            self._slot.header_limits(
                MessageKind.REPLY,
                d,
                num_layers=self.options.num_layers,
                num_stages=self.options.num_stages,
            )
            for d in range(self._topology.num_ffn_ranks)
        ]
        rings = range(self._window.ring_depth)
        local = transport.local_window()
        ffn_ranks = range(self._topology.num_ffn_ranks)
        self._send_views: list[list[SlotView]] = [
            [slot_view(transport.peer_window(d), self._window, self._rank, r) for r in rings]
            for d in ffn_ranks
        ]
        self._reply_views: list[list[SlotView]] = [
            [slot_view(local, self._window, d, r) for r in rings] for d in ffn_ranks
        ]
        self._free_rings = list(rings)
        self._in_flight: dict[int, WindowDispatch] = {}
        self._publish_to_all = self._topology.attn_ranks_per_dp > 1

    def _check_kernel_options(self) -> None:
        """Refuse options that need device kernels: this endpoint has none."""
        if self.options.combine == "fused" or self.options.device_pack is True:
            raise InvalidArgument(
                f"combine={self.options.combine!r}, device_pack={self.options.device_pack} "
                f"need device kernels, which this {type(self._transport).__name__} does not "
                f"offer; use the defaults (combine='auto', device_pack=None)"
            )

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    def _work_in_progress(self) -> int:
        return len(self._in_flight)

    # ---- dispatch -----------------------------------------------------------------------

    def dispatch(
        self,
        layer_idx: int,
        hidden_states: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        stage: int = 0,
    ) -> WindowDispatch:
        """Write this layer's routed rows into the FFN ranks' windows and publish them.

        See :meth:`afd_protocol.core.endpoints.AttentionEndpoint.dispatch`.
        """
        self._check_open()
        if self._shutdown_announced:
            raise ConnectorShutdown("dispatch after announce_shutdown()")
        check_dispatch_inputs(
            self._slot,
            self.options,
            self._transport.device,
            "window",
            layer_idx,
            stage,
            hidden_states,
            topk_ids,
            topk_weights,
        )
        plan = self._plan(topk_ids)
        if not self._free_rings:
            raise RingExhausted(
                f"ring exhausted: {len(self._in_flight)} dispatches are in flight and ring_depth "
                f"is {self._window.ring_depth}; combine one first, or size ring_depth to the "
                f"number of stages in flight"
            )
        ring = self._free_rings.pop(0)
        handle = WindowDispatch(
            layer=layer_idx,
            stage=stage,
            ring=ring,
            plan=plan,
            topk_ids=topk_ids,
            topk_weights=topk_weights,
            dtype=hidden_states.dtype,
        )
        try:
            self._send(handle, hidden_states)
        except BaseException:
            if handle.expected:
                # Some FFN ranks already have this layer: the endpoint cannot be trusted any
                # more, so tell every peer to fail fast rather than leave them waiting.
                self._transport.abort()
            else:
                self._free_rings.insert(0, ring)
            raise
        self._in_flight[ring] = handle
        return handle

    def _next_ring(self) -> int | None:
        """The ring slot the next dispatch takes (None: every slot is in flight)."""
        return self._free_rings[0] if self._free_rings else None

    def _plan(self, topk_ids: torch.Tensor) -> WireOrder:
        """The dispatch plan (capacities checked here, before any ring is taken)."""
        return plan_dispatch(topk_ids, self._topology, self._slot.shared_placement, self._slot)

    def _send(self, handle: WindowDispatch, hidden_states: torch.Tensor) -> None:
        """Write and publish every destination's part of ``handle``."""
        plan = handle.plan
        assert isinstance(plan, DispatchPlan)
        destinations: Iterable[int] = (
            range(self._topology.num_ffn_ranks) if self._publish_to_all else plan.destinations
        )
        ring = handle.ring
        weights = plan.rank_weights(handle.topk_weights) if plan.per_rank else None
        for dest in destinations:
            view = self._send_views[dest][ring]
            if weights is None:
                rows = plan.routed_rows(dest)
                tokens = plan.tokens_for(dest)
            else:
                rows = plan.rank_rows(dest)
                segment = plan.rank_segment(dest)
                assert plan.rank_tokens is not None
                assert plan.rank_local_ids is not None
                tokens = plan.rank_tokens[segment]
                view.route_ids[:rows].copy_(plan.rank_local_ids[segment])
                view.route_weights[:rows].copy_(weights[segment])
            if rows:
                torch.index_select(hidden_states, 0, tokens, out=view.routed_rows[:rows])
                view.route_index[:rows].copy_(tokens)
            counts = plan.host_group_list(dest)
            header = self._dispatch_header(handle, hidden_states, dest, rows, counts)
            self._write_and_publish(view, header, dest, ring)
            handle.expected[dest] = ExpectedReply(header.seq, counts, header.shared_rows)

    def _dispatch_header(
        self,
        handle: WindowDispatch,
        hidden_states: torch.Tensor,
        dest: int,
        routed_rows: int,
        counts: tuple[int, ...],
    ) -> Header:
        """Write ``dest``'s shared-expert rows; return the header that announces the part."""
        self._write_shared_rows(handle.plan, handle.ring, hidden_states, dest)
        return self._header(handle, dest, routed_rows, counts)

    def _write_shared_rows(
        self, plan: WireOrder, ring: int, hidden_states: torch.Tensor, dest: int
    ) -> None:
        """Copy the rows of ``dest``'s shared-expert tokens into its slot (none: nothing)."""
        shared = plan.shared_rows(dest)
        if shared:
            out = self._send_views[dest][ring].shared_rows[:shared]
            torch.index_select(hidden_states, 0, plan.shared_tokens[dest], out=out)

    def _header(
        self, handle: WindowDispatch, dest: int, routed_rows: int, counts: tuple[int, ...]
    ) -> Header:
        """The header that announces ``dest``'s part of ``handle`` (takes a sequence number)."""
        plan = handle.plan
        shared = plan.shared_rows(dest)
        return Header(
            MessageKind.DISPATCH,
            src_rank=self._rank,
            layer=handle.layer,
            stage=handle.stage,
            num_tokens=plan.num_tokens,
            routed_rows=routed_rows,
            shared_rows=shared,
            seq=self._transport.sequence.next(),
            flags=FLAG_ROWS_PER_TOKEN if self._slot.per_rank else 0,
            expert_counts=counts,
        )

    # ---- combine ------------------------------------------------------------------------

    def combine(self, handle: DispatchHandle, timeout: float | None = None) -> torch.Tensor:
        """Wait for the replies of ``handle`` and return the weighted sum ``[T, H]``.

        See :meth:`afd_protocol.core.endpoints.AttentionEndpoint.combine`. Accumulates in
        fp32 and returns the input dtype: in FFN-rank order on the portable path, in top-k
        choice order with a fused kernel (deterministic either way).
        """
        self._check_open()
        if not isinstance(handle, WindowDispatch) or self._in_flight.get(handle.ring) is not handle:
            raise InvalidArgument(
                f"layer {handle.layer} stage {handle.stage} is not in flight on this endpoint "
                f"(already combined, or dispatched elsewhere)"
            )
        self._await_replies(handle, self._timeout if timeout is None else timeout)
        output = self._combine_arrived(handle)
        self._release(handle.ring)
        return output

    def _await_replies(self, handle: WindowDispatch, limit: float) -> None:
        deadline = time.monotonic() + limit
        ring = handle.ring
        waiting = {d: e for d, e in handle.expected.items() if d not in handle.arrived}
        seen = self._transport.seen
        while waiting:
            dests = sorted(waiting)
            indices = [self._window.flag_index(d, ring) for d in dests]
            last = [seen[i] for i in indices]
            try:
                arrivals = self._transport.wait_any(
                    indices, last, max(0.0, deadline - time.monotonic()), peers=dests
                )
            except PeerTimeout:
                raise PeerTimeout(
                    f"attention rank {self._rank}: FFN ranks {dests} did not reply to layer "
                    f"{handle.layer} stage {handle.stage} within {limit:g} s; they may be dead "
                    f"or overloaded (raise the timeout if they are merely slow)"
                ) from None
            for dest, index, value, old in zip(dests, indices, arrivals.values, last, strict=True):
                if value == old:
                    continue
                seen[index] = value
                handle.arrived[dest] = self._check_reply(
                    dest, arrivals, value, waiting[dest], handle
                )
                del waiting[dest]

    def _combine_arrived(self, handle: WindowDispatch) -> torch.Tensor:
        """The weighted sum of the replies that all arrived (portable: per FFN rank)."""
        plan = handle.plan
        assert isinstance(plan, DispatchPlan)
        accumulator = new_accumulator(plan.num_tokens, self._slot.hidden_size, self.device)
        for dest in sorted(handle.arrived):
            header = handle.arrived[dest]
            view = self._reply_views[dest][handle.ring]
            shared = view.shared_rows[: header.shared_rows] if header.shared_rows else None
            routed = view.routed_rows[: header.routed_rows]
            if self._reduced_replies:
                combine_reduced(accumulator, plan, dest, routed, shared)
            else:
                combine_scatter(accumulator, plan, dest, routed, handle.topk_weights, shared)
        return accumulator.to(handle.dtype)

    def _release(self, ring: int) -> None:
        """The ring slot is free again: its replies have been read (or enqueued to be)."""
        del self._in_flight[ring]
        self._free_rings.append(ring)
        self._free_rings.sort()

    def _check_reply(
        self,
        dest: int,
        arrivals: Arrivals,
        flag: int,
        expected: ExpectedReply,
        handle: WindowDispatch,
    ) -> Header:
        ring = handle.ring
        index = self._window.flag_index(dest, ring)
        words = self._header_words(arrivals, index, self._reply_views[dest][ring])
        try:
            header = decode_header(words, self._reply_limits[dest])
        except ProtocolError as exc:
            raise ProtocolError(f"reply from FFN rank {dest} (ring {ring}): {exc}") from None
        if header.shutdown:
            raise ConnectorShutdown(
                f"FFN rank {dest} shut down while layer {handle.layer} stage {handle.stage} "
                f"was in flight"
            )
        problems = []
        if header.kind is not MessageKind.REPLY:
            problems.append(f"KIND={header.kind.name}")
        if header.src_rank != dest:
            problems.append(f"SRC_RANK={header.src_rank}")
        if header.seq != flag:
            problems.append(f"SEQ={header.seq} but the flag says {flag}")
        if header.answer_seq != expected.seq:
            problems.append(
                f"ANSWER_SEQ={header.answer_seq} but this dispatch was seq {expected.seq}"
            )
        if (header.layer, header.stage) != (handle.layer, handle.stage):
            problems.append(f"LAYER={header.layer} STAGE={header.stage}")
        if expected.counts is not None and header.expert_counts != expected.counts:
            problems.append("EXPERT_COUNTS differ from what was sent")
        if header.shared_rows != expected.shared_rows:
            problems.append(f"SHARED_ROWS={header.shared_rows}")
        if problems:
            raise ProtocolError(
                f"stale or misdirected reply from FFN rank {dest} (ring {ring}, layer "
                f"{handle.layer}): {'; '.join(problems)}"
            )
        return header

    # ---- shutdown -----------------------------------------------------------------------

    def announce_shutdown(self) -> None:
        """Tell every FFN rank that this attention rank sends no more work."""
        if self._shutdown_announced:
            return
        self._check_open()
        if self._in_flight:
            raise AFDError(
                f"announce_shutdown() with {len(self._in_flight)} dispatches in flight; combine "
                f"them first"
            )
        for dest in range(self._topology.num_ffn_ranks):
            header = self._shutdown_header(MessageKind.DISPATCH, dest)
            self._write_and_publish(self._send_views[dest][0], header, dest, 0)
        self._transport.shutdown_announced = True
