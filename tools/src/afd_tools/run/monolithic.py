"""The colocated baseline of one GPU (``--colocated mono``): what a one-GPU user runs.

One process holds the whole model (:class:`afd_models.MonolithicModel`, with the FFN
ranks' expert backend) on the whole device -- DP1, EP1, no exchange -- and prefills every
request first come, first served, with the same batch budget, arrivals and chunking as
the AFD replicas. Where the AFD ranks share one GPU (under CUDA MPS), this is the honest
baseline: NCCL refuses two ranks of one communicator on one GPU, and colocated ranks over
gloo would measure gloo.

It runs under the same launcher as every other mode (a process of its own with a fresh
CUDA context, the launcher's clean-up on failure and on Ctrl-C), over a connection that
has no peers (:class:`MonolithicConnection`).
"""

from __future__ import annotations

from multiprocessing.connection import Connection as Pipe

import torch

from afd_models import DeepseekConfig, KVCache, MonolithicModel, PrefillOutput, Prompt
from afd_protocol import InvalidArgument, Role, WindowLayout, freeze_heap
from afd_tools.prefill.workload import Request
from afd_tools.run.devices import random_weights, rank_device
from afd_tools.run.peerless import PeerlessConnection
from afd_tools.run.replica import ChunkLoop, ModeResult, request_tokens
from afd_tools.run.routing import RoutingLog

MODE = "colocated"


class MonolithicConnection(PeerlessConnection):
    """The launcher's connection of a rank without peers: it names the rank and its device
    and makes no endpoint (the monolithic model exchanges nothing)."""

    NO_ATTENTION_ENDPOINT = "the monolithic model exchanges nothing: it has no endpoint"
    NO_FFN_ENDPOINT = NO_ATTENTION_ENDPOINT


def monolithic_connection(
    window: WindowLayout,
    role: Role,
    rank: int,
    rendezvous: str,
    connect_timeout: float,
    *,
    device: str,
) -> MonolithicConnection:
    """A launcher transport factory (bind ``device``, e.g. ``"cuda:0"``, with
    ``functools.partial``) for the one rank of ``--colocated mono``."""
    if role is not Role.ATTENTION or rank != 0:
        raise InvalidArgument(f"the monolithic baseline is one attention rank 0, not {role} {rank}")
    return MonolithicConnection(window, rank, torch.device(device))


def monolithic_replica(
    connection: MonolithicConnection,
    *,
    config: DeepseekConfig,
    seed: int,
    requests: list[Request],
    max_tokens: int,
    backend: str,
    progress: Pipe,
    device: str = "cpu",
    warm_pass: bool = False,
) -> dict[str, ModeResult]:
    """Prefill ``requests`` (all of them: this is the only replica) with the whole model on
    ``device``; return ``{"colocated": ModeResult}`` as an attention replica does (final
    hidden states float32 ``[hidden]`` on the CPU, one per request; per step, the routing
    int32 ``[moe layers, T, k]`` on the CPU).

    Warmed up as an AFD replica is (:meth:`ReplicaSetup.warm_up
    <afd_tools.run.replica.ReplicaSetup.warm_up>`): the small and the largest batch, then,
    with ``warm_pass``, every request once, untimed. This process runs one mode only, so
    without the pass that mode ran cold where the AFD modes it is compared with did not:
    on one H200 the baseline stalled 3.3-5.2 s between its first and second finished
    requests (first calls of a continued chunk, among them an import of torch's causal
    bias module, 4.8 s on a 2-core CPU), which cut its tokens/s by up to a third
    (``docs/benchmarks.md``)."""
    where = rank_device(connection, device)
    dtype = getattr(torch, connection.layout.dtype)
    model = MonolithicModel(
        config, random_weights(seed, where), dtype=dtype, device=where, backend=backend
    )
    prompts = {r.request_id: request_tokens(r, config.vocab_size, seed) for r in requests}
    log = RoutingLog(config.moe_layers)  # every step's expert choices, for the verification
    loop = ChunkLoop(
        requests, max_tokens, prompts, log, progress, f"monolithic rank {connection.rank}"
    )
    for warm in loop.warm_up_batches(largest_step=where.type == "cuda"):  # as a replica does
        model.forward(warm, compute_logits=False)

    def step(entries: list[Prompt], rows: int, cache: KVCache) -> tuple[PrefillOutput, float]:
        output = model.forward(entries, compute_logits=False, cache=cache, select=log)
        _synchronize(where)  # the step ends when its work did
        return output, 0.0

    if warm_pass:
        loop.run_quietly(step)
    _synchronize(where)  # warmed up: allocations and first calls are not timed
    freeze_heap()
    return {MODE: loop.run(step)}


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
