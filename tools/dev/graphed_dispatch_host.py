#!/usr/bin/env python3
"""Host time of a graph-replayed ``dispatch()`` outside its replay, on the CPU.

The graph-replayed attention endpoint (``GraphedAttentionEndpoint``) over afd_protocol's
loopback transport with the torch reference kernels, graphs stood in for by
``replayed_calls`` (as its CPU tests do); the replay's own time is measured and taken out,
so what is left is the endpoint's Python around one graph launch: the per-layer host work
issue #27 wants under 30 us. ``--compare-encoding`` interleaves blocks where the header
words come from the replay's template (the default) with blocks where they are encoded
from a ``Header`` per FFN rank each layer, as before dc8e9b5.

Run: PYTHONPATH=packages/afd-protocol/src:packages/afd-transport-nvshmem/src \
python3 tools/dev/graphed_dispatch_host.py [--ffn-ranks F] [--wire per_rank]
[--compare-encoding]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from afd_protocol import CombineReduce, Role, SlotLayout, Topology, WireFormat
from afd_protocol.testing import LinearExperts, random_routing
from afd_protocol.window import LoopbackWorld, WindowOptions
from afd_transport_nvshmem.graphed_attention import GraphedAttentionEndpoint, replayed_calls
from afd_transport_nvshmem.kernel_specs import REFERENCE_KERNELS

HIDDEN, EXPERTS, TOPK, TOKENS = 8, 7, 3, 8


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ffn-ranks", type=int, default=1)
    parser.add_argument("--wire", choices=("per_choice", "per_rank"), default="per_rank")
    parser.add_argument("--blocks", type=int, default=40, help="blocks of 25 dispatches")
    parser.add_argument("--compare-encoding", action="store_true")
    args = parser.parse_args()
    per_rank = args.wire == "per_rank"
    reduce = CombineReduce.FFN if per_rank else CombineReduce.ATTENTION
    layout = SlotLayout(
        Topology(1, args.ffn_ranks, EXPERTS), HIDDEN, 16, TOPK, dtype="float32",
        wire_format=WireFormat(args.wire), combine_reduce=reduce, routed_cap_multiplier=2.0,
    )  # fmt: skip
    world = LoopbackWorld(layout.window(ring_depth=2))
    options = WindowOptions(timeout=5.0)
    ffns = [world.connection(Role.FFN, r).ffn_endpoint(options) for r in range(args.ffn_ranks)]
    replayed = [0.0]

    def capture(body: Callable[[], Any]) -> tuple[Callable[[], None], Any]:
        replay, outputs = replayed_calls(body)

        def timed() -> None:
            began = time.perf_counter()
            replay()
            replayed[0] += time.perf_counter() - began

        return timed, outputs

    transport = world.transport(Role.ATTENTION, 0)
    attention = GraphedAttentionEndpoint(transport, options, REFERENCE_KERNELS, capture=capture)
    experts = LinearExperts(8, EXPERTS, HIDDEN)
    x, ids, w = random_routing(TOKENS, HIDDEN, TOPK, range(EXPERTS), torch.Generator())

    def layer(i: int, forget_template: bool) -> float:
        """One layer; the host seconds of its dispatch() outside the replay."""
        if forget_template:  # as before dc8e9b5: a Header encoded per FFN rank
            for rings in attention._graphs.values():
                for entry in rings.values():
                    entry.header_words = None
        before = replayed[0]
        began = time.perf_counter()
        handle = attention.dispatch(i % 8, x, ids, w)
        spent = time.perf_counter() - began - (replayed[0] - before)
        experts.drain(ffns)
        attention.combine(handle)
        return spent

    for i in range(6):  # eager, capture, first replays
        layer(i, False)
    variants = {"template": False, "encoded": True} if args.compare_encoding else {"": False}
    medians: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.blocks):
        for name, forget in variants.items():
            block = [layer(i, forget) for i in range(25)]
            medians[name].append(statistics.median(block) * 1e6)
    for name, values in medians.items():
        q = statistics.quantiles(values, n=10)
        print(
            f"{args.wire}, {args.ffn_ranks} FFN rank(s){', ' + name if name else ''}: "
            f"dispatch() host outside the replay, median of {args.blocks} block medians "
            f"{statistics.median(values):.1f} us (p10-p90 {q[0]:.1f}-{q[-1]:.1f})"
        )
    attention.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
