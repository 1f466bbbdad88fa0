#!/usr/bin/env python3
"""Dispatch + combine per layer in each wire format, on ONE GPU, through the real endpoints.

Both roles run in this process over a :class:`~afd_protocol.window.LoopbackWorld` whose
windows are in this GPU's memory: the attention side is the kernel endpoint with the Triton
kernels, the FFN side the window endpoint with the Triton reduce and an identity expert
(``part.grouped()`` then ``part.finish()``, so ``per_rank``'s expansion and reduction are
timed). Each format runs with the host plan and with the device plan (the Triton pack, no
host read of the counts); ``per_rank_ffn`` also with the torch reference reduce, side by
side. What ``layer`` measures is the endpoints' own cost per layer -- the plan, the copies
(within HBM, not over NVLink), the headers, the FFN-side work of the format and the
combine -- plus both roles' host time in series; it is not what two GPUs see, and it
leaves no room for overlap. Shapes: 1 attention x 1 FFN rank, DeepSeek-V2-Lite's hidden
2048 bf16, 64 experts top-6.

A second figure puts the layer behind ~1 ms of queued compute (bf16 matmuls standing in
for the attention layer that produced the router output), the way a real run issues it:
``exposed`` is that layer's time minus the compute's own, i.e. what the exchange adds on
top of compute when the host may run ahead. A host plan reads the counts back, so the host
waits for the compute and then plans with the device idle; a device plan is enqueued while
the compute runs. (The loopback FFN side polls its flags from the host, which waits for
the device either way.)

Run (the GPU suite does): PYTHONPATH=packages/afd-protocol/src:packages/afd-transport-nvshmem/src:
tools/src python3 tools/gpu/loopback_formats.py [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from afd_protocol import DispatchHandle, Role, SlotLayout, Topology, WorkItem, plan_dispatch
from afd_protocol.window import LoopbackWorld, WindowFFNEndpoint, WindowOptions
from afd_tools.bench.shm_transport import FORMATS, layer_bytes
from afd_transport_nvshmem.graphed_attention import GraphCapture, GraphedAttentionEndpoint
from afd_transport_nvshmem.kernel_attention import KernelAttentionEndpoint
from afd_transport_nvshmem.kernels import triton_kernels

HIDDEN, EXPERTS, TOPK = 2048, 64, 6
TOKENS = [1024, 4096, 8192, 16384]


def identity(item: WorkItem) -> torch.Tensor:
    rows = [p.finish(p.grouped()[0]) for p in item.parts]
    return rows[0] if len(rows) == 1 else torch.cat(rows)


VARIANTS = {
    "per_choice": ("host plan", "device plan"),
    "per_rank": ("host plan", "device plan"),
    "per_rank_ffn": ("host plan, torch reduce", "host plan", "device plan"),
}


class QueuedCompute:
    """About ``target_ms`` of bf16 matmuls on the current stream (calibrated once)."""

    def __init__(self, target_ms: float = 1.0) -> None:
        self.a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
        self.out = torch.empty_like(self.a)
        self.count = 1
        self.alone_ms = self.time(repeats=5)
        self.count = max(1, round(target_ms / self.alone_ms))
        self.alone_ms = self.time(repeats=20)

    def enqueue(self) -> None:
        for _ in range(self.count):
            torch.matmul(self.a, self.a, out=self.out)

    def time(self, repeats: int) -> float:
        samples = []
        for _ in range(repeats + 2):
            start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            torch.cuda.synchronize()
            start.record()
            self.enqueue()
            end.record()
            torch.cuda.synchronize()
            samples.append(start.elapsed_time(end))
        return float(statistics.median(samples[2:]))


@dataclass
class LoopbackLayer:
    """1A1F endpoints over CUDA loopback windows in one format, and one layer's inputs."""

    layout: SlotLayout
    attention: KernelAttentionEndpoint
    ffn: WindowFFNEndpoint
    x: torch.Tensor
    ids: torch.Tensor
    w: torch.Tensor

    @classmethod
    def make(
        cls,
        name: str,
        tokens: int,
        device_pack: bool,
        reduce_kernel: bool = True,
        graphed: bool = False,
        capture: GraphCapture | None = None,
    ) -> LoopbackLayer:
        """``graphed``: the attention endpoint replays its exchange from CUDA graphs
        (:class:`~afd_transport_nvshmem.graphed_attention.GraphedAttentionEndpoint`; the
        first dispatch of a token count runs eagerly, the second captures), made by
        ``capture`` where given."""
        wire, reduce = FORMATS[name]
        topo = Topology(1, 1, EXPERTS)
        layout = SlotLayout(
            topo, HIDDEN, tokens, TOPK, dtype="bfloat16", wire_format=wire, combine_reduce=reduce
        )
        world = LoopbackWorld(layout.window(), device="cuda")
        kernels = triton_kernels()
        transport = world.transport(Role.ATTENTION, 0)
        options = WindowOptions(timeout=30.0, device_pack=device_pack)
        attention = (
            GraphedAttentionEndpoint(transport, options, kernels, capture=capture)
            if graphed
            else KernelAttentionEndpoint(transport, options, kernels)
        )
        ffn = WindowFFNEndpoint(
            world.transport(Role.FFN, 0),
            WindowOptions(timeout=30.0),
            kernels.reduce_partials if reduce_kernel else None,
        )
        gen = torch.Generator(device="cuda").manual_seed(tokens)
        x = torch.randn(tokens, HIDDEN, device="cuda", generator=gen).to(torch.bfloat16)
        scores = torch.rand(tokens, EXPERTS, device="cuda", generator=gen)
        w = torch.rand(tokens, TOPK, device="cuda", generator=gen)
        return cls(layout, attention, ffn, x, scores.topk(TOPK, dim=-1).indices, w)

    def serve(self, handle: DispatchHandle) -> torch.Tensor:
        """The FFN side's identity reply, then the combine."""
        item = self.ffn.next_work_item()
        self.ffn.reply(item, identity(item))
        return self.attention.combine(handle)

    def close(self) -> None:
        self.attention.close()
        self.ffn.close()


def measure(
    name: str, variant: str, tokens: int, repeats: int, compute: QueuedCompute
) -> dict[str, float]:
    case = LoopbackLayer.make(
        name, tokens, variant == "device plan", not variant.endswith("torch reduce")
    )
    layout, attention, x, ids, w = case.layout, case.attention, case.x, case.ids, case.w
    topo = layout.topology
    moved = layer_bytes(plan_dispatch(ids, topo, layout=layout), layout)
    dispatch_host, layer_ms, behind_ms = [], [], []
    for i in range(2 * (repeats + 3)):
        queued = i % 2 == 1  # alternate, so both figures see the same machine state
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        torch.cuda.synchronize()
        start.record()
        if queued:
            compute.enqueue()
        began = time.perf_counter()
        handle = attention.dispatch(0, x, ids, w)
        issued = time.perf_counter()
        case.serve(handle)
        end.record()
        torch.cuda.synchronize()
        if i < 6:  # warm-up: Triton compiles, caches fill
            continue
        if queued:
            behind_ms.append(start.elapsed_time(end) - compute.alone_ms)
        else:
            dispatch_host.append((issued - began) * 1e6)
            layer_ms.append(start.elapsed_time(end))
    case.close()
    return {
        "bytes": moved,
        "layer_ms_p50": statistics.median(layer_ms),
        "layer_ms_p10": sorted(layer_ms)[len(layer_ms) // 10],
        "layer_ms_p90": sorted(layer_ms)[(9 * len(layer_ms)) // 10],
        "dispatch_host_us_p50": statistics.median(dispatch_host),
        "exposed_ms_p50": statistics.median(behind_ms),
        "exposed_ms_p10": sorted(behind_ms)[len(behind_ms) // 10],
        "exposed_ms_p90": sorted(behind_ms)[(9 * len(behind_ms)) // 10],
        "compute_ms": compute.alone_ms,
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
        f"  {'format':>12} {'variant':>23} {'tokens':>6} {'MB/layer':>9} "
        f"{'layer ms p50 (p10-p90)':>24} {'dispatch() host us':>19} "
        f"{'exposed ms behind compute':>26}"
    )
    compute = QueuedCompute()
    print(f"  queued compute: {compute.count} matmuls 4096^3 bf16, {compute.alone_ms:.3f} ms")
    report: dict[str, dict[str, dict[str, float]]] = {}
    for tokens in TOKENS:
        for name in FORMATS:
            for variant in VARIANTS[name]:
                r = measure(name, variant, tokens, args.repeats, compute)
                report.setdefault(f"{name} {variant}", {})[str(tokens)] = r
                spread = (
                    f"{r['layer_ms_p50']:.3f} ({r['layer_ms_p10']:.3f}-{r['layer_ms_p90']:.3f})"
                )
                exposed = (
                    f"{r['exposed_ms_p50']:.3f} ({r['exposed_ms_p10']:.3f}-"
                    f"{r['exposed_ms_p90']:.3f})"
                )
                print(
                    f"  {name:>12} {variant:>23} {tokens:6d} {r['bytes'] / 1e6:9.1f} "
                    f"{spread:>24} {r['dispatch_host_us_p50']:19.0f} {exposed:>26}"
                )
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
