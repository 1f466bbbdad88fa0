"""The attention replica's pieces on their own, without processes or a transport: the
first-come-first-served loop (its lockstep of batch sizes and dummy batches, its end, its
busy/wait accounting), the modes' steps, and the endpoint wrappers over the one
forwarding base."""

from __future__ import annotations

import multiprocessing
import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from afd_models import KVCache, PromptChunk
from afd_protocol import SharedPlacement
from afd_tools.prefill.layer_times import LayerTimes
from afd_tools.prefill.workload import Request
from afd_tools.run.breakdown import Clock, TimedEndpoint
from afd_tools.run.expert_parallel import ExpertParallelEndpoint
from afd_tools.run.forwarding import DispatchCall, ForwardingEndpoint
from afd_tools.run.lockstep import LockstepEndpoint
from afd_tools.run.pull import Pulling
from afd_tools.run.replica import (
    AsyncMode,
    ChunkLoop,
    ColocatedMode,
    ExpertParallelMode,
    ModeResult,
    ReplicaMode,
    ReplicaSetup,
    SyncMode,
    replica_mode,
)
from afd_tools.run.routing import RoutingLog
from afd_tools.run.staging import StagedAttentionEndpoint

K = 2
"""Experts per token in the fake routing."""


class ScriptedSizes:
    """The other replica of a lockstep of two: its batch size at each step is scripted;
    records what this replica sent."""

    def __init__(self, others: list[int], seconds: float = 0.0) -> None:
        self.others = list(others)
        self.seconds = seconds
        self.sent: list[int] = []

    def exchange(self, value: int, timeout: float, what: str) -> list[int]:
        assert what == "step start"
        self.sent.append(value)
        time.sleep(self.seconds)  # waiting for the other replica
        return [value, self.others.pop(0)]


class FakeStep:
    """A step that records its calls and routes every token like a one-MoE-layer model; the
    final hidden state of a row is its chunk's last token id."""

    def __init__(self, log: RoutingLog, waited: float = 0.0, seconds: float = 0.0) -> None:
        self.log = log
        self.waited = waited
        self.seconds = seconds
        self.calls: list[tuple[list[Any], int]] = []

    def __call__(self, entries: list[Any], rows: int, cache: KVCache) -> tuple[Any, float]:
        self.calls.append((entries, rows))
        tokens = sum(len(_tokens(e)) for e in entries)
        self.log(0, SimpleNamespace(ids=torch.zeros(tokens, K, dtype=torch.long)))  # type: ignore[arg-type]
        time.sleep(self.seconds)
        last = torch.tensor([[float(_tokens(e)[-1])] for e in entries])
        return SimpleNamespace(last_hidden_states=lambda: last), self.waited


def _tokens(entry: Any) -> torch.Tensor:
    return entry.tokens if isinstance(entry, PromptChunk) else entry


def _loop(requests: list[Request], max_tokens: int) -> tuple[ChunkLoop, Any]:
    reader, writer = multiprocessing.Pipe(duplex=False)
    prompts = {r.request_id: torch.arange(r.prompt_len) + 100 * r.request_id for r in requests}
    loop = ChunkLoop(requests, max_tokens, prompts, RoutingLog((0,)), writer, "test replica", 5.0)
    return loop, reader


def _finished(reader: Any) -> int:
    count = 0
    while reader.poll(0):
        assert reader.recv_bytes() == b"1"
        count += 1
    return count


def test_a_replica_out_of_work_joins_the_others_steps_with_dummy_batches() -> None:
    """One request of 6 tokens at a budget of 4: two real steps (4, then the final 2),
    then two steps of the other replica's that this one joins with a one-token dummy,
    and the loop ends once both said -1; the exchanges count as waiting, not as busy."""
    loop, reader = _loop([Request(0, 6, 0.0)], max_tokens=4)
    sizes = ScriptedSizes([3, 3, 3, 3, -1], seconds=0.02)
    step = FakeStep(loop.log)
    result = loop.run(step, sizes)
    assert sizes.sent == [4, 2, -1, -1, -1]
    assert [rows for _, rows in step.calls] == [4, 3, 3, 3]  # the step's largest batch
    dummies = [entries for entries, _ in step.calls[2:]]
    assert all(len(e) == 1 and torch.equal(e[0], torch.zeros(1, dtype=torch.long)) for e in dummies)
    assert result.dummy_batches == 2
    assert [tokens for _, _, tokens in result.batches] == [4, 2, 0, 0]
    assert result.steps == [[(0, 0, 4, False)], [(0, 4, 6, True)]]  # real steps only
    assert [r.shape for r in result.routing] == [(1, 4, K), (1, 2, K)]
    assert list(result.done) == [0]
    assert result.done[0] == result.batches[1][1]
    assert result.last_hidden[0].item() == 5.0  # request 0's last token id (100 * 0 + 5)
    assert _finished(reader) == 1
    assert result.wait_s >= 5 * 0.02
    assert result.busy_s == pytest.approx(sum(end - start for start, end, _ in result.batches))


def test_a_lockstepped_loop_runs_until_every_replica_is_done() -> None:
    """Nothing here at all: the loop still joins every step of the other replica's (one
    dummy each) and only ends when it has nothing left either."""
    loop, _ = _loop([], max_tokens=4)
    sizes = ScriptedSizes([1, 7, -1])
    step = FakeStep(loop.log)
    result = loop.run(step, sizes)
    assert (sizes.sent, result.dummy_batches, result.steps) == ([-1, -1, -1], 2, [])
    assert [rows for _, rows in step.calls] == [1, 7]
    assert not sizes.others


def test_a_free_running_loop_ends_when_its_queue_is_empty_and_waits_for_arrivals() -> None:
    """Without a lockstep: no dummy batches, the idle replica sleeps until the second
    request arrives, and busy / wait split every step's time by what the step waited."""
    loop, reader = _loop([Request(0, 3, 0.0), Request(1, 2, 0.15)], max_tokens=8)
    step = FakeStep(loop.log, waited=0.004, seconds=0.01)
    result = loop.run(step)
    assert result.dummy_batches == 0
    assert result.steps == [[(0, 0, 3, True)], [(1, 0, 2, True)]]
    assert [rows for _, rows in step.calls] == [0, 0]
    assert result.batches[1][0] >= 0.15  # not before its arrival
    spans = sum(end - start for start, end, _ in result.batches)
    assert result.busy_s == pytest.approx(spans - 2 * 0.004)
    assert result.wait_s == pytest.approx(2 * 0.004)
    assert result.last_hidden[1].item() == 101.0
    assert _finished(reader) == 2


def test_a_pulling_loop_claims_at_each_step_start_and_sleeps_until_the_pool_s_next_arrival() -> (
    None
):
    """Under pull the loop ignores its own requests (its warm-up share) and claims from the
    pool: at 0 the two arrived requests (3 + 4 tokens, the second claimed with 3 < 4 queued),
    a step of 4 and then the rest; idle, it sleeps until the third arrives at 0.15."""
    pool_requests = [Request(0, 3, 0.0), Request(1, 4, 0.0), Request(2, 2, 0.15)]
    loop, reader = _loop([Request(9, 5, 0.0)], max_tokens=4)
    loop.prompts.update({r.request_id: torch.arange(r.prompt_len) + 100 * r.request_id
                         for r in pool_requests})  # fmt: skip
    pool = Pulling.over(pool_requests, ["async"]).pool("async")
    result = loop.run(FakeStep(loop.log), pool=pool)
    assert result.steps == [
        [(0, 0, 3, True), (1, 0, 1, False)],
        [(1, 1, 4, True)],
        [(2, 0, 2, True)],
    ]
    assert result.batches[2][0] >= 0.15  # not before its arrival
    assert sorted(result.done) == [0, 1, 2]  # never its own request 9
    assert pool.exhausted
    assert _finished(reader) == 3


def test_a_lockstepped_pulling_loop_is_done_only_once_the_pool_is_empty() -> None:
    """Stepping together with the pool not yet exhausted (its request arrives at 0.1), the
    replica joins with dummy batches (size 0) rather than saying -1; it claims the request
    once it arrives and says -1 only after it is prefilled."""
    loop, _ = _loop([], max_tokens=4)
    loop.prompts[0] = torch.arange(2)
    pool = Pulling.over([Request(0, 2, 0.1)], ["sync"]).pool("sync")
    sizes = ScriptedSizes([0] * 200 + [-1] * 3, seconds=0.005)
    result = loop.run(FakeStep(loop.log), sizes, pool=pool)
    real = [size for size in sizes.sent if size > 0]
    assert real == [2]
    assert sizes.sent[: sizes.sent.index(2)] == [0] * sizes.sent.index(2)  # waiting, not done
    assert all(size == -1 for size in sizes.sent[sizes.sent.index(2) + 1 :])
    assert result.steps == [[(0, 0, 2, True)]]


@pytest.mark.parametrize("lockstepped", [False, True])
def test_a_warm_pass_prefills_every_request_untimed_uncounted_and_without_waiting(
    lockstepped: bool,
) -> None:
    """ReplicaSetup.warm_pass_of: every token of every request goes through the mode's step
    once, arrivals are ignored (the second request arrives after 30 s), nothing is counted
    as finished, the timed totals start afresh, and the lockstep is used as the mode does."""
    loop, reader = _loop([Request(0, 5, 0.0), Request(1, 9, 30.0)], max_tokens=8)
    step = FakeStep(loop.log)
    lockstep = SlowBarrier(0.0)
    timed = SimpleNamespace(totals="a previous pass's")
    setup = SimpleNamespace(
        loop=loop, lockstep=lockstep, run_timeout=5.0, timed=timed, device=torch.device("cpu")
    )
    sizes: list[Any] = []
    quiet_loop: list[Any] = []
    original = ChunkLoop.run

    def spy(self: ChunkLoop, step_fn: Any, steps_together: Any = None) -> Any:
        quiet_loop.append(self)
        sizes.append(steps_together)
        return original(self, step_fn, None)

    mode = SimpleNamespace(step=step, lockstepped=lockstepped)
    started = time.monotonic()
    ChunkLoop.run = spy  # type: ignore[method-assign]
    try:
        ReplicaSetup.warm_pass_of(setup, mode)  # type: ignore[arg-type]
    finally:
        ChunkLoop.run = original  # type: ignore[method-assign]
    assert time.monotonic() - started < 5.0
    seen = sorted(int(t) for entries, _ in step.calls for e in entries for t in _tokens(e))
    assert seen == sorted([*range(5), *range(100, 109)])
    assert _finished(reader) == 0
    assert lockstep.barriers == ["start of the warm-up pass"]
    assert sizes == [lockstep if lockstepped else None]
    assert isinstance(timed.totals, LayerTimes)
    assert quiet_loop[0] is not loop
    assert loop.report  # the real loop still counts


class RecordingEndpoint:
    """The innermost attention endpoint: records every dispatch and combine."""

    rank = 0
    dtype = torch.float32
    in_flight = 0

    def __init__(self) -> None:
        self.dispatched: list[tuple[Any, ...]] = []

    def dispatch(self, *args: Any) -> str:
        self.dispatched.append(args)
        return f"handle {len(self.dispatched)}"

    def combine(self, handle: str, timeout: float | None = None) -> torch.Tensor:
        return torch.ones(2, 3)


class SlowBarrier:
    """A lockstep whose every barrier takes ``seconds``."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.barriers: list[str] = []

    def barrier(self, timeout: float, what: str) -> None:
        self.barriers.append(what)
        time.sleep(self.seconds)


def _dispatch_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.randn(2, 3), torch.zeros(2, K, dtype=torch.long), torch.ones(2, K)


def test_every_wrapper_passes_the_dispatch_on_unchanged_through_the_forwarding_base() -> None:
    inner = RecordingEndpoint()
    barrier = SlowBarrier(0.0)
    staged = StagedAttentionEndpoint(inner, torch.device("cpu"), torch.device("cpu"))  # type: ignore[arg-type]
    timed = TimedEndpoint(staged, Clock(torch.device("cpu")))
    outer = LockstepEndpoint(timed, barrier, 1.0)  # type: ignore[arg-type]
    for wrapper in (staged, timed, outer):
        assert isinstance(wrapper, ForwardingEndpoint)
        assert "dispatch" not in type(wrapper).__dict__  # only forward_dispatch is changed
    hidden, ids, weights = _dispatch_inputs()
    handle = outer.dispatch(3, hidden, ids, weights, 1)
    assert handle == "handle 1"
    (args,) = inner.dispatched
    assert args[0] == 3
    assert args[4] == 1
    assert all(torch.equal(a, b) for a, b in zip(args[1:4], (hidden, ids, weights), strict=True))
    assert barrier.barriers == ["lockstep before layer 3"]
    timed.end_step()
    assert timed.totals.layers == 1
    call = DispatchCall(5, hidden, ids, weights)
    assert call.to(torch.device("cpu")).on(inner) == "handle 2"
    assert inner.dispatched[1][0] == 5


class FakeModel:
    """An attention model with one MoE layer dispatched twice per forward (two stages'
    worth), whose combines waited ``combine_wait_s``."""

    def __init__(self, combine_wait_s: float) -> None:
        self.stats = SimpleNamespace(combine_wait_s=combine_wait_s)
        self.calls: list[dict[str, Any]] = []
        self.shared_placement = SharedPlacement.FFN

    def forward(self, entries: list[Any], endpoint: Any, **options: Any) -> str:
        self.calls.append({"endpoint": endpoint, **options})
        for _ in range(2):
            endpoint.combine(endpoint.dispatch(0, *_dispatch_inputs()))
        return "output"


def _setup(barrier_s: float = 0.0, combine_wait_s: float = 0.0, **more: Any) -> Any:
    timed = TimedEndpoint(RecordingEndpoint(), Clock(torch.device("cpu")))  # type: ignore[arg-type]
    barriers = LockstepEndpoint(timed, SlowBarrier(barrier_s), 1.0)  # type: ignore[arg-type]
    fields = {
        "model": FakeModel(combine_wait_s),
        "timed": timed,
        "barriers": barriers,
        "loop": SimpleNamespace(log="the log", exchanges="the exchange log"),
        "num_stages": 2,
        "min_stage_tokens": 0,
        "expert_parallel": None,
        "pulling": None,
    }
    return SimpleNamespace(**(fields | more))


def test_a_sync_step_waits_at_every_dispatch_and_counts_the_barriers_as_waiting() -> None:
    setup = _setup(barrier_s=0.02, combine_wait_s=0.003)
    setup.barriers.wait_s = 99.0  # a previous step's: reset by this one
    setup.timed.totals = LayerTimes()
    output, waited = SyncMode(setup).step(["entry"], 1, KVCache())
    assert output == "output"
    (call,) = setup.model.calls
    assert call["endpoint"] is setup.barriers
    assert call["num_stages"] == 1
    assert call["select"] == "the log"
    assert call["observe"] == "the exchange log"
    assert call["compute_logits"] is False
    assert setup.barriers.lockstep.barriers == ["lockstep before layer 0"] * 2
    assert setup.barriers.wait_s >= 0.04
    assert waited == pytest.approx(0.003 + setup.barriers.wait_s)
    # the breakdown marks each wait on the step's clock, just around the host's own timing
    assert setup.barriers.wait_s <= setup.timed.totals.barrier_s <= setup.barriers.wait_s + 0.01
    assert setup.timed.totals.layers == 2
    assert setup.timed.totals.step_s >= 0.04


def test_an_async_step_runs_its_stages_over_the_timed_endpoint_without_barriers() -> None:
    setup = _setup(combine_wait_s=0.003, min_stage_tokens=512)
    output, waited = AsyncMode(setup).step(["entry"], 0, KVCache())
    (call,) = setup.model.calls
    assert call["endpoint"] is setup.timed
    assert call["num_stages"] == 2
    assert call["min_stage_tokens"] == 512
    assert (output, waited) == ("output", 0.003)
    assert setup.barriers.lockstep.barriers == []
    assert setup.timed.totals.barrier_s == 0.0
    assert setup.timed.totals.layers == 2


def test_modes_are_chosen_by_name_and_by_the_connection() -> None:
    setup = _setup()
    assert [type(replica_mode(m, setup)) for m in ("async", "sync", "colocated")] == [
        AsyncMode,
        SyncMode,
        ColocatedMode,
    ]
    assert [m.lockstepped for m in (AsyncMode, SyncMode, ColocatedMode, ExpertParallelMode)] == [
        False,
        True,
        False,
        True,
    ]
    with pytest.raises(ValueError, match="unknown mode 'fast'"):
        replica_mode("fast", setup)
    ep = _setup(expert_parallel=object.__new__(ExpertParallelEndpoint))
    assert type(replica_mode("colocated", ep)) is ExpertParallelMode
    with pytest.raises(ValueError, match="only the colocated mode, not 'sync'"):
        replica_mode("sync", ep)


class RecordingLoop:
    """A loop that records how a mode ran it."""

    def __init__(self) -> None:
        self.sizes: list[Any] = []
        self.exchanges: list[bool] = []
        self.pools: list[Any] = []

    def run(self, step: Any, sizes: Any = None, exchanges: bool = False, pool: Any = None) -> Any:
        self.sizes.append(sizes)
        self.exchanges.append(exchanges)
        self.pools.append(pool)
        return SimpleNamespace(layer_times={})


@pytest.mark.parametrize("mode", [AsyncMode, SyncMode])
def test_a_mode_starts_with_every_replica_and_steps_together_only_when_lockstepped(
    mode: type[ReplicaMode],
) -> None:
    lockstep = SlowBarrier(0.0)
    setup = _setup(loop=RecordingLoop(), lockstep=lockstep, run_timeout=7.0)
    setup.timed.totals.layers = 5  # a previous mode's: reset at the start
    result = mode(setup).run()
    assert lockstep.barriers == [f"start of mode {mode.name}"]
    assert setup.loop.sizes == [lockstep if mode.lockstepped else None]
    assert setup.loop.exchanges == [True]  # both modes exchange: every step records it
    assert setup.loop.pools == [None]  # its own requests, no pool
    assert result.exchange_includes_shared  # the fake model's shared experts are on the FFN
    assert setup.timed.totals.layers == 0
    assert result.layer_times == {}


def test_under_pull_a_mode_claims_from_its_own_pool() -> None:
    requests = [Request(0, 5, 0.0), Request(1, 3, 0.0)]
    pulling = Pulling.over(requests, ["async", "sync"])
    setup = _setup(loop=RecordingLoop(), lockstep=SlowBarrier(0.0), run_timeout=7.0)
    setup.pulling = pulling
    for mode in (AsyncMode, SyncMode):
        mode(setup).run()
    first, second = setup.loop.pools
    assert first.cursor is pulling.cursors["async"]
    assert second.cursor is pulling.cursors["sync"]
    assert first.requests == second.requests == tuple(requests)


def test_warm_up_runs_the_small_batch_and_on_a_gpu_the_largest_step_of_real_prompts() -> None:
    requests = [Request(i, n, 0.0) for i, n in enumerate([5, 9, 30])]
    loop, _ = _loop(requests, max_tokens=16)

    small, largest = loop.warm_up_batches(largest_step=True)
    assert [t.tolist() for t in small] == [[0, 0, 0, 0]]
    # The first requests' own tokens, whole, until the step's budget: 5 + 9 + 2 of the third.
    assert [t.tolist() for t in largest] == [
        list(range(5)),
        list(range(100, 109)),
        [200, 201],
    ]
    assert [[t.tolist() for t in b] for b in loop.warm_up_batches(largest_step=False)] == [
        [[0, 0, 0, 0]]
    ]


def test_warm_up_batches_are_as_many_on_a_replica_without_requests() -> None:
    """Ranks that step together (colocated DP+EP) must run as many warm-up batches."""
    empty, _ = _loop([], max_tokens=3)
    busy, _ = _loop([Request(0, 8, 0.0)], max_tokens=3)
    assert len(empty.warm_up_batches(True)) == len(busy.warm_up_batches(True)) == 2
    assert [[t.tolist() for t in b] for b in empty.warm_up_batches(True)] == [[[0, 0, 0]], [[0]]]
    assert [t.tolist() for t in busy.warm_up_batches(True)[1]] == [[0, 1, 2]]


class DeviceMark:
    """A mark on a scripted device timeline (what a CUDA event is to :class:`Clock`)."""

    def __init__(self, t: float) -> None:
        self.t = t

    def synchronize(self) -> None:
        pass


class ScriptedDeviceClock(Clock):
    """A GPU's clock whose marks are read off a script: each mark is the next time."""

    def __init__(self, times: list[float]) -> None:
        self.cuda = True
        self._times = iter(times)

    def mark(self) -> Any:
        return DeviceMark(next(self._times))

    def seconds(self, start: Any, end: Any) -> float:
        return float(end.t - start.t)


DEVICE_STEPS = {
    # step start, then per dispatch (dispatch start, end, combine start, end), step end
    AsyncMode: [0.0, 1.0, 1.0625, 2.0, 2.125, 3.0, 3.0625, 4.0, 4.25, 5.0],
    # sync: each dispatch after a barrier (start, end) the device sat idle through briefly
    SyncMode: [0.0, 0.5, 0.5625, 1.0, 1.0625, 2.0, 2.125, 2.5, 2.75, 3.0, 3.0625, 4.0, 4.25, 5.0],
}
"""A scripted device timeline per mode: the two combines span 0.125 + 0.25 s, sync's two
barriers 0.0625 + 0.25 s."""


@pytest.mark.parametrize("mode", [AsyncMode, SyncMode])
def test_on_a_gpu_a_step_waits_for_its_combines_and_barriers_on_the_device_not_the_host(
    mode: type[ReplicaMode],
) -> None:
    """The host spent 0.5 s in each step's combines and 0.05 s at each barrier (its own
    queued compute still running meanwhile); the device's timeline says how long it
    waited: 0.375 s in combines, and in sync 0.3125 s at the barriers."""
    setup = _setup(combine_wait_s=0.5, barrier_s=0.05)
    setup.timed.clock = ScriptedDeviceClock(DEVICE_STEPS[mode])
    setup.timed.totals = LayerTimes()
    _, waited = mode(setup).step(["entry"], 1, KVCache())
    barriers = 0.0625 + 0.25 if mode is SyncMode else 0.0
    assert waited == pytest.approx(0.125 + 0.25 + barriers)
    assert setup.timed.totals.combine_s == pytest.approx(0.375)
    assert setup.timed.totals.barrier_s == pytest.approx(barriers)
    assert setup.timed.totals.step_s == pytest.approx(5.0)
    if mode is SyncMode:
        assert setup.barriers.wait_s >= 0.1  # the host's 2 x 0.05 s, not what counts


def test_on_a_cpu_a_step_waits_for_the_hosts_seconds_in_combine() -> None:
    setup = _setup(combine_wait_s=0.5)
    _, waited = AsyncMode(setup).step(["entry"], 0, KVCache())
    assert waited == 0.5  # the host's clock is the CPU's timeline


def test_run_phases_split_a_launch_at_its_first_mode_start_and_last_request_end() -> None:
    """Two replicas, two modes: start-up runs to the earliest mode start, the modes to the
    latest request end (origin + done), the stop to the launch's end; a launch whose
    replicas ran no mode is all start-up."""
    from afd_tools.run.api import RunPhases

    def result(origin: float, done: dict[int, float]) -> ModeResult:
        return ModeResult(origin=origin, done=done)

    values = [
        {"async": result(10.0, {0: 1.0}), "sync": result(12.0, {0: 0.5, 1: 2.5})},
        {"async": result(10.5, {2: 1.0}), "sync": result(12.0, {})},
    ]
    phases = RunPhases()
    phases.add_launch(7.0, (["async", "sync"], [], values, []), 15.0)
    assert (phases.start_s, phases.modes_s, phases.stop_s) == (3.0, 4.5, 0.5)
    phases.add_launch(20.0, (["async"], [], [{}], []), 21.5)
    assert phases.start_s == 4.5
    phases.verification_s = 2.25
    assert phases.describe() == (
        "start-up and warm-up 4.5 s, modes 4.5 s, stop 0.5 s, verification 2.2 s"
    )
    # the verification's parts follow its total, where it timed any
    phases.verification.seconds = {"replays": 1.0, "twin": 0.75, "confirmations": 0.25}
    phases.verification.counts = {"replays": 2, "twin": 1, "confirmations": 1}
    assert phases.describe() == (
        "start-up and warm-up 4.5 s, modes 4.5 s, stop 0.5 s, verification 2.2 s [2 replays "
        "1.0 s, 1 confirming replay 0.2 s, float32 twin built 0.8 s]"
    )


def test_run_phases_split_the_start_up_where_the_replicas_marked_it() -> None:
    """Per launch, the mean over the replicas that marked it (every mode of a replica
    carries the same marks) of: launch to program start, model, warm-up."""
    from afd_tools.run.api import RunPhases

    def result(marks: tuple[float, float, float] | None) -> ModeResult:
        return ModeResult(origin=10.0, done={0: 1.0}, start_marks=marks)

    values = [
        {"async": result((8.0, 8.5, 9.5)), "sync": result((8.0, 8.5, 9.5))},
        {"async": result((9.0, 9.5, 9.75))},
        {"async": result(None)},  # a replica that recorded nothing is left out of the means
    ]
    phases = RunPhases()
    phases.add_launch(7.0, (["async", "sync"], [], values, []), 12.0)
    assert (phases.processes_s, phases.models_s, phases.warm_up_s) == (1.5, 0.5, 0.625)
    assert phases.describe() == (
        "start-up and warm-up 3.0 s [per replica: processes and transport 1.5 s, model 0.5 s, "
        "warm-up 0.6 s], modes 1.0 s, stop 1.0 s, verification 0.0 s"
    )
    phases.add_launch(20.0, (["async"], [], [{"async": result(None)}], []), 31.5)
    assert (phases.processes_s, phases.split_launches) == (1.5, 1)
