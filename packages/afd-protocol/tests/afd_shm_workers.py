"""Rank programs for the multi-process shared-memory tests (spawned by the launcher).

Experts are linear and deterministic from a seed, so the attention side can check every
combined output against an independent per-token reference computed locally.
"""

from __future__ import annotations

import os
import signal
import stat
import tempfile
from pathlib import Path
from typing import Any

import torch

from afd_protocol import EndpointOptions, WorkItem, relative_error, serve, torch_dtype
from afd_protocol.testing import LinearExperts
from afd_protocol.window import SequenceCounter, WindowConnection, flag_words


def experts_for(connection: WindowConnection, seed: int, layers: int) -> LinearExperts:
    slot = connection.layout
    return LinearExperts(layers, slot.topology.num_experts, slot.hidden_size, seed)


def start_sequence_at(connection: WindowConnection, last: int | None) -> None:
    """Make this rank's next message carry sequence number ``last + 1`` (wrap tests)."""
    if last is not None:
        connection.transport.sequence = SequenceCounter(last)


def ffn_linear(
    connection: WindowConnection,
    *,
    seed: int,
    layers: int,
    timeout: float = 30.0,
    die_after: int | None = None,
    die_by: int = signal.SIGKILL,
    tolerate_garbage: bool = False,
    last_seq: int | None = None,
) -> dict[str, Any]:
    """Serve work items with linear experts until every attention rank shuts down (or,
    with ``die_after``, send itself ``die_by`` after that many items)."""
    start_sequence_at(connection, last_seq)
    ep = connection.ffn_endpoint(EndpointOptions(timeout=timeout))
    experts = experts_for(connection, seed, layers)
    linear = experts.compute_for(ep)
    computed = 0

    def compute(item: WorkItem) -> Any:
        nonlocal computed
        if die_after is not None and computed >= die_after:
            os.kill(os.getpid(), die_by)
        computed += 1
        return linear(item)

    stats = serve(ep, compute, on_protocol_error="skip" if tolerate_garbage else "raise")
    served = [(r.replica, r.layer, r.stage, list(r.src_ranks)) for r in stats.items]
    return {
        "served": served,
        "protocol_errors": stats.protocol_errors,
        "last_seq": connection.transport.sequence.last,
    }


def attention_linear(
    connection: WindowConnection,
    *,
    seed: int,
    layers: int,
    jobs: list[dict[str, Any]],
    in_flight: int = 1,
    timeout: float = 30.0,
    garbage_first: bool = False,
    last_seq: int | None = None,
) -> dict[str, Any]:
    """Dispatch ``jobs`` (``in_flight`` at a time), combine, check against a reference."""
    start_sequence_at(connection, last_seq)
    ep = connection.attention_endpoint(EndpointOptions(timeout=timeout))
    experts = experts_for(connection, seed, layers)
    transport = connection.transport
    slot = connection.layout
    dtype = torch_dtype(slot.dtype)
    shared_on_ffn = slot.shared_placement.value == "ffn"
    gen = torch.Generator().manual_seed(seed * 1000 + transport.rank)
    if garbage_first:
        # Garbage in the last ring slot (the real dispatches use ring 0 first, so the two
        # never race for the same bytes), published with a flag like a real message.
        ring = transport.window.ring_depth - 1
        window = transport.peer_window(0)
        at = transport.window.field_offset(transport.rank, ring, "header")
        window[at : at + 64] = torch.randint(0, 256, (64,), dtype=torch.uint8, generator=gen)
        transport.publish(0, transport.window.flag_index(transport.rank, ring), 1 << 30)
    errors, destinations = [], []
    for start in range(0, len(jobs), in_flight):
        batch = []
        for stage, job in enumerate(jobs[start : start + in_flight]):
            pool = torch.tensor(job.get("experts", range(slot.topology.num_experts)))
            n, k = job["tokens"], slot.topk
            x = torch.randn(n, slot.hidden_size, generator=gen).to(dtype)
            ids = torch.stack(
                [pool[torch.randperm(len(pool), generator=gen)[:k]] for _ in range(n)]
            )
            tw = torch.rand(n, k, generator=gen)
            handle = ep.dispatch(job["layer"], x, ids, tw, stage=stage)
            destinations.append(list(handle.ffn_ranks))
            batch.append((job["layer"], x, ids, tw, handle))
        for layer, x, ids, tw, handle in batch:
            out = ep.combine(handle)
            errors.append(relative_error(out, experts.reference(layer, x, ids, tw, shared_on_ffn)))
    ep.announce_shutdown()
    flags = flag_words(transport.local_window(), transport.window)
    return {
        "errors": errors,
        "destinations": destinations,
        "flags": flags.tolist(),
        "last_seq": transport.sequence.last,
    }


def attention_forever(connection: WindowConnection, *, timeout: float) -> None:
    """Keep dispatching and combining until something fails (for the fault tests)."""
    ep = connection.attention_endpoint(EndpointOptions(timeout=timeout))
    slot = connection.layout
    gen = torch.Generator().manual_seed(0)
    dtype = torch_dtype(slot.dtype)
    while True:
        x = torch.randn(16, slot.hidden_size, generator=gen).to(dtype)
        ids = torch.stack(
            [
                torch.randperm(slot.topology.num_experts, generator=gen)[: slot.topk]
                for _ in range(16)
            ]
        )
        ep.combine(ep.dispatch(0, x, ids, torch.rand(16, slot.topk, generator=gen)))


def report_rendezvous_mode(connection: Any) -> int:
    """Rank program: the mode of the directory the launcher made (it is this rank's TMPDIR
    child named afd-rendezvous-*)."""
    (folder,) = Path(tempfile.gettempdir()).glob("afd-rendezvous-*")
    return stat.S_IMODE(folder.stat().st_mode)


def report_environment(connection: Any, names: list[str]) -> dict[str, str | None]:
    """Rank program: these environment variables as the rank process sees them."""
    return {name: os.environ.get(name) for name in names}


def report_parent(connection: Any) -> int:
    """Rank program: the pid of the process that started this rank (the launcher for a
    spawned rank, the fork server for a forked one)."""
    return os.getppid()
