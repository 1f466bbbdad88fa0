"""``afd-vllm ffn``: the FFN role, a process that holds only its routed experts and serves
the attention engines' work items until every attention rank announced shutdown.

It takes the same ``--additional-config`` as the attention engine (with ``"role": "ffn"``)
and the same model directory (a Hugging Face checkpoint: ``config.json`` and safetensors);
it reads from the checkpoint only the routed experts of its rank. Its geometry must match
the attention side's (``--max-num-batched-tokens``, ``--dtype``): the connectors compare a
digest of it at start-up and name the first difference.

    afd-vllm ffn --model DIR --rank 0 --max-num-batched-tokens 2048 \\
        --additional-config '{"afd": {"role": "ffn", "connector": "HostAsyncAFDConnector"}}'

``--max-num-batched-tokens`` is the engines' *effective* value (vLLM may raise what it was
given; the engine's start-up log prints it, and a mismatch is named at connect). Send the
process SIGUSR1 to print how many work items each attention replica has sent so far.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path
from types import FrameType

import torch

from afd_models import DeepseekConfig, DeviceError, FFNRoleExecutor
from afd_models.weights import SafetensorsWeights
from afd_protocol import AFDError, ServeStats
from afd_vllm.config import parse_afd_config
from afd_vllm.connectors.base import ModelGeometry
from afd_vllm.connectors.factory import create_connector
from afd_vllm.extra import AFDConfigError

DTYPES = ("float32", "bfloat16", "float16")


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The ``ffn`` subcommand of ``afd-vllm``."""
    ffn = sub.add_parser(
        "ffn",
        help="run the FFN role: this rank's routed experts, serving until shutdown",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ffn.add_argument("--model", type=Path, required=True, help="checkpoint directory")
    ffn.add_argument("--rank", type=int, default=0, help="this FFN rank (0-based)")
    ffn.add_argument(
        "--additional-config",
        required=True,
        help='the engine\'s JSON, with {"afd": {"role": "ffn", ...}}',
    )
    ffn.add_argument(
        "--max-num-batched-tokens",
        type=int,
        required=True,
        help="the attention engines' value (it sizes the windows)",
    )
    ffn.add_argument("--dtype", choices=DTYPES, default="bfloat16", help="the engines' dtype")
    ffn.add_argument("--device", default="cpu", help="where the experts run (cpu, cuda:N)")
    ffn.add_argument("--backend", default="reference", help="afd_models expert backend")
    ffn.add_argument(
        "--connect-timeout",
        type=float,
        default=None,
        help="seconds to wait for the peers (default: connector_extra_config's "
        "connect_timeout_s, 300)",
    )
    ffn.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    try:
        return serve_ffn(args)
    except (AFDConfigError, AFDError, DeviceError, OSError) as exc:
        print(f"afd-vllm ffn: error: {exc}", file=sys.stderr)
        return 2


def _stop(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def describe_counts(stats: ServeStats, num_replicas: int) -> str:
    """The work items served per attention replica so far, for the SIGUSR1 report and the
    final line (an operator sees which replicas are stepping)."""
    return ", ".join(f"replica {r}: {n}" for r, n in enumerate(stats.per_replica(num_replicas)))


def serve_ffn(args: argparse.Namespace) -> int:
    try:
        additional = json.loads(args.additional_config)
    except json.JSONDecodeError as exc:
        raise AFDConfigError(f"--additional-config is not JSON: {exc}") from None
    config = parse_afd_config(additional, expected_role="ffn")
    if config is None:
        raise AFDConfigError('--additional-config has no "afd" entry')
    if not (args.model / "config.json").is_file():
        raise AFDConfigError(f"--model {args.model}: no config.json there")
    model = DeepseekConfig.from_json(args.model / "config.json")
    geometry = ModelGeometry(
        hidden_size=model.hidden_size,
        num_experts=model.n_routed_experts,
        topk=model.num_experts_per_tok,
        num_layers=model.num_hidden_layers,
        max_num_batched_tokens=args.max_num_batched_tokens,
        dtype=args.dtype,
    )
    connector = create_connector(config, geometry)
    local = connector.layout().topology.local_experts(args.rank)
    started = time.perf_counter()
    executor = FFNRoleExecutor(
        model,
        local,
        SafetensorsWeights(args.model),
        dtype=getattr(torch, args.dtype),
        device=args.device,
        backend=args.backend,
    )
    signal.signal(signal.SIGTERM, _stop)
    replicas = connector.layout().topology.num_dp_replicas
    stats = ServeStats()  # filled live by the serving loop
    signal.signal(
        signal.SIGUSR1,
        lambda signum, frame: print(
            f"afd-vllm ffn: rank {args.rank} items so far: {describe_counts(stats, replicas)}",
            flush=True,
        ),
    )
    timeout = args.connect_timeout
    if timeout is None:
        timeout = float(config.extra.connect_timeout_s)
    connection = connector.connect(args.rank, timeout)

    def ready() -> None:
        print(
            f"afd-vllm ffn: rank {args.rank} ready ({len(local)} experts, "
            f"{time.perf_counter() - started:.1f} s); serving",
            flush=True,
        )

    try:
        # The one FFN rank program (shared with afd run's FFN ranks).
        executor.serve_rank(connection, connector.endpoint_options(), stats=stats, on_ready=ready)
    except KeyboardInterrupt:
        connection.abort()
        print(f"afd-vllm ffn: rank {args.rank} stopped", flush=True)
        return 130
    except BaseException:
        connection.abort()
        raise
    finally:
        connection.close()
    print(
        f"afd-vllm ffn: rank {args.rank} served {len(stats.items)} work items "
        f"({describe_counts(stats, replicas)}); shut down",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    from afd_vllm.cli import main

    sys.exit(main())
