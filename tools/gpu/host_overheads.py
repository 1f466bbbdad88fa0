#!/usr/bin/env python3
"""Host cost of each call on the per-message path, on one CUDA GPU (no NVSHMEM needed).

The per-layer benchmark shows the host, not the link, bounding small layers; this prints
the median host time of every call a dispatch, a reply and a combine make, so the
expensive ones can be found without a profiler's own overhead in the way.
Run (the GPU suite does): PYTHONPATH=packages/afd-protocol/src:packages/afd-transport-nvshmem/src:
tools/src python3 tools/gpu/host_overheads.py [--mps SHARE]

``--mps SHARE`` runs the same table in a child process that is a client of a private CUDA
MPS daemon with SHARE percent of the SMs (started and stopped here), beside the plain one:
what each call costs a rank sharing the GPU, as the one-GPU benchmarks run.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Callable

import torch

from afd_protocol import Header, MessageKind, Topology, decode_header, encode_words, plan_dispatch
from afd_protocol.window import HeaderUpload, PinnedUpload
from afd_tools.bench.stats import median_seconds
from afd_transport_nvshmem.cuda_memory import stream_write_value32


def median_us(fn: Callable[[], object], n: int = 2000) -> float:
    return median_seconds(fn, n, warmup=50) * 1e6


def main() -> None:
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    stream = torch.cuda.current_stream(dev)
    side = torch.cuda.Stream(dev)  # type: ignore[no-untyped-call]
    flag = torch.zeros(64, dtype=torch.int32, device=dev)
    small = torch.zeros(256, device=dev)
    small_dst = torch.zeros(256, device=dev)
    header = Header(MessageKind.DISPATCH, 0, 3, 0, 1024, 6144, 0, 7, expert_counts=tuple([96] * 64))
    words = encode_words(header)
    word_tensor = torch.tensor(words, dtype=torch.int32)
    staging = HeaderUpload(dev)
    pinned = PinnedUpload(dev)
    segments = torch.zeros(2, dtype=torch.int64, device=dev)
    dest = torch.zeros(78, dtype=torch.int32, device=dev)
    event = torch.Event(device=dev)
    event.record(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        small.add_(1)
    graphs = {}
    for nodes in (5, 20, 80):
        many = torch.cuda.CUDAGraph()
        with torch.cuda.graph(many):
            for _ in range(nodes):
                small.add_(1)
        graphs[nodes] = many
    topo = Topology(1, 1, 64)
    ids = torch.rand(1024, 64, device=dev).topk(6, -1).indices
    keys = ids.reshape(-1)
    counter = [0]

    def write_flag() -> None:
        counter[0] += 1
        stream_write_value32(flag.data_ptr(), counter[0], stream)

    def enter_stream() -> None:
        with torch.cuda.stream(side):
            pass

    rows = [
        ("torch.cuda.current_stream(device)", lambda: torch.cuda.current_stream(dev)),
        ("torch.cuda.current_stream()", lambda: torch.cuda.current_stream()),
        ("torch.accelerator.current_stream(device)", lambda: torch.accelerator.current_stream(dev)),
        ("with torch.cuda.stream(side): pass", enter_stream),
        ("cuStreamWriteValue32 (cuda-bindings)", write_flag),
        ("small.add_(1) (one kernel launch)", lambda: small.add_(1)),
        ("small copy_ D2D", lambda: small_dst.copy_(small)),
        ("CUDAGraph.replay (one kernel)", graph.replay),
        *((f"CUDAGraph.replay ({n} kernels)", g.replay) for n, g in graphs.items()),
        ("torch.tensor(78 ints)", lambda: torch.tensor(words, dtype=torch.int32)),
        ("pageable H2D copy_ of 78 words", lambda: dest.copy_(word_tensor)),
        ("HeaderUpload.write", lambda: staging.write(dest, header, (0, 0))),
        ("PinnedUpload.copy (2 int64)", lambda: pinned.copy(segments, (0, 6144), 0)),
        ("torch.Event.query", event.query),
        ("torch.Event.record", lambda: event.record(stream)),
        ("encode_words (64 counts)", lambda: encode_words(header)),
        ("decode_header (64 counts)", lambda: decode_header(words)),
        ("torch.sort 6K int64, stable", lambda: torch.sort(keys, stable=True)),
        ("plan_dispatch 1K x top-6 (one sync)", lambda: plan_dispatch(ids, topo)),
        ("torch.cuda.synchronize", torch.cuda.synchronize),
    ]
    share = os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")
    where = f"as a CUDA MPS client at {share} %" if share else "alone on the GPU, no MPS"
    print(f"host time per call, median of 2000, {torch.cuda.get_device_name(dev)}, {where}")
    for name, fn in rows:
        print(f"  {name:42s} {median_us(fn):8.1f} us")
    device_plans(dev)


def device_plans(dev: torch.device) -> None:
    """The device plan as a CUDA graph: afd_protocol's torch ops against the Triton kernels
    (afd_transport_nvshmem.device_plan), checked equal, then the host time of a replay and
    the device time per replay (200 back to back, CUDA events)."""
    from afd_protocol import SharedPlacement, WireFormat, plan_on_device
    from afd_transport_nvshmem.device_plan import triton_plan_on_device

    print("device plan replayed from a CUDA graph: torch ops vs the Triton kernels")
    print(f"  {'case':34s} {'plan':7s} {'host us':>8s} {'device us':>10s}")
    cases = [
        ("V2-Lite per_choice", Topology(1, 1, 64), 6, WireFormat.PER_CHOICE, True),
        ("V2-Lite per_rank, FFN reduce", Topology(1, 1, 64), 6, WireFormat.PER_RANK, False),
        ("V3 8 FFN per_rank, FFN reduce", Topology(1, 8, 256), 8, WireFormat.PER_RANK, False),
    ]
    for label, topo, topk, wire, order in cases:
        for tokens in (1024, 4096, 16384):
            ids = torch.rand(tokens, topo.num_experts, device=dev).topk(topk, -1).indices
            plans = {}
            for name, planner in (("torch", plan_on_device), ("triton", triton_plan_on_device)):
                for _ in range(2):  # compile, allocate
                    planner(ids, topo, SharedPlacement.ATTENTION, wire, order)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    plan = planner(ids, topo, SharedPlacement.ATTENTION, wire, order)
                    wanted = plan.token_row_positions if wire is WireFormat.PER_RANK else None
                graph.replay()
                plans[name] = (plan, wanted)
                host = median_us(graph.replay, 500)
                start = torch.Event(device=dev, enable_timing=True)
                end = torch.Event(device=dev, enable_timing=True)
                torch.cuda.synchronize()
                start.record()
                for _ in range(200):
                    graph.replay()
                end.record()
                end.synchronize()
                device = start.elapsed_time(end) * 1e3 / 200
                print(f"  {label + f', {tokens} tokens':34s} {name:7s} {host:8.1f} {device:10.1f}")
            (a, pa), (b, pb) = plans["torch"], plans["triton"]
            for field in ("order", "expert_counts", "segment_offsets", "expert_bounds"):
                if not torch.equal(getattr(a, field), getattr(b, field)):
                    raise SystemExit(f"device plan mismatch: {label}, {tokens} tokens, {field}")
            if pa is not None and (pb is None or not torch.equal(pa, pb)):
                raise SystemExit(f"device plan mismatch: {label}, {tokens} tokens, token rows")


def under_mps(share: int) -> int:
    """This table again in a child process that is an MPS client with ``share`` % of the SMs."""
    from afd_transport_nvshmem.mps import MpsDaemon

    with MpsDaemon.start() as daemon:
        env = {**os.environ, **daemon.client_environment(share)}
        return subprocess.run([sys.executable, __file__], env=env, check=False).returncode


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mps", type=int, metavar="SHARE", help="also as an MPS client")
    args = parser.parse_args()
    # The MPS client first, before this process holds a context of its own on the GPU.
    code = under_mps(args.mps) if args.mps is not None else 0
    main()
    sys.exit(code)
