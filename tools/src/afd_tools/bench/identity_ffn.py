"""The FFN rank of the per-layer transport benchmarks: it replies with the rows it got.

An identity expert keeps compute out of the measurement, so dispatch + combine time is the
plan, the transport and the weighted combine alone. It runs the one serving loop,
:func:`afd_protocol.serve`, like every FFN rank.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Any

import torch

from afd_protocol import Connection, EndpointOptions, WorkItem, serve


def serve_identity(
    connection: Connection, timing: bool = False, profile: str | None = None
) -> dict[str, Any]:
    """Serve until every attention rank shuts down.

    Returns the number of work items served and, with ``timing`` on a CUDA device, per
    item size (routed rows): the median host time of ``reply`` and the median GPU time of
    the reply. With ``profile``, a cProfile of the whole loop is written to that path.
    """
    if profile is None:
        return _serve(connection, timing)
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    try:
        return profiler.runcall(_serve, connection, timing)
    finally:
        with open(profile, "w") as out:
            pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(30)


def _serve(connection: Connection, timing: bool) -> dict[str, Any]:
    endpoint = connection.ffn_endpoint(EndpointOptions(timeout=120.0))
    timed = timing and connection.device.type == "cuda"
    events: dict[int, list[tuple[Any, Any]]] = defaultdict(list)
    started: list[Any] = []

    def identity(item: WorkItem) -> tuple[torch.Tensor, None]:
        # The rows as the experts would get them, and the reply the wire format wants: no
        # copy for per_choice; per_rank rows are expanded (and reduced with the weights
        # when the FFN side reduces), which is protocol work and is timed.
        rows = [p.finish(p.grouped()[0]) for p in item.parts]
        if timed:
            start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            start.record()
            started.append(start)
        return (rows[0] if len(rows) == 1 else torch.cat(rows)), None

    def reply_done(item: WorkItem) -> None:
        if timed:
            end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            end.record()
            events[item.num_routed_rows].append((started.pop(), end))

    stats = serve(endpoint, identity, after_reply=reply_done)
    report: dict[str, Any] = {"served": len(stats.items)}
    if timed:
        torch.cuda.synchronize(connection.device)
        host: dict[int, list[float]] = defaultdict(list)
        for record in stats.items:
            host[record.routed_rows].append(record.replied - record.computed)
        report["reply_host_ms"] = {n: statistics.median(v) * 1e3 for n, v in host.items()}
        report["reply_gpu_ms"] = {
            n: statistics.median(s.elapsed_time(e) for s, e in pairs) for n, pairs in events.items()
        }
    return report


def serve_identity_graphed(connection: Connection, steps_per_graph: int = 4) -> dict[str, Any]:
    """Serve until every attention rank shuts down with the FFN loop replayed from a CUDA
    graph (:class:`afd_transport_nvshmem.graphed_ffn.GraphedFFNServer`), the expert step an
    identity: the replies are the rows the experts would get (``per_rank``: expanded, and
    reduced with the weights where the FFN side reduces). Returns the items served, the
    graph replays and the host time of the capture."""
    from afd_transport_nvshmem.graphed_ffn import ServeGraphOptions

    make = getattr(connection, "graphed_ffn_server", None)
    if make is None:
        raise SystemExit(
            f"the graphed FFN loop needs a connection with device kernels (NVSHMEM); got "
            f"{type(connection).__name__}"
        )
    server = make(
        lambda rows, counts, layer: rows,
        EndpointOptions(timeout=120.0),
        ServeGraphOptions(steps_per_graph=steps_per_graph),
    )
    try:
        stats = server.serve()
    finally:
        server.close()
    return {
        "served": len(stats.items),
        "replays": server.replays,
        "capture_s": server.capture_seconds,
    }
