"""``afd bench``: sub-commands and their options."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from afd_protocol import FIRST_PARTY_TRANSPORTS, AFDError, get_transport, transport_names
from afd_protocol.launch import START_METHODS
from afd_tools.bench import prefill
from afd_tools.bench.start_methods import compare_start_methods


@dataclass(frozen=True)
class TransportBench:
    """How ``afd bench transport`` measures one transport."""

    module: str
    """The module whose ``run(args)`` measures it and returns the JSON report."""
    smallest_tokens: int
    """The smallest ``--max-tokens`` its per-layer benchmark measures."""


TRANSPORT_BENCHES = {
    "shm": TransportBench("afd_tools.bench.shm_transport", smallest_tokens=256),
    "nvshmem": TransportBench("afd_tools.bench.nvshmem_transport", smallest_tokens=1024),
    "cam-emulator": TransportBench("afd_tools.bench.cam_transport", smallest_tokens=256),
}
"""The measuring module of every afd transport, by its name in the transport registry
(``afd_protocol.get_transport``), which is what ``--backend`` names."""
assert set(TRANSPORT_BENCHES) == set(FIRST_PARTY_TRANSPORTS), "a transport without a bench"


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
        default="shm",
        metavar="{" + ",".join(n for n in transport_names() if n in TRANSPORT_BENCHES) + "}",
        help="transport to measure, by its registry name: shm (shared memory between "
        "processes), nvshmem (two GPUs) or cam-emulator (the CPU emulator of Ascend CAM's "
        "operators, per layer, side by side with shm)",
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
    transport.add_argument(
        "--start-method",
        action="append",
        choices=START_METHODS,
        default=None,
        help="how rank processes start (afd's launcher: forked from a fork server, the "
        "default on CPU, or spawned, the default for GPU ranks); "
        "repeat to measure each side by side, the whole benchmark once per method in turn "
        "(with --rounds, A/B/A/B), with a table of every per-layer figure by method",
    )
    transport.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="with several --start-method: how many times each runs, interleaved",
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
    try:
        transport = get_transport(args.backend)  # installed, or what to install
    except AFDError as exc:
        return _refuse(str(exc))
    bench = TRANSPORT_BENCHES.get(transport.name)
    if bench is None:
        return _refuse(
            f"--backend {transport.name}: no benchmark measures this transport (afd bench "
            f"transport measures {', '.join(TRANSPORT_BENCHES)})"
        )
    smallest_tokens = bench.smallest_tokens
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
    if args.rounds < 1:
        problems.append(f"--rounds must be >= 1, got {args.rounds}")
    if args.rounds > 1 and len(args.start_method or []) < 2:
        problems.append("--rounds interleaves several --start-method: give two")
    if problems:
        return _refuse("; ".join(problems))
    measure = importlib.import_module(bench.module).run
    if args.start_method is None:
        report = measure(args)
    else:
        report = compare_start_methods(lambda: measure(args), args.start_method, args.rounds)
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2))
        print(f"\nwrote {args.json}")
    return 0


def _refuse(message: str) -> int:
    """Print ``message`` as the command's one-line error; the exit status of a refusal."""
    print(f"afd bench transport: error: {message}", file=sys.stderr)
    return 2
