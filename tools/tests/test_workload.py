"""Workload generation, assignment and batching for `afd run`."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from afd_tools.prefill.metrics import percentile
from afd_tools.prefill.workload import (
    PRESETS,
    UNASSIGNED,
    ArrivalPool,
    ChunkQueue,
    Request,
    WorkloadError,
    arrival_times,
    assign,
    prompt_lengths,
    read_workload,
)


@given(st.sampled_from(PRESETS), st.integers(1, 200), st.integers(0, 10**6), st.integers(4, 4096))
def test_presets_stay_in_range_and_are_deterministic(preset, count, seed, max_len) -> None:
    lengths = prompt_lengths(preset, count, seed, max_len)
    assert len(lengths) == count
    assert all(4 <= n <= max_len for n in lengths)
    assert lengths == prompt_lengths(preset, count, seed, max_len)


def test_uneven_is_heavier_tailed_than_uniform() -> None:
    def skew(lengths: list[int]) -> float:  # share of the attention cost in the top 10 %
        squares = sorted((n * n for n in lengths), reverse=True)
        return sum(squares[: len(squares) // 10]) / sum(squares)

    assert skew(prompt_lengths("uneven", 400, 1, 1024)) > 2 * skew(
        prompt_lengths("uniform", 400, 1, 1024)
    )


def test_bad_options_are_clear_errors() -> None:
    with pytest.raises(WorkloadError, match="unknown workload 'zipf'"):
        prompt_lengths("zipf", 4, 0, 64)
    with pytest.raises(WorkloadError, match="--requests must be >= 1"):
        prompt_lengths("uniform", 0, 0, 64)
    with pytest.raises(WorkloadError, match="--rate must be a positive"):
        arrival_times(3, -1.0, 0)
    with pytest.raises(WorkloadError, match="unknown assignment"):
        assign([4], [0.0], 1, "random")


def test_jsonl_prompts_lengths_or_tokens(tmp_path: Path) -> None:
    good = tmp_path / "w.jsonl"
    good.write_text(json.dumps({"prompt_len": 5}) + "\n\n" + json.dumps({"prompt_tokens": [1, 2]}))
    assert read_workload(good, 64, 100) == [(5, None), (2, (1, 2))]


BAD_LINES = [
    ('{"len": 3}', "exactly one of prompt_len"),
    ('{"prompt_len": 3, "prompt_tokens": [1]}', "exactly one of prompt_len"),
    ("[3]", "exactly one of prompt_len"),
    ("{prompt_len: 3}", "not valid JSON"),
    ('{"prompt_len": Infinity}', r"prompt_len must be a whole number in \[1, 64\].*Infinity"),
    ('{"prompt_len": 1e30}', "prompt_len must be a whole number"),
    ('{"prompt_len": 10000000000000000000000}', "prompt_len must be a whole number"),
    ('{"prompt_len": 3.0}', "prompt_len must be a whole number"),
    ('{"prompt_len": true}', "prompt_len must be a whole number"),
    ('{"prompt_len": 0}', "prompt_len must be a whole number"),
    ('{"prompt_len": 65}', r"in \[1, 64\] \(the model's longest prompt\), got 65"),
    ('{"prompt_tokens": []}', "a list of 1 to 64 token ids, got 0 tokens"),
    ('{"prompt_tokens": "abc"}', "got str"),
    ('{"prompt_tokens": [1, 100]}', r"prompt_tokens\[1\] must be a token id in \[0, 100\)"),
    ('{"prompt_tokens": [1, -1]}', r"prompt_tokens\[1\]"),
    ('{"prompt_tokens": [1, 2.5]}', r"prompt_tokens\[1\]"),
]


@pytest.mark.parametrize(("line", "message"), BAD_LINES)
def test_every_bad_workload_line_is_one_error_naming_file_line_and_field(
    tmp_path: Path, line: str, message: str
) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt_len": 5}\n' + line + "\n")
    with pytest.raises(WorkloadError, match=r"bad\.jsonl:2: ") as caught:
        read_workload(bad, 64, 100)
    assert caught.match(message)


def test_unreadable_workload_files_are_one_clear_error(tmp_path: Path) -> None:
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(b'{"prompt_len": 5}\n{"prompt_len": 5} \xe9\n')
    with pytest.raises(WorkloadError, match=r"latin\.jsonl:2: not UTF-8 text"):
        read_workload(latin, 64, 100)
    with pytest.raises(WorkloadError, match="cannot read the workload file"):
        read_workload(tmp_path / "missing.jsonl", 64, 100)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(WorkloadError, match="holds no requests"):
        read_workload(empty, 64, 100)


def test_poisson_arrivals_increase_at_the_asked_rate() -> None:
    times = arrival_times(2000, 50.0, 3)
    assert times == sorted(times)
    assert 2000 / times[-1] == pytest.approx(50.0, rel=0.1)
    assert arrival_times(3, None, 0) == [0.0, 0.0, 0.0]


def test_assignment_policies() -> None:
    lengths = [100, 1, 1, 1, 50, 1]
    arrivals = [0.0] * 6
    rr = assign(lengths, arrivals, 2, "round-robin")
    assert [r.replica for r in rr] == [0, 1, 0, 1, 0, 1]
    least = assign(lengths, arrivals, 2, "least-tokens")
    load = [0, 0]
    for r in least:
        load[r.replica] += r.prompt_len
    assert load == [100, 54]  # everything after the long prompt goes to the idle replica


def test_steps_are_fcfs_within_the_budget_and_chunk_what_does_not_fit() -> None:
    requests = [Request(i, n, 0.0) for i, n in enumerate([30, 30, 50, 10, 250])]
    queue = ChunkQueue(requests, 100)
    steps = []
    while not queue.empty:
        steps.append([(c.request_id, c.begin, c.end, c.final) for c in queue.next_step(0.0)])
    assert steps == [
        [(0, 0, 30, True), (1, 0, 30, True), (2, 0, 40, False)],  # 2 does not fit: a chunk
        [(2, 40, 50, True), (3, 0, 10, True), (4, 0, 80, False)],  # its rest goes first
        [(4, 80, 180, False)],
        [(4, 180, 250, True)],
    ]


def test_steps_take_only_arrived_requests_and_a_budget_of_one_works() -> None:
    queue = ChunkQueue([Request(0, 3, 0.0), Request(1, 2, 5.0)], 1)
    assert [(c.request_id, c.begin) for c in queue.next_step(0.0)] == [(0, 0)]
    assert queue.next_step(0.0)[0].begin == 1
    assert queue.next_step(4.9)[0].final  # request 0 done; 1 has not arrived
    assert queue.next_step(4.9) == []
    assert queue.next_arrival == 5.0
    assert [c.request_id for c in queue.next_step(5.0)] == [1]
    with pytest.raises(WorkloadError, match="--max-num-batched-tokens must be >= 1, got 0"):
        ChunkQueue([], 0)


@given(
    st.lists(st.integers(1, 300), min_size=1, max_size=20),
    st.integers(1, 128),
)
def test_every_prompt_token_is_scheduled_once_in_order(lengths: list[int], budget: int) -> None:
    queue = ChunkQueue([Request(i, n, 0.0) for i, n in enumerate(lengths)], budget)
    covered = dict.fromkeys(range(len(lengths)), 0)
    while not queue.empty:
        step = queue.next_step(0.0)
        assert 0 < sum(c.end - c.begin for c in step) <= budget
        for chunk in step:
            assert chunk.begin == covered[chunk.request_id]  # in order, no gap, no overlap
            covered[chunk.request_id] = chunk.end
            assert chunk.final == (chunk.end == lengths[chunk.request_id])
    assert covered == dict(enumerate(lengths))


@given(st.lists(st.floats(0, 1e6), min_size=1, max_size=300), st.sampled_from([50, 90, 99]))
def test_percentile_is_the_nearest_rank(values, q) -> None:
    got = percentile(values, q)
    ordered = sorted(values)
    import math

    assert got == ordered[max(0, math.ceil(q / 100 * len(values)) - 1)]


# --assign pull: the shared pool and the refill rule -------------------------------------
def test_pull_leaves_every_request_unassigned() -> None:
    pulled = assign([5, 7, 3], [0.5, 0.0, 0.25], 2, "pull", [None, (1,) * 7, None])
    assert [r.replica for r in pulled] == [UNASSIGNED] * 3
    assert [(r.request_id, r.prompt_len, r.arrival) for r in pulled] == [
        (0, 5, 0.5),
        (1, 7, 0.0),
        (2, 3, 0.25),
    ]
    assert pulled[1].tokens == (1,) * 7


def test_a_pool_hands_out_arrived_requests_in_arrival_order_once() -> None:
    pool = ArrivalPool([Request(0, 4, 2.0), Request(1, 4, 1.0), Request(2, 4, 1.0)])
    assert pool.next_arrival == 1.0
    assert not pool.exhausted
    assert pool.claim(0.5) is None  # nothing has arrived
    assert [pool.claim(1.0), pool.claim(1.0)] == [Request(1, 4, 1.0), Request(2, 4, 1.0)]
    assert pool.claim(1.5) is None
    assert pool.next_arrival == 2.0
    assert pool.claim(2.0) == Request(0, 4, 2.0)
    assert pool.exhausted
    assert pool.next_arrival == math.inf
    assert pool.claim(9.0) is None


def test_refill_claims_only_while_the_next_step_has_room() -> None:
    # budget 10: a 12-token prompt fills the next step, so nothing more is claimed; once
    # its first chunk is scheduled, 2 tokens are left and the replica claims again.
    pool = ArrivalPool([Request(i, n, 0.0) for i, n in enumerate([12, 3, 3, 9])])
    queue = ChunkQueue([], 10, pool)
    assert [r.request_id for r in queue.refill(0.0)] == [0]
    assert queue.unscheduled == 12
    assert [(c.request_id, c.end) for c in queue.next_step(0.0)] == [(0, 10)]
    assert queue.unscheduled == 2
    assert [r.request_id for r in queue.refill(0.0)] == [1, 2, 3]  # 2 -> 5 -> 8 -> 17
    assert queue.unscheduled == 17
    assert pool.exhausted


_pull_requests = st.lists(
    st.tuples(st.integers(1, 40), st.sampled_from([0.0, 0.5, 1.0, 1.5, 3.0])),
    min_size=1,
    max_size=25,
)


@given(
    _pull_requests,
    st.integers(1, 32),
    st.integers(1, 4),
    st.lists(st.tuples(st.integers(0, 3), st.sampled_from([0.0, 0.25, 0.5, 1.0])), max_size=60),
)
def test_the_pull_rule_claims_each_request_once_in_arrival_order_and_only_with_room(
    drawn: list[tuple[int, float]],
    budget: int,
    replicas: int,
    schedule: list[tuple[int, float]],
) -> None:
    """Replicas start steps in the drawn order at non-decreasing times (then drain): each
    claims at its step start, by the pull rule, and runs the step. Checked against the
    rule itself: claims in global arrival order, never before the arrival, never while
    the replica's queued tokens already fill a step, and no arrived request is left
    unclaimed by a replica that had room; every request is claimed and every prompt token
    scheduled exactly once."""
    requests = assign([n for n, _ in drawn], [t for _, t in drawn], replicas, "pull")
    pool = ArrivalPool(requests)
    queues = [ChunkQueue([], budget, pool) for _ in range(replicas)]
    claims: list[Request] = []
    scheduled: dict[int, list[tuple[int, int]]] = {r.request_id: [] for r in requests}
    now = 0.0
    drain = [(r % replicas, math.inf) for r in range(replicas * (sum(n for n, _ in drawn) + 1))]
    for who, later in [*schedule, *drain]:
        now += later if later != math.inf else 0.0
        at = math.inf if later == math.inf else now
        queue = queues[who % replicas]
        room_before = queue.unscheduled < budget
        claimed = queue.refill(at)
        assert not claimed or room_before  # a full next step claims nothing
        for i, request in enumerate(claimed):
            assert request.arrival <= at
            if i:  # each claim but the first was made with room left
                assert queue.unscheduled - sum(r.prompt_len for r in claimed[i:]) < budget
        arrived_left = not pool.exhausted and pool.next_arrival <= at
        assert queue.unscheduled >= budget or not arrived_left  # claimed all it had room for
        claims += claimed
        for chunk in queue.next_step(at):
            scheduled[chunk.request_id].append((chunk.begin, chunk.end))
    assert claims == sorted(requests, key=lambda r: (r.arrival, r.request_id))
    assert pool.exhausted
    assert all(q.empty and q.unscheduled == 0 for q in queues)
    for request in requests:  # every token once, in order
        pieces = scheduled[request.request_id]
        assert [b for b, _ in pieces] == [0, *(e for _, e in pieces[:-1])]
        assert pieces[-1][1] == request.prompt_len
