"""The launches of one planned ``afd run``: the AFD processes (A attention replicas and F
FFN ranks, with colocated DP inside), and the colocated baselines that are launches of
their own (DP+EP over all processors, or the monolithic model in one process).

Each :class:`Launch` is built just before it runs (its lockstep pipes open only then) and
runs its ranks with :func:`afd_protocol.launch.launch` in this (main) thread, so that Ctrl-C
and SIGTERM stop and clean up everything.
"""

from __future__ import annotations

import dataclasses
import functools
import multiprocessing as mp
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from afd_protocol import Role, SharedPlacement, SlotLayout, Topology, TransportFactory
from afd_protocol.launch import GPU_START_METHOD, RankSpec, launch
from afd_tools.prefill.workload import PULL, Request, assign
from afd_tools.run import ranks
from afd_tools.run.expert_parallel import expert_parallel_connection
from afd_tools.run.lockstep import pipes as lockstep_pipes
from afd_tools.run.monolithic import monolithic_connection, monolithic_replica
from afd_tools.run.plan import RunPlan
from afd_tools.run.pull import Pulling, warm_shares
from afd_tools.run.sharing import mps_clients

SPAWN = mp.get_context("spawn")

Outcome = tuple[list[str], list[Request], list[Any], list[Any]]
"""One launch's (modes, requests, per-replica results by mode, per-FFN-rank intervals)."""


@dataclass
class Launch:
    """One launch: the AFD processes (A attention + F FFN) or a colocated baseline's."""

    modes: list[str]
    requests: list[Request]
    window: Any
    specs: list[RankSpec]
    factory: TransportFactory
    replicas: int
    ffn_ranks: int
    pipes: list[Connection]
    shares: dict[str, int] = dataclasses.field(default_factory=dict)
    """Each rank's CUDA MPS share by rank name, where ranks share GPUs (empty: no MPS)."""
    start_method: str = "forkserver"
    """How the rank processes start (:func:`afd_protocol.launch`'s
    ``default_start_method``; ``AFD_START_METHOD`` overrides it)."""

    def run(self, run_timeout: float) -> Outcome:
        """Launch the ranks (as MPS clients with their shares, under a daemon that lives as
        long as the launch, when :attr:`shares` is not empty) and collect their results
        within ``run_timeout`` seconds."""
        try:
            with mps_clients(self.shares) as environments:
                specs = [_with_env(spec, environments.get(spec.name, {})) for spec in self.specs]
                results = _launch(self.window, specs, run_timeout, self.factory, self.start_method)
        finally:
            for end in self.pipes:
                end.close()
        values = [results[f"attention rank {r}"].value for r in range(self.replicas)]
        intervals = [results[f"ffn rank {r}"].value["intervals"] for r in range(self.ffn_ranks)]
        return self.modes, self.requests, values, intervals


def launches(plan: RunPlan) -> list[Callable[[Connection], Launch]]:
    """The plan's launches, in the order they run, each built from the progress pipe's
    writing end when its turn comes."""
    out: list[Callable[[Connection], Launch]] = []
    if plan.afd_modes:
        out.append(functools.partial(_started, _afd_launch, plan))
    if plan.separate_colocated:
        build = _colocated_launch if plan.job.colocated == "dp-ep" else _monolithic_launch
        out.append(functools.partial(_started, build, plan))
    return out


def _started(
    build: Callable[[RunPlan, Connection], Launch], plan: RunPlan, progress: Connection
) -> Launch:
    """``build``'s launch, its ranks spawned where they use GPUs (GPU_START_METHOD), else
    forked from the fork server (the faster start)."""
    method = GPU_START_METHOD if plan.placement.kind == "cuda" else "forkserver"
    return dataclasses.replace(build(plan, progress), start_method=method)


def _with_env(spec: RankSpec, env: dict[str, str]) -> RankSpec:
    """``spec`` with ``env`` added to its process environment."""
    return dataclasses.replace(spec, env={**spec.env, **env}) if env else spec


def _launch(
    window: Any,
    specs: list[RankSpec],
    run_timeout: float,
    factory: TransportFactory,
    start_method: str,
) -> dict[str, Any]:
    """Run the ranks with :func:`launch` in this (main) thread, so that Ctrl-C and SIGTERM
    stop and clean up everything."""
    return dict(
        launch(
            window,
            specs,
            timeout=run_timeout,
            transport_factory=factory,
            default_start_method=start_method,
        )
    )


def _handed_out(
    plan: RunPlan, requests: list[Request], replicas: int, modes: list[str]
) -> tuple[list[Request], Pulling | None]:
    """What a launch's ``replicas`` are given before the run: ``requests`` as assigned,
    with no pool; under ``--assign pull``, each replica's warm-up share
    (:func:`~afd_tools.run.pull.warm_shares`) and the pools its ``modes`` claim from."""
    if plan.job.assign != PULL:
        return requests, None
    return warm_shares(requests, replicas), Pulling.over(requests, modes)


def _replica_spec(
    plan: RunPlan,
    rank: int,
    given: tuple[list[Request], Pulling | None],
    modes: list[str],
    device: str,
    lockstep: tuple[list[Connection], list[Connection]],
    progress: Connection,
) -> RankSpec:
    """Attention replica (or DP+EP rank) ``rank`` of a launch, given its share of
    :func:`_handed_out`."""
    job = plan.job
    inboxes, outboxes = lockstep
    requests, pulling = given
    return RankSpec(
        Role.ATTENTION,
        rank,
        ranks.attention_replica,
        {
            "config": plan.config,
            "seed": job.seed,
            "timeout": job.timeout,
            "requests": [q for q in requests if q.replica == rank],
            "modes": modes,
            "max_tokens": job.max_num_batched_tokens,
            "lockstep_inbox": inboxes[rank],
            "lockstep_outboxes": outboxes,
            "run_timeout": job.run_timeout,
            "device": device,
            "num_stages": job.stages,
            "min_stage_tokens": job.min_stage_tokens,
            "warm_pass": job.warms_whole_workload(device),
            "progress": progress,
            "pulling": pulling,
        },
    )


def _afd_launch(plan: RunPlan, progress: Connection) -> Launch:
    """The A attention replicas and F FFN ranks over the plan's transport."""
    assert plan.afd_transport is not None, "prepare() builds it whenever AFD modes run"
    job, placement = plan.job, plan.placement
    window, factory = plan.afd_transport
    modes = plan.afd_modes
    # Pipes only (no semaphore, no shared-memory name): nothing outlives a crash.
    lockstep = lockstep_pipes(SPAWN, job.attention_ranks)
    given = _handed_out(plan, plan.requests, job.attention_ranks, modes)
    specs = [
        _replica_spec(plan, r, given, modes, placement.attention[r], lockstep, progress)
        for r in range(job.attention_ranks)
    ]
    specs += [
        RankSpec(
            Role.FFN,
            r,
            ranks.ffn_rank,
            {
                "config": plan.config,
                "seed": job.seed,
                "timeout": job.timeout,
                "backend": job.backend,
                "graph_buckets": job.ffn_graph_buckets,
                "serve_graph": job.ffn_graph,
                "device": placement.ffn[r],
                "num_stages": job.stages,
            },
        )
        for r in range(job.ffn_ranks)
    ]
    return Launch(
        modes,
        plan.requests,
        window,
        specs,
        factory,
        job.attention_ranks,
        job.ffn_ranks,
        [*lockstep[0], *lockstep[1]],
        plan.shares,
    )


def _colocated_launch(plan: RunPlan, progress: Connection) -> Launch:
    """Colocated DP+EP on the processors AFD uses (A+F on the CPU, one rank per GPU on
    CUDA): the same requests and arrivals, assigned over its ranks by the same policy."""
    job, config, placement = plan.job, plan.config, plan.placement
    world = len(placement.colocated)
    requests = assign(plan.lengths, plan.arrivals, world, job.assign, plan.tokens)
    slot = SlotLayout(
        Topology(world, world, config.n_routed_experts),
        config.hidden_size,
        job.max_num_batched_tokens,
        config.num_experts_per_tok,
        dtype=job.resolved("dtype"),
        shared_placement=SharedPlacement.ATTENTION,
    )
    factory = functools.partial(
        expert_parallel_connection,
        config=config,
        seed=job.seed,
        backend=job.resolved("backend"),
        device_kind=placement.kind,
        exchange=placement.exchange,
    )
    lockstep = lockstep_pipes(SPAWN, world)
    given = _handed_out(plan, requests, world, ["colocated"])
    specs = [
        _replica_spec(plan, r, given, ["colocated"], placement.colocated[r], lockstep, progress)
        for r in range(world)
    ]
    return Launch(
        ["colocated"],
        requests,
        slot.window(ring_depth=1),
        specs,
        factory,
        world,
        0,
        [*lockstep[0], *lockstep[1]],
    )


def _monolithic_launch(plan: RunPlan, progress: Connection) -> Launch:
    """``--colocated mono``: the monolithic model in one process on the first attention
    replica's device, every request with the same arrivals, first come first served
    (:mod:`afd_tools.run.monolithic`; whatever ``--assign`` says, the one replica gets
    every request: under pull it would claim them all, in the same order); not an MPS
    client, so it has the whole GPU."""
    job, config = plan.job, plan.config
    requests = assign(plan.lengths, plan.arrivals, 1, "round-robin", plan.tokens)
    slot = SlotLayout(
        Topology(1, 1, config.n_routed_experts),
        config.hidden_size,
        job.max_num_batched_tokens,
        config.num_experts_per_tok,
        dtype=job.resolved("dtype"),
    )
    device = plan.placement.colocated[0]
    spec = RankSpec(
        Role.ATTENTION,
        0,
        monolithic_replica,
        {
            "config": config,
            "seed": job.seed,
            "requests": requests,
            "max_tokens": job.max_num_batched_tokens,
            "backend": job.backend,
            "progress": progress,
            "device": device,
            "warm_pass": job.warms_whole_workload(device),
        },
    )
    factory = functools.partial(monolithic_connection, device=device)
    return Launch(["colocated"], requests, slot.window(ring_depth=1), [spec], factory, 1, 0, [])
