"""`afd run --assign pull`: replicas claim requests from one shared pool per mode."""

from __future__ import annotations

import dataclasses
import gc
import json
import os
from pathlib import Path
from typing import Any

import pytest

from afd_tools.cli import main
from afd_tools.prefill.run_report import RunReport
from afd_tools.prefill.typed_json import ReportError
from afd_tools.prefill.workload import UNASSIGNED, WorkloadError
from afd_tools.run.api import RunResult, execute
from afd_tools.run.job import RunJob
from afd_tools.run.plan import prepare
from afd_tools.run.pull import Pulling, warm_shares
from afd_tools.sim.costs import SimError
from afd_tools.sim.measured import measured_run

SMALL = {"device": "cpu", "max_prompt_len": 48, "max_num_batched_tokens": 64, "no_progress": True}


def _semaphores() -> set[str]:
    """The named POSIX semaphores on this machine (multiprocessing's locks among them)."""
    return {name for name in os.listdir("/dev/shm") if name.startswith("sem.")}


@pytest.fixture(scope="module")
def pulled() -> tuple[RunResult, set[str]]:
    """Async, sync and colocated DP under Poisson arrivals, every rank warmed on its
    round-robin share first (--warm-pass on), and the semaphores left behind."""
    before = _semaphores()
    job = RunJob(**SMALL, requests=12, rate=300.0, assign="pull", warm_pass="on")
    result = execute(prepare(job))
    gc.collect()
    return result, _semaphores() - before


def _replica_of(values: list[dict[str, Any]], mode: str) -> dict[int, int]:
    """Request id -> the replica whose result finished it (each result read once)."""
    return {rid: r for r, value in enumerate(values) for rid in value[mode].done}


def test_every_request_is_served_once_per_mode_and_verifies(
    pulled: tuple[RunResult, set[str]],
) -> None:
    result, _ = pulled
    assert result.passed, result.verdict.fail_line()
    report = result.report
    assert [q.replica for q in report.requests] == [UNASSIGNED] * 12
    assert list(report.served_by) == ["async", "sync", "colocated"]
    ((modes, requests, values, _),) = result.outcomes  # colocated dp runs in the AFD launch
    ids = [q.request_id for q in requests]
    for mode in modes:
        finished = [rid for value in values for rid in value[mode].done]
        assert sorted(finished) == ids, mode  # each request once: none twice, none lost
        owner = _replica_of(values, mode)
        assert report.served_by[mode] == [owner[rid] for rid in ids], mode
        for replica, value in enumerate(values):  # what a replica stepped, it served
            stepped = {chunk[0] for step in value[mode].steps for chunk in step}
            assert stepped == {rid for rid, r in owner.items() if r == replica}, mode
        checked = result.verdict.checks[mode]
        assert sorted(checked) == ids, mode


def test_the_pools_release_their_semaphores(pulled: tuple[RunResult, set[str]]) -> None:
    _, left = pulled
    assert left == set()


def test_a_pull_report_round_trips_and_the_simulator_replays_each_modes_assignment(
    pulled: tuple[RunResult, set[str]],
) -> None:
    report = pulled[0].report
    again = RunReport.from_json(report.to_json(), "pull.json")
    assert again.served_by == report.served_by
    run = measured_run(again, "pull.json")
    for mode in report.modes:
        requests, policy = run.assignment(mode)
        assert policy is None
        assert [q.replica for q in requests] == report.served_by[mode]
    data = report.to_json()
    del data["served_by"]
    older = measured_run(RunReport.from_json(data, "old.json"), "old.json")
    with pytest.raises(SimError, match=r"old\.json: an --assign pull run's mode async .*served_by"):
        older.assignment("async")
    data["served_by"] = {"async": [0] * 11}
    with pytest.raises(ReportError, match=r"'served_by\.async' must give a replica .* 12 requests"):
        RunReport.from_json(data, "bad.json")


@pytest.mark.parametrize("colocated", ["dp-ep", "mono"])
def test_the_colocated_launches_pull_too(colocated: str) -> None:
    """dp-ep: its A+F ranks share one pool; mono: its one process takes every request."""
    job = RunJob(
        **SMALL, requests=8, rate=300.0, assign="pull", colocated=colocated, modes=("colocated",)
    )
    result = execute(prepare(job))
    assert result.passed, result.verdict.fail_line()
    ((_, requests, values, _),) = result.outcomes
    ranks = 4 if colocated == "dp-ep" else 1
    assert len(values) == ranks
    owner = _replica_of(values, "colocated")
    assert sorted(owner) == [q.request_id for q in requests]
    assert result.report.served_by["colocated"] == [owner[q.request_id] for q in requests]


def test_warm_shares_and_cursors() -> None:
    """The warm-up share is round-robin in arrival order; a pool claims in arrival order
    through the shared cursor, once."""
    job = RunJob(**SMALL, requests=5, rate=10.0, assign="pull")
    plan = prepare(job)
    shares = warm_shares(plan.requests, 2)
    ordered = sorted(shares, key=lambda q: (q.arrival, q.request_id))
    assert [q.replica for q in ordered] == [0, 1, 0, 1, 0]
    pulling = Pulling.over(plan.requests, ["async", "sync"])
    first, second = pulling.pool("async"), pulling.pool("async")  # two replicas' views
    assert first.claim(ordered[0].arrival) == dataclasses.replace(ordered[0], replica=UNASSIGNED)
    assert second.claim(ordered[0].arrival) is None  # claimed by the other replica
    assert second.claim(ordered[1].arrival) == plan.requests[ordered[1].request_id]
    assert pulling.pool("sync").claim(ordered[0].arrival) is not None  # each mode its own


def test_an_unknown_policy_is_the_usual_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(WorkloadError, match=r"--assign random: choose one of .*least-tokens, pull"):
        RunJob(assign="random")
    with pytest.raises(SystemExit):
        main(["run", "--device", "cpu", "--assign", "random"])
    assert "invalid choice: 'random'" in capsys.readouterr().err


def test_pull_runs_from_the_command_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    report = tmp_path / "pull.json"
    argv = ["run", "--device", "cpu", "--requests", "6", "--max-prompt-len", "32",
            "--max-num-batched-tokens", "32", "--no-progress", "--mode", "sync", "--assign",
            "pull", "--json", str(report)]  # fmt: skip
    assert main(argv) == 0
    assert "PASS" in capsys.readouterr().out
    data = RunReport.from_json(json.loads(report.read_text()), str(report))
    assert sorted(data.served_by) == ["sync"]
