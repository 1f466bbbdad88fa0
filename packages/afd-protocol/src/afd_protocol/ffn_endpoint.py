"""The FFN side: take whichever work item is ready, reply to it.

A work item is one attention DP replica x one layer x one stage. It is ready when every
participant of the replica has published its part. Among ready items the scan start
rotates over replicas, so a replica that is ready is served within one round of the
others however fast they keep sending (no starvation). The FFN side never routes: each
part arrives grouped by local expert with its group list in the header.
"""

from __future__ import annotations

import itertools
import time

import torch

from afd_protocol.endpoint_base import EndpointBase
from afd_protocol.errors import ConnectorShutdown, PeerTimeout, ProtocolError
from afd_protocol.header import HEADER_FIXED_WORDS, Header, MessageKind, decode_header
from afd_protocol.topology import Role
from afd_protocol.transport import Transport
from afd_protocol.views import SlotView, slot_view
from afd_protocol.workitem import WorkItem, WorkItemKey, WorkItemPart


class FFNEndpoint(EndpointBase):
    """Work-item intake and replies for one FFN rank (see the module docstring)."""

    role = Role.FFN

    def __init__(
        self, transport: Transport, *, timeout: float = 30.0, num_layers: int | None = None
    ) -> None:
        super().__init__(transport, timeout)
        self._limits = self._slot.header_limits(
            MessageKind.DISPATCH, self._rank, num_layers=num_layers
        )
        ring_depth = self._window.ring_depth
        attention = range(self._topology.num_attention_ranks)
        rings = range(ring_depth)
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
        self._seen = [0] * len(self._watch)
        self._parts: dict[WorkItemKey, dict[int, WorkItemPart]] = {}
        self._arrival: dict[WorkItemKey, int] = {}
        self._counter = itertools.count()
        self._in_service: dict[WorkItemKey, WorkItem] = {}
        self._finished: set[int] = set()
        self._next_replica = 0

    @property
    def local_experts(self) -> tuple[int, ...]:
        """Global ids of this rank's routed experts, by local id."""
        return self._topology.local_experts(self._rank)

    def next_work_item(self, timeout: float | None = None) -> WorkItem:
        """The next ready work item (zero-copy views into this rank's window).

        Raises :class:`ConnectorShutdown` once every attention rank announced shutdown
        and nothing is left, :class:`PeerTimeout` if nothing became ready in time,
        :class:`PeerAborted` if an attention rank failed, and :class:`ProtocolError` for
        a malformed slot (the slot is then skipped; the endpoint stays usable).
        """
        limit = self._timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        while True:
            item = self._pick_ready()
            if item is not None:
                return item
            if len(self._finished) == self._topology.num_attention_ranks and not self._parts:
                raise ConnectorShutdown(f"FFN rank {self._rank}: every attention rank shut down")
            try:
                values = self._transport.wait_any(
                    self._watch_indices,
                    self._seen,
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
            self._ingest(values)

    def _ingest(self, values: list[int]) -> None:
        errors = []
        for i, (value, old) in enumerate(zip(values, self._seen, strict=True)):
            if value == old:
                continue
            self._seen[i] = value
            src, ring = self._watch[i]
            try:
                self._accept(src, ring, value)
            except ProtocolError as exc:
                errors.append(str(exc))
        if errors:
            raise ProtocolError("; ".join(errors))

    def _accept(self, src: int, ring: int, flag: int) -> None:
        view = self._inbox[src][ring]
        where = f"slot from attention rank {src} (ring {ring})"
        words = self._transport.read_header(self._window.flag_index(src, ring), flag, view.header)
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
        parts[src] = WorkItemPart(
            src_rank=src,
            ring=ring,
            header=header,
            routed_rows=view.routed_rows[: header.routed_rows],
            shared_rows=view.shared_rows[: header.shared_rows],
            # Taken from the header on the window's device, so an accelerator consumes the
            # counts where they landed (no host-to-device copy of the group list).
            group_list=view.header[HEADER_FIXED_WORDS : header.num_words].to(torch.int64),
            header_words=view.header[: header.num_words],
        )
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
                item = WorkItem(key, tuple(parts[s] for s in sorted(parts)))
                self._in_service[key] = item
                return item
        return None

    def reply(
        self, item: WorkItem, routed_out: torch.Tensor, shared_out: torch.Tensor | None = None
    ) -> None:
        """Write ``item``'s outputs into its sources' windows and publish them.

        ``routed_out`` has one row per routed row of the item, parts concatenated in
        ``item.parts`` order (each part grouped by local expert, as received);
        ``shared_out`` likewise for shared rows. The item's views must not be used after
        this call: the attention side may reuse the slot as soon as it sees the reply.
        """
        if self._in_service.get(item.key) is not item:
            raise ProtocolError(
                f"FFN rank {self._rank}: reply to a work item that is not in service "
                f"(replica {item.replica}, layer {item.layer}, stage {item.stage}); each item "
                f"is answered exactly once"
            )
        hidden = self._slot.hidden_size
        num_shared = sum(p.header.shared_rows for p in item.parts)
        if tuple(routed_out.shape) != (item.num_routed_rows, hidden):
            raise ProtocolError(
                f"routed_out has shape {tuple(routed_out.shape)}, expected "
                f"[{item.num_routed_rows}, {hidden}]"
            )
        if num_shared and (shared_out is None or tuple(shared_out.shape) != (num_shared, hidden)):
            got = None if shared_out is None else tuple(shared_out.shape)
            raise ProtocolError(f"shared_out has shape {got}, expected [{num_shared}, {hidden}]")
        routed_at = shared_at = 0
        for part in item.parts:
            rows, shared = part.header.routed_rows, part.header.shared_rows
            view = self._outbox[part.src_rank][part.ring]
            if rows:
                view.routed_rows[:rows].copy_(routed_out[routed_at : routed_at + rows])
            if shared and shared_out is not None:
                view.shared_rows[:shared].copy_(shared_out[shared_at : shared_at + shared])
            routed_at += rows
            shared_at += shared
            header = Header(
                MessageKind.REPLY,
                src_rank=self._rank,
                layer=part.header.layer,
                stage=part.header.stage,
                num_tokens=part.header.num_tokens,
                routed_rows=rows,
                shared_rows=shared,
                seq=self._next_seq(),
                answer_seq=part.header.seq,
                expert_counts=part.header.expert_counts,
            )
            self._write_and_publish(view, header, part.src_rank, part.ring)
        del self._in_service[item.key]

    def announce_shutdown(self) -> None:
        """Tell every attention rank that this FFN rank serves no more work."""
        if self._shutdown_announced:
            return
        for src in range(self._topology.num_attention_ranks):
            header = self._shutdown_header(MessageKind.REPLY, self._rank)
            self._write_and_publish(self._outbox[src][0], header, src, 0)
        self._shutdown_announced = True
