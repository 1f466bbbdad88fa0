"""The programs that run inside the rank processes of ``afd run``.

Attention replicas batch their requests first come, first served and prefill them
through :class:`afd_models.AttentionRoleModel` (``async``, ``sync``) or compute every
layer locally with :class:`afd_models.MonolithicModel` (``colocated``). ``sync`` puts a
barrier across replicas before every MoE dispatch -- the lockstep of a synchronous AFD
connector -- and a replica with nothing to do joins each step with a one-token dummy
batch, as data-parallel engines do. FFN ranks serve whatever work item is ready and
record when they were busy.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection as Pipe
from typing import Any

import torch

from afd_models import (
    AttentionRoleModel,
    DeepseekConfig,
    FFNRoleExecutor,
    MonolithicModel,
    RandomWeights,
)
from afd_protocol import (
    AttentionEndpoint,
    Connection,
    DispatchHandle,
    EndpointOptions,
    SharedPlacement,
)
from afd_protocol.core.rendezvous import check_supervisor
from afd_protocol.launch import roster
from afd_tools.run.lockstep import Lockstep
from afd_tools.run.workload import Request


def prompt_tokens(request_id: int, length: int, vocab: int, seed: int) -> torch.Tensor:
    """The deterministic prompt of a request (the parent rebuilds it for verification)."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + request_id)
    return torch.randint(0, vocab, (length,), generator=gen)


@dataclass
class ModeResult:
    """One replica's record of one mode."""

    done: dict[int, float] = field(default_factory=dict)
    """request id -> seconds after the mode start when its prefill finished."""
    last_hidden: dict[int, torch.Tensor] = field(default_factory=dict)
    busy_s: float = 0.0
    wait_s: float = 0.0
    batches: list[tuple[float, float, int]] = field(default_factory=list)
    """(start, end, tokens) of every batch, seconds after the mode start."""
    dummy_batches: int = 0
    origin: float = 0.0
    """``time.monotonic()`` at the mode start (comparable across processes on Linux)."""


class LockstepEndpoint:
    """An attention endpoint whose every dispatch first waits for all replicas: the
    lockstep of synchronous AFD, as an :class:`~afd_protocol.AttentionEndpoint`."""

    def __init__(self, endpoint: AttentionEndpoint, lockstep: Lockstep, timeout: float) -> None:
        self.endpoint = endpoint
        self.lockstep = lockstep
        self.timeout = timeout
        self.wait_s = 0.0

    @property
    def rank(self) -> int:
        return self.endpoint.rank

    @property
    def dtype(self) -> torch.dtype:
        return self.endpoint.dtype

    @property
    def shared_placement(self) -> SharedPlacement:
        return self.endpoint.shared_placement

    @property
    def in_flight(self) -> int:
        return self.endpoint.in_flight

    def dispatch(
        self,
        layer_idx: int,
        hidden_states: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        stage: int = 0,
    ) -> DispatchHandle:
        start = time.monotonic()
        self.lockstep.barrier(self.timeout, f"lockstep before layer {layer_idx}")
        self.wait_s += time.monotonic() - start
        return self.endpoint.dispatch(layer_idx, hidden_states, topk_ids, topk_weights, stage)

    def combine(self, handle: DispatchHandle, timeout: float | None = None) -> torch.Tensor:
        return self.endpoint.combine(handle, timeout)

    def announce_shutdown(self) -> None:
        self.endpoint.announce_shutdown()

    def abort(self) -> None:
        self.endpoint.abort()

    def close(self) -> None:
        self.endpoint.close()


def attention_replica(
    connection: Connection,
    *,
    config: DeepseekConfig,
    seed: int,
    requests: list[Request],
    modes: list[str],
    max_tokens: int,
    lockstep_inbox: Pipe,
    lockstep_outboxes: list[Pipe],
    progress: Pipe,
    timeout: float,
    run_timeout: float,
) -> dict[str, Any]:
    dtype = connection.layout.dtype
    torch_dtype = getattr(torch, dtype)
    placement = connection.layout.shared_placement
    weights = RandomWeights(seed)
    afd_model = AttentionRoleModel(config, weights, dtype=torch_dtype, shared_placement=placement)
    colocated = (
        MonolithicModel(config, weights, dtype=torch_dtype) if "colocated" in modes else None
    )
    endpoint = connection.attention_endpoint(EndpointOptions(timeout=timeout))
    everyone = roster()
    replicas = {
        r: everyone[f"attention rank {r}"]
        for r in range(len(lockstep_outboxes))
        if f"attention rank {r}" in everyone
    }
    steps = Lockstep(connection.rank, lockstep_inbox, lockstep_outboxes, replicas)
    lockstep = LockstepEndpoint(endpoint, steps, run_timeout)
    prompts = {
        r.request_id: prompt_tokens(r.request_id, r.prompt_len, config.vocab_size, seed)
        for r in requests
    }
    # Warm up every path once (allocations, first-call dispatch) before anything is timed.
    warm = [torch.zeros(4, dtype=torch.long)]
    afd_model.forward(warm, endpoint, compute_logits=False)
    if colocated is not None:
        colocated.forward(warm, compute_logits=False)
    out: dict[str, Any] = {}
    for mode in modes:
        steps.barrier(run_timeout, f"start of mode {mode}")
        origin = time.monotonic()
        result = ModeResult(origin=origin)
        pending = sorted(requests, key=lambda r: (r.arrival, r.request_id))
        while True:
            now = time.monotonic() - origin
            if mode == "sync":
                if not any(steps.exchange(1 if pending else 0, run_timeout, "step start")):
                    break
            elif not pending:
                break
            batch, used = [], 0
            for request in pending:
                if request.arrival > now or used + request.prompt_len > max_tokens:
                    break
                batch.append(request)
                used += request.prompt_len
            if not batch and mode != "sync":
                # Idle until the next arrival; an orphan (launcher gone) stops here too.
                check_supervisor(f"attention replica {connection.rank}")
                time.sleep(min(0.01, max(0.0, pending[0].arrival - now)))
                continue
            start = time.monotonic() - origin
            if batch:
                tokens = [prompts[r.request_id] for r in batch]
            else:  # sync: nothing ready; join the step with a dummy token
                tokens = [torch.zeros(1, dtype=torch.long)]
                result.dummy_batches += 1
            if mode == "colocated":
                assert colocated is not None
                output = colocated.forward(tokens, compute_logits=False)
                waited = 0.0
            else:
                lockstep.wait_s = 0.0
                chosen: AttentionEndpoint = lockstep if mode == "sync" else endpoint
                output = afd_model.forward(tokens, chosen, compute_logits=False)
                waited = afd_model.stats.combine_wait_s + lockstep.wait_s
            end = time.monotonic() - origin
            result.busy_s += end - start - waited
            result.wait_s += waited
            result.batches.append((start, end, used))
            if batch:
                last = output.last_hidden_states().float().cpu()
                for row, request in enumerate(batch):
                    result.done[request.request_id] = end
                    result.last_hidden[request.request_id] = last[row].clone()
                    progress.send_bytes(b"1")
                done_ids = {r.request_id for r in batch}
                pending = [r for r in pending if r.request_id not in done_ids]
        out[mode] = result
    endpoint.announce_shutdown()
    return out


def ffn_rank(
    connection: Connection,
    *,
    config: DeepseekConfig,
    seed: int,
    backend: str,
    timeout: float,
) -> dict[str, Any]:
    slot = connection.layout
    executor = FFNRoleExecutor(
        config,
        slot.topology.local_experts(connection.rank),
        RandomWeights(seed),
        dtype=getattr(torch, slot.dtype),
        backend=backend,
        shared_placement=slot.shared_placement,
    )
    endpoint = connection.ffn_endpoint(EndpointOptions(timeout=timeout))
    # Idle stretches (colocated mode, sparse arrivals) are waited out; a dead peer still
    # ends the loop with PeerAborted.
    stats = executor.serve(endpoint, keep_waiting=True)
    return {"intervals": [(r.taken, r.replied, r.replica, r.layer) for r in stats.items]}
