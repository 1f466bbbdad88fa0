#!/usr/bin/env python3
"""What a graph-replayed exchange's host time is made of, on ONE CUDA GPU (no NVSHMEM).

Two tables:

1. The graph-replayed attention endpoint over CUDA loopback windows (1A1F, V2-Lite shapes,
   the loopback FFN's identity reply between dispatch and combine): for each wire format,
   the node census of its dispatch and combine graphs (node types, kernel names, memcpy
   directions, read from the graphs themselves with ``keep_graph=True`` and
   ``cuGraphGetNodes``), the host time of each graph's launch (``CUDAGraph.replay``,
   timed inside ``dispatch()`` and ``combine()``) and of the whole calls.
2. Synthetic graphs of ten nodes: small torch kernels only, and with some of them
   replaced by copies from and to page-locked host memory or device-to-device copies; the
   host time of one replay each (median of 2000): which kind of node
   makes a launch expensive.

Run: PYTHONPATH=packages/afd-protocol/src:packages/afd-transport-nvshmem/src:tools/src
python3 tools/gpu/graph_launch.py [--tokens N] [--mps SHARE]
(``--mps SHARE`` first runs both tables in a child process that is a client of a private
CUDA MPS daemon with SHARE % of the SMs, as the one-GPU benchmarks' ranks are.)
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from loopback_formats import LoopbackLayer, identity

from afd_tools.bench.stats import median_seconds
from afd_transport_nvshmem.graph_census import graph_nodes
from afd_transport_nvshmem.graphed_attention import CudaGraphCapture

FORMATS_MEASURED = ("per_choice", "per_rank_ffn")


def _census(raw_graph: int) -> str:
    """``"13 nodes: 10 kernel [a, b, ...]; 3 memcpy [host -> device, 24 B, ...]"``."""
    nodes = graph_nodes(raw_graph)
    kinds = collections.Counter(n.kind for n in nodes)
    parts = []
    for kind, n in kinds.most_common():
        details = [node.detail[-48:] for node in nodes if node.kind == kind and node.detail]
        parts.append(f"{n} {kind}" + (f" [{', '.join(details)}]" if details else ""))
    return f"{len(nodes)} nodes: " + "; ".join(parts)


class _TimedCapture:
    """The endpoint's own capture (:class:`CudaGraphCapture` keeping each ``cudaGraph_t``,
    so its nodes can be read) with every replay's host time recorded, per graph in capture
    order (:attr:`graphs` and :attr:`replay_us` line up)."""

    def __init__(self, device: torch.device) -> None:
        self._capture = CudaGraphCapture(device, keep_graphs=True)
        self.replay_us: list[list[float]] = []

    @property
    def graphs(self) -> list[torch.cuda.CUDAGraph]:
        return self._capture.graphs

    def __call__(self, body: Callable[[], Any]) -> tuple[Callable[[], None], Any]:
        replay, outputs = self._capture(body)
        spent: list[float] = []
        self.replay_us.append(spent)

        def timed() -> None:
            began = time.perf_counter()
            replay()
            spent.append((time.perf_counter() - began) * 1e6)

        return timed, outputs


def endpoint_table(tokens: int, rounds: int) -> None:
    print(
        f"graph-replayed attention endpoint, loopback 1A1F, {tokens} tokens, V2-Lite shapes: "
        f"host us per call (median of {rounds}) and each graph's nodes"
    )
    for name in FORMATS_MEASURED:
        recorder = _TimedCapture(torch.device("cuda", 0))
        case = LoopbackLayer.make(name, tokens, True, graphed=True, capture=recorder)
        dispatch_us, combine_us = [], []
        for i in range(rounds + 5):
            torch.cuda.synchronize()
            began = time.perf_counter()
            handle = case.attention.dispatch(0, case.x, case.ids, case.w)
            issued = time.perf_counter()
            item = case.ffn.next_work_item()
            case.ffn.reply(item, identity(item))
            replied = time.perf_counter()
            case.attention.combine(handle)
            done = time.perf_counter()
            if i >= 5:
                dispatch_us.append((issued - began) * 1e6)
                combine_us.append((done - replied) * 1e6)
        torch.cuda.synchronize()
        print(
            f"  {name}: dispatch() {statistics.median(dispatch_us):.1f} us, combine() "
            f"{statistics.median(combine_us):.1f} us (the loopback FFN replied before it)"
        )
        for graph, times in zip(recorder.graphs, recorder.replay_us, strict=True):
            launch = f"launch {statistics.median(times):.1f} us" if times else "no replay"
            try:
                census = _census(graph.raw_cuda_graph())
            except Exception as exc:  # the census is a diagnosis: report, go on
                census = f"census failed: {exc}"
            print(f"    graph: {launch} ({len(times)} replays); {census}")
        case.close()


def synthetic_table() -> None:
    """Host time of one replay of ten-node graphs made of each kind of node."""
    dev = torch.device("cuda", 0)
    small = torch.zeros(256, device=dev)
    other = torch.zeros(256, device=dev)
    pinned_in = torch.zeros(64, dtype=torch.int32, pin_memory=True)
    pinned_out = torch.zeros(2, dtype=torch.int64, pin_memory=True)
    device_in = torch.zeros(64, dtype=torch.int32, device=dev)
    device_bounds = torch.zeros(2, dtype=torch.int64, device=dev)

    def kernels(n: int) -> Callable[[], None]:
        def body() -> None:
            for _ in range(n):
                small.add_(1)

        return body

    def with_host_copies() -> None:
        device_in.copy_(pinned_in, non_blocking=True)
        device_in.copy_(pinned_in, non_blocking=True)
        for _ in range(7):
            small.add_(1)
        pinned_out.copy_(device_bounds, non_blocking=True)

    def with_device_copies() -> None:
        for _ in range(3):
            other.copy_(small)
        for _ in range(7):
            small.add_(1)

    cases = {
        "10 small kernels": kernels(10),
        "7 kernels + 2 pinned HtoD + 1 pinned DtoH copies": with_host_copies,
        "7 kernels + 3 DtoD copies": with_device_copies,
        "3 small kernels": kernels(3),
    }
    print("synthetic graphs: host us per replay (median of 2000), node census")
    busy = _replay_behind_work(kernels(3))
    print(f"  {'3 small kernels, behind 2 ms of queued work':52s} {busy:7.1f} us")
    side = torch.cuda.Stream(dev)  # type: ignore[no-untyped-call]
    for label, body in cases.items():
        body()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph(keep_graph=True)
        try:
            with torch.cuda.graph(graph, stream=side):
                body()
        except Exception as exc:  # a node kind a capture refuses is a finding too
            print(f"  {label:52s} capture failed: {exc}")
            continue
        graph.instantiate()
        host = median_seconds(graph.replay, 2000, warmup=50) * 1e6
        torch.cuda.synchronize()
        try:
            census = _census(graph.raw_cuda_graph())
        except Exception as exc:
            census = f"census failed: {exc}"
        print(f"  {label:52s} {host:7.1f} us; {census}")


def _replay_behind_work(body: Callable[[], None], rounds: int = 200) -> float:
    """Host us of one replay of ``body``'s graph while the stream still runs earlier work
    (a 2 ms sleep kernel queued first; the sleep's own launch not counted), median."""
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    with torch.cuda.graph(graph, stream=side):
        body()
    spent = []
    for _ in range(rounds):
        torch.cuda._sleep(2_000_000)  # type: ignore[no-untyped-call]  # ~1-2 ms of device time at H200 clocks
        began = time.perf_counter()
        graph.replay()
        spent.append((time.perf_counter() - began) * 1e6)
        torch.cuda.synchronize()
    return statistics.median(spent)


def under_mps(share: int, argv: list[str]) -> int:
    """Both tables in a child process that is an MPS client with ``share`` % of the SMs."""
    from afd_transport_nvshmem.mps import MpsDaemon

    with MpsDaemon.start() as daemon:
        env = {**os.environ, **daemon.client_environment(share)}
        return subprocess.run([sys.executable, __file__, *argv], env=env, check=False).returncode


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--mps", type=int, metavar="SHARE", help="first as an MPS client")
    args = parser.parse_args()
    code = 0
    if args.mps is not None:  # before this process holds a context of its own
        code = under_mps(args.mps, ["--tokens", str(args.tokens), "--rounds", str(args.rounds)])
    share = os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")
    print(f"== {'an MPS client at ' + share + ' %' if share else 'alone on the GPU, no MPS'}")
    torch.cuda.set_device(0)
    synthetic_table()
    endpoint_table(args.tokens, args.rounds)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
