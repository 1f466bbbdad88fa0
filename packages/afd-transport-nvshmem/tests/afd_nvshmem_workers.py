"""Rank programs for the two-GPU tests (spawned by afd_protocol.host.launch)."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from typing import Any

import torch

from afd_protocol import (
    AttentionEndpoint,
    CapacityError,
    ConnectorShutdown,
    DevicePlan,
    FFNEndpoint,
    PendingDispatch,
    Transport,
    Word,
    expert_ids_from_counts,
)
from afd_protocol.testing import LinearExperts, random_routing, relative_error


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


def _header_reads(transport: Transport) -> dict[str, int]:
    return dict(getattr(transport, "header_reads", {}))


def _plan_summary(handle: PendingDispatch) -> tuple[list[int], tuple[int, ...], tuple[int, ...]]:
    """Who was waited on, the segment bounds and the counts (read back from a device plan)."""
    plan = handle.plan
    if isinstance(plan, DevicePlan):
        segments = tuple(plan.segment_offsets.tolist())
        return sorted(handle.expected_ffn), segments, tuple(plan.expert_counts.tolist())
    return sorted(handle.expected_ffn), plan.segment_offsets, plan.host_expert_counts


def _experts(transport: Transport, layers: int, seed: int) -> LinearExperts:
    slot = transport.window.slot
    return LinearExperts(layers, slot.topology.num_experts, slot.hidden_size, seed)


def ffn_grouped(
    transport: Transport,
    *,
    layers: int,
    seed: int,
    die_after: int | None = None,
    check_no_sync: bool = False,
) -> dict[str, Any]:
    """Serve with a real grouped GEMM (torch._grouped_mm where available) on the GPU.

    With ``check_no_sync``, every endpoint call after the first item runs with CUDA's sync
    debug mode set to "error": taking a work item and replying must not block on the GPU.
    """
    ep = FFNEndpoint(transport, timeout=60.0)
    experts = _experts(transport, layers, seed).to(transport.device)
    local = torch.tensor(ep.local_experts, device=transport.device)
    grouped = hasattr(torch, "_grouped_mm") and transport.device.type == "cuda"
    served = 0
    layers_on_device: list[torch.Tensor] = []
    while True:
        strict = check_no_sync and served > 0
        try:
            with no_host_sync(strict):
                item = ep.next_work_item()
        except ConnectorShutdown:
            return {
                "served": served,
                "grouped_mm": grouped,
                "header_reads": _header_reads(transport),
                "layers_on_device": [t.tolist() for t in layers_on_device],
            }
        if die_after is not None and served >= die_after:
            os.kill(os.getpid(), signal.SIGKILL)
        outs = []
        for part in item.parts:
            weights = experts.routed[item.layer][local].to(ep.dtype)  # [E_local, H, H]
            rows = part.routed_rows
            if grouped and rows.shape[0]:
                offsets = torch.cumsum(part.group_list.to(transport.device), 0).to(torch.int32)
                # Grouped GEMM kernels take each expert's matrix column-major.
                column_major = weights.transpose(-2, -1).contiguous().transpose(-2, -1)
                outs.append(torch._grouped_mm(rows, column_major, offs=offsets))
            else:
                ids = expert_ids_from_counts(part.group_list.to(transport.device), rows.shape[0])
                outs.append(torch.bmm(rows.unsqueeze(1), weights[ids]).squeeze(1))
        shared = torch.cat([p.shared_rows.float() @ experts.shared[item.layer] for p in item.parts])
        layers_on_device.append(torch.stack([p.header_words[Word.LAYER] for p in item.parts]))
        with no_host_sync(strict):
            ep.reply(item, torch.cat(outs).to(ep.dtype), shared.to(ep.dtype))
        served += 1


def attention_jobs(
    transport: Transport,
    *,
    layers: int,
    seed: int,
    jobs: list[dict[str, Any]],
    in_flight: int = 1,
    overflow_first: bool = False,
    record: bool = False,
    check_no_sync: bool = False,
) -> dict[str, Any]:
    """Dispatch jobs (``in_flight`` at a time), check every output, then shut down.

    With ``check_no_sync``, ``combine`` runs with CUDA's sync debug mode set to "error".
    """
    slot = transport.window.slot
    ep = AttentionEndpoint(transport, timeout=60.0)
    experts = _experts(transport, layers, seed)
    gen = torch.Generator().manual_seed(seed + 7)
    everyone = range(slot.topology.num_experts)
    out: dict[str, Any] = {"errors": [], "overflow": None, "plans": [], "outputs": []}
    if overflow_first:
        x, ids, w = random_routing(slot.token_cap + 1, slot.hidden_size, slot.topk, everyone, gen)
        try:
            ep.dispatch(
                0,
                x.to(ep.dtype).to(transport.device),
                ids.to(transport.device),
                w.to(transport.device),
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
            dev = transport.device
            handle = ep.dispatch(job["layer"], x.to(dev), ids.to(dev), w.to(dev), stage=stage)
            batch.append((job["layer"], x, ids, w, handle))
        for layer, x, ids, w, handle in batch:
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
    if transport.device.type == "cuda":
        torch.cuda.synchronize(transport.device)
    ep.announce_shutdown()
    out["header_reads"] = _header_reads(transport)
    return out
