"""Rank programs for the multi-process CAM emulator tests (spawned by afd's launcher).

They use only the connection and the endpoint protocols, as any afd rank program does;
linear experts from a seed let each attention rank check its outputs against an
independent float64 reference computed locally.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import torch

from afd_protocol import Connection, EndpointOptions, WorkItem, relative_error, serve
from afd_protocol.testing import LinearExperts, random_routing

HIDDEN = 8


def _experts(connection: Connection, seed: int, layers: int) -> LinearExperts:
    layout = connection.layout
    return LinearExperts(layers, layout.topology.num_experts, layout.hidden_size, seed)


def attention_linear(
    connection: Connection,
    *,
    seed: int,
    layers: int,
    tokens: list[int],
    timeout: float = 30.0,
    start_after: float = 0.0,
) -> list[float]:
    """Dispatch and combine ``layers`` layers, the first ``start_after`` seconds after the
    connection opened; returns each layer's relative error."""
    endpoint = connection.attention_endpoint(EndpointOptions(timeout=timeout))
    time.sleep(start_after)
    experts = _experts(connection, seed, layers)
    topo = connection.layout.topology
    errors = []
    for layer in range(layers):
        gen = torch.Generator().manual_seed(1000 * connection.rank + layer)
        n = tokens[layer % len(tokens)]
        x, ids, w = random_routing(
            n, connection.layout.hidden_size, 2, range(topo.num_experts), gen
        )
        handle = endpoint.dispatch(layer, x, ids, w)
        out = endpoint.combine(handle)
        errors.append(relative_error(out, experts.reference(layer, x, ids, w, False)))
    endpoint.announce_shutdown()
    return errors


def attention_leaves(connection: Connection) -> None:
    """Open the attention endpoint and close without announcing shutdown (a bug)."""
    connection.attention_endpoint(EndpointOptions(timeout=5.0))


def ffn_leaves(connection: Connection) -> None:
    """Open the FFN endpoint and close without serving (a bug)."""
    connection.ffn_endpoint(EndpointOptions(timeout=5.0))


def ffn_linear(
    connection: Connection,
    *,
    seed: int,
    layers: int,
    timeout: float = 30.0,
    die_after: int | None = None,
) -> list[tuple[int, int]]:
    """Serve with linear experts until every replica shut down; returns (replica, layer)."""
    endpoint = connection.ffn_endpoint(EndpointOptions(timeout=timeout))
    linear = _experts(connection, seed, layers).compute_for(endpoint)
    computed = 0

    def compute(item: WorkItem) -> Any:
        nonlocal computed
        if die_after is not None and computed >= die_after:
            os.kill(os.getpid(), signal.SIGKILL)
        computed += 1
        return linear(item)

    stats = serve(endpoint, compute)
    return [(r.replica, r.layer) for r in stats.items]
