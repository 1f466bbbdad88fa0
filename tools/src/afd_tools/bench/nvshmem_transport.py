"""``afd bench transport --backend nvshmem``: NVSHMEM windows between two GPUs.

Side by side in one run:

* bandwidth -- one-sided ``copy_`` into the peer's mapped window (64 KB .. 256 MB) beside the
  floor: the same ``copy_`` into ordinary memory of the other GPU mapped by CUDA peer access;
* arrival latency, one way (round trip / 2) -- host-polled ``wait_any`` (one D2H copy per
  check), device ``wait_any`` (a Triton poll reporting to pinned host memory, replayed from
  a CUDA graph, and the same kernel launched through Triton each time), stream
  memory operations (``cuStreamWaitValue32``/``cuStreamWriteValue32``, no host in the
  loop) and a persistent Triton ping-pong kernel (no host in the loop);
* dispatch + combine per layer, 1 attention x 1 FFN, DeepSeek-V2-Lite shapes (hidden
  2048 bf16, 64 experts top-6), identity FFN, with device and host waits.
"""

from __future__ import annotations

import statistics
import sys
import time
from functools import partial
from typing import Any

import torch

from afd_protocol import (
    AttentionEndpoint,
    Role,
    SlotLayout,
    Topology,
    Transport,
)
from afd_protocol.host import launch
from afd_protocol.host.launcher import RankSpec
from afd_tools.bench.identity_ffn import serve_identity
from afd_tools.bench.pingpong import flag_pingpong
from afd_tools.bench.stats import human_bytes

SIZES = [64 << 10, 1 << 20, 16 << 20, 64 << 20, 256 << 20]
LAYER_TOKENS = [1024, 4096, 8192, 16384]
HIDDEN, EXPERTS, TOPK = 2048, 64, 6


def _log(t: Transport, message: str) -> None:
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


def _pingpong_transport(t: Transport, ring: int, iterations: int) -> list[float]:
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


def _latency_and_bandwidth(t: Transport, iterations: int, repeats: int) -> dict[str, Any]:
    from afd_transport_nvshmem.cuda_memory import (
        device_bytes,
        stream_memops_available,
        stream_wait_value32_geq,
        stream_write_value32,
    )
    from afd_transport_nvshmem.device_wait import pingpong

    report: dict[str, Any] = {}
    for ring, mode, graph in ((0, "host", True), (1, "device", True), (4, "device", False)):
        name = mode if graph else f"{mode}_launch"
        _log(t, f"wait_any ping-pong, {name} waits")
        t.wait_mode = mode  # type: ignore[attr-defined]
        t.wait_graph = graph  # type: ignore[attr-defined]
        samples = _pingpong_transport(t, ring, iterations)[iterations // 10 :]
        if samples:
            report[f"wait_any_{name}_us"] = statistics.median(samples) / 2 * 1e6
    t.wait_graph = True  # type: ignore[attr-defined]
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
        p2p = _enable_peer_access(t.device, other)
        bandwidth = {}
        for size in SIZES:
            if rows_at + size > peer.numel():
                continue
            src = torch.randint(0, 255, (size,), dtype=torch.uint8, device=t.device)
            dst = peer[rows_at : rows_at + size]
            plain = torch.empty(size, dtype=torch.uint8, device=other)
            reps = max(3, min(5 * repeats, (4 << 30) // size))
            point = {
                "window": _timed(partial(dst.copy_, src), reps),
                "torch_cross_device": _timed(partial(plain.copy_, src, non_blocking=True), reps),
            }
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
    t: Transport, peer: torch.Tensor, rows_at: int, repeats: int
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
    "device": ("device", True, True, False),
    "device-pack": ("device", True, True, True),
    "torch-combine": ("device", True, False, False),
    "copied-header": ("device", False, True, False),
    "host": ("host", False, False, False),
}
"""Per-layer variants as (wait, header capture, fused combine, device pack): the defaults;
the defaults plus the dispatch packed on the device (opt-in); the portable per-FFN-rank
combine instead of the fused kernel; each header copied out of the window instead of
captured by the wait; host-polled waits with none of these (what a straightforward
implementation does)."""


def _layer_attention(
    t: Transport, tokens: list[int], repeats: int, profile: str | None
) -> dict[str, float]:
    """Time dispatch + combine per mode, the modes interleaved round by round (side by side:
    clock and thermal drift hit every mode alike)."""
    endpoint = AttentionEndpoint(t, timeout=120.0)
    gen = torch.Generator(device=t.device).manual_seed(0)
    results = {}

    def use(mode: str) -> None:
        wait, capture, fused, pack = LAYER_MODES[mode]
        t.wait_mode = wait  # type: ignore[attr-defined]
        t.capture_headers = capture  # type: ignore[attr-defined]
        endpoint.fused_combine = fused
        endpoint.device_pack = pack

    for n in tokens:
        x = torch.randn(n, HIDDEN, device=t.device, generator=gen).to(torch.bfloat16)
        ids = torch.rand(n, EXPERTS, device=t.device, generator=gen).topk(TOPK, -1).indices
        w = torch.rand(n, TOPK, device=t.device, generator=gen)
        for mode in LAYER_MODES:
            use(mode)
            for _ in range(2):
                endpoint.combine(endpoint.dispatch(0, x, ids, w))
        torch.cuda.synchronize(t.device)
        samples: dict[str, list[tuple[float, ...]]] = {m: [] for m in LAYER_MODES}
        for _ in range(repeats):
            for mode in LAYER_MODES:
                use(mode)
                marks = [_event() for _ in range(3)]
                start = time.perf_counter()
                marks[0].record()
                handle = endpoint.dispatch(0, x, ids, w)
                marks[1].record()
                issued = time.perf_counter()
                out = endpoint.combine(handle)
                marks[2].record()
                combined = time.perf_counter()
                torch.cuda.synchronize(t.device)
                total = time.perf_counter() - start
                gpu_dispatch = marks[0].elapsed_time(marks[1]) / 1e3
                gpu_rest = marks[1].elapsed_time(marks[2]) / 1e3
                samples[mode].append(
                    (total, issued - start, combined - issued, gpu_dispatch, gpu_rest)
                )
                del out
        for mode, rows in samples.items():
            columns = list(zip(*rows, strict=True))
            names = (
                "",
                "/dispatch_call",
                "/combine_call",
                "/dispatch_gpu",
                "/reply_and_combine_gpu",
            )
            for name, column in zip(names, columns, strict=True):
                results[f"{mode}/{n}{name}"] = statistics.median(column)
        if profile:
            use("device")
            _profile_layer(endpoint, x, ids, w, f"{profile}/attention.txt")
    endpoint.announce_shutdown()
    return results


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


def run(args: Any) -> dict[str, Any]:
    from afd_transport_nvshmem.launch_support import nvshmem_transport

    if torch.cuda.device_count() < 2:
        raise SystemExit("afd bench transport --backend nvshmem needs two CUDA GPUs")
    report: dict[str, Any] = {
        "backend": "nvshmem",
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
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
    micro = launch(big, specs, timeout=600, transport_factory=nvshmem_transport)
    attention = micro["attention rank 0"].value
    report["latency_us"] = {k: v for k, v in attention.items() if k.endswith("_us")}
    report["bandwidth"] = attention["bandwidth"]
    report["gather"] = attention["gather"]
    print(f"NVSHMEM transport on {report['gpu']} x2, torch {report['torch']}")
    print("\narrival latency, one way (round trip / 2, median):")
    for key, value in report["latency_us"].items():
        print(f"  {key[:-3]:22s} {value:8.2f} us")
    print("\none-sided copy_ into the NVSHMEM peer window, beside the floor: the same copy_ into")
    print("cudaMalloc memory of the other GPU mapped peer to peer by CUDA (same run), and torch's")
    print("cross-device copy_ (copy engine) for reference:")
    print(
        f"  {'size':>8} {'window GB/s':>12} {'floor GB/s':>11} {'ratio':>6} "
        f"{'torch x-device GB/s':>20} check"
    )
    for size, r in report["bandwidth"].items():
        n = int(size)
        ours = n / r["window"] / 1e9
        floor = n / r["peer_copy"] / 1e9 if "peer_copy" in r else float("nan")
        cross = n / r["torch_cross_device"] / 1e9
        ok = r["checked"] and r.get("floor_checked", True)
        print(
            f"  {human_bytes(n):>8} {ours:12.1f} {floor:11.1f} {ours / floor:6.2f} {cross:20.1f} "
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
            },
        ),
        RankSpec(
            Role.FFN,
            0,
            serve_identity,
            {"timing": True, "profile": None if profile is None else f"{profile}/ffn.txt"},
        ),
    ]
    per_layer = launch(layer, specs, timeout=600, transport_factory=nvshmem_transport)
    times = per_layer["attention rank 0"].value
    ffn = per_layer["ffn rank 0"].value
    report["ffn_reply"] = {
        "host_ms": {str(k): v for k, v in ffn.get("reply_host_ms", {}).items()},
        "gpu_ms": {str(k): v for k, v in ffn.get("reply_gpu_ms", {}).items()},
    }
    report["layer"] = {k: v for k, v in times.items() if k.count("/") == 1}
    report["layer_calls"] = {k: v for k, v in times.items() if k.count("/") == 2}
    floor_gbs = _floor_gbs(report["bandwidth"])
    report["layer_floor_gbs"] = floor_gbs
    print(
        f"\ndispatch + combine per layer, 1A1F, hidden {HIDDEN} bf16, {EXPERTS} experts "
        f"top-{TOPK}, identity FFN (median ms). 'device' = the defaults: device wait with the "
        f"header captured with the flag, fused combine kernel, counts read to the host once; "
        f"'dev pack' = the same with the dispatch packed on the device (no host read); 'torch "
        f"comb' = 'device' with the portable combine; 'copied hdr' = 'device' with each header "
        f"copied out of the window; 'host' = host polls, copied headers, portable combine. "
        f"'floor' = the rows there and back at the same-run peer copy_ bandwidth "
        f"({floor_gbs:.0f} GB/s)."
    )
    print(
        f"  {'tokens':>6} {'device':>8} {'dev pack':>9} {'torch comb':>10} {'copied hdr':>10} "
        f"{'host':>8} {'floor':>7} {'floor/device':>12} {'host/device':>11}"
    )
    for n in tokens:
        floor = 2 * n * TOPK * HIDDEN * 2 / (floor_gbs * 1e9)
        report["layer"][f"floor/{n}"] = floor
        ms = {m: times[f"{m}/{n}"] * 1e3 for m in LAYER_MODES}
        print(
            f"  {n:6d} {ms['device']:8.2f} {ms['device-pack']:9.2f} {ms['torch-combine']:10.2f} "
            f"{ms['copied-header']:10.2f} {ms['host']:8.2f} {floor * 1e3:7.2f} "
            f"{floor * 1e3 / ms['device']:12.2f} {ms['host'] / ms['device']:11.2f}"
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
    return report


def _floor_gbs(bandwidth: dict[str, Any]) -> float:
    """The same-run peer copy_ bandwidth at the largest measured size."""
    size, point = max(bandwidth.items(), key=lambda item: int(item[0]))
    return float(int(size) / point.get("peer_copy", point["window"]) / 1e9)
