"""``afd run``: launch the system, feed it a workload, verify every output, compare modes."""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing as mp
import sys
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

from afd_models import PRESET_NAMES, MonolithicModel, RandomWeights, preset
from afd_protocol import (
    AFDError,
    CombineReduce,
    Role,
    SharedPlacement,
    SlotLayout,
    Topology,
    WireFormat,
    relative_error,
)
from afd_protocol.launch import RankSpec, TransportFactory, launch, shm_transport
from afd_tools.run import ranks
from afd_tools.run.lockstep import pipes as lockstep_pipes
from afd_tools.run.metrics import ModeSummary, ratios, summarize
from afd_tools.run.outputs import check_writable, write_atomically
from afd_tools.run.report import print_report, write_plot
from afd_tools.run.workload import (
    ASSIGNMENTS,
    PRESETS,
    WorkloadError,
    arrival_times,
    assign,
    prompt_lengths,
    read_workload,
)

MODES = ("async", "sync", "colocated")
TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2}
QUANT_TOLERANCE = 5e-2
"""Relative error allowed when dispatch rows travel as int8 (about amax / 254 per element,
compounded over the layers)."""
TRANSPORTS = ("shm", "cam-emulator")


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "run",
        help="run attention replicas and FFN ranks as processes on a prefill workload",
        description=(
            "Launch A attention replicas and F FFN ranks as processes (shared-memory "
            "transport), prefill a workload in each mode, check every request's final hidden "
            "state against the monolithic reference, and report TTFT, throughput and how busy "
            "each rank was."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--preset", choices=PRESET_NAMES, default="tiny", help="model shapes")
    p.add_argument("--layers", type=int, default=None, help="override the preset's layer count")
    p.add_argument("--attention-ranks", type=int, default=2, help="attention DP replicas (A)")
    p.add_argument("--ffn-ranks", type=int, default=2, help="FFN ranks (F)")
    p.add_argument("--mode", choices=[*MODES, "all"], default="all", help="which modes to run")
    p.add_argument("--workload", choices=PRESETS, default="uneven", help="prompt-length mix")
    p.add_argument(
        "--workload-file",
        type=Path,
        default=None,
        help="JSONL with prompt_len (a whole number) or prompt_tokens (token ids) per line "
        "(overrides --workload)",
    )
    p.add_argument("--requests", type=int, default=48, help="number of requests")
    p.add_argument(
        "--max-prompt-len",
        type=int,
        default=256,
        help="longest prompt of a --workload preset; any length up to the model's "
        "max_position_embeddings works with any --max-num-batched-tokens (long prompts are "
        "prefilled in chunks)",
    )
    p.add_argument(
        "--rate",
        type=float,
        default=None,
        help="Poisson arrivals at this many requests/s (default: all at once)",
    )
    p.add_argument(
        "--assign",
        choices=ASSIGNMENTS,
        default="round-robin",
        help="how requests are given to replicas",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=256,
        help="tokens per prefill step and replica (also the slot capacity); longer prompts "
        "are prefilled in chunks over several steps",
    )
    p.add_argument("--dtype", choices=sorted(TOLERANCE), default="float32", help="activations")
    p.add_argument(
        "--shared",
        choices=[s.value for s in SharedPlacement],
        default="attention",
        help="where shared experts run",
    )
    p.add_argument(
        "--wire-format",
        choices=[w.value for w in WireFormat],
        default="per_rank",
        help="per_rank: a token's row travels once per FFN rank holding any of its experts; "
        "per_choice: once per (token, expert)",
    )
    p.add_argument(
        "--combine-reduce",
        choices=[c.value for c in CombineReduce],
        default="ffn",
        help="who weights and sums a token's partials: the FFN ranks (per_rank only, one "
        "reply row per token) or the attention side",
    )
    p.add_argument(
        "--transport",
        choices=TRANSPORTS,
        default="shm",
        help="shm: afd's shared-memory windows; cam-emulator: the CPU emulator of Ascend CAM's "
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
    p.add_argument("--backend", default="reference", help="expert backend on the FFN ranks")
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


def _run(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    modes = list(MODES) if args.mode == "all" else [args.mode]
    overrides = {} if args.layers is None else {"num_layers": args.layers}
    config = preset(args.preset, **overrides)
    if args.attention_ranks < 1 or args.ffn_ranks < 1:
        raise WorkloadError("--attention-ranks and --ffn-ranks must be >= 1")
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
    window = slot.window(ring_depth=1)
    factory = _transport_factory(args, slot)
    ctx = mp.get_context("spawn")
    # Pipes only (no semaphore, no shared-memory name): nothing outlives a crash.
    inboxes, outboxes = lockstep_pipes(ctx, args.attention_ranks)
    progress, progress_writer = ctx.Pipe(duplex=False)
    common = {"config": config, "seed": args.seed, "timeout": args.timeout}
    specs = [
        RankSpec(
            Role.ATTENTION,
            r,
            ranks.attention_replica,
            {
                **common,
                "requests": [q for q in requests if q.replica == r],
                "modes": modes,
                "max_tokens": args.max_num_batched_tokens,
                "lockstep_inbox": inboxes[r],
                "lockstep_outboxes": outboxes,
                "progress": progress_writer,
                "run_timeout": args.run_timeout,
            },
        )
        for r in range(args.attention_ranks)
    ]
    specs += [
        RankSpec(Role.FFN, r, ranks.ffn_rank, {**common, "backend": args.backend})
        for r in range(args.ffn_ranks)
    ]
    square = sum(n * n for n in lengths)
    print(
        f"afd run: {args.attention_ranks} attention x {args.ffn_ranks} FFN processes, preset "
        f"{args.preset} ({config.num_hidden_layers} layers, {config.n_routed_experts} experts "
        f"top-{config.num_experts_per_tok}, {args.dtype}), {len(requests)} requests "
        f"({args.workload_file or args.workload}: {sum(lengths)} tokens, sum of squares "
        f"{square}), modes {', '.join(modes)}"
    )
    try:
        results = _launch_with_progress(
            window, specs, len(requests) * len(modes), progress, args, factory
        )
    finally:
        for end in [*inboxes, *outboxes, progress, progress_writer]:
            end.close()

    replica_values = [results[f"attention rank {r}"].value for r in range(args.attention_ranks)]
    ffn_intervals = [results[f"ffn rank {r}"].value["intervals"] for r in range(args.ffn_ranks)]
    errors = _verify(config, args, requests, replica_values, modes)
    tolerance = _tolerance(args)
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
    summaries: dict[str, ModeSummary] = {
        mode: summarize(mode, requests, [v[mode] for v in replica_values], ffn_intervals)
        for mode in modes
    }
    print_report(summaries, ratios(summaries))
    if args.json is not None:
        report = {
            "args": {k: str(v) for k, v in vars(args).items() if k != "handler"},
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
        write_atomically(
            args.plot,
            lambda tmp: write_plot(tmp, summaries, replica_values, ffn_intervals, modes),
        )
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
            f"{_tolerance(args):.0e} ({listed}); {elapsed:.0f} s"
        )
        return 1
    print(
        f"PASS: every request's final hidden state matches the monolithic reference in every "
        f"mode (tolerance {tolerance:.0e}; worst {_worst_of(worst)}); {elapsed:.0f} s"
    )
    return 0


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
    from afd_transport_cam.emulated import emulated_connection
    from afd_transport_cam.endpoints import cam_geometry

    try:
        cam_geometry(slot, args.cam_dynamic_quant)
    except AFDError as exc:
        raise WorkloadError(f"--transport cam-emulator: {exc}") from None
    return functools.partial(
        emulated_connection, dynamic_quant=args.cam_dynamic_quant, spin_timeout=args.timeout
    )


def _launch_with_progress(
    window: Any,
    specs: list[RankSpec],
    total: int,
    progress: Connection,
    args: argparse.Namespace,
    factory: TransportFactory,
) -> dict[str, Any]:
    """Run the ranks with :func:`launch` in this (main) thread -- so that Ctrl-C and SIGTERM
    stop and clean up everything -- while a helper thread draws the progress bar."""
    stop = threading.Event()
    bar_thread = None
    if not args.no_progress and sys.stderr.isatty():
        bar_thread = threading.Thread(
            target=_draw_progress, args=(progress, total, stop), daemon=True
        )
        bar_thread.start()
    try:
        return dict(launch(window, specs, timeout=args.run_timeout, transport_factory=factory))
    finally:
        stop.set()
        if bar_thread is not None:
            bar_thread.join(timeout=5)


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
    requests: list[Any],
    replica_values: list[dict[str, Any]],
    modes: list[str],
) -> dict[str, dict[int, float]]:
    """Compare every request of every mode with the monolithic model; return every relative
    error (per mode, request id -> error)."""
    dtype = getattr(torch, args.dtype)
    reference = MonolithicModel(config, RandomWeights(args.seed), dtype=dtype)
    expected = {}
    for request in requests:
        prompt = ranks.request_tokens(request, config.vocab_size, args.seed)
        out = reference.forward([prompt], compute_logits=False)
        expected[request.request_id] = out.last_hidden_states()[0].float()
    errors: dict[str, dict[int, float]] = {mode: {} for mode in modes}
    for mode in modes:
        for values in replica_values:
            for rid, hidden in values[mode].last_hidden.items():
                errors[mode][rid] = relative_error(hidden, expected[rid])
    return errors


__all__ = ["MODES", "AFDError", "add_parser", "run"]
