"""`afd sim --assign pull`: replicas claim requests from one shared pool as they run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_sim import ONE_LAYER, _cal

from afd_tools.cli import main
from afd_tools.prefill.metrics import ReplicaTimes, served_by
from afd_tools.prefill.workload import Request, assign
from afd_tools.sim.modes import ModeRun
from afd_tools.sim.simulate import Deployment, deployment, simulate_mode, summary


def _dep(attention_ranks: int = 2, budget: int = 64, **cal: Any) -> Deployment:
    """A:1 over one MoE layer, round-number costs (test_sim's, no shared cores)."""
    return deployment(
        ONE_LAYER, _cal(**cal), attention_ranks=attention_ranks, ffn_ranks=1, budget=budget
    )


BURST = [64] + [8] * 8
"""One prompt that fills a step of 64 tokens, then eight short ones, all at once."""


def _assigned(run: ModeRun) -> list[int]:
    return [q.replica for q in sorted(run.requests, key=lambda q: q.request_id)]


@pytest.mark.parametrize("mode", ["async", "sync", "colocated"])
def test_a_burst_goes_to_the_replica_with_room(mode: str) -> None:
    """At 0 replica 0 starts first (engine order) and claims the long prompt, which fills
    its next step, so it claims nothing more; replica 1 claims the eight short ones (8,
    16, ..., 64 tokens: each claimed while under the budget). Round-robin gives replica 0
    the long prompt and four short ones, which wait a step behind it."""
    dep = _dep()
    requests = assign(BURST, [0.0] * len(BURST), 2, "pull")
    pulled = simulate_mode(dep, mode, requests, "pull")
    assert _assigned(pulled) == [0] + [1] * 8
    static = simulate_mode(
        dep, mode, assign(BURST, [0.0] * len(BURST), 2, "round-robin"), "round-robin"
    )
    assert _assigned(static) == [0, 1, 0, 1, 0, 1, 0, 1, 0]
    assert summary(pulled).ttft_p99 < summary(static).ttft_p99
    assert summary(pulled).makespan_s < summary(static).makespan_s
    # Every request once, by the replica the report says served it.
    for index, record in enumerate(pulled.replicas):
        assert sorted(record.done) == [q.request_id for q in pulled.requests if q.replica == index]


def test_colocated_dp_burst_by_hand() -> None:
    """Colocated DP: each replica alone, a step costs attention + the local experts. Pull:
    both replicas run one step of 64 tokens; round-robin: replica 0 runs 64 then 32."""
    dep = _dep()
    costs = dep.costs(shares=False)

    def step(tokens: int) -> float:
        return costs.attention_s(tokens, 0.0, 0) + costs.monolithic_moe_s(tokens)

    pulled = summary(simulate_mode(dep, "colocated", assign(BURST, [0.0] * 9, 2, "pull"), "pull"))
    static = summary(
        simulate_mode(dep, "colocated", assign(BURST, [0.0] * 9, 2, "round-robin"), "round-robin")
    )
    assert pulled.ttft_p99 == pytest.approx(step(64))
    assert pulled.ttft_s == pytest.approx([step(64)] * 9)
    assert static.ttft_p99 == pytest.approx(step(64) + step(32))


def test_colocated_dp_ep_pulls_over_its_a_plus_f_ranks() -> None:
    """dp-ep runs A+F ranks: three of them share the pool (no re-assignment first)."""
    dep = deployment(
        ONE_LAYER, _cal(), attention_ranks=2, ffn_ranks=1, budget=64, colocated="dp-ep"
    )
    run = simulate_mode(dep, "colocated", assign(BURST, [0.0] * 9, 2, "pull"), "pull")
    # rank 0 takes the long prompt; rank 1 the eight short ones (64 tokens); rank 2 none.
    assert _assigned(run) == [0] + [1] * 8
    assert len(run.replicas) == 3
    assert run.replicas[2].done == {}


_settings = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
_workload = st.lists(
    st.tuples(st.integers(1, 200), st.sampled_from([0.0, 0.5, 1.0, 2.0, 4.0, 8.0])),
    min_size=1,
    max_size=10,
)


def _solo_ends(dep: Deployment, mode: str, requests: list[Request]) -> list[float]:
    """Each request's end with the deployment to itself (on replica 0, nothing else
    running): no request can end sooner in company."""
    ends = []
    for q in requests:
        alone = Request(q.request_id, q.prompt_len, q.arrival, 0)
        run = simulate_mode(dep, mode, [alone], "round-robin")
        ends.append(run.replicas[0].done[q.request_id])
    return ends


@_settings
@given(_workload, st.sampled_from([16, 64, 256]))
def test_pull_lies_between_the_pool_less_extremes_in_colocated_dp(
    drawn: list[tuple[int, float]], budget: int
) -> None:
    """Colocated DP at two replicas under arrivals: every request ends no sooner than it
    would alone, and the makespan is no worse than one replica serving everything (what
    pull degenerates to if the second replica never claimed)."""
    dep = _dep(budget=budget)
    lengths, arrivals = [n for n, _ in drawn], [t for _, t in drawn]
    requests = assign(lengths, arrivals, 2, "pull")
    run = simulate_mode(dep, "colocated", requests, "pull")
    done = {rid: t for record in run.replicas for rid, t in record.done.items()}
    alone = _solo_ends(dep, "colocated", requests)
    for q, solo in zip(requests, alone, strict=True):
        assert done[q.request_id] >= solo * (1 - 1e-9)
    one = [Request(q.request_id, q.prompt_len, q.arrival, 0) for q in requests]
    serial = summary(simulate_mode(dep, "colocated", one, "round-robin"))
    assert summary(run).makespan_s <= serial.makespan_s * (1 + 1e-9)


@_settings
@given(_workload, st.sampled_from([16, 64, 256]), st.sampled_from(["async", "sync"]))
def test_pull_at_2a1f_serves_every_request_once_and_none_sooner_than_alone(
    drawn: list[tuple[int, float]], budget: int, mode: str
) -> None:
    """2A1F under arrivals: the assignment the mode reports is the one its replicas
    served, each request exactly once, and none ends sooner than with the deployment to
    itself."""
    dep = _dep(budget=budget)
    requests = assign([n for n, _ in drawn], [t for _, t in drawn], 2, "pull")
    run = simulate_mode(dep, mode, requests, "pull")
    assert _assigned(run) == served_by(mode, requests, run.replicas)
    done = {rid: t for record in run.replicas for rid, t in record.done.items()}
    for q, solo in zip(requests, _solo_ends(dep, mode, requests), strict=True):
        assert done[q.request_id] >= solo * (1 - 1e-9)


def test_served_by_names_requests_served_twice_or_never() -> None:
    requests = [Request(0, 4, 0.0), Request(1, 4, 0.0)]
    one, other = ReplicaTimes(done={0: 1.0}), ReplicaTimes(done={1: 1.0})
    assert served_by("async", requests, [other, one]) == [1, 0]
    with pytest.raises(RuntimeError, match=r"requests 0 \(replicas 0 and 1\) were prefilled twice"):
        served_by("async", requests, [one, ReplicaTimes(done={0: 2.0, 1: 2.0})])
    with pytest.raises(RuntimeError, match=r"mode sync: requests \[1\] never completed"):
        served_by("sync", requests, [one])


def test_a_static_policy_refuses_an_unassigned_request() -> None:
    with pytest.raises(ValueError, match="assigned to replica -1, not one of the mode's 2"):
        simulate_mode(_dep(), "async", assign([4], [0.0], 2, "pull"), "round-robin")


def test_afd_sim_pull_reports_each_modes_assignment(tmp_path: Path, capsys: Any) -> None:
    out = tmp_path / "sim.json"
    argv = ["sim", "--calibration", "cpu-tiny", "--requests", "12", "--rate", "50",
            "--assign", "pull", "--mode", "all", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    capsys.readouterr()
    data = json.loads(out.read_text())
    assert {r["replica"] for r in data["requests"]} == {-1}
    assert set(data["served_by"]) == {"async", "sync", "colocated"}
    for mode, replicas in data["served_by"].items():
        assert len(replicas) == 12, mode
        assert all(0 <= r < 2 for r in replicas), mode
