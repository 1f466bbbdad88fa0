"""The simulated ranks of ``afd sim``: what each rank does, step by step, in each mode.

They mirror the programs of :mod:`afd_tools.run.replica` and the layer-by-stage schedule of
:mod:`afd_models.schedule`, with costs from :class:`~afd_tools.sim.costs.CostModel`:

* ``async`` -- each attention replica batches its own requests first come, first served
  (:class:`afd_tools.prefill.workload.ChunkQueue`; under ``--assign pull`` it claims them
  from one pool shared by the replicas at the start of each step, in engine order at a
  tie: :meth:`~afd_tools.prefill.workload.ChunkQueue.refill`; in every mode), cuts the
  batch into ``stages`` token ranges, and per layer and stage: finishes the stage's
  previous MoE (waits for the reply, combines), computes attention, dispatches. FFN ranks
  serve whatever item is ready, rotating the replica they look at first, so none
  starves;
* ``sync`` -- the same, one stage, with the lockstep of ``afd run --mode sync``: every
  step starts with an exchange of batch sizes (a replica without work joins with a
  one-token dummy batch) and every MoE dispatch waits for all replicas;
* ``colocated`` -- ``dp``: each replica computes every layer itself, experts included,
  and never waits for another; ``dp-ep``: A+F ranks, each with attention and 1/(A+F) of
  the experts, in lockstep, exchanging every MoE layer with all_gather + reduce_scatter.

Routing is uniform, so every FFN rank receives the same items at the same times; the F
ranks are simulated as one server whose work counts F times against the cores.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from afd_models import stage_count
from afd_tools.prefill.layer_times import LayerTimes
from afd_tools.prefill.metrics import ReplicaTimes, served_by
from afd_tools.prefill.workload import ArrivalPool, Chunk, ChunkQueue, Request, RequestPool
from afd_tools.sim.costs import CostModel, experts_touched
from afd_tools.sim.engine import COMPUTE, DELAY, WAIT, Engine, Part, Process, Signal

MODES = ("async", "sync", "colocated")
COLOCATED = ("dp", "dp-ep")


@dataclass(frozen=True)
class Setup:
    """The simulated deployment (the ``afd run`` options that matter to time)."""

    attention_ranks: int
    ffn_ranks: int
    budget: int
    """``--max-num-batched-tokens``."""
    stages: int = 1
    colocated: str = "dp"
    ffn_batch: int = 1
    """Ready items of the same layer an FFN rank may serve at once (``afd run``: 1)."""
    min_stage_tokens: int = 0
    """Async steps under this many tokens per stage are cut into fewer stages
    (``afd run --min-stage-tokens``; :func:`afd_models.stage_count`)."""


@dataclass
class Features:
    """Sums of the cost model's inputs and of the simulated times, per kind of work: what
    :mod:`afd_tools.sim.calibrate` regresses measured times on."""

    count: float = 0.0
    tokens: float = 0.0
    square: float = 0.0
    nominal_s: float = 0.0
    elapsed_s: float = 0.0

    def add(self, tokens: float, square: float, nominal: float, elapsed: float) -> None:
        self.count += 1
        self.tokens += tokens
        self.square += square
        self.nominal_s += nominal
        self.elapsed_s += elapsed

    @property
    def stretch(self) -> float:
        """Simulated time over time alone on a processor (> 1: cores were shared)."""
        return self.elapsed_s / self.nominal_s if self.nominal_s > 0 else 1.0


@dataclass
class FFNFeatures:
    """Per FFN rank: what it served (the regression inputs of its item cost)."""

    serves: float = 0.0
    items: float = 0.0
    touched: float = 0.0
    rows: float = 0.0
    nominal_s: float = 0.0
    elapsed_s: float = 0.0

    @property
    def stretch(self) -> float:
        return self.elapsed_s / self.nominal_s if self.nominal_s > 0 else 1.0


@dataclass
class ReplicaRecord(ReplicaTimes):
    """One simulated replica's record of a mode: the times ``afd run``'s replicas record
    (:class:`~afd_tools.prefill.metrics.ReplicaTimes`, what
    :func:`~afd_tools.prefill.metrics.summarize` and the timeline plot read), the sums
    behind its per-layer times, and the cost model's inputs."""

    totals: LayerTimes = field(default_factory=LayerTimes)
    """The sums behind the per-layer times, the type ``afd run``'s ranks sum into
    (``layers`` counts the MoE layers dispatched)."""
    attention: Features = field(default_factory=Features)
    dispatch: Features = field(default_factory=Features)

    def finish(self) -> None:
        """Fill :attr:`layer_times` as ``afd run`` does (:meth:`LayerTimes.as_dict`)."""
        if self.totals.layers:
            self.layer_times = self.totals.as_dict()


@dataclass
class ModeRun:
    """What one simulated mode produced."""

    mode: str
    replicas: list[ReplicaRecord]
    ffn_intervals: list[list[tuple[float, float, int, int, float]]]
    """Per FFN rank: ``(taken, replied, replica, layer, compute seconds)`` per item."""
    ffn: FFNFeatures
    """Per FFN rank (the representative server): items, attention tokens served, rows."""
    requests: list[Request]
    """The requests as the mode assigned them (colocated dp-ep re-assigns over A+F; under
    ``pull``, the replica that claimed each)."""


class _Item:
    """One replica's layer (and stage) at the FFN ranks."""

    __slots__ = ("done_at", "layer", "replica", "signal", "tokens")

    def __init__(self, replica: int, layer: int, tokens: float) -> None:
        self.replica = replica
        self.layer = layer
        self.tokens = tokens
        self.done_at: float | None = None
        """When the replies are back at the replica (known once the FFN ranks served it)."""
        self.signal: Signal | None = None

    def waiter(self, engine: Engine) -> Signal:
        """A signal that fires when the replies are back (made when someone waits)."""
        if self.signal is None:
            self.signal = Signal()
            if self.done_at is not None:
                engine.fire_at(self.signal, self.done_at)
        return self.signal


class _Barrier:
    """All ``n`` participants arrive, then every one resumes ``latency`` later with the
    list of values they brought."""

    def __init__(self, engine: Engine, n: int, latency: float) -> None:
        self.engine, self.n, self.latency = engine, n, latency
        self._values: list[int] = [0] * n
        self._arrived = 0
        self._signal = Signal()

    def arrive(self, who: int, value: int = 0) -> Signal:
        signal = self._signal
        self._values[who] = value
        self._arrived += 1
        if self._arrived == self.n:
            self.engine.fire_at(signal, self.engine.now + self.latency, list(self._values))
            self._arrived = 0
            self._signal = Signal()
        return signal


def stage_pieces(
    chunks: Sequence[Chunk], stages: int, min_stage_tokens: int = 0
) -> list[list[tuple[int, int]]]:
    """The prompt pieces of each of at most ``stages`` near-equal token ranges of a batch
    (fewer under ``min_stage_tokens`` tokens per stage), cut as
    :meth:`afd_models.batch.PromptBatch.stages` cuts it: per stage, the ``(begin, end)``
    prompt positions of each chunk's part in it, in batch order."""
    total = sum(c.end - c.begin for c in chunks)
    stages = stage_count(total, stages, min_stage_tokens)
    bounds = sorted({(i * total) // stages for i in range(stages + 1)})
    out = []
    for lo_b, hi_b in itertools.pairwise(bounds):
        pieces = []
        offset = 0
        for c in chunks:
            length = c.end - c.begin
            lo, hi = max(lo_b, offset), min(hi_b, offset + length)
            if lo < hi:
                pieces.append((c.begin + lo - offset, c.begin + hi - offset))
            offset += length
        out.append(pieces)
    return out


def stage_split(
    chunks: Sequence[Chunk], stages: int, min_stage_tokens: int = 0
) -> list[tuple[float, float]]:
    """``(tokens, square)`` of each stage of :func:`stage_pieces`; ``square`` sums
    ``end**2 - begin**2`` over the prompt positions in the range."""
    return [
        (
            float(sum(p1 - p0 for p0, p1 in pieces)),
            float(sum(p1 * p1 - p0 * p0 for p0, p1 in pieces)),
        )
        for pieces in stage_pieces(chunks, stages, min_stage_tokens)
    ]


class Simulation:
    """One mode of one deployment on one workload (see the module docstring)."""

    def __init__(
        self,
        mode: str,
        setup: Setup,
        costs: CostModel,
        requests: Sequence[Request],
        pull: bool = False,
    ):
        """``requests`` as assigned over the mode's replicas, or with ``pull`` claimed from
        one shared pool while the mode runs (their ``replica`` ignored)."""
        self.mode = mode
        self.pool: RequestPool | None = ArrivalPool(requests) if pull else None
        self.setup = setup
        self.costs = costs
        cal = costs.cal
        self.comm = COMPUTE if cal.comm_uses_cores else DELAY
        self.requests = list(requests)
        world = setup.attention_ranks
        if mode == "colocated" and setup.colocated == "dp-ep":
            world = setup.attention_ranks + setup.ffn_ranks
        self.world = world
        # afd run launches the FFN processes in colocated dp too, but they receive nothing
        # all run long: their polls back off to the longest sleep (0.5 ms) and take next to
        # no processor, unlike FFN ranks waiting a few ms between items in the AFD modes
        # (what the fitted idle_load describes). Counting them charged colocated dp a
        # contention that the measurements do not show (docs/sim.md).
        processes = setup.attention_ranks + setup.ffn_ranks
        if mode == "colocated" and setup.colocated == "dp":
            processes = setup.attention_ranks
        self.engine = Engine(cal.cores, cal.idle_load, processes)
        self.records = [ReplicaRecord() for _ in range(world)]
        self.ffn = FFNFeatures()
        self.intervals: list[tuple[float, float, int, int, float]] = []
        self._ready: list[deque[_Item]] = [deque() for _ in range(world)]
        self._wakeup = Signal()
        self._waiting = 0
        """Items delivered to the FFN ranks and not yet taken."""
        self._barrier = _Barrier(self.engine, world, cal.barrier_s)

    def run(self) -> ModeRun:
        by_replica: list[list[Request]] = [[] for _ in range(self.world)]
        if self.pool is None:
            for q in self.requests:
                if not 0 <= q.replica < self.world:
                    raise ValueError(
                        f"request {q.request_id} is assigned to replica {q.replica}, not one "
                        f"of the mode's {self.world} (a pull workload needs pull=True)"
                    )
                by_replica[q.replica].append(q)
        lockstep = self.mode == "sync" or (
            self.mode == "colocated" and self.setup.colocated == "dp-ep"
        )
        for r in range(self.world):
            self.engine.spawn(self._replica(r, by_replica[r], lockstep))
        uses_ffn = self.mode in ("async", "sync")
        if uses_ffn:
            self.engine.spawn(self._ffn_server())
        self.engine.run()
        for record in self.records:
            record.finish()
        ffn_ranks = self.setup.ffn_ranks
        if self.mode == "colocated":
            intervals: list[list[tuple[float, float, int, int, float]]] = (
                [[] for _ in range(ffn_ranks)] if self.setup.colocated == "dp" else []
            )
        else:
            intervals = [self.intervals] * ffn_ranks  # identical ranks, one shared list
        requests = self.requests
        if self.pool is not None:  # the assignment the claims made
            served = served_by(self.mode, requests, self.records)
            requests = [
                dataclasses.replace(q, replica=r) for q, r in zip(requests, served, strict=True)
            ]
        return ModeRun(self.mode, self.records, intervals, self.ffn, requests)

    # attention replicas --------------------------------------------------------------
    def _replica(self, r: int, requests: list[Request], lockstep: bool) -> Process:
        rec = self.records[r]
        engine = self.engine
        queue = ChunkQueue(requests, self.setup.budget, self.pool)
        stages = self.setup.stages if self.mode == "async" else 1
        while True:
            now = engine.now
            queue.refill(now)
            if lockstep:
                done = queue.done
                chunks = [] if done else queue.next_step(now)
                size = -1 if done else sum(c.end - c.begin for c in chunks)
                sizes = yield (WAIT, self._barrier.arrive(r, size))
                rec.wait_s += engine.now - now
                if max(sizes) < 0:
                    return
                padded = max(1, *sizes)
                real = sum(max(0, s) for s in sizes)
            elif queue.done:
                return
            else:
                chunks = queue.next_step(now)
                padded = real = 0
                if not chunks:  # idle until the next arrival, here or in the pool
                    yield (DELAY, queue.next_arrival - now)
                    continue
            start = engine.now
            before = dataclasses.replace(rec.totals)
            if chunks:
                pieces = stage_split(chunks, stages, self.setup.min_stage_tokens)
            else:
                pieces = [(1.0, 1.0)]  # lockstep: a one-token dummy batch
                rec.dummy_batches += 1
            if self.mode == "colocated" and self.setup.colocated == "dp":
                waited = yield from self._monolithic_step(rec, pieces[0])
            elif self.mode == "colocated":
                waited = yield from self._expert_parallel_step(r, rec, pieces[0], padded, real)
            else:
                waited = yield from self._afd_step(r, rec, pieces, lockstep)
            end = engine.now
            rec.totals.step_s += end - start
            rec.busy_s += end - start - waited
            rec.wait_s += waited
            rec.batches.append((start, end, sum(c.end - c.begin for c in chunks)))
            tokens = sum(c.end - c.begin for c in chunks) if chunks else 1
            square = sum(c.end**2 - c.begin**2 for c in chunks) if chunks else 1
            rec.attention_steps.append(rec.totals.step_entry(before, tokens, square))
            for c in chunks:
                if c.final:
                    rec.done[c.request_id] = end

    def _attention(self, rec: ReplicaRecord, tokens: float, square: float, layer: int) -> Process:
        engine = self.engine
        cost = self.costs.attention_s(tokens, square, layer)
        t0 = engine.now
        yield (COMPUTE, cost, 1)
        rec.attention.add(tokens, square, cost, engine.now - t0)

    def _afd_step(
        self, r: int, rec: ReplicaRecord, pieces: list[tuple[float, float]], lockstep: bool
    ) -> Part:
        """One step through every layer (the stage schedule); returns seconds waited
        (combine calls and barriers, as ``afd run`` counts them).

        A stage's combine, its next attention and its dispatch follow each other on the
        rank without a wait in between, so they are one piece of work for the engine (the
        same end time under processor sharing); its time is split among them in
        proportion to their costs for the breakdown."""
        engine, costs = self.engine, self.costs
        notify = costs.cal.notify_s
        waited = 0.0
        pending: list[_Item | None] = [None] * len(pieces)
        moe_layers = costs.shapes.moe
        host_barrier = lockstep and costs.cal.host_barrier
        # A host barrier's arrival for the next MoE layer (Calibration.host_barrier): the
        # host reaches it as soon as nothing blocks it -- after the last reply it waited
        # for -- having only launched the compute up to it, dense layers included.
        barrier: Signal | None = None
        for layer, moe in enumerate(moe_layers):
            for i, (tokens, square) in enumerate(pieces):
                item = pending[i]
                combine = 0.0
                if item is not None:
                    waited += yield from self._await_reply(rec, item)
                    combine = costs.combine_s(tokens)
                    pending[i] = None
                if host_barrier and barrier is None and any(moe_layers[layer:]):
                    barrier = self._barrier.arrive(r)
                work = costs.attention_s(tokens, square, layer)
                send = costs.dispatch_s(tokens) if moe and not lockstep else 0.0
                t0 = engine.now
                yield (COMPUTE, combine + work + send, 1)
                waited += self._account(rec, t0, combine, work, send, tokens, square)
                if not moe:
                    continue
                if lockstep:  # sync: the barrier (reached now, or earlier), the dispatch
                    t0 = engine.now
                    yield (WAIT, barrier or self._barrier.arrive(r))
                    barrier = None
                    rec.totals.barrier_s += engine.now - t0
                    waited += engine.now - t0
                    send = costs.dispatch_s(tokens)
                    t0 = engine.now
                    yield (self.comm, send, 1)
                    self._account(rec, t0, 0.0, 0.0, send, tokens, square)
                rec.totals.layers += 1
                item = _Item(r, layer, tokens)
                engine.at(engine.now + notify, self._deliver, item)
                pending[i] = item
        for i, (tokens, _) in enumerate(pieces):
            item = pending[i]
            if item is not None:
                waited += yield from self._await_reply(rec, item)
                t0 = engine.now
                yield (self.comm, costs.combine_s(tokens), 1)
                rec.totals.combine_s += engine.now - t0
                waited += engine.now - t0
        return waited

    def _await_reply(self, rec: ReplicaRecord, item: _Item) -> Part:
        """Wait until every FFN rank's reply to ``item`` has arrived; the seconds waited."""
        engine = self.engine
        t0 = engine.now
        if item.done_at is None or item.done_at > t0:
            yield (WAIT, item.waiter(engine))
        rec.totals.combine_s += engine.now - t0
        return engine.now - t0

    def _account(
        self,
        rec: ReplicaRecord,
        t0: float,
        combine: float,
        work: float,
        send: float,
        tokens: float,
        square: float,
    ) -> float:
        """Split one piece of work's elapsed time among combine, attention and dispatch
        in proportion to their costs; the combine's share."""
        elapsed = self.engine.now - t0
        total = combine + work + send
        stretch = elapsed / total if total > 0 else 1.0
        rec.totals.combine_s += combine * stretch
        if work:
            rec.attention.add(tokens, square, work, work * stretch)
        if send:
            rec.totals.dispatch_s += send * stretch
            rec.dispatch.add(tokens, self.costs.dispatch_bytes(tokens), send, send * stretch)
        return combine * stretch

    def _monolithic_step(self, rec: ReplicaRecord, piece: tuple[float, float]) -> Part:
        tokens, square = piece
        for layer, moe in enumerate(self.costs.shapes.moe):
            yield from self._attention(rec, tokens, square, layer)
            if moe:
                yield (COMPUTE, self.costs.monolithic_moe_s(tokens), 1)
        return 0.0

    def _expert_parallel_step(
        self, r: int, rec: ReplicaRecord, piece: tuple[float, float], padded: int, real: int
    ) -> Part:
        engine, costs = self.engine, self.costs
        tokens, square = piece
        element = costs.shapes.dtype_bytes
        waited = 0.0
        for layer, moe in enumerate(costs.shapes.moe):
            yield from self._attention(rec, tokens, square, layer)
            if not moe:
                continue
            t0 = engine.now
            yield (WAIT, self._barrier.arrive(r))
            yield (self.comm, costs.collective_s(padded, self.world, element), 1)
            yield (COMPUTE, costs.expert_parallel_moe_s(real, self.world), 1)
            yield (WAIT, self._barrier.arrive(r))
            yield (self.comm, costs.collective_s(padded, self.world, 4), 1)  # fp32 partials
            elapsed = engine.now - t0
            rec.totals.dispatch_s += elapsed
            rec.totals.layers += 1
            waited += elapsed
        return waited

    # FFN ranks -------------------------------------------------------------------------
    def _deliver(self, item: _Item) -> None:
        self._ready[item.replica].append(item)
        self._waiting += 1
        self.engine.fire(self._wakeup)

    def _ffn_server(self) -> Process:
        """The F FFN ranks as one server (uniform routing makes them identical)."""
        engine, costs = self.engine, self.costs
        ready = self._ready
        world = self.world
        first = 0
        weight = self.setup.ffn_ranks
        notify = costs.cal.notify_s
        while True:
            if not self._waiting:
                self._wakeup = Signal()
                yield (WAIT, self._wakeup)
                continue
            chosen = first
            while not ready[chosen]:
                chosen = (chosen + 1) % world
            first = (chosen + 1) % world
            items = [ready[chosen].popleft()]
            layer = items[0].layer
            if self.setup.ffn_batch > 1:
                for k in range(world):
                    r = (first + k) % world
                    while (
                        ready[r]
                        and ready[r][0].layer == layer
                        and len(items) < self.setup.ffn_batch
                    ):
                        items.append(ready[r].popleft())
            self._waiting -= len(items)
            tokens = sum(i.tokens for i in items)
            cost = costs.ffn_s(tokens, len(items))
            taken = engine.now
            yield (COMPUTE, cost, weight)
            replied = engine.now
            rows = costs.ffn_rows(tokens)
            ffn = self.ffn
            ffn.serves += 1
            ffn.items += len(items)
            ffn.rows += rows
            ffn.touched += experts_touched(costs.local_experts, rows / costs.local_experts)
            ffn.nominal_s += cost
            ffn.elapsed_s += replied - taken
            for item in items:
                item.done_at = replied + notify
                if item.signal is not None:
                    engine.fire_at(item.signal, item.done_at)
                self.intervals.append((taken, replied, item.replica, item.layer, replied - taken))
