"""Rank programs for the two-GPU tests (spawned by afd_protocol.launch)."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from typing import Any

import torch

from afd_protocol import (
    CapacityError,
    Connection,
    DevicePlan,
    DispatchHandle,
    DispatchPlan,
    EndpointOptions,
    FFNEndpoint,
    WorkItem,
    expert_ids_from_counts,
    relative_error,
    serve,
)
from afd_protocol.testing import LinearExperts, random_routing
from afd_protocol.window import WindowDispatch, WindowOptions


@contextlib.contextmanager
def no_host_sync(enabled: bool) -> Iterator[None]:
    """Make any synchronising CUDA call (a blocking D2H copy, a stream sync) raise."""
    if not enabled:
        yield
        return
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


class StrictAfterFirst:
    """An FFN endpoint whose intake and replies, after the first item, run with CUDA's sync
    debug mode set to "error": any blocking device-to-host copy or stream sync raises."""

    def __init__(self, endpoint: FFNEndpoint, enabled: bool) -> None:
        self.endpoint = endpoint
        self.enabled = enabled
        self.served = 0

    def __getattr__(self, name: str) -> Any:  # rank, dtype, local_experts, ...
        return getattr(self.endpoint, name)

    def next_work_item(self, timeout: float | None = None) -> WorkItem:
        with no_host_sync(self.enabled and self.served > 0):
            return self.endpoint.next_work_item(timeout)

    def reply(self, item: WorkItem, routed: torch.Tensor, shared: torch.Tensor | None) -> None:
        with no_host_sync(self.enabled and self.served > 0):
            self.endpoint.reply(item, routed, shared)
        self.served += 1


def _plan_summary(handle: DispatchHandle) -> Any:
    """Who was waited on, the segment bounds and the counts of the plan this endpoint built
    (on its own device; read back when it stayed there)."""
    assert isinstance(handle, WindowDispatch)
    plan = handle.plan
    if isinstance(plan, DispatchPlan):
        return list(handle.ffn_ranks), plan.segment_offsets, plan.host_expert_counts
    assert isinstance(plan, DevicePlan)
    segments = tuple(plan.segment_offsets.tolist())
    return list(handle.ffn_ranks), segments, tuple(plan.expert_counts.tolist())


def _experts(connection: Connection, layers: int, seed: int) -> LinearExperts:
    slot = connection.layout
    return LinearExperts(layers, slot.topology.num_experts, slot.hidden_size, seed)


def ffn_grouped(
    connection: Connection,
    *,
    layers: int,
    seed: int,
    die_after: int | None = None,
    check_no_sync: bool = False,
) -> dict[str, Any]:
    """Serve with a real grouped GEMM (torch._grouped_mm where available) on the GPU.

    With ``check_no_sync``, taking a work item and replying (after the first item) run with
    CUDA's sync debug mode set to "error": neither may block on the GPU.
    """
    ep = connection.ffn_endpoint(EndpointOptions(timeout=60.0))
    device = connection.device
    experts = _experts(connection, layers, seed).to(device)
    local = torch.tensor(ep.local_experts, device=device)
    grouped = hasattr(torch, "_grouped_mm") and device.type == "cuda"
    layers_on_device: list[torch.Tensor] = []

    def compute(item: WorkItem) -> tuple[torch.Tensor, torch.Tensor]:
        if die_after is not None and len(layers_on_device) >= die_after:
            os.kill(os.getpid(), signal.SIGKILL)
        outs = []
        for part in item.parts:
            weights = experts.routed[item.layer][local].to(ep.dtype)  # [E_local, H, H]
            rows = part.routed_rows
            if grouped and rows.shape[0]:
                offsets = torch.cumsum(part.group_list.to(device), 0).to(torch.int32)
                # Grouped GEMM kernels take each expert's matrix column-major.
                column_major = weights.transpose(-2, -1).contiguous().transpose(-2, -1)
                outs.append(torch._grouped_mm(rows, column_major, offs=offsets))
            else:
                ids = expert_ids_from_counts(part.group_list.to(device), rows.shape[0])
                outs.append(torch.bmm(rows.unsqueeze(1), weights[ids]).squeeze(1))
        shared = torch.cat([p.shared_rows.float() @ experts.shared[item.layer] for p in item.parts])
        layers_on_device.append(torch.cat([p.layer_index for p in item.parts]))
        return torch.cat(outs), shared

    strict = StrictAfterFirst(ep, check_no_sync)
    stats = serve(strict, compute)  # type: ignore[arg-type]  # a duck-typed FFNEndpoint
    return {
        "served": len(stats.items),
        "grouped_mm": grouped,
        "header_reads": dict(getattr(ep, "header_reads", {})),
        "layers_on_device": [t.tolist() for t in layers_on_device],
    }


def linear_step(experts: LinearExperts, local: list[int], device: torch.device, dtype: Any) -> Any:
    """The :class:`LinearExperts` of an FFN rank holding ``local`` as a graph-capturable
    expert step (``afd_transport_nvshmem.graphed_ffn.ExpertStep``): each row times its
    expert's matrix, the expert from the counts and the layer read on the device."""
    routed = experts.routed[:, local].to(device, dtype)  # [L, E_local, H, H]
    last = len(local) - 1

    def step(rows: torch.Tensor, counts: torch.Tensor, layer: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(rows.shape[0], device=rows.device)
        ids = torch.searchsorted(torch.cumsum(counts, 0), positions, right=True).clamp(max=last)
        weights = routed.index_select(0, layer.long())[0][ids]
        return torch.bmm(rows.unsqueeze(1), weights).squeeze(1)

    return step


def affine_step(layers: int, seed: int, local: list[int], device: torch.device) -> Any:
    """Expert ``e`` of layer ``l`` as ``x * scale[l, e] + bias[l, e]``: elementwise, so a
    graphed step over a static buffer and an eager one over the item's rows compute the same
    bits (the bitwise comparison of the two FFN loops)."""
    gen = torch.Generator().manual_seed(seed)
    experts = len(local)
    scale = (torch.rand(layers, experts, generator=gen) + 0.5).to(device)
    bias = torch.randn(layers, experts, 1, generator=gen).to(device)

    def step(rows: torch.Tensor, counts: torch.Tensor, layer: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(rows.shape[0], device=rows.device)
        ids = torch.searchsorted(torch.cumsum(counts, 0), positions, right=True)
        ids = ids.clamp(max=experts - 1)
        at = layer.long()
        return rows * scale.index_select(0, at)[0][ids][:, None] + bias.index_select(0, at)[0][ids]

    return step


def ffn_graphed(
    connection: Connection,
    *,
    layers: int,
    seed: int,
    experts: str = "linear",
    steps_per_graph: int = 4,
    eager: bool = False,
) -> dict[str, Any]:
    """Serve with :class:`GraphedFFNServer` (or, with ``eager``, the window FFN endpoint
    and the same expert step on each item's grouped rows) until every attention rank shut
    down; ``experts``: ``linear`` (:class:`LinearExperts`) or ``affine``. With
    ``AFD_DEBUG_DUMP=S`` in the environment the rank prints every thread's stack to stderr
    after S seconds (to see where a hang sits; run pytest with ``-s``)."""
    from afd_transport_nvshmem.graphed_ffn import ServeGraphOptions

    device = connection.device
    options = EndpointOptions(timeout=60.0, num_layers=layers, num_stages=2)
    local = list(connection.layout.topology.local_experts(connection.rank))
    dtype = getattr(torch, connection.layout.dtype)
    if experts == "linear":
        step = linear_step(_experts(connection, layers, seed), local, device, dtype)
    else:
        step = affine_step(layers, seed, local, device)
    if eager:
        ep = connection.ffn_endpoint(options)

        def compute(item: WorkItem) -> tuple[torch.Tensor, None]:
            outs = []
            for part in item.parts:
                rows, group_list = part.grouped()
                layer = torch.tensor([item.layer], dtype=torch.int32, device=device)
                outs.append(part.finish(step(rows, group_list, layer)))
            return torch.cat(outs), None

        return {"served": len(serve(ep, compute).items)}
    graph = ServeGraphOptions(steps_per_graph=steps_per_graph)
    if os.environ.get("AFD_DEBUG_DUMP"):
        import faulthandler
        import sys

        faulthandler.dump_traceback_later(float(os.environ["AFD_DEBUG_DUMP"]), file=sys.stderr)
    server = connection.graphed_ffn_server(step, options, graph)  # type: ignore[attr-defined]
    stats = server.serve()
    server.close()
    return {
        "served": len(stats.items),
        "replicas": [r.replica for r in stats.items],
        "replays": server.replays,
        "capture_s": server.capture_seconds,
        "sequence": connection.transport.sequence.last,  # type: ignore[attr-defined]
    }


def attention_deferred_bursts(
    connection: Connection,
    *,
    layers: int,
    seed: int,
    tokens: list[int],
    bursts: int,
    burst_len: int,
    stall_s: float,
) -> dict[str, Any]:
    """A graph-replayed endpoint with ``defer_checks``: ``bursts`` times, keep the stream
    busy for ``stall_s`` seconds (``torch.cuda._sleep``), then issue ``burst_len`` layers
    (dispatch, combine) of ``tokens[i % len(tokens)]`` tokens each, the host ahead of the
    device (a deferred combine returns at once; the next one on the ring checks it); then
    flush() and check every output against the reference. ``ahead``: bursts whose first
    combine returned while the stall was still running."""
    device = connection.device
    ep = connection.graphed_attention_endpoint(  # type: ignore[attr-defined]
        WindowOptions(timeout=60.0), 4, defer_checks=True
    )
    slot = connection.layout
    experts = _experts(connection, layers, seed)
    gen = torch.Generator().manual_seed(seed + 7)
    everyone = range(slot.topology.num_experts)
    jobs = []
    for i in range(bursts * burst_len):
        count = tokens[i % len(tokens)]
        x, ids, w = random_routing(count, slot.hidden_size, slot.topk, everyone, gen, ep.dtype)
        # On the device before the stalls: a copy from pageable memory would wait for them.
        jobs.append((i % layers, x, ids, w, x.to(device), ids.to(device), w.to(device)))
    torch.cuda.synchronize(device)
    cycles = int(stall_s * torch.cuda.clock_rate(device) * 1e6)  # clock_rate is in MHz
    outputs, ahead = [], 0
    for burst in range(bursts):
        torch.cuda._sleep(cycles)
        stalled = torch.cuda.Event()
        stalled.record()
        for i, (layer, *_, dx, dids, dw) in enumerate(
            jobs[burst * burst_len : (burst + 1) * burst_len]
        ):
            outputs.append(ep.combine(ep.dispatch(layer, dx, dids, dw)))
            if i == 0 and not stalled.query():
                ahead += 1
    ep.flush()
    errors = [
        relative_error(out, experts.reference(layer, x, ids, w, False))
        for out, (layer, x, ids, w, *_) in zip(outputs, jobs, strict=True)
    ]
    ep.announce_shutdown()
    return {"errors": errors, "ahead": ahead, "graph_replays": ep.replays}


def attention_jobs(
    connection: Connection,
    *,
    layers: int,
    seed: int,
    jobs: list[dict[str, Any]],
    in_flight: int = 1,
    overflow_first: bool = False,
    record: bool = False,
    check_no_sync: bool = False,
    device_pack: bool | None = None,
    die_after: int | None = None,
) -> dict[str, Any]:
    """Dispatch jobs (``in_flight`` at a time), check every output, then shut down.

    With ``check_no_sync``, ``combine`` runs with CUDA's sync debug mode set to "error";
    ``device_pack`` is the endpoint option (None: the default); ``die_after``: SIGKILL
    this process after that many combines. With ``AFD_DEBUG_DUMP=S`` in the environment the
    rank prints every thread's stack to stderr after S seconds (to see where a hang sits).
    """
    slot = connection.layout
    if os.environ.get("AFD_DEBUG_DUMP"):
        import faulthandler
        import sys

        faulthandler.dump_traceback_later(float(os.environ["AFD_DEBUG_DUMP"]), file=sys.stderr)
    ep = connection.attention_endpoint(WindowOptions(timeout=60.0, device_pack=device_pack))
    experts = _experts(connection, layers, seed)
    gen = torch.Generator().manual_seed(seed + 7)
    everyone = range(slot.topology.num_experts)
    out: dict[str, Any] = {"errors": [], "overflow": None, "plans": [], "outputs": []}
    if overflow_first:
        x, ids, w = random_routing(slot.token_cap + 1, slot.hidden_size, slot.topk, everyone, gen)
        try:
            ep.dispatch(
                0,
                x.to(ep.dtype).to(connection.device),
                ids.to(connection.device),
                w.to(connection.device),
            )
        except CapacityError as exc:
            out["overflow"] = str(exc)
    for start in range(0, len(jobs), in_flight):
        batch = []
        for stage, job in enumerate(jobs[start : start + in_flight]):
            x, ids, w = random_routing(
                job["tokens"],
                slot.hidden_size,
                slot.topk,
                job.get("experts", everyone),
                gen,
                ep.dtype,
            )
            dev = connection.device
            handle = ep.dispatch(job["layer"], x.to(dev), ids.to(dev), w.to(dev), stage=stage)
            batch.append((job["layer"], x, ids, w, handle))
        for layer, x, ids, w, handle in batch:
            if die_after is not None and len(out["errors"]) >= die_after:
                os.kill(os.getpid(), signal.SIGKILL)
            with no_host_sync(check_no_sync):
                result = ep.combine(handle)
            out.setdefault("layers", []).append(layer)
            shared = slot.shared_placement.value == "ffn"
            out["errors"].append(
                relative_error(result, experts.reference(layer, x, ids, w, shared))
            )
            if record:
                out["plans"].append(_plan_summary(handle))
                out["outputs"].append(result.float().cpu())
    if connection.device.type == "cuda":
        torch.cuda.synchronize(connection.device)
    ep.announce_shutdown()
    out["header_reads"] = dict(getattr(ep, "header_reads", {}))
    out["graph_replays"] = getattr(ep, "replays", None)  # a graph-replayed endpoint's count
    return out
