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
    KVCache,
    MonolithicModel,
    Prompt,
    PromptChunk,
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
from afd_tools.run.workload import ChunkQueue, Request


def request_tokens(request: Request, vocab: int, seed: int) -> torch.Tensor:
    """The request's prompt: the workload's token ids, or drawn deterministically from the
    seed (the launcher rebuilds the same tokens for verification)."""
    if request.tokens is not None:
        return torch.tensor(request.tokens, dtype=torch.long)
    gen = torch.Generator().manual_seed(seed * 1_000_003 + request.request_id)
    return torch.randint(0, vocab, (request.prompt_len,), generator=gen)


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
    # The endpoint knows the model's layer count and the stages in flight, so a header that
    # names any other layer or stage is refused.
    options = EndpointOptions(timeout=timeout, num_layers=config.num_hidden_layers, num_stages=1)
    endpoint = connection.attention_endpoint(options)
    everyone = roster()
    replicas = {
        r: everyone[f"attention rank {r}"]
        for r in range(len(lockstep_outboxes))
        if f"attention rank {r}" in everyone
    }
    steps = Lockstep(connection.rank, lockstep_inbox, lockstep_outboxes, replicas)
    lockstep = LockstepEndpoint(endpoint, steps, run_timeout)
    prompts = {r.request_id: request_tokens(r, config.vocab_size, seed) for r in requests}
    # Warm up every path once (allocations, first-call dispatch) before anything is timed.
    warm = [torch.zeros(min(4, max_tokens), dtype=torch.long)]
    afd_model.forward(warm, endpoint, compute_logits=False)
    if colocated is not None:
        colocated.forward(warm, compute_logits=False)
    out: dict[str, Any] = {}
    for mode in modes:
        steps.barrier(run_timeout, f"start of mode {mode}")
        origin = time.monotonic()
        result = ModeResult(origin=origin)
        queue = ChunkQueue(requests, max_tokens)
        cache = KVCache()  # earlier chunks of prompts longer than the budget
        while True:
            now = time.monotonic() - origin
            if mode == "sync":
                if not any(steps.exchange(0 if queue.empty else 1, run_timeout, "step start")):
                    break
            elif queue.empty:
                break
            chunks = queue.next_step(now)
            if not chunks and mode != "sync":
                # Idle until the next arrival; an orphan (launcher gone) stops here too.
                check_supervisor(f"attention replica {connection.rank}")
                time.sleep(min(0.01, max(0.0, queue.next_arrival - now)))
                continue
            start = time.monotonic() - origin
            entries: list[Prompt]
            if chunks:
                entries = [
                    PromptChunk(
                        c.request_id, prompts[c.request_id][c.begin : c.end], c.begin, c.final
                    )
                    for c in chunks
                ]
            else:  # sync: nothing ready; join the step with a dummy token
                entries = [torch.zeros(1, dtype=torch.long)]
                result.dummy_batches += 1
            if mode == "colocated":
                assert colocated is not None
                output = colocated.forward(entries, compute_logits=False, cache=cache)
                waited = 0.0
            else:
                lockstep.wait_s = 0.0
                chosen: AttentionEndpoint = lockstep if mode == "sync" else endpoint
                output = afd_model.forward(entries, chosen, compute_logits=False, cache=cache)
                waited = afd_model.stats.combine_wait_s + lockstep.wait_s
            end = time.monotonic() - origin
            result.busy_s += end - start - waited
            result.wait_s += waited
            result.batches.append((start, end, sum(c.end - c.begin for c in chunks)))
            if chunks:
                last = output.last_hidden_states().float().cpu()
                for row, chunk in enumerate(chunks):
                    if chunk.final:  # the prompt's last token: its time to first token
                        result.done[chunk.request_id] = end
                        result.last_hidden[chunk.request_id] = last[row].clone()
                        progress.send_bytes(b"1")
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
    options = EndpointOptions(timeout=timeout, num_layers=config.num_hidden_layers, num_stages=1)
    endpoint = connection.ffn_endpoint(options)
    # Idle stretches (colocated mode, sparse arrivals) are waited out; a dead peer still
    # ends the loop with PeerAborted.
    stats = executor.serve(endpoint, keep_waiting=True)
    return {"intervals": [(r.taken, r.replied, r.replica, r.layer) for r in stats.items]}
