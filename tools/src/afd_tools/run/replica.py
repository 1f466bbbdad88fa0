"""The attention replica of ``afd run``: its set-up, built once, and one object per mode.

A replica batches its requests first come, first served and prefills them through
:class:`afd_models.AttentionRoleModel` (or, in colocated DP, computes every layer itself
with :class:`afd_models.MonolithicModel`). The pieces:

* :class:`ReplicaSetup` -- built once per rank process: the device, the weights, the
  model, the connection's endpoint and its wrappers (host staging, timing, lockstep), the
  lockstep between replicas, the routing log; :meth:`ReplicaSetup.warm_up` runs every path
  once before anything is timed.
* one :class:`ReplicaMode` per mode: :class:`AsyncMode` (stages in flight, nobody waited
  for), :class:`SyncMode` (a barrier across replicas before every MoE dispatch -- the
  lockstep of a synchronous AFD connector), :class:`ColocatedMode` (colocated DP: the whole
  model in this process) and :class:`ExpertParallelMode` (colocated DP+EP, over an
  :class:`~afd_tools.run.expert_parallel.ExpertParallelEndpoint`'s collectives). Each
  says how one step is computed (:meth:`ReplicaMode.forward`) and whether the replicas step
  together.
* :class:`ChunkLoop` -- the first-come-first-served loop over a
  :class:`~afd_tools.prefill.workload.ChunkQueue` that every mode runs (and the monolithic
  baseline, :mod:`afd_tools.run.monolithic`), collecting a :class:`ModeResult`; under
  ``--assign pull`` it fills the queue at each step start from the mode's shared pool
  (:mod:`afd_tools.run.pull`). Modes that
  step together (sync, DP+EP) start each step with an exchange of batch sizes; a replica
  with nothing to do joins the step with a one-token dummy batch, as data-parallel engines
  do.

On a GPU every step ends with a device synchronisation, so that its end time is when its
work finished. :func:`attention_replica` is the rank program the launcher starts (a
module-level function, so it pickles by name).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection as Pipe
from typing import Any, ClassVar, Protocol

import torch

from afd_models import (
    AttentionRoleModel,
    DeepseekConfig,
    KVCache,
    MonolithicModel,
    PrefillOutput,
    Prompt,
    PromptChunk,
)
from afd_protocol import (
    AttentionEndpoint,
    Connection,
    EndpointOptions,
    SharedPlacement,
    check_supervisor,
    freeze_heap,
)
from afd_protocol.launch import roster
from afd_tools.prefill.layer_times import LayerTimes
from afd_tools.prefill.metrics import ReplicaTimes
from afd_tools.prefill.workload import Chunk, ChunkQueue, Request, RequestPool
from afd_tools.run.breakdown import Clock, TimedEndpoint
from afd_tools.run.devices import random_weights, rank_device
from afd_tools.run.exchanges import ExchangeLog, StepExchanges, probed_rows
from afd_tools.run.expert_parallel import ExpertParallelEndpoint
from afd_tools.run.lockstep import Lockstep, LockstepEndpoint
from afd_tools.run.pull import Pulling
from afd_tools.run.routing import RoutingLog
from afd_tools.run.staging import StagedAttentionEndpoint


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
    exchanges: list[StepExchanges | None] = field(default_factory=list)
    """Per real step (as ``steps``), the MoE exchange of up to
    :data:`~afd_tools.run.exchanges.PROBES_PER_CHUNK` tokens of each chunk at every MoE
    layer (:mod:`afd_tools.run.exchanges`; ``None`` in a mode without an exchange): the
    verification checks it against the reference's experts, one layer at a time."""
    exchange_includes_shared: bool = False
    """Whether :attr:`exchanges` hold the shared experts (they ran on the FFN ranks)."""
    routing: list[torch.Tensor] = field(default_factory=list)
    """Per real step (as ``steps``), int32 ``[moe layers, T, k]`` on the CPU: every token's
    top-k expert ids at each MoE layer (``config.moe_layers`` order), as this replica routed
    them (:class:`~afd_tools.run.routing.RoutingLog`); the verification's reference takes
    them at routing near-ties and checks them everywhere else. ``T * k * 4`` bytes per MoE
    layer and step, copied to the host after the step's end time was taken."""
    start_marks: tuple[float, float, float] | None = None
    """``time.monotonic()`` (comparable across processes on Linux) when the replica's
    program began (its process started and its transport connected), when its model was
    built (weights drawn, the GEMM probe run on a GPU), and when its warm-up ended; the
    same for every mode of a replica, None where not recorded."""


class StepSizes(Protocol):
    """How replicas that step together agree on a step: :class:`Lockstep`'s all-gather."""

    def exchange(self, value: int, timeout: float, what: str) -> list[int]:
        """Every replica's ``value`` of this step, by replica."""
        ...


StepOutput = tuple[PrefillOutput, float]
"""A step's output and the seconds of it spent waiting (for combines, barriers or
collectives): not counted as busy."""
Step = Callable[[list[Prompt], int, KVCache], StepOutput]
"""One step of a mode: ``(entries, rows, cache) -> (output, waited)``; ``rows`` is the
step's largest batch over the replicas when they step together, else 0."""


def _tokens(chunks: list[Chunk]) -> int:
    return sum(c.end - c.begin for c in chunks)


@dataclass
class ChunkLoop:
    """First come, first served prefill of ``requests`` in steps of at most ``max_tokens``
    tokens (:class:`~afd_tools.prefill.workload.ChunkQueue`), one :class:`ModeResult` per
    :meth:`run`."""

    requests: list[Request]
    """The replica's requests (under ``--assign pull``: its warm-up share; the timed modes
    claim from a pool, :meth:`run`)."""
    max_tokens: int
    prompts: dict[int, torch.Tensor]
    """Every request's token ids (:func:`request_tokens`): under pull, every request of
    the workload."""
    log: RoutingLog
    """Where the step's forward records its expert choices (taken once per step)."""
    progress: Pipe
    """One byte is sent here per finished request."""
    who: str
    """The rank, in words, for the orphan check while idle."""
    run_timeout: float = 0.0
    """How long a step-size exchange may wait for the other replicas."""
    report: bool = True
    """Whether finished requests are counted on :attr:`progress` (not in a warm-up pass)."""
    exchanges: ExchangeLog | None = None
    """Where the step's forward records the exchange of the probed tokens of each chunk
    (:func:`~afd_tools.run.exchanges.probed_rows`; taken once per step, in modes with an
    exchange)."""

    def warm_up_batches(self, largest_step: bool) -> list[list[torch.Tensor]]:
        """The untimed batches a rank runs before its first mode, so that no mode pays
        first-call costs the others find paid (each batch a list of int64 ``[n]`` tensors of
        token ids on the CPU): four tokens (the small-batch kernels), then, with
        ``largest_step``, the run's largest step -- the requests' own prompts from the
        first, whole, until ``max_tokens`` is reached, the last one cut short (one dummy
        token for a replica without requests: ranks stepping together run as many batches).

        The largest step is for GPUs: it grows the caching allocator to about its peak and
        loads the large-batch kernels, which on one H200 under MPS made a launch's first
        mode run its layers 1.4-3.1x slower than the modes after it (``docs/benchmarks.md``).
        On a CPU neither cost exists, and the step would only lengthen every run."""
        batches = [[torch.zeros(min(4, self.max_tokens), dtype=torch.long)]]
        if not largest_step:
            return batches
        largest: list[torch.Tensor] = []
        room = self.max_tokens
        for request in self.requests:
            if room <= 0:
                break
            tokens = self.prompts[request.request_id][:room]
            largest.append(tokens)
            room -= len(tokens)
        batches.append(largest or [torch.zeros(1, dtype=torch.long)])
        return batches

    def run(
        self,
        step: Step,
        sizes: StepSizes | None = None,
        exchanges: bool = False,
        pool: RequestPool | None = None,
    ) -> ModeResult:
        """Prefill every request once through ``step``: :attr:`requests`, or with ``pool``
        (``--assign pull``) the requests this replica claims from it at each step start
        (:meth:`ChunkQueue.refill`; the replica is done once its queue is empty and the
        pool exhausted). With ``sizes`` the replicas step together: each step starts with
        an exchange of batch sizes (-1: nothing left; the time it takes counts as waiting),
        a replica with nothing ready joins with a one-token dummy batch, and the loop ends
        when every replica is done. Without it, an idle replica sleeps until the next
        arrival and the loop ends when it is done. With ``exchanges`` (a mode whose
        forward reports its MoE exchange to :attr:`exchanges`) every real step records it."""
        log = self.exchanges if exchanges else None
        origin = time.monotonic()
        result = ModeResult(origin=origin)
        queue = ChunkQueue(self.requests if pool is None else [], self.max_tokens, pool)
        cache = KVCache()  # earlier chunks of prompts longer than the budget
        while True:
            now = time.monotonic() - origin
            queue.refill(now)
            done = queue.done
            rows = 0
            if sizes is not None:
                chunks = [] if done else queue.next_step(now)
                every = sizes.exchange(
                    -1 if done else _tokens(chunks), self.run_timeout, "step start"
                )
                result.wait_s += time.monotonic() - origin - now  # waiting for the others
                if max(every) < 0:
                    break
                rows = max(1, *every)
            elif done:
                break
            else:
                chunks = queue.next_step(now)
                if not chunks:
                    # Idle until the next arrival; an orphan (launcher gone) stops here too.
                    check_supervisor(self.who)
                    time.sleep(min(0.01, max(0.0, queue.next_arrival - now)))
                    continue
            start = time.monotonic() - origin
            entries: list[Prompt]
            if chunks:
                entries = [
                    PromptChunk(
                        c.request_id, self.prompts[c.request_id][c.begin : c.end], c.begin, c.final
                    )
                    for c in chunks
                ]
            else:  # stepping together, nothing ready: join the step with a dummy token
                entries = [torch.zeros(1, dtype=torch.long)]
                result.dummy_batches += 1
            if log is not None:
                log.expect(probed_rows([c.end - c.begin for c in chunks]))
            output, waited = step(entries, rows, cache)
            end = time.monotonic() - origin
            result.busy_s += end - start - waited
            result.wait_s += waited
            result.batches.append((start, end, _tokens(chunks)))
            routing = self.log.take()  # after the end time: its copy to the host is not timed
            exchanged = None if log is None else log.take()  # likewise
            if chunks:
                self._record(result, chunks, routing, output, end)
                result.exchanges.append(exchanged)
        return result

    def run_quietly(self, step: Step, sizes: StepSizes | None = None) -> None:
        """Prefill every request once through ``step`` as :meth:`run` does, but untimed and
        uncounted: arrivals ignored (every request ready at once), no progress bytes, the
        result dropped. The warm-up pass of a process's first mode (``--warm-pass``)."""
        quiet = dataclasses.replace(
            self,
            requests=[dataclasses.replace(r, arrival=0.0) for r in self.requests],
            report=False,
        )
        quiet.run(step, sizes)

    def _record(
        self,
        result: ModeResult,
        chunks: list[Chunk],
        routing: torch.Tensor,
        output: PrefillOutput,
        end: float,
    ) -> None:
        """A real step's batch, routing and finished requests."""
        result.steps.append([(c.request_id, c.begin, c.end, c.final) for c in chunks])
        result.routing.append(routing)
        last = output.last_hidden_states().float().cpu()
        for row, chunk in enumerate(chunks):
            if chunk.final:  # the prompt's last token: its time to first token
                result.done[chunk.request_id] = end
                result.last_hidden[chunk.request_id] = last[row].clone()
                if self.report:
                    self.progress.send_bytes(b"1")


@dataclass
class ReplicaSetup:
    """What one attention replica builds once and every mode uses (:meth:`build`)."""

    device: torch.device
    model: AttentionRoleModel
    endpoint: AttentionEndpoint
    """The connection's endpoint, staged to the model's device where the transport's
    windows live elsewhere (announced shut down at the end)."""
    expert_parallel: ExpertParallelEndpoint | None
    """The endpoint, when the connection is colocated DP+EP's."""
    monolithic: MonolithicModel | None
    """The whole model on this replica, for colocated DP (built when that mode runs)."""
    lockstep: Lockstep
    timed: TimedEndpoint
    """``endpoint``, timed per call (:mod:`afd_tools.run.breakdown`)."""
    barriers: LockstepEndpoint
    """``timed`` behind a barrier across replicas before every dispatch (sync)."""
    loop: ChunkLoop
    modes: list[str]
    num_stages: int
    run_timeout: float
    min_stage_tokens: int = 0
    """Async steps with under this many tokens per stage are cut into fewer stages."""
    warm_pass: bool = False
    """Whether :meth:`warm_up` also prefills every request once, untimed, in the first mode."""
    pulling: Pulling | None = None
    """Under ``--assign pull``: every request and each mode's shared claim cursor."""

    @classmethod
    def build(
        cls,
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
        min_stage_tokens: int = 0,
        warm_pass: bool = False,
        pulling: Pulling | None = None,
    ) -> ReplicaSetup:
        """The replica on ``connection``: prefill ``requests`` (with ``seed``'s weights and
        prompts) in each of ``modes``, in steps of at most ``max_tokens`` tokens on
        ``device``; ``lockstep_inbox`` / ``lockstep_outboxes`` are this replica's ends of the
        lockstep's pipes (:func:`afd_tools.run.lockstep.pipes`), ``progress`` gets a byte
        per finished request; ``timeout`` bounds every endpoint wait, ``run_timeout`` every
        wait for the other replicas; ``num_stages`` micro-batches are in flight in async
        (fewer in a step with under ``min_stage_tokens`` tokens per stage); ``warm_pass``:
        :meth:`warm_up` also runs every request once, untimed, in the first mode;
        ``pulling`` (``--assign pull``): the timed modes claim from its pools, and
        ``requests`` are only what this replica warms up on."""
        torch_dtype = getattr(torch, connection.layout.dtype)
        where = rank_device(connection, device)
        weights = random_weights(seed, where)
        model = AttentionRoleModel(
            config,
            weights,
            dtype=torch_dtype,
            device=where,
            shared_placement=connection.layout.shared_placement,
        )
        # The endpoint knows the model's layer count and the stages in flight, so a header
        # that names any other layer or stage is refused.
        options = EndpointOptions(
            timeout=timeout, num_layers=config.num_hidden_layers, num_stages=num_stages
        )
        endpoint: AttentionEndpoint = connection.attention_endpoint(options)
        expert_parallel = endpoint if isinstance(endpoint, ExpertParallelEndpoint) else None
        if connection.device != where and expert_parallel is None:
            endpoint = StagedAttentionEndpoint(endpoint, connection.device, where)
        monolithic = (
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
        lockstep = Lockstep(connection.rank, lockstep_inbox, lockstep_outboxes, replicas)
        timed = TimedEndpoint(endpoint, Clock(where))
        every = requests if pulling is None else pulling.requests
        loop = ChunkLoop(
            requests,
            max_tokens,
            {r.request_id: request_tokens(r, config.vocab_size, seed) for r in every},
            RoutingLog(config.moe_layers),  # every step's expert choices, for the verification
            progress,
            f"attention replica {connection.rank}",
            run_timeout,
            exchanges=ExchangeLog(config.moe_layers),  # and their exchange, checked per layer
        )
        return cls(
            where,
            model,
            endpoint,
            expert_parallel,
            monolithic,
            lockstep,
            timed,
            LockstepEndpoint(timed, lockstep, run_timeout),
            loop,
            modes,
            num_stages,
            run_timeout,
            min_stage_tokens,
            warm_pass,
            pulling,
        )

    def warm_up(self, first: ReplicaMode | None = None) -> None:
        """Run every path untimed at the small and the largest batch
        (:meth:`ChunkLoop.warm_up_batches`: allocations, first-call dispatch, kernel loads)
        before anything is timed; with :attr:`warm_pass`, then every request once in the
        ``first`` mode (:meth:`warm_pass_of`); then freeze the start-up heap (no full
        garbage collection of it inside a mode)."""
        batches = self.loop.warm_up_batches(largest_step=self.device.type == "cuda")
        for index, warm in enumerate(batches):
            if self.expert_parallel is not None:  # every rank pads to the same rows
                self.expert_parallel.begin_step(
                    len(warm[0]) if index == 0 else self.loop.max_tokens
                )
            self.model.forward(warm, self.endpoint, compute_logits=False)
            if self.monolithic is not None:
                self.monolithic.forward(warm, compute_logits=False)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if self.warm_pass and first is not None:
            self.warm_pass_of(first)
        freeze_heap()

    def warm_pass_of(self, mode: ReplicaMode) -> None:
        """Prefill every request once through ``mode``, untimed and uncounted (arrivals
        ignored, no progress, the result dropped).

        Why: on one H200 under MPS, with makespans under a second, the first timed mode of a
        process ran its layers up to 1.4x slower than the same mode in a later position
        (`afd run --mode all`: sync after async 38,597 tokens/s, sync first 27,561): the
        largest step alone does not load everything a workload's steps use (continued
        chunks, stage cuts, other sizes). After this pass every mode runs as a later one."""
        self.lockstep.barrier(self.run_timeout, "start of the warm-up pass")
        self.loop.run_quietly(mode.step, self.lockstep if mode.lockstepped else None)
        self.timed.totals = LayerTimes()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


class ReplicaMode:
    """One mode of a replica: :meth:`run` prefills its requests once, each step through
    :meth:`forward` between the timed endpoint's step marks."""

    name: ClassVar[str]
    lockstepped: ClassVar[bool] = False
    """Whether the replicas step together (exchange batch sizes, dummy batches)."""

    def __init__(self, setup: ReplicaSetup) -> None:
        self.setup = setup
        self._steps: list[list[float]] = []
        """This mode's step records (:func:`step_record`) since :meth:`run` began."""

    def forward(self, entries: list[Prompt], rows: int, cache: KVCache) -> StepOutput:
        """One step's forward: its output and the seconds of it spent waiting."""
        raise NotImplementedError

    def prefill(
        self,
        entries: list[Prompt],
        endpoint: AttentionEndpoint,
        cache: KVCache,
        num_stages: int = 1,
        min_stage_tokens: int = 0,
    ) -> PrefillOutput:
        """The attention model's forward of one step over ``endpoint``, its expert choices
        logged."""
        setup = self.setup
        return setup.model.forward(
            entries,
            endpoint,
            num_stages=num_stages,
            min_stage_tokens=min_stage_tokens,
            compute_logits=False,
            cache=cache,
            select=setup.loop.log,
            observe=setup.loop.exchanges,
        )

    exchanges: ClassVar[bool] = True
    """Whether :meth:`forward` goes through :meth:`prefill`, whose exchange is recorded."""
    waits_in_combine: ClassVar[bool] = False
    """Whether :meth:`forward`'s waiting is the host's seconds in combine (and in sync
    mode's barriers), which a GPU's timeline replaces (:meth:`step`)."""

    def step(self, entries: list[Prompt], rows: int, cache: KVCache) -> StepOutput:
        """:meth:`forward`, timed per endpoint call; returns once the device finished it.

        On a GPU the host runs ahead of the device, so the host's seconds in ``combine``
        (and at a barrier) also cover this rank's own compute still queued before it: the
        step's waiting is the combines' and barriers' spans on the device's timeline
        instead (the breakdown's columns), so that busy + waiting describe the device."""
        timed = self.setup.timed
        before = dataclasses.replace(timed.totals)
        timed.begin_step()
        output, waited = self.forward(entries, rows, cache)
        combined, barred = timed.totals.combine_s, timed.totals.barrier_s
        timed.end_step()  # waits for the device: the step's end is when its work ended
        if self.waits_in_combine and timed.clock.cuda:
            waited = timed.totals.combine_s - combined + timed.totals.barrier_s - barred
        self._steps.append(step_record(entries, before, timed.totals))
        return output, waited

    def run(self) -> ModeResult:
        """Start together with every replica, prefill every request (its own, or those it
        claims from the mode's pool), and return the record (with the per-layer times where
        the endpoint was called)."""
        setup = self.setup
        setup.lockstep.barrier(setup.run_timeout, f"start of mode {self.name}")
        setup.timed.totals = LayerTimes()
        self._steps = []
        pool = None if setup.pulling is None else setup.pulling.pool(self.name)
        result = setup.loop.run(
            self.step, setup.lockstep if self.lockstepped else None, self.exchanges, pool
        )
        result.exchange_includes_shared = (
            self.exchanges and setup.model.shared_placement is SharedPlacement.FFN
        )
        if setup.timed.totals.layers:
            result.layer_times = setup.timed.totals.as_dict()
        result.attention_steps = self._steps
        return result


def step_record(entries: list[Prompt], before: LayerTimes, after: LayerTimes) -> list[float]:
    """One entry of :attr:`ReplicaTimes.attention_steps` for a step over ``entries`` (a
    one-token dummy batch counts as a prompt of one token; :meth:`LayerTimes.step_entry`)."""
    tokens = square = 0
    for entry in entries:
        begin = entry.start if isinstance(entry, PromptChunk) else 0
        length = len(entry.tokens if isinstance(entry, PromptChunk) else entry)
        tokens += length
        square += (begin + length) ** 2 - begin**2
    return after.step_entry(before, tokens, square)


class AsyncMode(ReplicaMode):
    """Asynchronous AFD: ``num_stages`` micro-batches in flight, no replica waits for
    another; waiting is the time spent in combine."""

    name = "async"
    waits_in_combine = True

    def forward(self, entries: list[Prompt], rows: int, cache: KVCache) -> StepOutput:
        setup = self.setup
        output = self.prefill(entries, setup.timed, cache, setup.num_stages, setup.min_stage_tokens)
        return output, setup.model.stats.combine_wait_s


class SyncMode(ReplicaMode):
    """Synchronous AFD: one stage, every replica at every MoE dispatch together (a barrier
    before each, whose time counts as waiting and as the layer times' ``barrier_s``)."""

    name = "sync"
    lockstepped = True
    waits_in_combine = True

    def forward(self, entries: list[Prompt], rows: int, cache: KVCache) -> StepOutput:
        setup = self.setup
        barriers = setup.barriers
        barriers.wait_s = 0.0
        output = self.prefill(entries, barriers, cache)  # the barriers' breakdown: marked
        return output, setup.model.stats.combine_wait_s + barriers.wait_s


class ColocatedMode(ReplicaMode):
    """Colocated DP: this replica computes every layer and every expert itself."""

    name = "colocated"
    exchanges = False

    def forward(self, entries: list[Prompt], rows: int, cache: KVCache) -> StepOutput:
        monolithic = self.setup.monolithic
        assert monolithic is not None, "built whenever the colocated mode runs"
        output = monolithic.forward(
            entries, compute_logits=False, cache=cache, select=self.setup.loop.log
        )
        return output, 0.0


class ExpertParallelMode(ReplicaMode):
    """Colocated DP+EP: every rank runs every layer of every step, exchanging tokens with
    collectives padded to the step's largest batch; waiting is the time in them."""

    name = "colocated"
    lockstepped = True

    def forward(self, entries: list[Prompt], rows: int, cache: KVCache) -> StepOutput:
        setup = self.setup
        exchange = setup.expert_parallel
        assert exchange is not None, "chosen only over an expert-parallel connection"
        exchange.begin_step(rows)
        exchanged = exchange.exchange_s
        output = self.prefill(entries, setup.timed, cache)
        return output, exchange.exchange_s - exchanged


def replica_mode(name: str, setup: ReplicaSetup) -> ReplicaMode:
    """The mode ``name`` ("async", "sync", "colocated") of ``setup``'s replica."""
    if setup.expert_parallel is not None:
        if name != "colocated":
            raise ValueError(f"a colocated DP+EP rank runs only the colocated mode, not {name!r}")
        return ExpertParallelMode(setup)
    modes: dict[str, type[ReplicaMode]] = {
        "async": AsyncMode,
        "sync": SyncMode,
        "colocated": ColocatedMode,
    }
    if name not in modes:
        raise ValueError(f"unknown mode {name!r}; the modes are {sorted(modes)}")
    return modes[name](setup)


def attention_replica(connection: Connection, **options: Any) -> dict[str, ModeResult]:
    """One attention replica (or, over an expert-parallel connection, one colocated DP+EP
    rank): prefill its requests in each of its modes, returning a :class:`ModeResult` per
    mode. ``options`` are :meth:`ReplicaSetup.build`'s (the launcher passes them by name)."""
    entered = time.monotonic()
    setup = ReplicaSetup.build(connection, **options)
    built = time.monotonic()
    chosen = {name: replica_mode(name, setup) for name in setup.modes}
    setup.warm_up(next(iter(chosen.values())))
    marks = (entered, built, time.monotonic())
    out = {name: mode.run() for name, mode in chosen.items()}
    for result in out.values():
        result.start_marks = marks
    setup.endpoint.announce_shutdown()
    return out
