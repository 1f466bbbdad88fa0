"""``afd run``: launch the system, feed it a workload, verify every output, compare modes."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import multiprocessing as mp
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

from afd_models import PRESET_NAMES, MonolithicModel, preset
from afd_protocol import (
    AFDError,
    CombineReduce,
    DeviceSharing,
    Role,
    SharedPlacement,
    SlotLayout,
    Topology,
    TransportFactory,
    TransportOptions,
    TransportSpec,
    WindowLayout,
    available_transports,
    get_transport,
    transport_names,
)
from afd_protocol.launch import RankSpec, launch
from afd_tools.outputs import check_writable, json_safe, write_atomically
from afd_tools.prefill.metrics import ModeSummary, ratios, summarize
from afd_tools.prefill.options import add_wire_options, add_workload_options
from afd_tools.prefill.report import print_report, write_plot
from afd_tools.prefill.run_report import Deployment, RunReport
from afd_tools.prefill.workload import (
    Request,
    WorkloadError,
    arrival_times,
    assign,
    prompt_lengths,
    read_workload,
)
from afd_tools.run import ranks
from afd_tools.run.devices import COLOCATED, DEVICE_DEFAULTS, Placement, place, resolve_device
from afd_tools.run.expert_parallel import expert_parallel_connection
from afd_tools.run.lockstep import pipes as lockstep_pipes
from afd_tools.run.monolithic import monolithic_connection, monolithic_replica
from afd_tools.run.sharing import afd_shares, check_mps_options, describe_sharing, mps_clients
from afd_tools.run.verify import QUANT_TIE_MARGIN, TIE_MARGIN, Checks, Verdict, verify

MODES = ("async", "sync", "colocated")
TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2}
_SPAWN = mp.get_context("spawn")
QUANT_TOLERANCE = 5e-2
"""Relative error allowed when dispatch rows travel as int8 (about amax / 254 per element,
compounded over the layers)."""


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "run",
        help="run attention replicas and FFN ranks as processes on a prefill workload",
        description=(
            "Launch A attention replicas and F FFN ranks as processes (on CPU over shared "
            "memory; on CUDA one GPU per process over NVSHMEM, or with --share-gpus several per "
            "GPU under CUDA MPS), prefill a workload in each mode (async AFD, sync AFD, "
            "colocated), check every request's final hidden state against the monolithic "
            "reference, and report TTFT, throughput and how busy each rank was. Defaults that "
            "depend on the device: float32 / reference experts / shm / colocated dp on CPU; "
            "bfloat16 / grouped_mm / nvshmem / colocated dp-ep on CUDA (mono when the ranks "
            "share one GPU)."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="where the ranks compute: cuda (one GPU per process, attention replicas on the "
        "first A GPUs, FFN ranks on the next F) or cpu; auto picks cuda when a GPU is visible",
    )
    p.add_argument(
        "--share-gpus",
        action="store_true",
        help="cuda: allow more processes than GPUs, rank i on GPU i mod G. Ranks sharing a GPU "
        "run as clients of a private CUDA MPS daemon that afd run starts and stops (NVSHMEM "
        "needs it), each with its share of the GPU's SMs. On one GPU this measures fixed "
        "costs, kernels, device waits and asynchrony faithfully, but rows cross HBM, not "
        "NVLink, and each rank has only its share of the SMs",
    )
    p.add_argument(
        "--mps-attention-share",
        type=int,
        default=None,
        metavar="PCT",
        help="with shared GPUs: the percent of its GPU's SMs each attention rank may use "
        "(its CUDA_MPS_ACTIVE_THREAD_PERCENTAGE; the FFN ranks on that GPU split the rest; a "
        "GPU's ranks must add up to <= 100; with neither share given, every GPU is split "
        "equally among its ranks)",
    )
    p.add_argument(
        "--mps-ffn-share",
        type=int,
        default=None,
        metavar="PCT",
        help="with shared GPUs: the percent of its GPU's SMs each FFN rank may use (the "
        "attention ranks on that GPU split the rest)",
    )
    p.add_argument(
        "--no-mps",
        action="store_true",
        help="with shared GPUs: start no CUDA MPS daemon; the ranks time-slice the GPU "
        "(--transport shm only: NVSHMEM refuses ranks sharing a GPU outside MPS)",
    )
    p.add_argument("--preset", choices=PRESET_NAMES, default="tiny", help="model shapes")
    p.add_argument("--layers", type=int, default=None, help="override the preset's layer count")
    p.add_argument("--attention-ranks", type=int, default=2, help="attention DP replicas (A)")
    p.add_argument("--ffn-ranks", type=int, default=2, help="FFN ranks (F)")
    p.add_argument("--mode", choices=[*MODES, "all"], default="all", help="which modes to run")
    add_workload_options(p)
    p.add_argument(
        "--dtype",
        choices=sorted(TOLERANCE),
        default=None,
        help="activations and weights (default: float32 on cpu, bfloat16 on cuda)",
    )
    p.add_argument(
        "--tie-margin",
        type=float,
        default=None,
        help="verification: the relative router-score gap under which a token's top-k is a "
        "near tie, where the reference takes the run's expert choice (default: "
        + ", ".join(f"{v:.1e} in {k}" for k, v in sorted(TIE_MARGIN.items()))
        + f", {QUANT_TIE_MARGIN:.1e} with --cam-dynamic-quant); elsewhere a different choice "
        "is a wrong expert. 1 follows every disagreement: the report's largest followed gap "
        "then measures what a device needs",
    )
    p.add_argument(
        "--colocated",
        choices=COLOCATED,
        default=None,
        help="the colocated baseline: dp = each of the A replicas holds the whole model; dp-ep "
        "= one rank per processor AFD uses (A+F on cpu, one per GPU on cuda), each with "
        "attention and its share of the routed experts, tokens exchanged every MoE layer by "
        "all_gather + reduce_scatter (NCCL on cuda, gloo on cpu); mono = the monolithic model "
        "in one process on the whole first GPU (DP1, EP1), all requests first come first "
        "served: what a one-GPU user runs, and what dp-ep becomes on one GPU (default: dp on "
        "cpu, dp-ep on cuda)",
    )
    add_wire_options(p)
    p.add_argument(
        "--transport",
        default=None,
        metavar="{" + ",".join(transport_names()) + "}",
        help="a transport installed here (afd_protocol's transport registry): shm: afd's "
        "shared-memory windows (default on cpu; on cuda rows are staged through host memory); "
        "nvshmem: GPU windows over NVLink (default on cuda); cam-emulator: the CPU emulator of "
        "Ascend CAM's compact routed-only operators (needs --shared attention and experts "
        "that split evenly over the FFN ranks; its own wire format, so --wire-format and "
        "--combine-reduce do not apply)",
    )
    p.add_argument(
        "--cam-dynamic-quant",
        action="store_true",
        help="cam-emulator: dispatch rows as int8 with a per-token scale (outputs are then "
        f"verified to {QUANT_TOLERANCE:g} instead of the dtype's tolerance)",
    )
    p.add_argument(
        "--backend",
        default=None,
        help="expert backend on the FFN ranks (default: reference on cpu, grouped_mm on cuda)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed for weights and the workload")
    p.add_argument(
        "--timeout",
        type=float,
        default=120.0,
        help="seconds an attention rank waits for FFN replies before failing (a dead peer is "
        "detected within a second whatever this is)",
    )
    p.add_argument(
        "--run-timeout",
        type=float,
        default=1800.0,
        help="seconds the whole run may take (replicas wait for each other at mode starts "
        "and, in sync mode, at every layer, for up to this long)",
    )
    p.add_argument("--json", type=Path, default=None, help="write every number here")
    p.add_argument("--plot", type=Path, default=None, help="write a PNG timeline here")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except WorkloadError as exc:
        print(f"afd run: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("afd run: interrupted; every rank process was stopped", file=sys.stderr)
        return 130


def _apply_device_defaults(args: argparse.Namespace) -> Placement:
    """Fill the device-dependent defaults into ``args`` (``--colocated`` as placed) and place
    the ranks; the MPS options are checked against the placement."""
    kind = resolve_device(args.device)
    for key, value in DEVICE_DEFAULTS[kind].items():
        if getattr(args, key) is None:
            if key == "backend" and args.dtype != "bfloat16":
                value = "reference"
            setattr(args, key, value)
    transport = get_transport(args.transport)
    transport.check_device(kind, transport_option="--transport", device_option="--device")
    if args.stages < 1:
        raise WorkloadError(f"--stages must be >= 1, got {args.stages}")
    if args.attention_ranks < 1 or args.ffn_ranks < 1:
        raise WorkloadError("--attention-ranks and --ffn-ranks must be >= 1")
    placement = place(kind, args.attention_ranks, args.ffn_ranks, args.share_gpus, args.colocated)
    args.colocated = placement.colocated_mode
    if placement.shared and transport.device_sharing is DeviceSharing.EXCLUSIVE:
        raise WorkloadError(
            f"--share-gpus: --transport {transport.name} runs one rank per GPU; drop --share-gpus"
        )
    check_mps_options(
        placement, args.mps_attention_share, args.mps_ffn_share, args.no_mps, args.transport
    )
    return placement


def _run(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    modes = list(MODES) if args.mode == "all" else [args.mode]
    overrides = {} if args.layers is None else {"num_layers": args.layers}
    config = preset(args.preset, **overrides)
    placement = _apply_device_defaults(args)
    shares = (
        {} if args.no_mps else afd_shares(placement, args.mps_attention_share, args.mps_ffn_share)
    )
    if args.max_num_batched_tokens < 1:
        raise WorkloadError(
            f"--max-num-batched-tokens must be >= 1, got {args.max_num_batched_tokens}"
        )
    if args.tie_margin is not None and not 0 <= args.tie_margin <= 1:
        raise WorkloadError(f"--tie-margin must be within [0, 1], got {args.tie_margin}")
    if not args.timeout > 0:
        raise WorkloadError(f"--timeout must be > 0 seconds, got {args.timeout}")
    _check_transport_options(args, get_transport(args.transport))
    if args.combine_reduce == CombineReduce.FFN.value and args.wire_format != "per_rank":
        raise WorkloadError(
            "--combine-reduce ffn needs --wire-format per_rank (per_choice rows carry no "
            "weights for the FFN ranks to reduce with); add --combine-reduce attention"
        )
    for path in (args.json, args.plot):
        check_writable(path)
    longest = config.max_position_embeddings
    tokens: list[tuple[int, ...] | None] | None = None
    if args.workload_file is not None:
        prompts = read_workload(args.workload_file, longest, config.vocab_size)
        lengths = [length for length, _ in prompts]
        tokens = [given for _, given in prompts]
    else:
        if args.max_prompt_len > longest:
            raise WorkloadError(
                f"--max-prompt-len {args.max_prompt_len} exceeds the model's longest prompt "
                f"({longest}, max_position_embeddings)"
            )
        lengths = prompt_lengths(args.workload, args.requests, args.seed, args.max_prompt_len)
    arrivals = arrival_times(len(lengths), args.rate, args.seed)
    requests = assign(lengths, arrivals, args.attention_ranks, args.assign, tokens)
    # Colocated dp runs inside the AFD launch; dp-ep and mono are launches of their own.
    separate = "colocated" in modes and args.colocated != "dp"
    afd_modes = [m for m in modes if not (m == "colocated" and separate)]
    # Each launch is built just before it runs (its pipes open only then).
    groups: list[Callable[[Connection], _Group]] = []
    if afd_modes:
        transport = _afd_transport(args, config)
        groups.append(
            lambda progress: _afd_group(
                args, config, placement, requests, afd_modes, transport, progress, shares
            )
        )
    if separate:
        colocated = _colocated_group if args.colocated == "dp-ep" else _monolithic_group
        groups.append(
            lambda progress: colocated(args, config, placement, lengths, arrivals, tokens, progress)
        )
    square = sum(n * n for n in lengths)
    sharing = describe_sharing(placement, shares)
    print(
        f"afd run: {args.attention_ranks} attention x {args.ffn_ranks} FFN processes on "
        f"{placement.kind}{f' ({sharing})' if sharing else ''}, preset "
        f"{args.preset} ({config.num_hidden_layers} layers, {config.n_routed_experts} experts "
        f"top-{config.num_experts_per_tok}, {args.dtype}, {args.transport}), {len(requests)} "
        f"requests ({args.workload_file or args.workload}: {sum(lengths)} tokens, sum of "
        f"squares {square}), modes {', '.join(modes)}"
        + (f"; colocated: {placement.colocated_label}" if "colocated" in modes else "")
    )
    total = len(requests) * len(modes)
    outcomes: list[tuple[list[str], list[Request], list[Any], list[Any]]] = []
    with _progress_bar(total, args) as progress:
        for build in groups:
            outcomes.append(build(progress).run(args))

    verdict = Verdict(_verify(config, args, placement, outcomes), _tolerance(args), _margin(args))
    failures = verdict.failures()
    summaries: dict[str, ModeSummary] = {}
    for group_modes, group_requests, values, intervals in outcomes:
        for mode in group_modes:
            summaries[mode] = summarize(mode, group_requests, [v[mode] for v in values], intervals)
    summaries = {m: summaries[m] for m in modes}
    print_report(summaries, ratios(summaries))
    if args.json is not None:
        report = RunReport(
            deployment=_deployment(args, placement),
            requests=tuple(requests),
            modes=summaries,
            ratios=ratios(summaries),
            placement=_placement_record(placement, shares),
            verification=verdict.as_json(),
            args={k: str(v) for k, v in vars(args).items() if k != "handler"},
        )
        text = json.dumps(json_safe(report.to_json()), indent=2, allow_nan=False)
        write_atomically(args.json, lambda tmp: tmp.write_text(text))
        print(f"wrote {args.json}")
    if args.plot is not None:
        write_atomically(args.plot, lambda tmp: write_plot(tmp, summaries, outcomes))
        print(f"wrote {args.plot}")
    elapsed = time.perf_counter() - started
    if failures:
        print(f"{verdict.fail_line()}; {elapsed:.0f} s")
        return 1
    print(f"{verdict.pass_line()}; {elapsed:.0f} s")
    return 0


@dataclass
class _Group:
    """One launch: the AFD processes (A attention + F FFN) or the colocated DP+EP ranks."""

    modes: list[str]
    requests: list[Request]
    window: Any
    specs: list[RankSpec]
    factory: TransportFactory
    replicas: int
    ffn_ranks: int
    pipes: list[Connection]
    shares: dict[str, int] = dataclasses.field(default_factory=dict)
    """Each rank's CUDA MPS share by rank name, where ranks share GPUs (empty: no MPS)."""

    def run(
        self, args: argparse.Namespace
    ) -> tuple[list[str], list[Request], list[Any], list[Any]]:
        """Launch the ranks (as MPS clients with their shares, under a daemon that lives as
        long as the launch, when :attr:`shares` is not empty) and collect their results."""
        try:
            with mps_clients(self.shares) as environments:
                specs = [_with_env(spec, environments.get(spec.name, {})) for spec in self.specs]
                results = _launch(self.window, specs, args, self.factory)
        finally:
            for end in self.pipes:
                end.close()
        values = [results[f"attention rank {r}"].value for r in range(self.replicas)]
        intervals = [results[f"ffn rank {r}"].value["intervals"] for r in range(self.ffn_ranks)]
        return self.modes, self.requests, values, intervals


def _with_env(spec: RankSpec, env: dict[str, str]) -> RankSpec:
    """``spec`` with ``env`` added to its process environment."""
    return dataclasses.replace(spec, env={**spec.env, **env}) if env else spec


def _deployment(args: argparse.Namespace, placement: Placement) -> Deployment:
    """The deployment as the report records it (``args`` with the device defaults filled
    in, the device as placed)."""
    return Deployment(
        device=placement.kind,
        preset=args.preset,
        layers=args.layers,
        dtype=args.dtype,
        attention_ranks=args.attention_ranks,
        ffn_ranks=args.ffn_ranks,
        max_num_batched_tokens=args.max_num_batched_tokens,
        stages=args.stages,
        colocated=args.colocated,
        assign=args.assign,
        wire_format=args.wire_format,
        combine_reduce=args.combine_reduce,
        shared=args.shared,
        transport=args.transport,
        backend=args.backend,
        workload=args.workload,
        workload_file=None if args.workload_file is None else str(args.workload_file),
        max_prompt_len=args.max_prompt_len,
        rate=None if args.rate is None else float(args.rate),
        seed=args.seed,
        cam_dynamic_quant=bool(args.cam_dynamic_quant),
    )


def _placement_record(placement: Placement, shares: dict[str, int]) -> dict[str, Any]:
    """The ``placement`` object of the JSON report: every rank's device, the colocated
    baseline in words, and how the AFD ranks shared GPUs (``mps_shares``: percent by rank
    name, empty when no GPU was shared under MPS)."""
    return placement.__dict__ | {
        "exchange": placement.exchange,
        "colocated_label": f"colocated: {placement.colocated_label}",
        "sharing": describe_sharing(placement, shares) or "none",
        "mps_shares": dict(shares),
    }


def _replica_spec(
    args: argparse.Namespace,
    config: Any,
    rank: int,
    requests: list[Request],
    modes: list[str],
    device: str,
    inboxes: list[Connection],
    outboxes: list[Connection],
    progress: Connection,
) -> RankSpec:
    return RankSpec(
        Role.ATTENTION,
        rank,
        ranks.attention_replica,
        {
            "config": config,
            "seed": args.seed,
            "timeout": args.timeout,
            "requests": [q for q in requests if q.replica == rank],
            "modes": modes,
            "max_tokens": args.max_num_batched_tokens,
            "lockstep_inbox": inboxes[rank],
            "lockstep_outboxes": outboxes,
            "run_timeout": args.run_timeout,
            "device": device,
            "num_stages": args.stages,
            "progress": progress,
        },
    )


def _afd_transport(args: argparse.Namespace, config: Any) -> tuple[WindowLayout, TransportFactory]:
    """The AFD launch's window and connection factory (checked before anything runs)."""
    topology = Topology(args.attention_ranks, args.ffn_ranks, config.n_routed_experts)
    slot = SlotLayout(
        topology,
        config.hidden_size,
        args.max_num_batched_tokens,
        config.num_experts_per_tok,
        dtype=args.dtype,
        shared_placement=args.shared,
        wire_format=args.wire_format,
        combine_reduce=args.combine_reduce,
    )
    return slot.window(ring_depth=args.stages), _transport_factory(args, slot)


def _afd_group(
    args: argparse.Namespace,
    config: Any,
    placement: Placement,
    requests: list[Request],
    modes: list[str],
    transport: tuple[WindowLayout, TransportFactory],
    progress: Connection,
    shares: dict[str, int],
) -> _Group:
    window, factory = transport
    # Pipes only (no semaphore, no shared-memory name): nothing outlives a crash.
    inboxes, outboxes = lockstep_pipes(_SPAWN, args.attention_ranks)
    specs = [
        _replica_spec(
            args, config, r, requests, modes, placement.attention[r], inboxes, outboxes, progress
        )
        for r in range(args.attention_ranks)
    ]
    specs += [
        RankSpec(
            Role.FFN,
            r,
            ranks.ffn_rank,
            {
                "config": config,
                "seed": args.seed,
                "timeout": args.timeout,
                "backend": args.backend,
                "device": placement.ffn[r],
                "num_stages": args.stages,
            },
        )
        for r in range(args.ffn_ranks)
    ]
    return _Group(
        modes,
        requests,
        window,
        specs,
        factory,
        args.attention_ranks,
        args.ffn_ranks,
        [*inboxes, *outboxes],
        shares,
    )


def _colocated_group(
    args: argparse.Namespace,
    config: Any,
    placement: Placement,
    lengths: list[int],
    arrivals: list[float],
    tokens: list[tuple[int, ...] | None] | None,
    progress: Connection,
) -> _Group:
    """Colocated DP+EP on the processors AFD uses (A+F on the CPU, one rank per GPU on
    CUDA): the same requests and arrivals, assigned over its ranks by the same policy."""
    world = len(placement.colocated)
    requests = assign(lengths, arrivals, world, args.assign, tokens)
    slot = SlotLayout(
        Topology(world, world, config.n_routed_experts),
        config.hidden_size,
        args.max_num_batched_tokens,
        config.num_experts_per_tok,
        dtype=args.dtype,
        shared_placement=SharedPlacement.ATTENTION,
    )
    factory = functools.partial(
        expert_parallel_connection,
        config=config,
        seed=args.seed,
        backend=args.backend,
        device_kind=placement.kind,
        exchange=placement.exchange,
    )
    inboxes, outboxes = lockstep_pipes(_SPAWN, world)
    specs = [
        _replica_spec(
            args,
            config,
            r,
            requests,
            ["colocated"],
            placement.colocated[r],
            inboxes,
            outboxes,
            progress,
        )
        for r in range(world)
    ]
    return _Group(
        ["colocated"],
        requests,
        slot.window(ring_depth=1),
        specs,
        factory,
        world,
        0,
        [*inboxes, *outboxes],
    )


def _monolithic_group(
    args: argparse.Namespace,
    config: Any,
    placement: Placement,
    lengths: list[int],
    arrivals: list[float],
    tokens: list[tuple[int, ...] | None] | None,
    progress: Connection,
) -> _Group:
    """``--colocated mono``: the monolithic model in one process on the first attention
    replica's device, every request with the same arrivals, first come first served
    (:mod:`afd_tools.run.monolithic`); not an MPS client, so it has the whole GPU."""
    requests = assign(lengths, arrivals, 1, args.assign, tokens)
    slot = SlotLayout(
        Topology(1, 1, config.n_routed_experts),
        config.hidden_size,
        args.max_num_batched_tokens,
        config.num_experts_per_tok,
        dtype=args.dtype,
    )
    device = placement.colocated[0]
    spec = RankSpec(
        Role.ATTENTION,
        0,
        monolithic_replica,
        {
            "config": config,
            "seed": args.seed,
            "requests": requests,
            "max_tokens": args.max_num_batched_tokens,
            "backend": args.backend,
            "progress": progress,
            "device": device,
        },
    )
    factory = functools.partial(monolithic_connection, device=device)
    return _Group(["colocated"], requests, slot.window(ring_depth=1), [spec], factory, 1, 0, [])


def _tolerance(args: argparse.Namespace) -> float:
    """The relative error a request's output may have against the monolithic reference."""
    return QUANT_TOLERANCE if args.cam_dynamic_quant else TOLERANCE[args.dtype]


def _margin(args: argparse.Namespace) -> float:
    """The relative router-score gap under which the reference follows the run's experts."""
    if args.tie_margin is not None:
        return float(args.tie_margin)
    return QUANT_TIE_MARGIN if args.cam_dynamic_quant else TIE_MARGIN[args.dtype]


def _check_transport_options(args: argparse.Namespace, transport: TransportSpec) -> None:
    """Refuse the options ``--transport`` cannot honour, naming the ones that can."""
    if args.cam_dynamic_quant and not transport.dynamic_quant:
        able = [t.name for t in available_transports().values() if t.dynamic_quant]
        raise WorkloadError(
            f"--cam-dynamic-quant applies to --transport {' or '.join(able) or '(none here)'} only"
        )
    transport.check_shared_placement(
        args.shared, transport_option="--transport", shared_option="--shared"
    )


def _transport_factory(args: argparse.Namespace, slot: SlotLayout) -> TransportFactory:
    """The launcher's connection factory for ``--transport``, from the transport registry
    (checked before any process starts: why the deployment cannot run on it names it)."""
    transport = get_transport(args.transport)
    options = TransportOptions(wait_timeout=args.timeout, dynamic_quant=args.cam_dynamic_quant)
    try:
        return transport.factory(slot, options)
    except AFDError as exc:
        raise WorkloadError(f"--transport {transport.name}: {exc}") from None


def _launch(
    window: Any, specs: list[RankSpec], args: argparse.Namespace, factory: TransportFactory
) -> dict[str, Any]:
    """Run the ranks with :func:`launch` in this (main) thread, so that Ctrl-C and SIGTERM
    stop and clean up everything."""
    return dict(launch(window, specs, timeout=args.run_timeout, transport_factory=factory))


@contextlib.contextmanager
def _progress_bar(total: int, args: argparse.Namespace) -> Iterator[Connection]:
    """The writing end of a pipe the ranks report finished requests into, while a helper
    thread draws the progress bar (on a terminal, unless --no-progress)."""
    reader, writer = _SPAWN.Pipe(duplex=False)
    stop = threading.Event()
    bar_thread = None
    if not args.no_progress and sys.stderr.isatty():
        bar_thread = threading.Thread(
            target=_draw_progress, args=(reader, total, stop), daemon=True
        )
        bar_thread.start()
    try:
        yield writer
    finally:
        stop.set()
        if bar_thread is not None:
            bar_thread.join(timeout=5)
        reader.close()
        writer.close()


def _draw_progress(progress: Connection, total: int, stop: threading.Event) -> None:
    from rich.progress import Progress

    with Progress(transient=True) as bar:
        task = bar.add_task("prefill requests (all modes)", total=total)
        while not stop.is_set():
            if progress.poll(0.1):
                try:
                    progress.recv_bytes()
                except (EOFError, OSError):
                    return
                bar.advance(task)


def _verify(
    config: Any,
    args: argparse.Namespace,
    placement: Placement,
    outcomes: list[tuple[list[str], list[Request], list[Any], list[Any]]],
) -> Checks:
    """Check every request of every mode against the monolithic model on the first
    attention replica's device, with the FFN ranks' expert backend, replaying each
    replica's own steps and following its expert choice at routing near ties
    (:mod:`afd_tools.run.verify`)."""
    dtype = getattr(torch, args.dtype)
    device = placement.attention[0]
    weights = ranks.random_weights(args.seed, torch.device(device))
    reference = MonolithicModel(config, weights, dtype=dtype, device=device, backend=args.backend)
    prompts = {
        r.request_id: ranks.request_tokens(r, config.vocab_size, args.seed)
        for _, requests, _, _ in outcomes
        for r in requests
    }
    checks = verify(reference, outcomes, prompts, _margin(args))
    del reference
    return checks


__all__ = ["COLOCATED", "MODES", "AFDError", "add_parser", "run"]
