#!/usr/bin/env python3
"""Where the attention endpoint's ``dispatch()`` spends host time, on ONE GPU.

cProfile of 100 ``dispatch()`` calls (each followed, outside the profile, by the loopback
FFN's identity reply and the combine) at 4,096 tokens, 1A1F, V2-Lite shapes, for the host
and the device plan of each wire format: the functions with the most own time, so host
work can be cut where it is spent (the issue #27 target is <= 30 us per layer); 100 more
calls, interleaved, without the profiler give the plain median. ``--graphed`` profiles the
endpoint that replays its exchange from CUDA graphs (the device plan): how much of its
``dispatch()`` is the graph's launch (torch's ``CUDAGraph.replay``) and how much Python.
Not run by the GPU suite (first run of ``--graphed`` on a GPU: still to come).

Run (the endpoints are :class:`loopback_formats.LoopbackLayer`'s, imported from beside this
script): PYTHONPATH=packages/afd-protocol/src:packages/afd-transport-nvshmem/src:tools/src
python3 tools/gpu/profile_dispatch.py [--tokens N] [--top K] [--graphed]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch
from loopback_formats import LoopbackLayer

from afd_tools.bench.shm_transport import FORMATS


def profile(name: str, device_pack: bool, tokens: int, top: int, graphed: bool = False) -> str:
    case = LoopbackLayer.make(name, tokens, device_pack, graphed=graphed)
    profiler = cProfile.Profile()
    spent = []
    plain = []  # the same calls without the profiler's own overhead
    for i in range(205):
        torch.cuda.synchronize()
        # Warm-up: Triton compiles, caches fill (graphed: eager, then captured); then
        # 100 dispatches profiled and 100 not, interleaved.
        measured = i >= 5 and i % 2 == 1
        began = time.perf_counter()
        if measured:
            profiler.enable()
        handle = case.attention.dispatch(0, case.x, case.ids, case.w)
        if measured:
            profiler.disable()
            spent.append((time.perf_counter() - began) * 1e6)
        elif i >= 5:
            plain.append((time.perf_counter() - began) * 1e6)
        case.serve(handle)
    case.close()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(top)
    spent.sort()
    plain.sort()
    plan = "device plan" if device_pack else "host plan"
    mode = ", replayed from CUDA graphs" if graphed else ""
    replays = getattr(case.attention, "replays", None)
    head = (
        f"== {name}, {plan}{mode}, {tokens} tokens: dispatch() p50 {plain[len(plain) // 2]:.0f}"
        f" us ({spent[len(spent) // 2]:.0f} us under cProfile)"
        + (f"; {replays} graph replays" if graphed else "")
    )
    return head + "\n" + out.getvalue()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--top", type=int, default=14)
    parser.add_argument(
        "--graphed",
        action="store_true",
        help="profile the graph-replayed endpoint (device plan) instead of the eager one; "
        "its replay is the 'replay' of torch's CUDAGraph in the table",
    )
    args = parser.parse_args()
    torch.cuda.set_device(0)
    for name in FORMATS:
        for device_pack in (True,) if args.graphed else (False, True):
            print(profile(name, device_pack, args.tokens, args.top, args.graphed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
