"""Workload generation, assignment and batching for `afd run`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from afd_tools.prefill.metrics import percentile
from afd_tools.prefill.workload import (
    PRESETS,
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
