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


def serve(
    endpoint: FFNEndpoint,
    compute: Compute,
    *,
    timeout: float | None = None,
    while_idle: Literal["raise", "wait"] = "raise",
    on_protocol_error: Literal["raise", "skip"] = "raise",
    after_reply: Callable[[WorkItem], None] | None = None,
) -> ServeStats:
    """Serve work items from ``endpoint`` with ``compute`` until every attention rank shut down.

    * ``timeout``: seconds to wait for the next item (None: the endpoint's own timeout);
    * ``while_idle``: ``"raise"`` lets :class:`PeerTimeout` out when nothing arrives in
      time; ``"wait"`` keeps waiting (for deployments with idle stretches -- a dead peer
      still ends the wait with :class:`PeerAborted` through its abort word or liveness);
    * ``on_protocol_error``: ``"raise"`` fails on a malformed message; ``"skip"`` records
      it in :attr:`ServeStats.protocol_errors` and serves on (the endpoint skipped it);
    * ``after_reply``: called after each reply (instrumentation).

    Runs under ``torch.inference_mode()``. Returns on
    :class:`~afd_protocol.core.errors.ConnectorShutdown`; every other error propagates.
    """
    if while_idle not in ("raise", "wait"):
        raise InvalidArgument(f"while_idle must be 'raise' or 'wait', got {while_idle!r}")
    if on_protocol_error not in ("raise", "skip"):
        raise InvalidArgument(
            f"on_protocol_error must be 'raise' or 'skip', got {on_protocol_error!r}"
        )
    stats = ServeStats()
    dtype = endpoint.dtype
    with torch.inference_mode():
        while True:
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
            if after_reply is not None:
                after_reply(item)


__all__ = ["Compute", "ItemRecord", "ServeStats", "serve"]
