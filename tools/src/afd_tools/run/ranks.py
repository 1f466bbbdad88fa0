"""The programs that run inside the rank processes of ``afd run``.

Attention replicas (and colocated DP+EP ranks) run :func:`attention_replica`, whose set-up
and modes are objects of :mod:`afd_tools.run.replica`. FFN ranks serve whatever work item
is ready and record when they were busy (:func:`ffn_rank`).
"""

from __future__ import annotations

from typing import Any

import torch

from afd_models import ConfigError, DeepseekConfig, FFNRoleExecutor
from afd_protocol import Connection, EndpointOptions, freeze_heap
from afd_tools.run.breakdown import Clock, ItemTimer
from afd_tools.run.devices import random_weights, rank_device
from afd_tools.run.replica import ModeResult, attention_replica, request_tokens
from afd_tools.run.staging import staged_compute

__all__ = [
    "ModeResult",
    "attention_replica",
    "ffn_rank",
    "random_weights",
    "rank_device",
    "request_tokens",
]


def ffn_rank(
    connection: Connection,
    *,
    config: DeepseekConfig,
    seed: int,
    backend: str,
    timeout: float,
    device: str = "cpu",
    num_stages: int = 1,
    graph_buckets: tuple[int, ...] | None = None,
    serve_graph: bool = False,
) -> dict[str, Any]:
    """Serve until every attention replica shut down; returns each item's ``(taken,
    replied, replica, layer, device seconds)``. With ``serve_graph`` the serve loop itself is
    one CUDA graph (:func:`_serve_from_a_graph`)."""
    slot = connection.layout
    where = rank_device(connection, device)
    executor = FFNRoleExecutor(
        config,
        slot.topology.local_experts(connection.rank),
        random_weights(seed, where),
        dtype=getattr(torch, slot.dtype),
        device=where,
        backend=backend,
        shared_placement=slot.shared_placement,
        graph_buckets=graph_buckets,
    )
    options = EndpointOptions(
        timeout=timeout, num_layers=config.num_hidden_layers, num_stages=num_stages
    )
    if serve_graph:
        return _serve_from_a_graph(connection, executor, options)
    # The one FFN rank program (shared with afd-vllm ffn): idle stretches (colocated mode,
    # sparse arrivals) are waited out; a dead peer still ends the loop with PeerAborted.
    # Each item's expert compute is timed on this rank's device, without the copies between
    # the transport's device and it.
    timer = ItemTimer(Clock(where))
    there = connection.device
    wrappers = [timer.wrap]
    if there != where:
        wrappers.append(lambda compute: staged_compute(compute, where, there))
    stats = executor.serve_rank(connection, options, compute_wrappers=wrappers)
    seconds = timer.seconds()
    return {
        "intervals": [
            (r.taken, r.replied, r.replica, r.layer, s)
            for r, s in zip(stats.items, seconds, strict=True)
        ]
    }


def _serve_from_a_graph(
    connection: Connection, executor: FFNRoleExecutor, options: EndpointOptions
) -> dict[str, Any]:
    """``afd run --ffn-graph``: the FFN rank's serve loop replayed from one CUDA graph around
    the executor's device expert step (``afd_transport_nvshmem.GraphedFFNServer``). An item's
    time is from the host seeing it taken to the host seeing its reply published (both on
    the device: no host work between them)."""
    from afd_transport_nvshmem.graphed_ffn import ServeGraphOptions

    make = getattr(connection, "graphed_ffn_server", None)
    if make is None or executor.device != connection.device:
        raise ConfigError(
            f"--ffn-graph needs the NVSHMEM connection and the experts on its device "
            f"({connection.device}); got {type(connection).__name__} and {executor.device}"
        )
    graph = ServeGraphOptions(served_layers=tuple(executor.config.moe_layers))
    server = make(executor.device_expert_step(), options, graph)
    freeze_heap()
    try:
        stats = server.serve(while_idle="wait")
    finally:
        server.close()
    return {
        "intervals": [
            (r.taken, r.replied, r.replica, r.layer, r.replied - r.taken) for r in stats.items
        ]
    }
