"""``afd run``: launch the system, feed it a workload, verify every output, compare modes."""

from __future__ import annotations

import argparse
import contextlib
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

from afd_models import PRESET_NAMES, KVCache, MonolithicModel, PromptChunk, preset
from afd_protocol import (
    AFDError,
    CombineReduce,
    Role,
    SharedPlacement,
    SlotLayout,
    Topology,
    WindowLayout,
    relative_error,
)
from afd_protocol.launch import RankSpec, TransportFactory, launch, shm_transport
from afd_tools.run import ranks
from afd_tools.run.devices import DEVICE_DEFAULTS, Placement, place, resolve_device
from afd_tools.run.expert_parallel import expert_parallel_connection
from afd_tools.run.lockstep import pipes as lockstep_pipes
from afd_tools.run.metrics import ModeSummary, ratios, summarize
from afd_tools.run.options import add_wire_options, add_workload_options
from afd_tools.run.outputs import check_writable, write_atomically
from afd_tools.run.report import print_report, write_plot
from afd_tools.run.workload import (
    Request,
    WorkloadError,
    arrival_times,
    assign,
    prompt_lengths,
    read_workload,
)

MODES = ("async", "sync", "colocated")
TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2}
_SPAWN = mp.get_context("spawn")
QUANT_TOLERANCE = 5e-2
"""Relative error allowed when dispatch rows travel as int8 (about amax / 254 per element,
compounded over the layers)."""
TRANSPORTS = ("shm", "nvshmem", "cam-emulator")
COLOCATED = ("dp", "dp-ep")


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "run",
        help="run attention replicas and FFN ranks as processes on a prefill workload",
        description=(
            "Launch A attention replicas and F FFN ranks as processes (on CPU over shared "
            "memory; on CUDA one GPU per process over NVSHMEM), prefill a workload in each mode "
            "(async AFD, sync AFD, colocated), check every request's final hidden state against "
            "the monolithic reference, and report TTFT, throughput and how busy each rank was. "
            "Defaults that depend on the device: float32 / reference experts / shm / colocated dp "
            "on CPU; bfloat16 / grouped_mm / nvshmem / colocated dp-ep on CUDA."
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
        help="cuda: allow more processes than GPUs, several per GPU (a functional check; use "
        "--transport shm, since NVSHMEM and NCCL want one process per GPU)",
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
        "--colocated",
        choices=COLOCATED,
        default=None,
        help="the colocated baseline: dp = each of the A replicas holds the whole model; dp-ep "
        "= A+F ranks (the same processors AFD uses), each with attention and 1/(A+F) of the "
        "routed experts, tokens exchanged every MoE layer by all_gather + reduce_scatter "
        "(NCCL on cuda, gloo on cpu) (default: dp on cpu, dp-ep on cuda)",
    )
    add_wire_options(p)
    p.add_argument(
        "--transport",
        choices=TRANSPORTS,
        default=None,
        help="shm: afd's shared-memory windows (default on cpu; on cuda rows are staged "
        "through host memory); nvshmem: GPU windows over NVLink (default on cuda); "
        "cam-emulator: the CPU emulator of Ascend CAM's "
        "compact routed-only operators (needs --shared attention and experts that split "
        "evenly over the FFN ranks; its own wire format, so --wire-format and "
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
    """Fill the device-dependent defaults into ``args`` and place the ranks."""
    kind = resolve_device(args.device)
    for key, value in DEVICE_DEFAULTS[kind].items():
        if getattr(args, key) is None:
            if key == "backend" and args.dtype != "bfloat16":
                value = "reference"
            setattr(args, key, value)
    if args.transport == "nvshmem" and kind != "cuda":
        raise WorkloadError("--transport nvshmem needs --device cuda")
    if args.transport == "cam-emulator" and kind != "cpu":
        raise WorkloadError("--transport cam-emulator runs on cpu only; add --device cpu")
    if args.stages < 1:
        raise WorkloadError(f"--stages must be >= 1, got {args.stages}")
    if args.attention_ranks < 1 or args.ffn_ranks < 1:
        raise WorkloadError("--attention-ranks and --ffn-ranks must be >= 1")
    return place(kind, args.attention_ranks, args.ffn_ranks, args.share_gpus)


def _run(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    modes = list(MODES) if args.mode == "all" else [args.mode]
    overrides = {} if args.layers is None else {"num_layers": args.layers}
    config = preset(args.preset, **overrides)
    placement = _apply_device_defaults(args)
    if args.max_num_batched_tokens < 1:
        raise WorkloadError(
            f"--max-num-batched-tokens must be >= 1, got {args.max_num_batched_tokens}"
        )
    if args.cam_dynamic_quant and args.transport != "cam-emulator":
        raise WorkloadError("--cam-dynamic-quant applies to --transport cam-emulator only")
    if args.transport == "cam-emulator" and args.shared != SharedPlacement.ATTENTION.value:
        raise WorkloadError(
            "--transport cam-emulator carries routed experts only: use --shared attention"
        )
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
    expert_parallel = "colocated" in modes and args.colocated == "dp-ep"
    afd_modes = [m for m in modes if not (m == "colocated" and expert_parallel)]
    # Each launch is built just before it runs (its pipes open only then).
    groups: list[Callable[[Connection], _Group]] = []
    if afd_modes:
        transport = _afd_transport(args, config)
        groups.append(
            lambda progress: _afd_group(
                args, config, placement, requests, afd_modes, transport, progress
            )
        )
    if expert_parallel:
        groups.append(
            lambda progress: _colocated_group(
                args, config, placement, lengths, arrivals, tokens, progress
            )
        )
    square = sum(n * n for n in lengths)
    print(
        f"afd run: {args.attention_ranks} attention x {args.ffn_ranks} FFN processes on "
        f"{placement.kind}{' (GPUs shared)' if placement.shared else ''}, preset "
        f"{args.preset} ({config.num_hidden_layers} layers, {config.n_routed_experts} experts "
        f"top-{config.num_experts_per_tok}, {args.dtype}, {args.transport}), {len(requests)} "
        f"requests ({args.workload_file or args.workload}: {sum(lengths)} tokens, sum of "
        f"squares {square}), modes {', '.join(modes)}"
        + (
            f"; colocated = DP{len(placement.colocated)}+EP over {placement.exchange}"
            if expert_parallel
            else ""
        )
    )
    total = len(requests) * len(modes)
    outcomes: list[tuple[list[str], list[Request], list[Any], list[Any]]] = []
    with _progress_bar(total, args) as progress:
        for build in groups:
            outcomes.append(build(progress).run(args))

    tolerance = _tolerance(args)
    errors = _verify(config, args, placement, outcomes)
    failures = {
        mode: {r: e for r, e in by_request.items() if e > tolerance}
        for mode, by_request in errors.items()
        if any(e > tolerance for e in by_request.values())
    }
    worst = {
        mode: max(by_request.items(), key=lambda item: item[1])
        for mode, by_request in errors.items()
        if by_request
    }
    summaries: dict[str, ModeSummary] = {}
    for group_modes, group_requests, values, intervals in outcomes:
        for mode in group_modes:
            summaries[mode] = summarize(mode, group_requests, [v[mode] for v in values], intervals)
    summaries = {m: summaries[m] for m in modes}
    print_report(summaries, ratios(summaries))
    if args.json is not None:
        report = {
            "args": {k: str(v) for k, v in vars(args).items() if k != "handler"},
            "placement": placement.__dict__ | {"exchange": placement.exchange},
            "modes": {m: s.as_dict() for m, s in summaries.items()},
            "ratios": ratios(summaries),
            "requests": [r.__dict__ for r in requests],
            "verification_failures": {m: sorted(f) for m, f in failures.items()},
            "verification_worst": {
                m: {"request": r, "relative_error": e} for m, (r, e) in worst.items()
            },
            "verification_errors": {
                m: {str(r): e for r, e in f.items()} for m, f in failures.items()
            },
        }
        write_atomically(args.json, lambda tmp: tmp.write_text(json.dumps(report, indent=2)))
        print(f"wrote {args.json}")
    if args.plot is not None:
        write_atomically(args.plot, lambda tmp: write_plot(tmp, summaries, outcomes))
        print(f"wrote {args.plot}")
    elapsed = time.perf_counter() - started
    if failures:
        listed = "; ".join(
            f"{m}: "
            + ", ".join(f"request {r} (relative error {e:.2e})" for r, e in sorted(f.items()))
            for m, f in failures.items()
        )
        print(
            f"FAIL: outputs differ from the monolithic reference beyond the tolerance "
            f"{tolerance:.0e} ({listed}); {elapsed:.0f} s"
        )
        return 1
    print(
        f"PASS: every request's final hidden state matches the monolithic reference in every "
        f"mode (tolerance {tolerance:.0e}; worst {_worst_of(worst)}); {elapsed:.0f} s"
    )
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

    def run(
        self, args: argparse.Namespace
    ) -> tuple[list[str], list[Request], list[Any], list[Any]]:
        try:
            results = _launch(self.window, self.specs, args, self.factory)
        finally:
            for end in self.pipes:
                end.close()
        values = [results[f"attention rank {r}"].value for r in range(self.replicas)]
        intervals = [results[f"ffn rank {r}"].value["intervals"] for r in range(self.ffn_ranks)]
        return self.modes, self.requests, values, intervals


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
    """Colocated DP+EP on the A+F processors AFD uses: the same requests and arrivals,
    assigned over A+F replicas by the same policy."""
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


def _worst_of(worst: dict[str, tuple[int, float]]) -> str:
    if not worst:
        return "none"
    mode, (request, error) = max(worst.items(), key=lambda item: item[1][1])
    return f"{error:.1e}, request {request} in {mode}"


def _tolerance(args: argparse.Namespace) -> float:
    """The relative error a request's output may have against the monolithic reference."""
    return QUANT_TOLERANCE if args.cam_dynamic_quant else TOLERANCE[args.dtype]


def _transport_factory(args: argparse.Namespace, slot: SlotLayout) -> TransportFactory:
    """The launcher's connection factory for ``--transport`` (checked before any process)."""
    if args.transport == "shm":
        return shm_transport
    if args.transport == "nvshmem":
        from afd_transport_nvshmem.launch_support import nvshmem_transport

        return nvshmem_transport
    from afd_transport_cam.emulated import emulated_connection
    from afd_transport_cam.endpoints import cam_geometry

    try:
        cam_geometry(slot, args.cam_dynamic_quant)
    except AFDError as exc:
        raise WorkloadError(f"--transport cam-emulator: {exc}") from None
    return functools.partial(
        emulated_connection, dynamic_quant=args.cam_dynamic_quant, spin_timeout=args.timeout
    )


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
) -> dict[str, dict[int, float]]:
    """Compare every request of every mode with the monolithic model (on the first
    attention replica's device); return every relative error (per mode, request id ->
    error).

    The reference replays each replica's steps -- the same batches, the same chunks of
    long prompts -- and computes its routed experts with the FFN ranks' backend, so that
    the one thing it does differently is the MoE exchange under test. In float32 that
    hardly matters; in bfloat16 it does: another batch shape makes the GEMMs round
    differently, and where two experts' router scores are that close, a token's top-k
    flips from one layer on -- a difference of several percent in one token's final state
    (more with V3's group-limited routing) that would say nothing about AFD."""
    dtype = getattr(torch, args.dtype)
    device = placement.attention[0]
    weights = ranks.random_weights(args.seed, torch.device(device))
    reference = MonolithicModel(config, weights, dtype=dtype, device=device, backend=args.backend)
    replayed: dict[tuple[Any, ...], dict[int, torch.Tensor]] = {}
    errors: dict[str, dict[int, float]] = {}
    for modes, requests, values, _ in outcomes:
        prompts = {
            r.request_id: ranks.request_tokens(r, config.vocab_size, args.seed) for r in requests
        }
        for mode in modes:
            errors[mode] = {}
            for replica in values:
                result = replica[mode]
                key = tuple(tuple(step) for step in result.steps)
                if key not in replayed:
                    replayed[key] = _replay(reference, prompts, result.steps)
                for rid, hidden in result.last_hidden.items():
                    errors[mode][rid] = relative_error(hidden, replayed[key][rid])
    del reference
    return errors


def _replay(
    reference: MonolithicModel,
    prompts: dict[int, torch.Tensor],
    steps: list[list[tuple[int, int, int, bool]]],
) -> dict[int, torch.Tensor]:
    """Every finished request's final hidden state, from the steps a replica ran."""
    cache = KVCache()
    out: dict[int, torch.Tensor] = {}
    for step in steps:
        entries = [PromptChunk(rid, prompts[rid][b:e], b, final) for rid, b, e, final in step]
        last = reference.forward(entries, compute_logits=False, cache=cache)
        states = last.last_hidden_states().float().cpu()
        for row, (rid, _, _, final) in enumerate(step):
            if final:
                out[rid] = states[row]
    return out


__all__ = ["MODES", "AFDError", "add_parser", "run"]
