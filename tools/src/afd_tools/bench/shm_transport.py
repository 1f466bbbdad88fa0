"""``afd bench transport --backend shm``: the shared-memory transport on this machine.

Three measurements, each beside its floor from the same run:

* notify latency -- a flag ping-pong between two processes through
  ``publish``/``wait_any``; one way = round trip / 2;
* payload bandwidth -- one-sided writes into a peer's window (4 KB .. 64 MB) against a
  plain ``copy_`` of the same bytes into this process's own shared-memory window;
* dispatch + combine per layer -- 2 attention x 2 FFN processes, hidden 2048 bf16,
  64 experts top-6, identity FFN (so only the transport, the plan and the wire format's
  own work are timed), in each wire format (``--wire-format``), against a plain copy of
  the same bytes (dispatch rows with their routing columns + reply rows) in one process.
"""

from __future__ import annotations

import statistics
from functools import partial
from typing import Any

import torch

from afd_protocol import (
    CombineReduce,
    Connection,
    DispatchPlan,
    EndpointOptions,
    MessageKind,
    Role,
    SlotLayout,
    Topology,
    WireFormat,
    plan_dispatch,
)
from afd_protocol.launch import RankSpec, launch
from afd_protocol.window import WindowConnection
from afd_tools.bench.identity_ffn import serve_identity
from afd_tools.bench.pingpong import flag_pingpong
from afd_tools.bench.stats import human_bytes, median_seconds

PAYLOAD_SIZES = [4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
LAYER_TOKENS = [256, 1024, 4096, 8192]
HIDDEN, EXPERTS, TOPK = 2048, 64, 6
FORMATS = {
    "per_choice": (WireFormat.PER_CHOICE, CombineReduce.ATTENTION),
    "per_rank": (WireFormat.PER_RANK, CombineReduce.ATTENTION),
    "per_rank_ffn": (WireFormat.PER_RANK, CombineReduce.FFN),
}
"""The wire formats the per-layer benchmark can run: (wire_format, combine_reduce)."""


def layer_bytes(plan: DispatchPlan, layout: SlotLayout) -> int:
    """Bytes one attention rank's layer moves: dispatch rows (with ``per_rank``'s ids and
    weights) and reply rows, over every FFN rank."""
    row = layout.row_bytes
    if not plan.per_rank:
        return 2 * plan.segment_offsets[-1] * row
    assert plan.rank_token_offsets is not None
    tokens = plan.rank_token_offsets[-1]
    dispatch = tokens * (row + 8 * layout.topk)  # int32 id + fp32 weight per choice
    replies = tokens if layout.rows_per_token(MessageKind.REPLY) else plan.segment_offsets[-1]
    return dispatch + replies * row


# ---- latency and bandwidth: one attention and one FFN process -------------------------


def _pingpong(connection: WindowConnection, iterations: int) -> list[float]:
    """Attention side bumps its flag in the FFN window; the FFN echoes it back."""
    return flag_pingpong(connection.transport, 0, 1, iterations)


def _bandwidth(connection: WindowConnection, sizes: list[int], repeats: int) -> dict[str, Any]:
    """Attention writes each size into the FFN window and publishes; FFN acknowledges."""
    transport = connection.transport
    window = transport.window
    rows_at = window.field_offset(0, 0, "routed_rows")
    out_flag, in_flag = window.flag_index(0, 0), window.flag_index(0, 0)
    seen = 0
    seq = 0
    if transport.role is Role.FFN:
        while True:
            (seen,) = transport.wait_any([in_flag], [seen], 60.0, [0]).values
            if seen < 0:
                return {}
            transport.publish(0, out_flag, seen)
    results: dict[str, Any] = {}
    source = torch.randint(0, 255, (max(sizes),), dtype=torch.uint8)
    peer = transport.peer_window(0)
    local = transport.local_window()

    def write_and_notify(dst: torch.Tensor, size: int) -> None:
        nonlocal seq, seen
        seq += 1
        dst.copy_(source[:size])
        transport.publish(0, out_flag, seq)
        (seen,) = transport.wait_any([in_flag], [seen], 60.0, [0]).values

    def copy(dst: torch.Tensor, size: int) -> None:
        dst.copy_(source[:size])

    for size in sizes:
        dst = peer[rows_at : rows_at + size]
        own = local[rows_at : rows_at + size]
        reps = max(5, min(repeats, (256 << 20) // size))
        results[str(size)] = {
            "floor": median_seconds(partial(copy, own, size), reps),
            "write": median_seconds(partial(copy, dst, size), reps),
            "write_notify_ack": median_seconds(partial(write_and_notify, dst, size), reps),
        }
    transport.publish(0, out_flag, -1)
    return results


# ---- dispatch + combine per layer: 2 attention x 2 FFN --------------------------------


def _layer_attention(
    connection: Connection, tokens: list[int], repeats: int
) -> dict[str, dict[str, float]]:
    endpoint = connection.attention_endpoint(EndpointOptions(timeout=120.0))
    layout = connection.layout
    gen = torch.Generator().manual_seed(connection.rank)
    results = {}

    def layer(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> None:
        endpoint.combine(endpoint.dispatch(0, x, ids, weights))

    for t in tokens:
        x = torch.randn(t, HIDDEN, generator=gen).to(torch.bfloat16)
        ids = torch.rand(t, EXPERTS, generator=gen).topk(TOPK, dim=-1).indices
        weights = torch.rand(t, TOPK, generator=gen)
        plan = plan_dispatch(ids, layout.topology, layout=layout)
        results[str(t)] = {
            "seconds": median_seconds(partial(layer, x, ids, weights), repeats),
            "bytes": layer_bytes(plan, layout),
        }
    endpoint.announce_shutdown()
    return results


def layer_slot(name: str, max_tokens: int) -> SlotLayout:
    """The per-layer benchmark's geometry in wire format ``name`` (a key of FORMATS): 2A2F,
    hidden 2048 bf16, 64 experts top-6."""
    wire, reduce = FORMATS[name]
    topo = Topology(2, 2, EXPERTS)
    return SlotLayout(
        topo, HIDDEN, max_tokens, TOPK, dtype="bfloat16", wire_format=wire, combine_reduce=reduce
    )


def layer_specs(tokens: list[int], repeats: int) -> list[RankSpec]:
    """Two attention ranks timing ``tokens``-sized layers, two identity FFN ranks."""
    attention = [
        RankSpec(Role.ATTENTION, r, _layer_attention, {"tokens": tokens, "repeats": repeats})
        for r in range(2)
    ]
    return attention + [RankSpec(Role.FFN, r, serve_identity) for r in range(2)]


def run(args: Any) -> dict[str, Any]:
    torch.set_num_threads(1)
    report: dict[str, Any] = {"backend": "shm"}

    # Latency.
    topo = Topology(1, 1, 1)
    tiny = SlotLayout(topo, 64, 16, 1, dtype="bfloat16").window()
    specs = [RankSpec(role, 0, _pingpong, {"iterations": args.iterations}) for role in Role]
    samples = launch(tiny, specs, timeout=300)["attention rank 0"].value[100:]
    one_way = [s / 2 * 1e6 for s in samples]
    report["latency_us"] = {
        "p50": statistics.median(one_way),
        "p99": sorted(one_way)[int(0.99 * (len(one_way) - 1))],
        "mean": statistics.fmean(one_way),
    }
    print(f"notify latency, one way ({len(one_way)} round trips / 2):")
    lat = report["latency_us"]
    print(f"  p50 {lat['p50']:.1f} us   p99 {lat['p99']:.1f} us   mean {lat['mean']:.1f} us")

    # Bandwidth.
    sizes = [size for size in PAYLOAD_SIZES if size <= args.max_bytes]
    rows = max(sizes) // (HIDDEN * 2) or 1
    big = SlotLayout(topo, HIDDEN, rows, 1, routed_cap_multiplier=1.0).window()
    specs = [
        RankSpec(role, 0, _bandwidth, {"sizes": sizes, "repeats": args.repeats}) for role in Role
    ]
    bandwidth = launch(big, specs, timeout=600)["attention rank 0"].value
    report["bandwidth"] = bandwidth
    print("\none-sided write into a peer window vs plain copy_ into own shared memory:")
    print(
        f"  {'size':>8} {'floor GB/s':>11} {'write GB/s':>11} {'ratio':>6} {'+notify+ack GB/s':>17}"
    )
    for size in sizes:
        r = bandwidth[str(size)]
        gbs = {k: size / v / 1e9 for k, v in r.items()}
        print(
            f"  {human_bytes(size):>8} {gbs['floor']:11.2f} {gbs['write']:11.2f} "
            f"{gbs['write'] / gbs['floor']:6.2f} {gbs['write_notify_ack']:17.2f}"
        )

    # Dispatch + combine per layer, 2A2F, in each wire format.
    tokens = [t for t in LAYER_TOKENS if t <= args.max_tokens]
    formats = list(FORMATS) if args.wire_format == "all" else [args.wire_format]
    report["layer"] = {}
    print(
        f"\ndispatch + combine per layer, 2A2F, hidden {HIDDEN} bf16, {EXPERTS} experts top-{TOPK}"
    )
    print("(identity FFN; both attention ranks run at once; floor = plain copy of the same bytes)")
    print(
        f"  {'format':>12} {'tokens':>6} {'MB/rank':>8} {'rank0 ms':>9} {'rank1 ms':>9} "
        f"{'floor ms':>9} {'floor/rank0':>12}"
    )
    for name in formats:
        slot = layer_slot(name, max(tokens))
        results = launch(slot.window(), layer_specs(tokens, args.repeats), timeout=900)
        report["layer"][name] = {}
        for t in tokens:
            r0 = results["attention rank 0"].value[str(t)]
            r1 = results["attention rank 1"].value[str(t)]
            moved = int(r0["bytes"])
            src = torch.empty(moved, dtype=torch.uint8)
            dst = torch.empty(moved, dtype=torch.uint8)
            floor = median_seconds(partial(dst.copy_, src), args.repeats)
            s0, s1 = r0["seconds"], r1["seconds"]
            report["layer"][name][str(t)] = {
                "rank0": s0,
                "rank1": s1,
                "floor": floor,
                "bytes": moved,
            }
            print(
                f"  {name:>12} {t:6d} {moved / 1e6:8.1f} {s0 * 1e3:9.2f} {s1 * 1e3:9.2f} "
                f"{floor * 1e3:9.2f} {floor / s0:12.2f}"
            )
    return report
