"""``afd roundtrip``: real processes move MoE layers through shared memory, checked.

Launches A attention ranks and F FFN ranks as separate processes connected by shared
memory windows. Every attention rank runs several MoE layers on its own batch size
(uneven across ranks, so they drift onto different layers), dispatching each layer to the
FFN ranks that own its tokens' experts; every FFN rank serves whichever work item is
ready with deterministic linear experts, from the group list alone. Each combined output
is compared with an independent per-token reference computed on the attention rank.
"""

from __future__ import annotations

import argparse
import math
import time
from typing import Any

import torch

from afd_protocol import (
    Connection,
    EndpointOptions,
    Role,
    SharedPlacement,
    SlotLayout,
    Topology,
    relative_error,
    serve,
    torch_dtype,
)
from afd_protocol.launch import RankSpec, launch
from afd_protocol.testing import LinearExperts, random_routing

TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2}


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "roundtrip",
        help="run attention and FFN ranks as processes over shared memory and check outputs",
        description=__doc__,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--attention-ranks", type=int, default=2, help="attention ranks (A)")
    p.add_argument("--ffn-ranks", type=int, default=2, help="FFN ranks (F)")
    p.add_argument("--experts", type=int, default=64, help="routed experts")
    p.add_argument("--topk", type=int, default=6, help="experts per token")
    p.add_argument("--tokens", type=int, default=256, help="largest batch (max_num_batched_tokens)")
    p.add_argument("--hidden", type=int, default=128, help="hidden size")
    p.add_argument("--layers", type=int, default=6, help="MoE layers per attention rank")
    p.add_argument(
        "--shared",
        choices=[s.value for s in SharedPlacement],
        default="attention",
        help="where shared experts run",
    )
    p.add_argument("--dtype", choices=sorted(TOLERANCE), default="bfloat16", help="activations")
    p.add_argument("--seed", type=int, default=0, help="random seed")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds any rank may wait")
    p.set_defaults(handler=run)


def attention_rank(
    connection: Connection, *, layers: int, tokens: int, seed: int, timeout: float
) -> dict[str, Any]:
    slot = connection.layout
    experts = LinearExperts(layers, slot.topology.num_experts, slot.hidden_size, seed)
    dtype = torch_dtype(slot.dtype)
    endpoint = connection.attention_endpoint(EndpointOptions(timeout=timeout))
    gen = torch.Generator().manual_seed(seed + 1 + connection.rank)
    everyone = range(slot.topology.num_experts)
    worst, rows = 0.0, 0
    destinations: set[int] = set()
    start = time.perf_counter()
    for layer in range(layers):
        x, ids, w = random_routing(tokens, slot.hidden_size, slot.topk, everyone, gen, dtype)
        pending = endpoint.dispatch(layer, x, ids, w)
        out = endpoint.combine(pending)
        reference = experts.reference(layer, x, ids, w, slot.shared_placement.value == "ffn")
        worst = max(worst, relative_error(out, reference))
        rows += tokens * slot.topk
        destinations.update(pending.ffn_ranks)
    elapsed = time.perf_counter() - start
    endpoint.announce_shutdown()
    return {"worst": worst, "partials": rows, "ffn": sorted(destinations), "seconds": elapsed}


def ffn_rank(connection: Connection, *, layers: int, seed: int, timeout: float) -> dict[str, Any]:
    slot = connection.layout
    experts = LinearExperts(layers, slot.topology.num_experts, slot.hidden_size, seed)
    endpoint = connection.ffn_endpoint(EndpointOptions(timeout=timeout))
    stats = serve(endpoint, experts.compute_for(endpoint))
    return {"items": len(stats.items), "replicas": sorted({r.replica for r in stats.items})}


def run(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    topo = Topology(args.attention_ranks, args.ffn_ranks, args.experts)
    slot = SlotLayout(
        topo, args.hidden, args.tokens, args.topk, dtype=args.dtype, shared_placement=args.shared
    )
    window = slot.window(ring_depth=1)
    print(
        f"afd roundtrip: {args.attention_ranks} attention x {args.ffn_ranks} FFN processes over "
        f"shared memory; {args.experts} experts top-{args.topk}, hidden {args.hidden} "
        f"{args.dtype}, shared experts on {args.shared}, {args.layers} layers"
    )
    print(
        f"  window {window.total_bytes / 2**20:.1f} MiB per rank, routed_cap {slot.routed_cap} "
        f"rows, geometry digest {window.digest()}"
    )
    common = {"layers": args.layers, "seed": args.seed, "timeout": args.timeout}
    specs = [
        RankSpec(
            Role.ATTENTION,
            r,
            attention_rank,
            {**common, "tokens": max(1, args.tokens * (r + 1) // args.attention_ranks)},
        )
        for r in range(args.attention_ranks)
    ]
    specs += [RankSpec(Role.FFN, r, ffn_rank, common) for r in range(args.ffn_ranks)]
    results = launch(window, specs, timeout=args.timeout * 4)
    worst = 0.0
    for r in range(args.attention_ranks):
        value = results[f"attention rank {r}"].value
        worst = max(worst, value["worst"])
        tokens = max(1, args.tokens * (r + 1) // args.attention_ranks)
        print(
            f"  attention rank {r}: {tokens:5d} tokens x {args.layers} layers, "
            f"{value['partials']} partials to FFN ranks {value['ffn']}, "
            f"worst relative error {value['worst']:.2e} ({value['seconds']:.2f} s)"
        )
    for r in range(args.ffn_ranks):
        value = results[f"ffn rank {r}"].value
        print(
            f"  FFN rank {r}: served {value['items']} work items from replicas "
            f"{value['replicas']}, then every attention rank announced shutdown"
        )
    tolerance = TOLERANCE[args.dtype]
    ok = worst <= tolerance  # relative_error is inf, never NaN, where a value is not finite
    verdict = "matches" if ok else "does NOT match"
    shown = f"{worst:.2e}" if math.isfinite(worst) else "not finite (NaN or inf in an output)"
    print(
        f"{'PASS' if ok else 'FAIL'}: every combined output {verdict} the per-token reference "
        f"(worst {shown}, tolerance {tolerance:.0e}); {time.perf_counter() - start:.1f} s"
    )
    return 0 if ok else 1
