"""The FFN side over a window transport: take whichever work item is ready, reply to it.

Implements :class:`~afd_protocol.core.endpoints.FFNEndpoint`. A work item is one
attention DP replica x one layer x one stage; it is ready when every participant of the
replica has published its part. Among ready items the scan start rotates over replicas,
so a replica that is ready is served within one round of the others however fast they
keep sending (no starvation). The FFN side never routes: each part arrives grouped by
local expert with its group list in the header.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from dataclasses import dataclass

import torch

from afd_protocol.core.endpoints import EndpointOptions
from afd_protocol.core.errors import ConnectorShutdown, InvalidArgument, PeerTimeout, ProtocolError
from afd_protocol.core.header import (
    FLAG_ROWS_PER_TOKEN,
    HEADER_FIXED_WORDS,
    Header,
    MessageKind,
    Word,
    decode_header,
)
from afd_protocol.core.layout import CombineReduce
from afd_protocol.core.topology import Role
from afd_protocol.core.workitem import PartialsReduce, WorkItem, WorkItemKey, WorkItemPart
from afd_protocol.window.common import WindowEndpoint
from afd_protocol.window.transport import Arrivals, WindowTransport
from afd_protocol.window.views import SlotView, slot_view


@dataclass(frozen=True)
class _Received:
    """One part as it arrived: the public view and what the reply needs."""

    part: WorkItemPart
    ring: int
    header: Header


class WindowFFNEndpoint(WindowEndpoint):
    """Work-item intake and replies for one FFN rank (see the module docstring)."""

    role = Role.FFN

    def __init__(
        self,
        transport: WindowTransport,
        options: EndpointOptions | None = None,
        reduce_partials: PartialsReduce | None = None,
    ) -> None:
        """``reduce_partials``: a backend's device kernel for the FFN-side reduce of
        ``per_rank`` partials, handed out with each part (``None``: the torch reference)."""
        self._reduce_kernel = reduce_partials
        super().__init__(transport, options)

    def _setup(self) -> None:
        transport = self._transport
        self._limits = self._slot.header_limits(
            MessageKind.DISPATCH,
            self._rank,
            num_layers=self.options.num_layers,
            num_stages=self.options.num_stages,
        )
        rings = range(self._window.ring_depth)
        attention = range(self._topology.num_attention_ranks)
        local = transport.local_window()
        self._inbox: list[list[SlotView]] = [
            [slot_view(local, self._window, a, r) for r in rings] for a in attention
        ]
        self._outbox: list[list[SlotView]] = [
            [slot_view(transport.peer_window(a), self._window, self._rank, r) for r in rings]
            for a in attention
        ]
        self._watch = [(a, r) for a in attention for r in rings]
        self._watch_indices = [self._window.flag_index(a, r) for a, r in self._watch]
        self._parts: dict[WorkItemKey, dict[int, _Received]] = {}
        self._arrival: dict[WorkItemKey, int] = {}
        self._counter = itertools.count()
        self._in_service: dict[WorkItemKey, tuple[WorkItem, list[_Received]]] = {}
        self._finished: set[int] = set()
        self._next_replica = 0
        self._reduce_on_ffn = self._slot.combine_reduce is CombineReduce.FFN
        self._reply_flags = FLAG_ROWS_PER_TOKEN if self._reduce_on_ffn else 0

    def _work_in_progress(self) -> int:
        # Items taken but not answered, and parts received but not yet taken: a later
        # endpoint would not see them again (their flags were consumed).
        return len(self._in_service) + len(self._parts)

    @property
    def local_experts(self) -> tuple[int, ...]:
        """Global ids of this rank's routed experts, by local id."""
        return self._topology.local_experts(self._rank)

    def next_work_item(self, timeout: float | None = None) -> WorkItem:
        """The next ready work item (zero-copy views into this rank's window).

        See :meth:`afd_protocol.core.endpoints.FFNEndpoint.next_work_item`.
        """
        self._check_open()
        limit = self._timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        while True:
            item = self._pick_ready()
            if item is not None:
                return item
            if len(self._finished) == self._topology.num_attention_ranks and not self._parts:
                raise ConnectorShutdown(f"FFN rank {self._rank}: every attention rank shut down")
            seen = self._transport.seen
            try:
                arrivals = self._transport.wait_any(
                    self._watch_indices,
                    [seen[i] for i in self._watch_indices],
                    max(0.0, deadline - time.monotonic()),
                    # A rank that announced shutdown may exit: stop watching its liveness.
                    peers=[
                        a
                        for a in range(self._topology.num_attention_ranks)
                        if a not in self._finished
                    ],
                )
            except PeerTimeout:
                raise PeerTimeout(
                    f"FFN rank {self._rank}: no work item became ready within {limit:g} s"
                ) from None
            self._ingest(arrivals)

    def _ingest(self, arrivals: Arrivals) -> None:
        errors = []
        seen = self._transport.seen
        for (src, ring), index, value in zip(
            self._watch, self._watch_indices, arrivals.values, strict=True
        ):
            if value == seen[index]:
                continue
            seen[index] = value
            try:
                self._accept(src, ring, index, value, arrivals)
            except ProtocolError as exc:
                errors.append(str(exc))
        if errors:
            raise ProtocolError("; ".join(errors))

    def _accept(self, src: int, ring: int, index: int, flag: int, arrivals: Arrivals) -> None:
        view = self._inbox[src][ring]
        where = f"slot from attention rank {src} (ring {ring})"
        words = self._header_words(arrivals, index, view)
        try:
            header = decode_header(words, self._limits)
        except ProtocolError as exc:
            raise ProtocolError(f"FFN rank {self._rank}: {where}: {exc}") from None
        if header.kind is not MessageKind.DISPATCH or header.src_rank != src or header.seq != flag:
            raise ProtocolError(
                f"FFN rank {self._rank}: {where} is inconsistent: KIND={header.kind.name}, "
                f"SRC_RANK={header.src_rank}, SEQ={header.seq} (flag {flag})"
            )
        if header.shutdown:
            self._finished.add(src)
            return
        key = WorkItemKey(self._topology.dp_replica_of(src), header.layer, header.stage)
        parts = self._parts.get(key, {})
        if src in parts or key in self._in_service:
            raise ProtocolError(
                f"FFN rank {self._rank}: attention rank {src} published layer {header.layer} "
                f"stage {header.stage} again before it was answered"
            )
        self._parts[key] = parts
        part = WorkItemPart(
            src_rank=src,
            num_tokens=header.num_tokens,
            routed_rows=view.routed_rows[: header.routed_rows],
            shared_rows=view.shared_rows[: header.shared_rows],
            # Taken from the header on the window's device, so an accelerator consumes the
            # counts where they landed (no host-to-device copy of the group list).
            group_list=view.header[HEADER_FIXED_WORDS : header.num_words].to(torch.int64),
            layer_index=view.header[Word.LAYER : Word.LAYER + 1],
        )
        if header.rows_per_token:
            rows = header.routed_rows
            part = dataclasses.replace(
                part,
                route_ids=view.route_ids[:rows],
                route_weights=view.route_weights[:rows],
                reduce_on_ffn=self._reduce_on_ffn,
                partials_hint=header.num_partials,
                reduce_kernel=self._reduce_kernel,
            )
        parts[src] = _Received(part, ring, header)
        self._arrival.setdefault(key, next(self._counter))

    def _pick_ready(self) -> WorkItem | None:
        replicas = self._topology.num_dp_replicas
        ready = [
            key
            for key, parts in self._parts.items()
            if len(parts) == self._topology.attn_ranks_per_dp
        ]
        if not ready:
            return None
        for offset in range(replicas):
            replica = (self._next_replica + offset) % replicas
            candidates = [k for k in ready if k.replica == replica]
            if candidates:
                key = min(candidates, key=self._arrival.__getitem__)
                self._next_replica = (replica + 1) % replicas
                parts = self._parts.pop(key)
                del self._arrival[key]
                received = [parts[s] for s in sorted(parts)]
                item = WorkItem(key, tuple(r.part for r in received))
                self._in_service[key] = (item, received)
                return item
        return None

    def reply(
        self, item: WorkItem, routed_out: torch.Tensor, shared_out: torch.Tensor | None = None
    ) -> None:
        """Write ``item``'s outputs into its sources' windows and publish them.

        See :meth:`afd_protocol.core.endpoints.FFNEndpoint.reply`.
        """
        self._check_open()
        entry = self._in_service.get(item.key)
        if entry is None or entry[0] is not item:
            raise InvalidArgument(
                f"FFN rank {self._rank}: reply to a work item that is not in service "
                f"(replica {item.replica}, layer {item.layer}, stage {item.stage}); each item "
                f"is answered exactly once"
            )
        hidden = self._slot.hidden_size
        num_shared = item.num_shared_rows
        if tuple(routed_out.shape) != (item.num_routed_rows, hidden):
            raise InvalidArgument(
                f"routed_out has shape {tuple(routed_out.shape)}, expected "
                f"[{item.num_routed_rows}, {hidden}]"
            )
        if num_shared and (shared_out is None or tuple(shared_out.shape) != (num_shared, hidden)):
            got = None if shared_out is None else tuple(shared_out.shape)
            raise InvalidArgument(f"shared_out has shape {got}, expected [{num_shared}, {hidden}]")
        for name, out in (("routed_out", routed_out), ("shared_out", shared_out)):
            if out is not None and out.numel() and out.dtype != self.dtype:
                raise InvalidArgument(
                    f"{name} is {out.dtype} but the window carries {self.dtype}; cast it first"
                )
        routed_at = shared_at = 0
        for received in entry[1]:
            sent = received.header
            rows, shared = received.part.num_reply_rows, sent.shared_rows
            view = self._outbox[sent.src_rank][received.ring]
            if rows:
                view.routed_rows[:rows].copy_(routed_out[routed_at : routed_at + rows])
            if shared and shared_out is not None:
                view.shared_rows[:shared].copy_(shared_out[shared_at : shared_at + shared])
            routed_at += rows
            shared_at += shared
            header = Header(
                MessageKind.REPLY,
                src_rank=self._rank,
                layer=sent.layer,
                stage=sent.stage,
                num_tokens=sent.num_tokens,
                routed_rows=rows,
                shared_rows=shared,
                seq=self._transport.sequence.next(),
                answer_seq=sent.seq,
                flags=self._reply_flags if sent.rows_per_token else 0,
                expert_counts=sent.expert_counts,
            )
            self._write_and_publish(view, header, sent.src_rank, received.ring)
        del self._in_service[item.key]

    def announce_shutdown(self) -> None:
        """Tell every attention rank that this FFN rank serves no more work."""
        if self._shutdown_announced:
            return
        self._check_open()
        for src in range(self._topology.num_attention_ranks):
            header = self._shutdown_header(MessageKind.REPLY, self._rank)
            self._write_and_publish(self._outbox[src][0], header, src, 0)
        self._transport.shutdown_announced = True
