"""The programs that run inside the rank processes of ``afd run``.

Attention replicas batch their requests first come, first served and prefill them
through :class:`afd_models.AttentionRoleModel` (``async``, ``sync``; colocated DP+EP too,
over an :class:`~afd_tools.run.expert_parallel.ExpertParallelEndpoint`) or compute every
layer locally with :class:`afd_models.MonolithicModel` (colocated DP). ``sync`` puts a
barrier across replicas before every MoE dispatch -- the lockstep of a synchronous AFD
connector -- and, like colocated DP+EP, starts each step with an exchange of batch sizes;
a replica with nothing to do joins the step with a one-token dummy batch, as
data-parallel engines do. FFN ranks serve whatever work item is ready and record when
they were busy. On a GPU every step ends with a device synchronisation, so that its end
time is when its work finished.
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
    check_gemms_write_every_output,
)
from afd_protocol import (
    AttentionEndpoint,
    Connection,
    DispatchHandle,
    EndpointOptions,
    check_supervisor,
    freeze_heap,
)
from afd_protocol.launch import roster
from afd_tools.prefill.layer_times import LayerTimes
from afd_tools.prefill.metrics import ReplicaTimes
from afd_tools.prefill.workload import ChunkQueue, Request
from afd_tools.run.breakdown import Clock, ItemTimer, TimedEndpoint
from afd_tools.run.expert_parallel import ExpertParallelEndpoint
from afd_tools.run.forwarding import ForwardingEndpoint
from afd_tools.run.lockstep import Lockstep
from afd_tools.run.routing import RoutingLog
from afd_tools.run.staging import StagedAttentionEndpoint, staged_compute


def request_tokens(request: Request, vocab: int, seed: int) -> torch.Tensor:
    """The request's prompt: the workload's token ids, or drawn deterministically from the
    seed (the launcher rebuilds the same tokens for verification)."""
    if request.tokens is not None:
        return torch.tensor(request.tokens, dtype=torch.long)
    gen = torch.Generator().manual_seed(seed * 1_000_003 + request.request_id)
    return torch.randint(0, vocab, (request.prompt_len,), generator=gen)


@dataclass
class ModeResult(ReplicaTimes):
    """One replica's record of one mode: its times (:class:`ReplicaTimes`, the per-layer
    ones measured by :mod:`afd_tools.run.breakdown`) and what the verification checks."""

    last_hidden: dict[int, torch.Tensor] = field(default_factory=dict)
    steps: list[list[tuple[int, int, int, bool]]] = field(default_factory=list)
    """Every real step's batch: ``(request id, begin, end, final)`` per chunk, in order (the
    reference replays them: in bfloat16 the batching changes the rounding)."""
    routing: list[torch.Tensor] = field(default_factory=list)
    """Per real step (as ``steps``), int32 ``[moe layers, T, k]`` on the CPU: every token's
    top-k expert ids at each MoE layer (``config.moe_layers`` order), as this replica routed
    them (:class:`~afd_tools.run.routing.RoutingLog`); the verification's reference takes
    them at routing near-ties and checks them everywhere else. ``T * k * 4`` bytes per MoE
    layer and step, copied to the host after the step's end time was taken."""


class LockstepEndpoint(ForwardingEndpoint):
    """An attention endpoint whose every dispatch first waits for all replicas: the
    lockstep of synchronous AFD, as an :class:`~afd_protocol.AttentionEndpoint`."""

    def __init__(self, endpoint: AttentionEndpoint, lockstep: Lockstep, timeout: float) -> None:
        super().__init__(endpoint)
        self.lockstep = lockstep
        self.timeout = timeout
        self.wait_s = 0.0

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


def rank_device(connection: Connection, device: str) -> torch.device:
    """Where this rank's model runs: ``device`` ("cpu", "cuda:N"); a transport on a GPU
    must be on that same GPU, and the GPU must pass the GEMM start-up probe
    (:func:`afd_models.check_gemms_write_every_output`)."""
    chosen = torch.device(device)
    there = connection.device
    if there.type != "cpu" and there != chosen:
        raise RuntimeError(
            f"the transport runs on {there} but this rank was given {chosen}; the launcher and "
            f"the transport must place ranks alike"
        )
    if chosen.type == "cuda":
        torch.cuda.set_device(chosen)
        check_gemms_write_every_output(chosen)  # e.g. cuBLAS at some MPS shares
    return chosen


def random_weights(seed: int, device: torch.device) -> RandomWeights:
    """The run's weights, drawn where they are used: on a GPU (fast for large presets, and
    the same values on every GPU) or on the CPU."""
    return RandomWeights(seed, device=device if device.type == "cuda" else "cpu")


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
    device: str = "cpu",
    num_stages: int = 1,
) -> dict[str, Any]:
    """One attention replica (or, over an expert-parallel connection, one colocated DP+EP
    rank): prefill its requests in each of ``modes``, returning a :class:`ModeResult` per
    mode."""
    dtype = connection.layout.dtype
    torch_dtype = getattr(torch, dtype)
    placement = connection.layout.shared_placement
    where = rank_device(connection, device)
    weights = random_weights(seed, where)
    afd_model = AttentionRoleModel(
        config, weights, dtype=torch_dtype, device=where, shared_placement=placement
    )
    # The endpoint knows the model's layer count and the stages in flight, so a header that
    # names any other layer or stage is refused.
    options = EndpointOptions(
        timeout=timeout, num_layers=config.num_hidden_layers, num_stages=num_stages
    )
    endpoint: AttentionEndpoint = connection.attention_endpoint(options)
    expert_parallel = endpoint if isinstance(endpoint, ExpertParallelEndpoint) else None
    if connection.device != where and expert_parallel is None:
        endpoint = StagedAttentionEndpoint(endpoint, connection.device, where)
    colocated = (
        MonolithicModel(config, weights, dtype=torch_dtype, device=where)
        if "colocated" in modes and expert_parallel is None
        else None
    )
    everyone = roster()
    replicas = {
        r: everyone[f"attention rank {r}"]
        for r in range(len(lockstep_outboxes))
        if f"attention rank {r}" in everyone
    }
    steps = Lockstep(connection.rank, lockstep_inbox, lockstep_outboxes, replicas)
    clock = Clock(where)
    timed = TimedEndpoint(endpoint, clock)
    lockstep = LockstepEndpoint(timed, steps, run_timeout)
    prompts = {r.request_id: request_tokens(r, config.vocab_size, seed) for r in requests}
    log = RoutingLog(config.moe_layers)  # every step's expert choices, for the verification
    # Warm up every path once (allocations, first-call dispatch) before anything is timed.
    warm = [torch.zeros(min(4, max_tokens), dtype=torch.long)]
    if expert_parallel is not None:
        expert_parallel.begin_step(len(warm[0]))
    afd_model.forward(warm, endpoint, compute_logits=False)
    if colocated is not None:
        colocated.forward(warm, compute_logits=False)
    if where.type == "cuda":
        torch.cuda.synchronize(where)
    freeze_heap()  # no full garbage collection of the start-up heap inside a timed mode
    out: dict[str, Any] = {}
    for mode in modes:
        # Sync AFD and colocated DP+EP run every layer together: each step starts with an
        # exchange of every replica's batch size (-1: nothing left), and a replica without
        # work joins with a one-token dummy batch.
        lockstepped = mode == "sync" or expert_parallel is not None
        steps.barrier(run_timeout, f"start of mode {mode}")
        origin = time.monotonic()
        result = ModeResult(origin=origin)
        timed.totals = LayerTimes()
        queue = ChunkQueue(requests, max_tokens)
        cache = KVCache()  # earlier chunks of prompts longer than the budget
        while True:
            now = time.monotonic() - origin
            rows = 0
            if lockstepped:
                done = queue.empty
                chunks = [] if done else queue.next_step(now)
                size = -1 if done else sum(c.end - c.begin for c in chunks)
                sizes = steps.exchange(size, run_timeout, "step start")
                result.wait_s += time.monotonic() - origin - now  # waiting for the others
                if max(sizes) < 0:
                    break
                rows = max(1, *sizes)
            elif queue.empty:
                break
            else:
                chunks = queue.next_step(now)
            if not chunks and not lockstepped:
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
            else:  # lockstep: nothing ready; join the step with a dummy token
                entries = [torch.zeros(1, dtype=torch.long)]
                result.dummy_batches += 1
            timed.begin_step()
            lockstep.wait_s = 0.0
            if mode == "colocated" and colocated is not None:
                output = colocated.forward(entries, compute_logits=False, cache=cache, select=log)
                waited = 0.0
            elif mode == "colocated":
                assert expert_parallel is not None
                expert_parallel.begin_step(rows)
                exchanged = expert_parallel.exchange_s
                output = afd_model.forward(
                    entries, timed, compute_logits=False, cache=cache, select=log
                )
                waited = expert_parallel.exchange_s - exchanged
            else:
                chosen: AttentionEndpoint = lockstep if mode == "sync" else timed
                stages = num_stages if mode == "async" else 1
                output = afd_model.forward(
                    entries,
                    chosen,
                    num_stages=stages,
                    compute_logits=False,
                    cache=cache,
                    select=log,
                )
                waited = afd_model.stats.combine_wait_s + lockstep.wait_s
            timed.totals.barrier_s += lockstep.wait_s
            timed.end_step()  # waits for the device: the step's end is when its work ended
            end = time.monotonic() - origin
            result.busy_s += end - start - waited
            result.wait_s += waited
            result.batches.append((start, end, sum(c.end - c.begin for c in chunks)))
            routing = log.take()  # after the end time: its copy to the host is not timed
            if chunks:
                result.steps.append([(c.request_id, c.begin, c.end, c.final) for c in chunks])
                result.routing.append(routing)
                last = output.last_hidden_states().float().cpu()
                for row, chunk in enumerate(chunks):
                    if chunk.final:  # the prompt's last token: its time to first token
                        result.done[chunk.request_id] = end
                        result.last_hidden[chunk.request_id] = last[row].clone()
                        progress.send_bytes(b"1")
        if timed.totals.layers:
            result.layer_times = timed.totals.as_dict()
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
    device: str = "cpu",
    num_stages: int = 1,
) -> dict[str, Any]:
    slot = connection.layout
    where = rank_device(connection, device)
    executor = FFNRoleExecutor(
        config,
        slot.topology.local_experts(connection.rank),
        random_weights(seed, where),
        dtype=getattr(torch, slot.dtype),
        device=where,
        backend=backend,
        shared_placement=slot.shared_placement,
    )
    options = EndpointOptions(
        timeout=timeout, num_layers=config.num_hidden_layers, num_stages=num_stages
    )
    # The one FFN rank program (shared with afd-vllm ffn): idle stretches (colocated mode,
    # sparse arrivals) are waited out; a dead peer still ends the loop with PeerAborted.
    # Each item's expert compute is timed on this rank's device, without the copies between
    # the transport's device and it.
    timer = ItemTimer(Clock(where))
    there = connection.device
    wrappers = [timer.wrap]
    if there != where:
        wrappers.append(lambda compute: staged_compute(compute, where, there))
    stats = executor.serve_rank(connection, options, compute_wrappers=wrappers)
    seconds = timer.seconds()
    return {
        "intervals": [
            (r.taken, r.replied, r.replica, r.layer, s)
            for r, s in zip(stats.items, seconds, strict=True)
        ]
    }
