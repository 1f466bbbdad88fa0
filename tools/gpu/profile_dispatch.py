#!/usr/bin/env python3
"""Where the attention endpoint's ``dispatch()`` spends host time, on ONE GPU.

cProfile of 100 ``dispatch()`` calls (each followed, outside the profile, by the loopback
FFN's identity reply and the combine) at 4,096 tokens, 1A1F, V2-Lite shapes, for the host
and the device plan of each wire format: the functions with the most own time, so host
work can be cut where it is spent (the issue #12 target is <= 30 us per layer).

Run (the endpoints are :class:`loopback_formats.LoopbackLayer`'s, imported from beside this
script): PYTHONPATH=packages/afd-protocol/src:packages/afd-transport-nvshmem/src:tools/src
python3 tools/gpu/profile_dispatch.py [--tokens N] [--top K]
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


def profile(name: str, device_pack: bool, tokens: int, top: int) -> str:
    case = LoopbackLayer.make(name, tokens, device_pack)
    profiler = cProfile.Profile()
    spent = []
    for i in range(105):
        torch.cuda.synchronize()
        measured = i >= 5  # warm-up: Triton compiles, caches fill
        began = time.perf_counter()
        if measured:
            profiler.enable()
        handle = case.attention.dispatch(0, case.x, case.ids, case.w)
        if measured:
            profiler.disable()
            spent.append((time.perf_counter() - began) * 1e6)
        case.serve(handle)
    case.close()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(top)
    spent.sort()
    plan = "device plan" if device_pack else "host plan"
    head = f"== {name}, {plan}, {tokens} tokens: dispatch() p50 {spent[len(spent) // 2]:.0f} us"
    return head + " (under cProfile)\n" + out.getvalue()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--top", type=int, default=14)
    args = parser.parse_args()
    torch.cuda.set_device(0)
    for name in FORMATS:
        for device_pack in (False, True):
            print(profile(name, device_pack, args.tokens, args.top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
