"""The FFN rank of the per-layer transport benchmarks: it replies with the rows it got.

An identity expert keeps compute out of the measurement, so dispatch + combine time is the
plan, the transport and the weighted combine alone.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from typing import Any

import torch

from afd_protocol import ConnectorShutdown, FFNEndpoint, Transport


def serve_identity(
    transport: Transport, timing: bool = False, profile: str | None = None
) -> dict[str, Any]:
    """Serve until every attention rank shuts down.

    Returns the number of work items served and, with ``timing`` on a CUDA transport, per
    item size (routed rows): the median host time of ``reply`` and the median GPU time from
    the item's arrival on the host to its reply being published. With ``profile``, a
    cProfile of the whole loop is written to that path.
    """
    if profile is None:
        return _serve(transport, timing)
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    try:
        return profiler.runcall(_serve, transport, timing)
    finally:
        with open(profile, "w") as out:
            pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(30)


def _serve(transport: Transport, timing: bool) -> dict[str, Any]:
    endpoint = FFNEndpoint(transport, timeout=120.0)
    timed = timing and transport.device.type == "cuda"
    host: dict[int, list[float]] = defaultdict(list)
    events: dict[int, list[tuple[Any, Any]]] = defaultdict(list)
    served = 0
    while True:
        try:
            item = endpoint.next_work_item()
        except ConnectorShutdown:
            break
        rows = [p.routed_rows for p in item.parts]
        if timed:
            start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            start.record()
            began = time.perf_counter()
        endpoint.reply(item, rows[0] if len(rows) == 1 else torch.cat(rows))
        if timed:
            host[item.num_routed_rows].append(time.perf_counter() - began)
            end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            end.record()
            events[item.num_routed_rows].append((start, end))
        served += 1
    report: dict[str, Any] = {"served": served}
    if timed:
        torch.cuda.synchronize(transport.device)
        report["reply_host_ms"] = {n: statistics.median(v) * 1e3 for n, v in host.items()}
        report["reply_gpu_ms"] = {
            n: statistics.median(s.elapsed_time(e) for s, e in pairs) for n, pairs in events.items()
        }
    return report
