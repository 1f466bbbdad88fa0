"""The FFN rank of the per-layer transport benchmarks: it replies with the rows it got.

An identity expert keeps compute out of the measurement, so dispatch + combine time is the
plan, the transport and the weighted combine alone.
"""

from __future__ import annotations

import torch

from afd_protocol import ConnectorShutdown, FFNEndpoint, Transport


def serve_identity(transport: Transport) -> int:
    """Serve until every attention rank shuts down; returns the number of work items."""
    endpoint = FFNEndpoint(transport, timeout=120.0)
    served = 0
    while True:
        try:
            item = endpoint.next_work_item()
        except ConnectorShutdown:
            return served
        rows = [p.routed_rows for p in item.parts]
        endpoint.reply(item, rows[0] if len(rows) == 1 else torch.cat(rows))
        served += 1
