"""``afd bench transport --backend cam-emulator``: the CAM operator emulator per layer.

Dispatch + combine per layer through the endpoint protocols, 2 attention x 2 FFN rank
processes, hidden 2048 bf16, 64 experts top-6, identity FFN, the same program over two
connections side by side in one run: afd's shared-memory transport in the ``per_rank``
format with the attention side reducing (the semantics CAM's compact operators have), and
the CAM emulator. What it measures is the emulator's cost on this CPU -- how fast the
CAM-shaped protocol can be driven from Python -- not an NPU's: the emulator copies rows
through its token store and address table and blocks in every call.
"""

from __future__ import annotations

from typing import Any

import torch

from afd_protocol import TransportFactory, TransportOptions, get_transport
from afd_protocol.launch import launch
from afd_tools.bench.shm_transport import (
    EXPERTS,
    HIDDEN,
    LAYER_TOKENS,
    TOPK,
    layer_slot,
    layer_specs,
)


def run(args: Any) -> dict[str, Any]:
    torch.set_num_threads(1)
    tokens = [t for t in LAYER_TOKENS if t <= args.max_tokens]
    slot = layer_slot("per_rank", max(tokens))  # reduced on the attention side, as CAM
    connections: dict[str, TransportFactory] = {
        "shm per_rank": get_transport("shm").factory(slot),
        "cam-emulator": get_transport("cam-emulator").factory(
            slot, TransportOptions(wait_timeout=300.0)
        ),
    }
    report: dict[str, Any] = {"backend": "cam-emulator", "layer": {}}
    print(f"dispatch + combine per layer, 2A2F, hidden {HIDDEN} bf16, {EXPERTS} experts top-{TOPK}")
    print("(identity FFN; both attention ranks at once; MB = the per_rank bytes of a layer)")
    print(f"  {'connection':>13} {'tokens':>6} {'MB/rank':>8} {'rank0 ms':>9} {'rank1 ms':>9}")
    for name, factory in connections.items():
        specs = layer_specs(tokens, args.repeats)
        results = launch(slot.window(), specs, timeout=1800, transport_factory=factory)
        report["layer"][name] = {}
        for t in tokens:
            r0 = results["attention rank 0"].value[str(t)]
            r1 = results["attention rank 1"].value[str(t)]
            report["layer"][name][str(t)] = {
                "rank0": r0["seconds"],
                "rank1": r1["seconds"],
                "bytes": r0["bytes"],
            }
            print(
                f"  {name:>13} {t:6d} {r0['bytes'] / 1e6:8.1f} {r0['seconds'] * 1e3:9.2f} "
                f"{r1['seconds'] * 1e3:9.2f}"
            )
    return report
