#!/usr/bin/env python3
"""Dispatch + combine per layer in each wire format, on ONE GPU, through the real endpoints.

Both roles run in this process over a :class:`~afd_protocol.window.LoopbackWorld` whose
windows are in this GPU's memory: the attention side is the kernel endpoint with the Triton
kernels, the FFN side the window endpoint with an identity expert (``part.grouped()`` then
``part.finish()``, so ``per_rank``'s expansion and reduction are timed). What this measures
is the endpoints' own cost per layer -- the plan, the copies (within HBM, not over NVLink),
the headers, the FFN-side work of the format and the combine -- plus both roles' host time
in series; it is not what two GPUs see, and it leaves no room for overlap. Shapes: 1
attention x 1 FFN rank, DeepSeek-V2-Lite's hidden 2048 bf16, 64 experts top-6.

Run (the GPU suite does): PYTHONPATH=packages/afd-protocol/src:packages/afd-transport-nvshmem/src:
tools/src python3 tools/gpu/loopback_formats.py [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from afd_protocol import Role, SlotLayout, Topology, WorkItem, plan_dispatch
from afd_protocol.window import KernelAttentionEndpoint, LoopbackWorld, WindowOptions
from afd_tools.bench.shm_transport import FORMATS, layer_bytes
from afd_transport_nvshmem.kernels import triton_kernels

HIDDEN, EXPERTS, TOPK = 2048, 64, 6
TOKENS = [1024, 4096, 8192, 16384]


def identity(item: WorkItem) -> torch.Tensor:
    rows = [p.finish(p.grouped()[0]) for p in item.parts]
    return rows[0] if len(rows) == 1 else torch.cat(rows)


def measure(name: str, tokens: int, repeats: int) -> dict[str, float]:
    wire, reduce = FORMATS[name]
    topo = Topology(1, 1, EXPERTS)
    layout = SlotLayout(
        topo, HIDDEN, tokens, TOPK, dtype="bfloat16", wire_format=wire, combine_reduce=reduce
    )
    world = LoopbackWorld(layout.window(), device="cuda")
    options = WindowOptions(timeout=30.0)
    attention = KernelAttentionEndpoint(
        world.transport(Role.ATTENTION, 0), options, triton_kernels()
    )
    ffn = world.transport(Role.FFN, 0).ffn_endpoint(options)
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, HIDDEN, device="cuda", generator=gen).to(torch.bfloat16)
    ids = torch.rand(tokens, EXPERTS, device="cuda", generator=gen).topk(TOPK, dim=-1).indices
    w = torch.rand(tokens, TOPK, device="cuda", generator=gen)
    moved = layer_bytes(plan_dispatch(ids, topo, layout=layout), layout)
    dispatch_host, layer_ms = [], []
    for i in range(repeats + 3):
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        torch.cuda.synchronize()
        start.record()
        began = time.perf_counter()
        handle = attention.dispatch(0, x, ids, w)
        issued = time.perf_counter()
        item = ffn.next_work_item()
        ffn.reply(item, identity(item))
        attention.combine(handle)
        end.record()
        torch.cuda.synchronize()
        if i >= 3:  # warm-up: Triton compiles, caches fill
            dispatch_host.append((issued - began) * 1e6)
            layer_ms.append(start.elapsed_time(end))
    attention.close()
    ffn.close()
    return {
        "bytes": moved,
        "layer_ms_p50": statistics.median(layer_ms),
        "layer_ms_p10": sorted(layer_ms)[len(layer_ms) // 10],
        "layer_ms_p90": sorted(layer_ms)[(9 * len(layer_ms)) // 10],
        "dispatch_host_us_p50": statistics.median(dispatch_host),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    torch.cuda.set_device(0)
    print(
        f"one GPU ({torch.cuda.get_device_name(0)}), loopback windows in its memory; 1A1F, "
        f"hidden {HIDDEN} bf16, {EXPERTS} experts top-{TOPK}, identity FFN"
    )
    print(
        f"  {'format':>12} {'tokens':>6} {'MB/layer':>9} {'layer ms p50 (p10-p90)':>24} "
        f"{'dispatch() host us':>19}"
    )
    report: dict[str, dict[str, dict[str, float]]] = {}
    for tokens in TOKENS:
        for name in FORMATS:
            r = measure(name, tokens, args.repeats)
            report.setdefault(name, {})[str(tokens)] = r
            spread = f"{r['layer_ms_p50']:.3f} ({r['layer_ms_p10']:.3f}-{r['layer_ms_p90']:.3f})"
            print(
                f"  {name:>12} {tokens:6d} {r['bytes'] / 1e6:9.1f} {spread:>24} "
                f"{r['dispatch_host_us_p50']:19.0f}"
            )
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
