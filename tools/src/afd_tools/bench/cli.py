"""``afd bench``: sub-commands and their options."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from afd_tools.bench import prefill


def add_parser(sub: Any) -> None:
    bench = sub.add_parser(
        "bench",
        help="micro and layer benchmarks (transport, ...)",
        description="Benchmarks that print a table with their floor measured in the same run.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    kinds = bench.add_subparsers(dest="bench", required=True, metavar="BENCH")
    transport = kinds.add_parser(
        "transport",
        help="notify latency, payload bandwidth, dispatch+combine per layer",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    transport.add_argument(
        "--backend",
        choices=["shm", "nvshmem", "cam-emulator", "host"],
        default="shm",
        help="transport to measure: shm (shared memory between processes), nvshmem (two "
        "GPUs) or cam-emulator (the CPU emulator of Ascend CAM's operators, per layer, side "
        "by side with shm); host is the old name of shm",
    )
    transport.add_argument("--iterations", type=int, default=2000, help="latency round trips")
    transport.add_argument("--repeats", type=int, default=20, help="timed repeats per point")
    transport.add_argument(
        "--max-tokens", type=int, default=8192, help="largest batch of the per-layer benchmark"
    )
    transport.add_argument(
        "--max-bytes", type=int, default=64 << 20, help="largest payload of the bandwidth sweep"
    )
    transport.add_argument(
        "--wire-format",
        choices=["all", "per_choice", "per_rank", "per_rank_ffn"],
        default="all",
        help="shm only: the wire formats of the per-layer run (per_rank_ffn: per_rank "
        "reduced on the FFN side); all runs each, side by side",
    )
    transport.add_argument("--json", type=Path, default=None, help="also write results here")
    transport.add_argument(
        "--profile",
        type=Path,
        default=None,
        help="nvshmem only: write torch.profiler tables of the per-layer rounds into this folder",
    )
    transport.set_defaults(handler=run_transport)
    prefill.add_parser(kinds)


def run_transport(args: argparse.Namespace) -> int:
    if args.backend == "host":
        args.backend = "shm"
    smallest_tokens = 1024 if args.backend == "nvshmem" else 256
    problems = []
    if args.iterations < 200:
        problems.append(
            f"--iterations must be >= 200 (the first 10% warm up), got {args.iterations}"
        )
    if args.repeats < 1:
        problems.append(f"--repeats must be >= 1, got {args.repeats}")
    if args.max_tokens < smallest_tokens:
        problems.append(f"--max-tokens must be >= {smallest_tokens} for --backend {args.backend}")
    if args.max_bytes < 4096:
        problems.append("--max-bytes must be >= 4096 (the smallest payload measured)")
    if problems:
        print(f"afd bench transport: error: {'; '.join(problems)}", file=sys.stderr)
        return 2
    if args.backend == "nvshmem":
        from afd_tools.bench import nvshmem_transport

        report = nvshmem_transport.run(args)
    elif args.backend == "cam-emulator":
        from afd_tools.bench import cam_transport

        report = cam_transport.run(args)
    else:
        from afd_tools.bench import shm_transport

        report = shm_transport.run(args)
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2))
        print(f"\nwrote {args.json}")
    return 0
