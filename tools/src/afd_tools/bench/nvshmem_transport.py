"""``afd bench transport --backend nvshmem``: NVSHMEM windows between two GPUs, or between
two processes on one GPU.

With one GPU the two ranks share it as clients of a private CUDA MPS daemon, 50 % of the
SMs each (NVSHMEM's full multi-process-per-GPU mode): latencies, host costs, kernels and
the per-layer fixed costs are measured as they are; row copies go through HBM instead of
NVLink, so the floor is a copy within the GPU and the per-layer table adds the link term
(the layer's bytes at the 394 GB/s a peer ``copy_`` reached between two H200s).

Side by side in one run:

* bandwidth -- one-sided ``copy_`` into the peer's mapped window (64 KB .. 256 MB) beside the
  floor: the same ``copy_`` into ordinary memory of the other GPU mapped by CUDA peer access;
* arrival latency, one way (round trip / 2) -- what a host caller of ``wait_any`` sees
  with a host poll (one D2H copy per check), with the device poll (a Triton poll
  reporting to pinned host memory, replayed from a CUDA graph, and the same kernel
  launched through Triton each time); and with no host in the loop, the raw device-side
  figures: stream memory operations (``cuStreamWaitValue32``/``cuStreamWriteValue32``) and
  a persistent Triton ping-pong kernel;
* dispatch + combine per layer, 1 attention x 1 FFN, DeepSeek-V2-Lite shapes (hidden
  2048 bf16, 64 experts top-6), identity FFN: the endpoint options side by side (blocks of
  rounds interleaved), and host-polled waits as a separate launch; the put path
  (``data_path="put"``: slots staged locally, then NVSHMEM device puts and the flag),
  eager and graph-replayed, in the launch after the mapped kernel-publish one.

Wait modes are transport options, fixed when a transport opens, so each is its own launch
(two processes, NVSHMEM started afresh); endpoint options are fixed per endpoint, so the
per-layer modes close one endpoint and open the next on the same transport.
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time
from functools import partial
from typing import Any

import torch

from afd_protocol import (
    AttentionEndpoint,
    CombineReduce,
    Role,
    SlotLayout,
    Topology,
    WireFormat,
    plan_on_device,
)
from afd_protocol.launch import GPU_START_METHOD, RankSpec, launch
from afd_protocol.window import WindowConnection, WindowOptions, WindowTransport
from afd_tools.bench.identity_ffn import serve_identity, serve_identity_graphed
from afd_tools.bench.pingpong import flag_pingpong
from afd_tools.bench.stats import human_bytes

SIZES = [64 << 10, 1 << 20, 16 << 20, 64 << 20, 256 << 20]
NVLINK_GBS = 394.0
"""One-sided ``copy_`` into a peer window between two H200s over NVLink (NV18), 256 MB,
measured 2026-11-30: what a one-GPU run's per-layer bytes would cost on the link."""
LAYER_TOKENS = [1024, 4096, 8192, 16384]
HIDDEN, EXPERTS, TOPK = 2048, 64, 6


def _log(t: WindowTransport, message: str) -> None:
    print(
        f"[{time.strftime('%H:%M:%S')}] {t.role.value} {t.rank}: {message}",
        file=sys.stderr,
        flush=True,
    )


def _event() -> torch.cuda.Event:
    return torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]


def _sync_both() -> None:
    for d in range(min(2, torch.cuda.device_count())):
        torch.cuda.synchronize(d)


def _timed(fn: Any, repeats: int) -> float:
    fn()
    _sync_both()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    _sync_both()
    return (time.perf_counter() - start) / repeats


_ROUNDS: dict[int, int] = {}
"""Flag value each ring reached so far; both sides make the same calls in the same order,
so both know every expected value without reading the flag (which would race)."""


def _pingpong_transport(t: WindowTransport, ring: int, iterations: int) -> list[float]:
    base = _ROUNDS.get(ring, 0)
    _ROUNDS[ring] = base + iterations
    samples = flag_pingpong(t, ring, base + 1, iterations)
    torch.cuda.synchronize(t.device)
    return samples


def _enable_peer_access(device: torch.device, other: torch.device) -> bool:
    """Let ``device`` address ``other``'s memory directly (True when it can)."""
    if not torch.cuda.can_device_access_peer(device.index, other.index):
        return False
    try:
        from cuda.bindings import runtime as cudart
    except ImportError:
        return False
    with torch.cuda.device(device):
        (err,) = cudart.cudaDeviceEnablePeerAccess(other.index, 0)
    # Success, or "already enabled" (torch may have done it for a cross-device copy).
    return int(err) in (0, int(cudart.cudaError_t.cudaErrorPeerAccessAlreadyEnabled))


WAIT_VARIANTS: dict[str, dict[str, Any]] = {
    "device": {"wait": "device", "wait_graph": True},
    "device_launch": {"wait": "device", "wait_graph": False},
    "host": {"wait": "host", "wait_graph": True},
    "kernel_publish": {"wait": "device", "wait_graph": True, "publish": "kernel"},
    "put": {"wait": "device", "wait_graph": True, "publish": "kernel", "data_path": "put"},
}
"""Transport option sets (each its own launch): the ``wait_any`` variants, and the device
wait with every flag of a dispatch published by one kernel, and the same over the put path
(slots staged locally, then NVSHMEM device puts: ``data_path="put"``)."""
KERNEL_PUBLISH_MODE = WindowOptions(timeout=120.0, device_pack=True)
"""The 'dev pack' endpoint over the kernel-publish transport (the publish kernel serves the
packed dispatch)."""
PROFILED_MODES = ("device", "graphs", "ffn-graph", "ffn-graph-rank")
"""The modes ``--profile`` profiles on the attention side (one file each)."""
GRAPHED_MODES = frozenset(
    {
        "graphs",
        "ffn-graph",
        "ffn-graph-rank",
        "ffn-graph-rank-deferred",
        "graphs-host-wait",
        "graphs-torch-plan",
        "put-graphs",
    }
)
"""Modes whose endpoint replays its exchange from CUDA graphs (``graphed_attention_endpoint``
of the NVSHMEM connection): 'graphs' in the kernel-publish launch, beside 'kern pub';
'ffn-graph' in a launch of its own whose FFN rank serves from a CUDA graph too, and
'ffn-graph-rank' the same over the ``per_rank`` wire format reduced on the FFN side (what
``afd run`` sends by default: one row per token and FFN rank each way);
'put-graphs' in the put path's launch, beside 'put'; 'ffn-graph-rank-deferred' is
'ffn-graph-rank' with each combine's replies checked later (``defer_checks``: at the next
combine on its ring, or ``flush()``), interleaved with it."""
ROW_MODES = ("ffn-graph-rank", "ffn-graph-rank-deferred")
"""Modes also timed :data:`LAYERS_IN_A_ROW` layers back to back (then flush() and one
synchronize): a forward pass's view, where the host may run ahead of the device."""
LAYERS_IN_A_ROW = 8


def _wait_any_latency(connection: WindowConnection, iterations: int) -> float:
    """One way (round trip / 2, median, us) of a flag ping-pong through ``wait_any``, as the
    attention side times it (the FFN side only echoes: NaN there)."""
    samples = _pingpong_transport(connection.transport, 0, iterations)[iterations // 10 :]
    return statistics.median(samples) / 2 * 1e6 if samples else float("nan")


def _latency_and_bandwidth(
    connection: WindowConnection, iterations: int, repeats: int
) -> dict[str, Any]:
    from afd_transport_nvshmem.cuda_memory import (
        device_bytes,
        stream_memops_available,
        stream_wait_value32_geq,
        stream_write_value32,
    )
    from afd_transport_nvshmem.device_wait import pingpong

    t = connection.transport
    _log(t, "wait_any ping-pong, device waits")
    report: dict[str, Any] = {"wait_any_device_us": _wait_any_latency(connection, iterations)}
    window = t.window
    local_flags = t.local_window()[window.flags_offset :].view(torch.int32)
    peer_flags = t.peer_window(0)[window.flags_offset :].view(torch.int32)
    stream = torch.cuda.current_stream(t.device)
    initiator = t.role is Role.ATTENTION
    if stream_memops_available():
        _log(t, "stream memory operations ping-pong")
        flag = window.flag_index(0, 2)
        mine = window.flag_index(t.rank, 2)
        local_addr = local_flags.data_ptr() + 4 * flag
        peer_addr = peer_flags.data_ptr() + 4 * mine
        _pingpong_transport(t, 3, 3)  # line both sides up
        start, end = _event(), _event()
        start.record(stream)
        for i in range(1, iterations + 1):
            if initiator:
                stream_write_value32(peer_addr, i, stream)
                stream_wait_value32_geq(local_addr, i, stream)
            else:
                stream_wait_value32_geq(local_addr, i, stream)
                stream_write_value32(peer_addr, i, stream)
        end.record(stream)
        end.synchronize()
        report["stream_memops_us"] = start.elapsed_time(end) * 1e3 / iterations / 2
    _log(t, "barrier")
    _pingpong_transport(t, 3, 3)
    flag = window.flag_index(0, 2)
    mine = window.flag_index(t.rank, 2)
    local_word = local_flags[flag : flag + 1]
    peer_word = peer_flags[mine : mine + 1]
    local_word.zero_()
    pingpong(local_word, peer_word, 0, initiator)  # compile before the clock starts
    torch.cuda.synchronize(t.device)
    _pingpong_transport(t, 3, 3)
    _log(t, "persistent Triton ping-pong")
    start, end = _event(), _event()
    start.record(stream)
    pingpong(local_word, peer_word, iterations, initiator)
    end.record(stream)
    end.synchronize()
    report["triton_kernel_us"] = start.elapsed_time(end) * 1e3 / iterations / 2

    _log(t, "bandwidth")
    if initiator:  # bandwidth: only the attention rank writes
        rows_at = window.field_offset(t.rank, 0, "routed_rows")
        peer = t.peer_window(0)
        other = torch.device("cuda", (t.device.index + 1) % torch.cuda.device_count())
        one_gpu = other == t.device
        p2p = not one_gpu and _enable_peer_access(t.device, other)
        bandwidth = {}
        for size in SIZES:
            if rows_at + size > peer.numel():
                continue
            src = torch.randint(0, 255, (size,), dtype=torch.uint8, device=t.device)
            dst = peer[rows_at : rows_at + size]
            plain = torch.empty(size, dtype=torch.uint8, device=other)
            reps = max(3, min(5 * repeats, (4 << 30) // size))
            point = {"window": _timed(partial(dst.copy_, src), reps)}
            if one_gpu:
                # The floor on one GPU: the same copy_ into ordinary memory of this GPU.
                point["peer_copy"] = _timed(partial(plain.copy_, src), reps)
                point["floor_checked"] = bool(torch.equal(plain[:4096].cpu(), src[:4096].cpu()))
            else:
                point["torch_cross_device"] = _timed(
                    partial(plain.copy_, src, non_blocking=True), reps
                )
            if p2p:
                # The floor: the same copy_ into ordinary cudaMalloc memory of the other GPU,
                # mapped peer to peer by CUDA itself -- no NVSHMEM involved.
                mapped = device_bytes(plain.data_ptr(), size, t.device)
                point["peer_copy"] = _timed(partial(mapped.copy_, src), reps)
                point["floor_checked"] = bool(torch.equal(plain[:4096].cpu(), src[:4096].cpu()))
            point["checked"] = bool(torch.equal(dst[:4096].cpu(), src[:4096].cpu()))
            bandwidth[str(size)] = point
        report["bandwidth"] = bandwidth
        report["gather"] = _gather_into_peer(t, peer, rows_at, repeats)
    _pingpong_transport(t, 3, 3)  # the FFN side waits here until the writer is done
    _log(t, "done")
    return report


def _gather_into_peer(
    t: WindowTransport, peer: torch.Tensor, rows_at: int, repeats: int
) -> dict[str, dict[str, float]]:
    """Dispatch's gather (rows in wire order, ``index_select`` into the peer window) beside
    a plain ``copy_`` of the same bytes, at 1K..16K tokens."""
    gen = torch.Generator(device=t.device).manual_seed(1)
    out: dict[str, dict[str, float]] = {}
    for n in LAYER_TOKENS:
        count = n * TOPK
        nbytes = count * HIDDEN * 2
        if rows_at + nbytes > peer.numel():
            continue
        dst = peer[rows_at : rows_at + nbytes].view(torch.bfloat16).view(count, HIDDEN)
        x = torch.randn(n, HIDDEN, device=t.device, generator=gen).to(torch.bfloat16)
        ids = torch.rand(n, EXPERTS, device=t.device, generator=gen).topk(TOPK, -1).indices
        index = torch.sort(ids.reshape(-1), stable=True).indices // TOPK
        contiguous = x.index_select(0, index)
        reps = max(5, repeats)
        point = {
            "index_select": _timed(partial(torch.index_select, x, 0, index, out=dst), reps),
            "copy": _timed(partial(dst.copy_, contiguous), reps),
        }
        point["checked"] = float(torch.equal(dst[:64].cpu(), contiguous[:64].cpu()))
        out[str(n)] = point
    return out


LAYER_MODES = {
    "device": WindowOptions(timeout=120.0, device_pack=False),
    "device-pack": WindowOptions(timeout=120.0, device_pack=True),
    "torch-combine": WindowOptions(timeout=120.0, combine="portable"),
    "copied-header": WindowOptions(timeout=120.0, capture_headers=False),
}
"""Per-layer endpoint options side by side: the host plan (device wait with the header
captured with the flag, fused combine, counts read to the host once); the dispatch packed
on the device (the default since the device plan measured faster behind queued compute;
this benchmark queues none); the portable per-FFN-rank combine instead of the
fused kernel; each header copied out of the window instead of captured by the wait."""
HOST_MODE = WindowOptions(timeout=120.0, combine="portable", capture_headers=False)
"""The straightforward implementation, measured in a launch of its own because host polls
are a transport option: host-polled waits, copied headers, the portable combine."""
ROUNDS_PER_BLOCK = 5
"""Timed rounds per endpoint before the next mode's turn (after one warm-up round)."""


def _layer_attention(
    connection: WindowConnection,
    tokens: list[int],
    repeats: int,
    profile: str | None,
    modes: dict[str, WindowOptions],
) -> dict[str, float]:
    """Time dispatch + combine per mode: each mode's endpoint in turn for a block of rounds,
    the blocks interleaved so that clock and thermal drift hit every mode alike. Two untimed
    rounds per block first: buffers, compiles, and a graphed mode's capture."""
    device = connection.device
    gen = torch.Generator(device=device).manual_seed(0)
    results = {}
    blocks = max(1, -(-repeats // ROUNDS_PER_BLOCK))
    for n in tokens:
        x = torch.randn(n, HIDDEN, device=device, generator=gen).to(torch.bfloat16)
        ids = torch.rand(n, EXPERTS, device=device, generator=gen).topk(TOPK, -1).indices
        w = torch.rand(n, TOPK, device=device, generator=gen)
        samples: dict[str, list[tuple[float, ...]]] = {m: [] for m in modes}
        in_a_row: dict[str, list[float]] = {m: [] for m in modes if m in ROW_MODES}
        captures = dict.fromkeys(modes, 0.0)
        capture_seconds = dict.fromkeys(modes, 0.0)
        for _ in range(blocks):
            for mode, options in modes.items():
                endpoint = _endpoint(connection, mode, options)
                for _ in range(2):  # eager once, then (a graphed mode) captured
                    endpoint.combine(endpoint.dispatch(0, x, ids, w))
                torch.cuda.synchronize(device)
                for _ in range(ROUNDS_PER_BLOCK):
                    samples[mode].append(_timed_round(endpoint, x, ids, w))
                if mode in ROW_MODES:
                    in_a_row[mode].append(_timed_row(endpoint, x, ids, w))
                _flush(endpoint)  # a deferred mode's last check: before close() cancels it
                captures[mode] += getattr(endpoint, "captures", 0)
                capture_seconds[mode] += getattr(endpoint, "capture_seconds", 0.0)
                endpoint.close()
        for mode in GRAPHED_MODES & set(modes):
            # Per endpoint (one per block): the graphs it held, and the host time per capture.
            results[f"{mode}/{n}/captures"] = captures[mode] / blocks
            results[f"{mode}/{n}/capture_s"] = capture_seconds[mode] / max(1.0, captures[mode])
        for mode, row_times in in_a_row.items():
            results[f"{mode}/{n}/row"] = statistics.median(row_times)
            results[f"{mode}/{n}/row_p10"] = _quantile(row_times, 0.1)
            results[f"{mode}/{n}/row_p90"] = _quantile(row_times, 0.9)
        for mode, rows in samples.items():
            columns = list(zip(*rows, strict=True))
            names = (
                "",
                "/dispatch_call",
                "/combine_call",
                "/dispatch_gpu",
                "/reply_and_combine_gpu",
                "/combine_wait",
            )
            for name, column in zip(names, columns, strict=True):
                results[f"{mode}/{n}{name}"] = statistics.median(column)
                if not name:
                    results[f"{mode}/{n}/p10"] = _quantile(column, 0.1)
                    results[f"{mode}/{n}/p90"] = _quantile(column, 0.9)
        for mode in PROFILED_MODES:
            if profile and mode in modes:
                endpoint = _endpoint(connection, mode, modes[mode])
                for _ in range(2):  # eager once, then (a graphed mode) captured
                    endpoint.combine(endpoint.dispatch(0, x, ids, w))
                _profile_layer(endpoint, x, ids, w, f"{profile}/attention-{mode}.txt")
                endpoint.close()
    endpoint = connection.attention_endpoint(next(iter(modes.values())))
    endpoint.announce_shutdown()
    endpoint.close()
    return results


def _endpoint(connection: WindowConnection, mode: str, options: WindowOptions) -> Any:
    """The attention endpoint of ``mode``: graph-replayed for :data:`GRAPHED_MODES` (with
    the replies waited for inside the combine graph, but in 'graphs-host-wait')."""
    if mode in GRAPHED_MODES:
        make = connection.graphed_attention_endpoint  # type: ignore[attr-defined]
        kernels = None
        if mode == "graphs-torch-plan":  # the device plan as afd_protocol's torch ops
            own = connection.endpoint_kernels()  # type: ignore[attr-defined]
            kernels = dataclasses.replace(own, device_plan=plan_on_device)
        return make(
            options,
            wait_in_graph=mode != "graphs-host-wait",
            kernels=kernels,
            defer_checks=mode.endswith("-deferred"),
        )
    return connection.attention_endpoint(options)


def _quantile(values: Any, q: float) -> float:
    ordered = sorted(values)
    return float(ordered[min(len(ordered) - 1, int(q * len(ordered)))])


def _timed_round(
    endpoint: AttentionEndpoint, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor
) -> tuple[float, ...]:
    """(total, dispatch() host, combine() host, dispatch GPU, reply+combine GPU, combine()'s
    host spin on its device wait) seconds; the last is NaN for an endpoint without one."""
    marks = [_event() for _ in range(3)]
    waited = getattr(endpoint, "wait_seconds", float("nan"))
    start = time.perf_counter()
    marks[0].record()
    handle = endpoint.dispatch(0, x, ids, w)
    marks[1].record()
    issued = time.perf_counter()
    out = endpoint.combine(handle)
    marks[2].record()
    combined = time.perf_counter()
    waited = getattr(endpoint, "wait_seconds", float("nan")) - waited
    torch.cuda.synchronize(x.device)
    total = time.perf_counter() - start
    del out
    return (
        total,
        issued - start,
        combined - issued,
        marks[0].elapsed_time(marks[1]) / 1e3,
        marks[1].elapsed_time(marks[2]) / 1e3,
        waited,
    )


def _timed_row(
    endpoint: AttentionEndpoint, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor
) -> float:
    """Seconds per layer of :data:`LAYERS_IN_A_ROW` dispatch + combine pairs issued back to
    back from an idle GPU, every check done (``flush()``) and the device drained."""
    torch.cuda.synchronize(x.device)
    start = time.perf_counter()
    for layer in range(LAYERS_IN_A_ROW):
        endpoint.combine(endpoint.dispatch(layer % 2, x, ids, w))
    _flush(endpoint)
    torch.cuda.synchronize(x.device)
    return (time.perf_counter() - start) / LAYERS_IN_A_ROW


def _flush(endpoint: AttentionEndpoint) -> None:
    """Check what a deferred endpoint left unchecked (others have nothing to flush)."""
    flush = getattr(endpoint, "flush", None)
    if flush is not None:
        flush()


def _profile_layer(endpoint: AttentionEndpoint, x: Any, ids: Any, w: Any, path: str) -> None:
    """Append to ``path`` a torch.profiler table of five dispatch+combine rounds (CPU and CUDA
    time per op) and a cProfile of fifty (where the host's time goes, call by call)."""
    import cProfile
    import io
    import pstats

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            endpoint.combine(endpoint.dispatch(0, x, ids, w))
        torch.cuda.synchronize(x.device)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(50):
        endpoint.combine(endpoint.dispatch(0, x, ids, w))
    torch.cuda.synchronize(x.device)
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(30)
    with open(path, "a") as out:
        out.write(f"==== {x.shape[0]} tokens: torch.profiler, 5 rounds ====\n")
        out.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
        out.write(f"\n==== {x.shape[0]} tokens: cProfile, 50 rounds ====\n")
        out.write(text.getvalue())


LATENCY_LABELS = {
    "wait_any_device_us": "endpoint wait_any, device poll (graph replay)",
    "wait_any_device_launch_us": "endpoint wait_any, device poll (Triton launch)",
    "wait_any_host_us": "endpoint wait_any, host poll (D2H per check)",
    "stream_memops_us": "raw device: stream memory operations",
    "triton_kernel_us": "raw device: persistent Triton kernel",
}
"""What each latency figure is: what an endpoint sees through ``wait_any`` (the host learns
of the arrival), or a raw device-side ping-pong with no host in the loop."""


def _with(specs: list[RankSpec], env: dict[str, str]) -> list[RankSpec]:
    """``specs`` with ``env`` in every rank's environment (the MPS client settings)."""
    return [dataclasses.replace(spec, env={**spec.env, **env}) for spec in specs]


def _launch(window: Any, specs: list[RankSpec], wait_variant: str) -> dict[str, Any]:
    """The ranks run over NVSHMEM with ``wait_variant``'s waits, started as afd run starts
    GPU ranks (:data:`~afd_protocol.launch.GPU_START_METHOD`, unless ``AFD_START_METHOD``
    says otherwise: ``--start-method`` sets it)."""
    return dict(
        launch(
            window,
            specs,
            timeout=600,
            transport_factory=_factory(wait_variant),
            default_start_method=GPU_START_METHOD,
        )
    )


def _factory(wait_variant: str) -> Any:
    from afd_transport_nvshmem.launch_support import nvshmem_transport
    from afd_transport_nvshmem.transport import NvshmemOptions

    return partial(nvshmem_transport, options=NvshmemOptions(**WAIT_VARIANTS[wait_variant]))


def run(args: Any) -> dict[str, Any]:
    """The benchmark (module docstring); one GPU: under a private MPS daemon, closed at the
    end whatever happens."""
    gpus = torch.cuda.device_count()
    if gpus < 1:
        raise SystemExit("afd bench transport --backend nvshmem needs a CUDA GPU")
    if gpus >= 2:
        return _run(args, {}, "two GPUs, one rank each")
    from afd_protocol.launch import sigterm_as_interrupt
    from afd_transport_nvshmem.mps import MpsDaemon, equal_shares

    share = equal_shares(2)
    with sigterm_as_interrupt(), MpsDaemon.start() as daemon:
        placement = f"one GPU, both ranks as CUDA MPS clients at {share} % of the SMs each"
        return _run(args, daemon.client_environment(share), placement)


def _run(args: Any, env: dict[str, str], placement: str) -> dict[str, Any]:
    one_gpu = bool(env)
    report: dict[str, Any] = {
        "backend": "nvshmem",
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "placement": placement,
    }
    rows = max(SIZES) // (4096 * 2)
    big = SlotLayout(Topology(1, 1, 1), 4096, rows, 1, routed_cap_multiplier=1.0).window(
        ring_depth=5
    )
    specs = [
        RankSpec(
            role,
            0,
            _latency_and_bandwidth,
            {"iterations": args.iterations, "repeats": args.repeats},
        )
        for role in Role
    ]
    micro = _launch(big, _with(specs, env), "device")
    attention = micro["attention rank 0"].value
    latency = {k: v for k, v in attention.items() if k.endswith("_us")}
    tiny = SlotLayout(Topology(1, 1, 1), 64, 16, 1).window()
    for variant in ("device_launch", "host"):
        specs = [
            RankSpec(role, 0, _wait_any_latency, {"iterations": args.iterations}) for role in Role
        ]
        result = _launch(tiny, _with(specs, env), variant)
        latency[f"wait_any_{variant}_us"] = result["attention rank 0"].value
    report["latency_us"] = {k: latency[k] for k in LATENCY_LABELS if k in latency}
    report["bandwidth"] = attention["bandwidth"]
    report["gather"] = attention["gather"]
    print(f"NVSHMEM transport on {report['gpu']} ({placement}), torch {report['torch']}")
    if one_gpu:
        print(
            "  one GPU: fixed costs, host time, kernels and waits as they are; row copies go "
            "through HBM, not NVLink (the floor below is a copy within the GPU; the per-layer "
            f"table adds the link term at {NVLINK_GBS:.0f} GB/s)"
        )
    print("\narrival latency, one way (round trip / 2, median): what an endpoint sees through")
    print("wait_any (the host learns of the arrival), and raw device-side ping-pongs (no host):")
    for key, value in report["latency_us"].items():
        print(f"  {LATENCY_LABELS[key]:48s} {value:8.2f} us")
    if one_gpu:
        print("\none-sided copy_ into the NVSHMEM peer window (the other process's heap on this")
        print("GPU), beside the floor: the same copy_ into cudaMalloc memory of this GPU:")
    else:
        print("\none-sided copy_ into the NVSHMEM peer window, beside the floor: the same copy_")
        print("into cudaMalloc memory of the other GPU mapped peer to peer by CUDA (same run),")
        print("and torch's cross-device copy_ (copy engine) for reference:")
    print(
        f"  {'size':>8} {'window GB/s':>12} {'floor GB/s':>11} {'ratio':>6} "
        f"{'torch x-device GB/s':>20} check"
    )
    for size, r in report["bandwidth"].items():
        n = int(size)
        ours = n / r["window"] / 1e9
        floor = n / r["peer_copy"] / 1e9 if "peer_copy" in r else float("nan")
        # One GPU has no cross-device copy to time: the column says so instead of "nan".
        cross = (
            f"{n / r['torch_cross_device'] / 1e9:20.1f}"
            if "torch_cross_device" in r
            else f"{'-':>20}"
        )
        ok = r["checked"] and r.get("floor_checked", True)
        print(
            f"  {human_bytes(n):>8} {ours:12.1f} {floor:11.1f} {ours / floor:6.2f} {cross} "
            f"{'ok' if ok else 'MISMATCH'}"
        )

    print("\ndispatch's gather into the peer window (rows of 2048 bf16 in wire order), GB/s:")
    print(f"  {'tokens':>6} {'index_select':>12} {'copy_':>8} {'ratio':>6} check")
    for n, r in report["gather"].items():
        nbytes = int(n) * TOPK * HIDDEN * 2
        gbs = {k: nbytes / r[k] / 1e9 for k in ("index_select", "copy")}
        print(
            f"  {n:>6} {gbs['index_select']:12.1f} {gbs['copy']:8.1f} "
            f"{gbs['index_select'] / gbs['copy']:6.2f} {'ok' if r['checked'] else 'MISMATCH'}"
        )

    tokens = [n for n in LAYER_TOKENS if n <= args.max_tokens]
    layer = SlotLayout(
        Topology(1, 1, EXPERTS), HIDDEN, max(tokens), TOPK, dtype="bfloat16"
    ).window()
    profile = getattr(args, "profile", None)
    if profile is not None:
        profile.mkdir(parents=True, exist_ok=True)
    specs = [
        RankSpec(
            Role.ATTENTION,
            0,
            _layer_attention,
            {
                "tokens": tokens,
                "repeats": args.repeats,
                "profile": None if profile is None else str(profile),
                "modes": LAYER_MODES,
            },
        ),
        RankSpec(
            Role.FFN,
            0,
            serve_identity,
            {"timing": True, "profile": None if profile is None else f"{profile}/ffn.txt"},
        ),
    ]
    per_layer = _launch(layer, _with(specs, env), "device")
    times = dict(per_layer["attention rank 0"].value)
    ffn = per_layer["ffn rank 0"].value
    specs = [
        RankSpec(
            Role.ATTENTION,
            0,
            _layer_attention,
            {
                "tokens": tokens,
                "repeats": args.repeats,
                "profile": None,
                "modes": {"host": HOST_MODE},
            },
        ),
        RankSpec(Role.FFN, 0, serve_identity),
    ]
    host_polls = _launch(layer, _with(specs, env), "host")
    times.update(host_polls["attention rank 0"].value)
    specs[0] = dataclasses.replace(
        specs[0],
        kwargs={
            **specs[0].kwargs,
            "modes": {
                "kernel-publish": KERNEL_PUBLISH_MODE,
                "graphs": KERNEL_PUBLISH_MODE,
                "graphs-host-wait": KERNEL_PUBLISH_MODE,
                "graphs-torch-plan": KERNEL_PUBLISH_MODE,
            },
            "profile": None if profile is None else str(profile),
        },
    )
    kernel_publish = _launch(layer, _with(specs, env), "kernel_publish")
    times.update(kernel_publish["attention rank 0"].value)
    # The put path (a transport option: a launch of its own, next to the one above): the
    # same endpoints, eager and graphed, with every slot put by NVSHMEM device puts.
    put_specs = [
        dataclasses.replace(
            specs[0],
            kwargs={
                **specs[0].kwargs,
                "modes": {"put": KERNEL_PUBLISH_MODE, "put-graphs": KERNEL_PUBLISH_MODE},
                "profile": None,
            },
        ),
        RankSpec(Role.FFN, 0, serve_identity),
    ]
    put = _launch(layer, _with(put_specs, env), "put")
    times.update(put["attention rank 0"].value)
    # Both sides replayed from CUDA graphs: the FFN rank's serve loop is one graph (a launch
    # of its own, since an FFN rank serves one way).
    specs = [
        dataclasses.replace(
            specs[0],
            kwargs={
                **specs[0].kwargs,
                "modes": {"ffn-graph": KERNEL_PUBLISH_MODE},
                "profile": None if profile is None else str(profile),
            },
        ),
        RankSpec(Role.FFN, 0, serve_identity_graphed),
    ]
    ffn_graph = _launch(layer, _with(specs, env), "kernel_publish")
    times.update(ffn_graph["attention rank 0"].value)
    report["ffn_graph"] = ffn_graph["ffn rank 0"].value
    # The same over afd run's default wire format (per_rank, reduced on the FFN side): one
    # row per token and FFN rank each way instead of one per routed choice.
    rank_layer = SlotLayout(
        Topology(1, 1, EXPERTS),
        HIDDEN,
        max(tokens),
        TOPK,
        dtype="bfloat16",
        wire_format=WireFormat.PER_RANK,
        combine_reduce=CombineReduce.FFN,
    ).window()
    specs[0] = dataclasses.replace(
        specs[0],
        kwargs={
            **specs[0].kwargs,
            "modes": {
                "ffn-graph-rank": KERNEL_PUBLISH_MODE,
                "ffn-graph-rank-deferred": KERNEL_PUBLISH_MODE,
            },
        },
    )
    ffn_graph_rank = _launch(rank_layer, _with(specs, env), "kernel_publish")
    times.update(ffn_graph_rank["attention rank 0"].value)
    report["ffn_reply"] = {
        "host_ms": {str(k): v for k, v in ffn.get("reply_host_ms", {}).items()},
        "gpu_ms": {str(k): v for k, v in ffn.get("reply_gpu_ms", {}).items()},
    }
    report["layer"] = {k: v for k, v in times.items() if k.count("/") == 1}
    report["layer_calls"] = {k: v for k, v in times.items() if k.count("/") == 2}
    report["layer_spread"] = {k: v for k, v in times.items() if k.endswith(("/p10", "/p90"))}
    floor_gbs = _floor_gbs(report["bandwidth"])
    report["layer_floor_gbs"] = floor_gbs
    print(
        f"\ndispatch + combine per layer, 1A1F, hidden {HIDDEN} bf16, {EXPERTS} experts "
        f"top-{TOPK}, identity FFN (median ms). 'device' = the defaults: device wait with the "
        f"header captured with the flag, fused combine kernel, counts read to the host once; "
        f"'dev pack' = the same with the dispatch packed on the device (no host read); 'torch "
        f"comb' = 'device' with the portable combine; 'copied hdr' = 'device' with each header "
        f"copied out of the window (these four side by side, blocks of {ROUNDS_PER_BLOCK} "
        f"rounds interleaved); 'host' = host polls, copied headers, portable combine (a launch "
        f"of its own: host polls are a transport option); 'kern pub' = 'dev pack' with every "
        f"flag set by one publish kernel (a launch of its own, the transport option "
        f"publish='kernel'); 'graphs' = 'kern pub' with dispatch and combine replayed from "
        f"CUDA graphs, each combine graph waiting for its replies on the device, the "
        f"dispatch planned by the Triton kernels ('torch plan': by afd_protocol's torch ops; "
        f"'host wait': the host waits, then replays the combine; all interleaved with 'kern "
        f"pub' in that launch); 'ffn graph' = 'graphs' "
        f"with the FFN rank's serve loop replayed from one CUDA graph too (a launch of its "
        f"own); 'put' and 'put graphs' = 'kern pub' and 'graphs' over the put path (slots "
        f"staged locally, then NVSHMEM device puts of the bytes used and the flag; the next "
        f"launch). 'floor' = the rows there "
        f"and back at "
        f"the same-run peer copy_ bandwidth ({floor_gbs:.0f} GB/s). 'p10-p90' = the spread of "
        f"'device' over its rounds. 'link' = the same bytes at {NVLINK_GBS:.0f} GB/s (a peer "
        f"copy_ between two H200s): what NVLink would add where this run copies through HBM."
    )
    print(
        f"  {'tokens':>6} {'device':>8} {'dev pack':>9} {'torch comb':>10} {'copied hdr':>10} "
        f"{'host':>8} {'kern pub':>8} {'graphs':>7} {'torch plan':>10} {'host wait':>9} "
        f"{'ffn graph':>9} {'put':>6} {'put graphs':>10} "
        f"{'floor':>7} "
        f"{'floor/device':>12} "
        f"{'host/device':>11} "
        f"{'p10-p90':>11} "
        f"{'link':>6}"
    )
    for n in tokens:
        nbytes = 2 * n * TOPK * HIDDEN * 2
        floor = nbytes / (floor_gbs * 1e9)
        report["layer"][f"floor/{n}"] = floor
        report["layer"][f"link/{n}"] = nbytes / (NVLINK_GBS * 1e9)
        modes = [*LAYER_MODES, "host", "kernel-publish", "graphs", "graphs-torch-plan"]
        modes += ["graphs-host-wait", "ffn-graph", "put", "put-graphs"]
        ms = {m: times[f"{m}/{n}"] * 1e3 for m in modes}
        spread = _spread(times, f"device/{n}")
        print(
            f"  {n:6d} {ms['device']:8.2f} {ms['device-pack']:9.2f} {ms['torch-combine']:10.2f} "
            f"{ms['copied-header']:10.2f} {ms['host']:8.2f} {ms['kernel-publish']:8.2f} "
            f"{ms['graphs']:7.2f} {ms['graphs-torch-plan']:10.2f} "
            f"{ms['graphs-host-wait']:9.2f} {ms['ffn-graph']:9.2f} "
            f"{ms['put']:6.2f} {ms['put-graphs']:10.2f} "
            f"{floor * 1e3:7.2f} "
            f"{floor * 1e3 / ms['device']:12.2f} {ms['host'] / ms['device']:11.2f} {spread:>11} "
            f"{nbytes / (NVLINK_GBS * 1e9) * 1e3:6.2f}"
        )
    print(
        "\nwhere the 'device' time goes (median ms): attention host time in dispatch() and in "
        "combine(); attention GPU time from the start of dispatch to its last write, and from "
        "there to the end of the combine (the FFN round trip included); FFN host time in "
        "reply() and GPU time of the reply"
    )
    print(
        f"  {'tokens':>6} {'dispatch()':>10} {'combine()':>9} {'dispatch GPU':>12} "
        f"{'reply+combine GPU':>17} {'FFN reply()':>11} {'FFN reply GPU':>13}"
    )
    ffn_host, ffn_gpu = report["ffn_reply"]["host_ms"], report["ffn_reply"]["gpu_ms"]
    for n in tokens:
        k = f"device/{n}"
        print(
            f"  {n:6d} {times[k + '/dispatch_call'] * 1e3:10.2f} "
            f"{times[k + '/combine_call'] * 1e3:9.2f} {times[k + '/dispatch_gpu'] * 1e3:12.2f} "
            f"{times[k + '/reply_and_combine_gpu'] * 1e3:17.2f} "
            f"{ffn_host.get(str(n * TOPK), float('nan')):11.2f} "
            f"{ffn_gpu.get(str(n * TOPK), float('nan')):13.2f}"
        )
    print(
        "\nattention host time per layer, eager ('kern pub') vs graph-replayed ('graphs'), "
        "median us (target for graphs: dispatch() + combine() <= 30 us; combine() includes "
        "the host's wait for the replies); 'graphs held' = graphs one endpoint captured (a "
        "dispatch and a combine graph per token count and ring), 'ms per capture' = host "
        "time to capture and instantiate one"
    )
    print(
        f"  {'tokens':>6} {'kern pub dispatch()':>19} {'combine()':>9} "
        f"{'graphs dispatch()':>17} {'combine()':>9} {'graphs/kern pub, layer':>22} "
        f"{'kern pub p10-p90 ms':>19} {'graphs p10-p90 ms':>17} {'graphs held':>11} "
        f"{'ms per capture':>14}"
    )
    for n in tokens:
        eager, graphed = f"kernel-publish/{n}", f"graphs/{n}"
        print(
            f"  {n:6d} {times[eager + '/dispatch_call'] * 1e6:19.1f} "
            f"{times[eager + '/combine_call'] * 1e6:9.1f} "
            f"{times[graphed + '/dispatch_call'] * 1e6:17.1f} "
            f"{times[graphed + '/combine_call'] * 1e6:9.1f} "
            f"{times[graphed] / times[eager]:22.2f} "
            f"{_spread(times, eager):>19} {_spread(times, graphed):>17} "
            f"{times.get(graphed + '/captures', float('nan')):11.0f} "
            f"{times.get(graphed + '/capture_s', float('nan')) * 1e3:14.2f}"
        )
        for label, mode in (
            ("(torch plan)", "graphs-torch-plan"),
            ("(host wait)", "graphs-host-wait"),
            ("(ffn graph)", "ffn-graph"),
            ("(put graphs)", "put-graphs"),
        ):
            key = f"{mode}/{n}"
            print(
                f"  {'':>6} {label:>19} {'':>9} "
                f"{times[key + '/dispatch_call'] * 1e6:17.1f} "
                f"{times[key + '/combine_call'] * 1e6:9.1f} "
                f"{times[key] / times[eager]:22.2f} {'':>19} {_spread(times, key):>17}"
            )
    print(
        "\n'ffn graph' over afd run's default wire format (per_rank, reduced on the FFN side: "
        "one row per token and FFN rank each way; a launch of its own) beside 'ffn graph' "
        "(per_choice: one row per routed choice each way), median ms; 'of it waiting' = "
        "combine()'s host time spinning on the device wait (the rest is its own work: the "
        "replay, the clone, the reply checks); 'floor' = its rows "
        f"there and back at {floor_gbs:.0f} GB/s; 'link' = the same bytes at "
        f"{NVLINK_GBS:.0f} GB/s"
    )
    print(
        f"  {'tokens':>6} {'per_choice':>10} {'per_rank_ffn':>12} {'p10-p90':>11} "
        f"{'dispatch() us':>13} {'combine() us':>12} {'of it waiting':>13} {'floor':>6} "
        f"{'link':>6}"
    )
    for n in tokens:
        key = f"ffn-graph-rank/{n}"
        nbytes = 2 * n * HIDDEN * 2
        report["layer"][f"floor-per-rank/{n}"] = nbytes / (floor_gbs * 1e9)
        print(
            f"  {n:6d} {times[f'ffn-graph/{n}'] * 1e3:10.2f} {times[key] * 1e3:12.2f} "
            f"{_spread(times, key):>11} {times[key + '/dispatch_call'] * 1e6:13.1f} "
            f"{times[key + '/combine_call'] * 1e6:12.1f} "
            f"{times[key + '/combine_wait'] * 1e6:13.1f} "
            f"{nbytes / (floor_gbs * 1e9) * 1e3:6.3f} {nbytes / (NVLINK_GBS * 1e9) * 1e3:6.3f}"
        )
    print(
        f"\n'ffn graph' per_rank_ffn, each combine checked at once ('checked') or later "
        f"('deferred': at the next combine on its ring, or flush(); interleaved in one "
        f"launch), median ms per layer: 'round' = one dispatch + combine from an idle GPU, "
        f"then a synchronize; 'in a row' = {LAYERS_IN_A_ROW} layers back to back, then "
        f"flush() and one synchronize (a forward pass's view: the host may run ahead)"
    )
    print(
        f"  {'tokens':>6} {'round checked':>13} {'deferred':>8} {'in a row checked':>16} "
        f"{'deferred':>8} {'p10-p90 checked':>15} {'p10-p90 deferred':>16} "
        f"{'deferred dispatch() us':>22} {'combine() us':>12}"
    )
    for n in tokens:
        checked, deferred = f"ffn-graph-rank/{n}", f"ffn-graph-rank-deferred/{n}"
        print(
            f"  {n:6d} {times[checked] * 1e3:13.2f} {times[deferred] * 1e3:8.2f} "
            f"{times[checked + '/row'] * 1e3:16.3f} {times[deferred + '/row'] * 1e3:8.3f} "
            f"{_row_spread(times, checked):>15} {_row_spread(times, deferred):>16} "
            f"{times[deferred + '/dispatch_call'] * 1e6:22.1f} "
            f"{times[deferred + '/combine_call'] * 1e6:12.1f}"
        )
    graph = report["ffn_graph"]
    print(
        f"\nthe FFN rank's serve loop as one CUDA graph ('ffn graph'): {graph['served']} items "
        f"served in {graph['replays']} graph replays, {graph['capture_s'] * 1e3:.1f} ms to "
        f"compile, warm up and capture it"
    )
    return report


def _spread(times: dict[str, float], key: str) -> str:
    """``p10-p90`` of ``key``'s rounds, in ms."""
    return f"{times[key + '/p10'] * 1e3:.2f}-{times[key + '/p90'] * 1e3:.2f}"


def _row_spread(times: dict[str, float], key: str) -> str:
    """``p10-p90`` of ``key``'s layers-in-a-row samples, in ms."""
    return f"{times[key + '/row_p10'] * 1e3:.3f}-{times[key + '/row_p90'] * 1e3:.3f}"


def _floor_gbs(bandwidth: dict[str, Any]) -> float:
    """The same-run peer copy_ bandwidth at the largest measured size."""
    size, point = max(bandwidth.items(), key=lambda item: int(item[0]))
    return float(int(size) / point.get("peer_copy", point["window"]) / 1e9)
