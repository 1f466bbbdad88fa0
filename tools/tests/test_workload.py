"""Workload generation, assignment and batching for `afd run`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from afd_tools.run.metrics import percentile
from afd_tools.run.workload import (
    PRESETS,
    Request,
    WorkloadError,
    arrival_times,
    assign,
    batches,
    prompt_lengths,
    read_lengths,
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


def test_jsonl_lengths_and_their_errors(tmp_path: Path) -> None:
    good = tmp_path / "w.jsonl"
    good.write_text(json.dumps({"prompt_len": 5}) + "\n\n" + json.dumps({"prompt_tokens": [1, 2]}))
    assert read_lengths(good, 64) == [5, 2]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt_len": 5}\n{"len": 3}\n')
    with pytest.raises(WorkloadError, match=r"bad\.jsonl:2: expected a JSON object"):
        read_lengths(bad, 64)
    long = tmp_path / "long.jsonl"
    long.write_text('{"prompt_len": 65}\n')
    with pytest.raises(WorkloadError, match="65 tokens is outside"):
        read_lengths(long, 64)
    with pytest.raises(WorkloadError, match="cannot read"):
        read_lengths(tmp_path / "missing.jsonl", 64)


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


def test_batches_are_fcfs_within_the_token_budget() -> None:
    requests = [Request(i, n, float(i)) for i, n in enumerate([30, 30, 50, 10, 90])]
    got = [[r.request_id for r in b] for b in batches(requests, 100)]
    assert got == [[0, 1], [2, 3], [4]]
    with pytest.raises(WorkloadError, match="request 0 has 101 prompt tokens"):
        batches([Request(0, 101, 0.0)], 100)


@given(st.lists(st.floats(0, 1e6), min_size=1, max_size=300), st.sampled_from([50, 90, 99]))
def test_percentile_is_the_nearest_rank(values, q) -> None:
    got = percentile(values, q)
    ordered = sorted(values)
    import math

    assert got == ordered[max(0, math.ceil(q / 100 * len(values)) - 1)]
