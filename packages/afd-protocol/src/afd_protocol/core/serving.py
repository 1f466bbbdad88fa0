"""The FFN serving loop: take the next ready work item, compute it, reply; until shutdown.

Every FFN rank runs this one loop, whatever computes the experts (a DeepSeek executor,
linear test experts, an identity for benchmarks) and whatever the transport: the loop
owns intake, the reply, clean exit on shutdown and what to do while idle, so those rules
are written and tested once.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch

from afd_protocol.core.endpoints import FFNEndpoint
from afd_protocol.core.errors import (
    ConnectorShutdown,
    InvalidArgument,
    PeerTimeout,
    ProtocolError,
)
from afd_protocol.core.workitem import WorkItem

Compute = Callable[[WorkItem], tuple[torch.Tensor, torch.Tensor | None]]
"""``compute(item) -> (routed_out, shared_out)`` in the shapes
:meth:`~afd_protocol.core.endpoints.FFNEndpoint.reply` takes (any float dtype: the loop
casts to the wire's)."""


@dataclass(frozen=True)
class ItemRecord:
    """One served work item, with ``time.monotonic()`` marks (comparable across processes
    on Linux, so a launcher can put every rank on one timeline)."""

    replica: int
    layer: int
    stage: int
    routed_rows: int
    shared_rows: int
    src_ranks: tuple[int, ...]
    taken: float
    """When the item was handed to the loop (waiting ended)."""
    computed: float
    replied: float


@dataclass
class ServeStats:
    """What :func:`serve` did, item by item."""

    items: list[ItemRecord] = field(default_factory=list)
    protocol_errors: list[str] = field(default_factory=list)
    """Malformed messages skipped (only with ``on_protocol_error="skip"``)."""

    @property
    def busy_s(self) -> float:
        """Seconds spent computing and replying (the rest was waiting for work)."""
        return sum(r.replied - r.taken for r in self.items)

    @property
    def routed_rows(self) -> int:
        return sum(r.routed_rows for r in self.items)

    @property
    def shared_rows(self) -> int:
        return sum(r.shared_rows for r in self.items)

    @property
    def served(self) -> list[tuple[int, int, int]]:
        """``(replica, layer, stage)`` of every item, in service order."""
        return [(r.replica, r.layer, r.stage) for r in self.items]

    def per_replica(self, num_replicas: int = 0) -> list[int]:
        """Items served per attention replica: index ``r`` counts replica ``r``'s items; at
        least ``num_replicas`` entries (replicas that sent nothing count 0). Reads the items
        served so far, so it may be called while :func:`serve` fills these stats."""
        counts = [0] * num_replicas
        for record in list(self.items):
            if record.replica >= len(counts):
                counts.extend([0] * (record.replica + 1 - len(counts)))
            counts[record.replica] += 1
        return counts


def serve(
    endpoint: FFNEndpoint,
    compute: Compute,
    *,
    timeout: float | None = None,
    while_idle: Literal["raise", "wait"] = "raise",
    on_protocol_error: Literal["raise", "skip"] = "raise",
    after_reply: Callable[[WorkItem], None] | None = None,
    max_items: int | None = None,
    stats: ServeStats | None = None,
) -> ServeStats:
    """Serve work items from ``endpoint`` with ``compute`` until every attention rank shut down.

    * ``timeout``: seconds to wait for the next item (None: the endpoint's own timeout);
    * ``while_idle``: ``"raise"`` lets :class:`PeerTimeout` out when nothing arrives in
      time; ``"wait"`` keeps waiting (for deployments with idle stretches -- a dead peer
      still ends the wait with :class:`PeerAborted` through its abort word or liveness);
    * ``on_protocol_error``: ``"raise"`` fails on a malformed message; ``"skip"`` records
      it in :attr:`ServeStats.protocol_errors` and serves on (the endpoint skipped it);
    * ``after_reply``: called after each reply (instrumentation);
    * ``max_items``: return after serving this many items (None: no limit);
    * ``stats``: the :class:`ServeStats` to record into (default: a new one); filled item
      by item, so a caller holding it sees the service live (a signal handler's report)
      and keeps what was served when an error ends the loop.

    ``compute`` takes each :class:`~afd_protocol.core.workitem.WorkItem` as the endpoint
    gives it (rows ``[rows, hidden]`` in the wire's dtype on the endpoint's device) and
    returns ``(routed_out [routed rows, hidden], shared_out [shared rows, hidden] or
    None)`` in any float dtype; the loop casts them to :attr:`FFNEndpoint.dtype`.

    Runs under ``torch.inference_mode()``. Returns the stats on
    :class:`~afd_protocol.core.errors.ConnectorShutdown` or after ``max_items``; every other
    error propagates.
    """
    if while_idle not in ("raise", "wait"):
        raise InvalidArgument(f"while_idle must be 'raise' or 'wait', got {while_idle!r}")
    if on_protocol_error not in ("raise", "skip"):
        raise InvalidArgument(
            f"on_protocol_error must be 'raise' or 'skip', got {on_protocol_error!r}"
        )
    if max_items is not None and max_items < 0:
        raise InvalidArgument(f"max_items must be >= 0 or None, got {max_items}")
    stats = ServeStats() if stats is None else stats
    dtype = endpoint.dtype
    served = 0
    with torch.inference_mode():
        while max_items is None or served < max_items:
            try:
                item = endpoint.next_work_item(timeout)
            except ConnectorShutdown:
                return stats
            except PeerTimeout:
                if while_idle == "wait":
                    continue
                raise
            except ProtocolError as exc:
                if on_protocol_error == "skip":
                    stats.protocol_errors.append(str(exc))
                    continue
                raise
            taken = time.monotonic()
            routed, shared = compute(item)
            computed = time.monotonic()
            endpoint.reply(item, routed.to(dtype), None if shared is None else shared.to(dtype))
            replied = time.monotonic()
            stats.items.append(
                ItemRecord(
                    replica=item.replica,
                    layer=item.layer,
                    stage=item.stage,
                    routed_rows=item.num_routed_rows,
                    shared_rows=item.num_shared_rows,
                    src_ranks=tuple(p.src_rank for p in item.parts),
                    taken=taken,
                    computed=computed,
                    replied=replied,
                )
            )
            served += 1
            if after_reply is not None:
                after_reply(item)
    return stats


__all__ = ["Compute", "ItemRecord", "ServeStats", "serve"]
