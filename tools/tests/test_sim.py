"""``afd sim``: the engine, hand-computed schedules, properties, calibration, the CLI."""

from __future__ import annotations

import dataclasses
import json
from importlib import resources
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from afd_models import preset
from afd_tools.cli import main
from afd_tools.prefill.run_report import Deployment
from afd_tools.prefill.workload import Request, assign
from afd_tools.sim import calibrate, costs
from afd_tools.sim.calibrate import fit_runs
from afd_tools.sim.costs import Calibration, SimError, Wire, rank_hit_probability
from afd_tools.sim.engine import COMPUTE, DELAY, WAIT, Engine, Signal
from afd_tools.sim.measured import MeasuredRun
from afd_tools.sim.simulate import deployment, simulate, simulate_mode, summary
from afd_tools.sim.sweep import splits

ONE_LAYER = preset("tiny", num_layers=1, first_k_dense_replace=0)
"""One MoE layer, 8 experts top-2, hidden 64, float32."""


def _cal(**changes: Any) -> Calibration:
    """Round numbers (binary fractions) so that schedules can be computed by hand."""
    base = Calibration(
        device="test",
        preset="tiny",
        dtype="float32",
        attn_fixed_s=1.0,
        attn_token_s=0.1,
        attn_square_s=0.0,
        ffn_item_s=0.0,
        ffn_expert_s=0.0,
        ffn_row_s=0.05,
        dispatch_latency_s=0.5,
        dispatch_bandwidth=1e30,
        combine_latency_s=0.25,
        combine_bandwidth=1e30,
        notify_s=0.125,
        barrier_s=0.0625,
        collective_latency_s=0.5,
        collective_bandwidth=1e30,
    )
    return base.replace(**changes)


def _two_requests(replicas: int = 2) -> list[Request]:
    return assign([10, 30], [0.0, 0.0], replicas, "round-robin")


def _run(mode: str, colocated: str = "dp", **cal: Any) -> Any:
    dep = deployment(
        ONE_LAYER, _cal(**cal), attention_ranks=2, ffn_ranks=1, budget=64, colocated=colocated
    )
    return summary(simulate_mode(dep, mode, _two_requests()))


# engine ---------------------------------------------------------------------------------
def test_processor_sharing_two_jobs_on_one_core() -> None:
    """1 s and 3 s of work on one core: both run at half speed until the short one ends at
    2 s; the long one has 2 s left, alone, so it ends at 4 s."""
    engine = Engine(cores=1.0)
    ends: dict[str, float] = {}

    def job(name: str, seconds: float) -> Any:
        yield (COMPUTE, seconds, 1)
        ends[name] = engine.now

    engine.spawn(job("short", 1.0))
    engine.spawn(job("long", 3.0))
    engine.run()
    assert ends == pytest.approx({"short": 2.0, "long": 4.0})


def test_processor_sharing_weight_counts_identical_ranks() -> None:
    """Weight 3 on 2 cores with nothing else: each of the 3 gets 2/3 of a core."""
    engine = Engine(cores=2.0)
    end = []

    def job() -> Any:
        yield (COMPUTE, 2.0, 3)
        end.append(engine.now)

    engine.spawn(job())
    engine.run()
    assert end == pytest.approx([3.0])


def test_signals_delays_and_no_sharing_without_cores() -> None:
    engine = Engine(cores=None)
    signal = Signal()
    log = []

    def waiter() -> Any:
        value = yield (WAIT, signal)
        log.append(("woke", engine.now, value))

    def worker() -> Any:
        yield (COMPUTE, 1.5, 1)
        yield (DELAY, 0.5)
        engine.fire(signal, "hello")

    def other() -> Any:
        yield (COMPUTE, 1.5, 1)
        log.append(("other", engine.now, None))

    engine.spawn(waiter())
    engine.spawn(worker())
    engine.spawn(other())
    engine.run()
    assert sorted(log) == [("other", 1.5, None), ("woke", 2.0, "hello")]


# hand-computed schedules: 2 requests (10 and 30 tokens), 1 MoE layer, A=2, F=1 ------------
# attention(T) = 1 + 0.1 T; FFN(T) = 0.05 * 2T rows (top-2, one FFN rank holds all 8
# experts); dispatch 0.5; combine 0.25; arrival 0.125 each way; barrier 0.0625.
def test_async_schedule_by_hand() -> None:
    # replica 0: attention 0-2, dispatch 2-2.5, at the FFN 2.625, served 2.625-3.625,
    # reply back 3.75, combine 3.75-4.0. Replica 1: attention 0-4, dispatch 4-4.5, FFN
    # 4.625-7.625, back 7.75, combine 7.75-8.0.
    s = _run("async")
    assert s.makespan_s == pytest.approx(8.0)
    assert s.ttft_p50 == pytest.approx(4.0)
    assert s.ttft_p99 == pytest.approx(8.0)
    assert s.ffn_busy == pytest.approx([4.0 / 8.0])  # 1 + 3 s of FFN work
    assert s.attention_wait[0] == pytest.approx((4.0 - 2.5) / 8.0)  # 2.5 -> 4.0 in combine


def test_sync_schedule_by_hand() -> None:
    # step start: both at 0, resume 0.0625. Attention: replica 0 until 2.0625, replica 1
    # until 4.0625; the barrier before the dispatch releases both at 4.125; dispatch
    # 4.125-4.625; both items at the FFN at 4.75; replica 0's first (rotation): 4.75-5.75,
    # back 5.875, combine -> 6.125; replica 1's 5.75-8.75, back 8.875, combine -> 9.125.
    s = _run("sync")
    assert s.makespan_s == pytest.approx(9.125)
    assert s.ttft_p50 == pytest.approx(6.125)
    assert s.dummy_batches == 0
    assert s.breakdown.barrier_ms_per_layer == pytest.approx(1e3 * (2.0625 + 0.0625) / 2)


def test_colocated_dp_schedule_by_hand() -> None:
    # each replica alone: attention + all experts locally, no waiting:
    # 2 + 1 = 3 and 4 + 3 = 7.
    s = _run("colocated", colocated="dp")
    assert s.makespan_s == pytest.approx(7.0)
    assert s.ttft_p50 == pytest.approx(3.0)
    assert s.attention_wait == pytest.approx([0.0, 0.0])


def test_colocated_dp_ep_schedule_by_hand() -> None:
    # 3 ranks (A+F); requests round-robin over them: 10, 30, nothing (a 1-token dummy).
    # Step start 0.0625; attention ends 2.0625 / 4.0625 / 1.1625; barrier -> 4.125;
    # all_gather 0.5 -> 4.625; experts: 40 real tokens x 2 / 3 rows x 0.05 -> 5.958333;
    # barrier -> 6.020833; reduce_scatter 0.5 -> 6.520833.
    s = _run("colocated", colocated="dp-ep")
    end = 4.625 + 40 * 2 / 3 * 0.05 + 0.0625 + 0.5
    assert s.makespan_s == pytest.approx(end)
    assert s.ttft_p50 == pytest.approx(end)
    assert s.dummy_batches == 1


def test_stages_overlap_attention_with_the_ffn() -> None:
    """One replica, one long prompt: with 2 stages the FFN work of stage 0 runs while
    stage 1's attention does; the makespan falls."""
    requests = assign([64], [0.0], 1, "round-robin")
    cal = _cal(attn_token_s=0.2, ffn_row_s=0.1)
    ends = []
    for stages in (1, 2):
        dep = deployment(
            preset("tiny", num_layers=2, first_k_dense_replace=0),
            cal,
            attention_ranks=1,
            ffn_ranks=1,
            budget=64,
            stages=stages,
        )
        ends.append(summary(simulate_mode(dep, "async", requests)).makespan_s)
    assert ends[1] < ends[0]


def test_a_stage_floor_keeps_small_steps_whole_where_fixed_costs_dominate() -> None:
    """Attention all fixed cost: two stages pay it twice and lose to one; a floor above the
    step's tokens per stage simulates exactly the one-stage run, and a floor the stages
    clear changes nothing."""
    requests = assign([64], [0.0], 1, "round-robin")
    cal = _cal(attn_fixed_s=0.5, ffn_row_s=0.001)
    config = preset("tiny", num_layers=2, first_k_dense_replace=0)

    def makespan(stages: int, floor: int) -> float:
        dep = deployment(
            config,
            cal,
            attention_ranks=1,
            ffn_ranks=1,
            budget=64,
            stages=stages,
            min_stage_tokens=floor,
        )
        return float(summary(simulate_mode(dep, "async", requests)).makespan_s)

    one, two = makespan(1, 0), makespan(2, 0)
    assert two > one
    assert makespan(2, 33) == one  # 64 tokens: under 33 per stage for two stages
    assert makespan(2, 32) == two
    with pytest.raises(SimError, match="--min-stage-tokens must be >= 0, got -1"):
        deployment(config, cal, attention_ranks=1, ffn_ranks=1, budget=64, min_stage_tokens=-1)


# properties -----------------------------------------------------------------------------
_coef = st.floats(min_value=0.0, max_value=2.0, allow_nan=False)
_lengths = st.lists(st.integers(min_value=1, max_value=300), min_size=1, max_size=12)


@st.composite
def _scenario(draw: Any) -> tuple[Calibration, list[int], int, int, int]:
    cal = _cal(
        attn_fixed_s=draw(_coef) * 1e-3,
        attn_token_s=draw(_coef) * 1e-5,
        attn_square_s=draw(_coef) * 1e-8,
        ffn_item_s=draw(_coef) * 1e-3,
        ffn_expert_s=draw(_coef) * 1e-4,
        ffn_row_s=draw(_coef) * 1e-5,
        dispatch_latency_s=draw(_coef) * 1e-3,
        combine_latency_s=draw(_coef) * 1e-3,
        notify_s=draw(_coef) * 1e-4,
        barrier_s=draw(_coef) * 1e-4,
    )
    lengths = draw(_lengths)
    a = draw(st.integers(min_value=1, max_value=3))
    f = draw(st.integers(min_value=1, max_value=3))
    budget = draw(st.sampled_from([16, 64, 512]))
    return cal, lengths, a, f, budget


def _makespan(cal: Calibration, lengths: list[int], a: int, f: int, budget: int, mode: str) -> Any:
    dep = deployment(preset("tiny"), cal, attention_ranks=a, ffn_ranks=f, budget=budget)
    requests = assign(lengths, [0.0] * len(lengths), a, "round-robin")
    return simulate_mode(dep, mode, requests)


_settings = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@_settings
@given(_scenario())
def test_async_never_slower_than_sync(scenario: Any) -> None:
    cal, lengths, a, f, budget = scenario
    fast = summary(_makespan(cal, lengths, a, f, budget, "async")).makespan_s
    slow = summary(_makespan(cal, lengths, a, f, budget, "sync")).makespan_s
    assert fast <= slow * (1 + 1e-9)


@_settings
@given(_scenario(), st.sampled_from(["async", "sync"]))
def test_work_is_conserved(scenario: Any, mode: str) -> None:
    """Without shared cores every piece of work takes its cost: the FFN ranks' busy
    time is the sum of the item costs, every replica's attention time the sum of its
    attention costs, and the makespan lies between the busiest rank's work and the
    serial sum of everything."""
    cal, lengths, a, f, budget = scenario
    run = _makespan(cal, lengths, a, f, budget, mode)
    s = summary(run)
    ffn_work = sum(e - b for b, e, *_ in run.ffn_intervals[0])
    assert ffn_work == pytest.approx(run.ffn.nominal_s, rel=1e-9, abs=1e-12)
    for record in run.replicas:
        assert record.attention.elapsed_s == pytest.approx(record.attention.nominal_s, rel=1e-9)
    # The last step's end (sync: dummy batches of finished replicas may end after the
    # last request did).
    end = max(b[1] for r in run.replicas for b in r.batches)
    busiest = max([run.ffn.nominal_s, *(r.attention.nominal_s for r in run.replicas)])
    # Serial upper bound: every piece of work one after the other, plus every latency
    # (two arrivals and a combine per dispatch -- the bandwidths are infinite here --
    # and a barrier per step and per dispatch in sync).
    dispatches = sum(r.totals.layers for r in run.replicas)
    steps = sum(len(r.batches) + 1 for r in run.replicas)
    everything = (
        run.ffn.nominal_s
        + sum(r.attention.nominal_s + r.dispatch.nominal_s for r in run.replicas)
        + dispatches * (2 * cal.notify_s + cal.combine_latency_s)
        + (steps + dispatches) * cal.barrier_s
    )
    assert s.makespan_s <= end * (1 + 1e-9)
    assert busiest <= end * (1 + 1e-9)
    assert end <= everything * (1 + 1e-9) + 1e-12
    assert sorted(run.replicas[0].done) == sorted(
        q.request_id for q in run.requests if q.replica == 0
    )


@_settings
@given(
    _scenario(),
    st.sampled_from(
        ["attn_fixed_s", "attn_token_s", "ffn_item_s", "ffn_row_s", "dispatch_latency_s"]
    ),
)
def test_makespan_is_monotone_in_costs(scenario: Any, field: str) -> None:
    """More expensive work never finishes sooner: sync (every layer in lockstep) for any
    A, async for one replica (with several, which replica the FFN ranks serve first
    depends on timing, and list-scheduling anomalies are possible)."""
    cal, lengths, a, f, budget = scenario
    dearer = cal.replace(**{field: getattr(cal, field) * 1.5 + 1e-4})
    for mode, replicas in (("sync", a), ("async", 1)):
        low = summary(_makespan(cal, lengths, replicas, f, budget, mode)).makespan_s
        high = summary(_makespan(dearer, lengths, replicas, f, budget, mode)).makespan_s
        assert high >= low * (1 - 1e-9)


def test_shared_cores_only_slow_down() -> None:
    requests = assign([100, 200, 50, 300], [0.0] * 4, 2, "round-robin")
    spans = []
    for cores in (None, 2.0, 1.0):
        dep = deployment(
            preset("tiny"), _cal(cores=cores), attention_ranks=2, ffn_ranks=2, budget=256
        )
        spans.append(summary(simulate_mode(dep, "async", requests)).makespan_s)
    assert spans[0] <= spans[1] * (1 + 1e-9) <= spans[2] * (1 + 1e-9)
    assert spans[2] > spans[0]


# cost model -------------------------------------------------------------------------------
def test_rank_hit_probability() -> None:
    assert rank_hit_probability(8, 2, 1) == 1.0
    # 8 experts, 2 FFN ranks of 4: P(both choices on the other rank) = 4/8 * 3/7
    assert rank_hit_probability(8, 2, 2) == pytest.approx(1 - 4 / 8 * 3 / 7)


def test_per_rank_wire_sends_fewer_bytes_than_per_choice() -> None:
    cal = _cal()
    shapes = costs.Shapes.of(preset("v2-lite"), "bfloat16")
    per_rank = costs.CostModel(cal, shapes, 1, 1, Wire("per_rank", "ffn"))
    per_choice = costs.CostModel(cal, shapes, 1, 1, Wire("per_choice", "attention"))
    # top-6 at one FFN rank: a row once instead of six times
    assert per_choice.combine_bytes(1000) == pytest.approx(6 * per_rank.combine_bytes(1000))


# calibration round trip -------------------------------------------------------------------
def synthetic_deployment(a: int, f: int, workload: str, **changes: Any) -> Deployment:
    """The deployment record of a simulated "measurement" (CPU, ``tiny``, budget 256)."""
    record = Deployment(
        device="cpu",
        preset="tiny",
        layers=None,
        dtype="float32",
        attention_ranks=a,
        ffn_ranks=f,
        max_num_batched_tokens=256,
        stages=1,
        colocated="dp",
        assign="round-robin",
        wire_format=Wire().format,
        combine_reduce=Wire().combine_reduce,
        shared=Wire().shared,
        transport="shm",
        backend="reference",
        workload=workload,
        workload_file=None,
        max_prompt_len=256,
        rate=None,
        seed=0,
    )
    return dataclasses.replace(record, **changes)


def _synthetic_runs(truth: Calibration) -> list[MeasuredRun]:
    """Simulated "measurements" of several configurations with known coefficients."""
    out = []
    config = preset("tiny")
    lengths_by_workload = {
        "a": [37, 200, 12, 90, 150, 8, 64, 256, 5, 120],
        "b": [250, 10, 10, 240, 16, 200, 30, 9],
        "c": [180, 45, 3, 77, 210, 33, 128, 60, 14, 99],
    }
    for (a, f), (name, lengths) in (
        ((1, 1), ("a", lengths_by_workload["a"])),
        ((2, 1), ("b", lengths_by_workload["b"])),
        ((1, 2), ("c", lengths_by_workload["c"])),
        ((2, 2), ("b", lengths_by_workload["b"])),
        ((3, 1), ("a", lengths_by_workload["a"])),
    ):
        requests = assign(lengths, [0.0] * len(lengths), a, "round-robin")
        dep = deployment(config, truth, attention_ranks=a, ffn_ranks=f, budget=256)
        modes = {
            m: s for m, (_, s) in simulate(dep, ["async", "sync", "colocated"], requests).items()
        }
        out.append(
            MeasuredRun(
                source=f"synthetic {a}A{f}F",
                deployment=synthetic_deployment(a, f, name),
                requests=tuple(requests),
                modes=modes,
            )
        )
    return out


def test_calibration_round_trip_recovers_known_coefficients() -> None:
    truth = _cal(
        attn_fixed_s=2e-3,
        attn_token_s=4e-5,
        attn_square_s=3e-8,
        ffn_item_s=5e-4,
        ffn_expert_s=1e-4,
        ffn_row_s=2e-6,
        dispatch_latency_s=3e-4,
        dispatch_bandwidth=2e8,
        combine_latency_s=3e-4,
        combine_bandwidth=2e8,
        notify_s=2e-4,
        barrier_s=5e-5,
        cores=1.4,
        comm_uses_cores=True,
    )
    fitted = fit_runs(_synthetic_runs(truth), cores_grid=(1.0, 1.4, 2.0), notify_grid=(5e-5, 2e-4))
    assert fitted.cores == 1.4
    assert fitted.notify_s == 2e-4
    for name in (
        "attn_fixed_s",
        "attn_token_s",
        "attn_square_s",
        "ffn_row_s",
        "dispatch_latency_s",
    ):
        assert getattr(fitted, name) == pytest.approx(getattr(truth, name), rel=0.05), name
    assert 1 / fitted.dispatch_bandwidth == pytest.approx(1 / truth.dispatch_bandwidth, rel=0.1)
    assert fitted.fit["mean_abs_log_error_makespan_ttft_p50"] < 0.01


def without_steps(run: MeasuredRun) -> MeasuredRun:
    """``run`` as a report from before per-step records were kept."""
    modes = {m: dataclasses.replace(s, attention_steps=[]) for m, s in run.modes.items()}
    return dataclasses.replace(run, modes=modes)


def test_coefficients_the_runs_cannot_separate_are_named_not_guessed(
    tmp_path: Path, capsys: Any
) -> None:
    """1A1F on one mix and 2A1F, 2A2F on another give two distinct attention batches per
    layer: three attention coefficients cannot all be determined from the per-layer means
    of reports without step records (every report before they were recorded; with them,
    test_sim_one_gpu shows the steps separating what these cannot). The fit sets the last
    in preference (the fixed cost) to 0 and says so, in the file and on the screen,
    instead of returning whichever split the linear algebra's rounding favoured."""
    runs = [
        without_steps(r)
        for r in _synthetic_runs(_generic_truth())
        if (r.attention_ranks, r.ffn_ranks) in ((1, 1), (2, 1), (2, 2))
    ]
    cal = fit_runs(runs, cores_grid=[None], notify_grid=[5e-4])
    assert cal.attn_fixed_s == 0.0
    assert set(cal.fit["not_determined"]) == {"attn_fixed_s"}
    assert (
        "not separable from attn_token_s, attn_square_s"
        in cal.fit["not_determined"]["attn_fixed_s"]
    )
    # the FFN and dispatch coefficients are still recovered
    truth = _generic_truth()
    for name in ("ffn_item_s", "ffn_expert_s", "ffn_row_s", "dispatch_latency_s"):
        assert getattr(cal, name) == pytest.approx(getattr(truth, name), rel=EXACT), name
    sources = []
    for i, run in enumerate(runs):
        sources.append(tmp_path / f"run{i}.json")
        sources[-1].write_text(json.dumps(_as_report(run)))
    out = tmp_path / "cal.json"
    args = ["sim", "calibrate", *map(str, sources), "-o", str(out), "--cores-grid", "none"]
    assert main([*args, "--notify-grid", "500", "--no-progress"]) == 0
    assert "not determined, set to 0: attn_fixed_s: not separable" in capsys.readouterr().out
    assert set(json.loads(out.read_text())["fit"]["not_determined"]) == {"attn_fixed_s"}


# calibration files and the command -------------------------------------------------------
@pytest.mark.parametrize("name", costs.SHIPPED)
def test_shipped_calibrations_load_and_say_where_they_came_from(name: str) -> None:
    cal = costs.load(name)
    assert cal.command.startswith("afd sim calibrate")
    assert cal.date
    path = resources.files("afd_tools.sim").joinpath("calibrations").joinpath(f"{name}.json")
    assert json.loads(path.read_text())["schema"] == costs.SCHEMA_VERSION


def test_bad_calibration_is_one_line_error(tmp_path: Path, capsys: Any) -> None:
    bad = tmp_path / "bad.json"
    data = costs.load("h200-v3").to_json()
    data["attn_token_s"] = -1
    bad.write_text(json.dumps(data))
    assert main(["sim", "--calibration", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("afd sim: error: ")
    assert "attn_token_s" in err
    assert err.count("\n") == 1
    with pytest.raises(SimError, match="schema"):
        costs.from_json({**data, "schema": 99}, "x")


def test_preset_mismatch_is_refused_unless_asked(capsys: Any) -> None:
    assert main(["sim", "--calibration", "cpu-tiny", "--preset", "v3-slice"]) == 2
    assert "--any-preset" in capsys.readouterr().err


def test_afd_sim_prints_the_run_report_and_writes_json(tmp_path: Path, capsys: Any) -> None:
    out = tmp_path / "sim.json"
    plot = tmp_path / "sim.png"
    code = main(
        [
            "sim",
            "--attention-ranks",
            "2",
            "--ffn-ranks",
            "1",
            "--json",
            str(out),
            "--plot",
            str(plot),
        ]
    )
    assert code == 0
    text = capsys.readouterr().out
    assert "TTFT p50 s" in text
    assert "async/sync tokens/s" in text
    report = json.loads(out.read_text())
    assert report["simulated"] is True
    assert set(report["modes"]) == {"async", "sync", "colocated"}
    assert plot.stat().st_size > 0


def test_afd_sim_calibrate_from_a_run_report(tmp_path: Path) -> None:
    """An unversioned report as afd run wrote it before the typed one (args as strings,
    requests, modes) is still read back, through the legacy reader."""
    sources = []
    for i, run in enumerate(_synthetic_runs(_cal(cores=None))):
        sources.append(tmp_path / f"run{i}.json")
        sources[-1].write_text(json.dumps(_as_report(run)))
    out = tmp_path / "cal.json"
    args = ["sim", "calibrate", *map(str, sources), "-o", str(out), "--cores-grid", "none"]
    assert main([*args, "--notify-grid", "125", "--no-progress"]) == 0
    cal = costs.load(str(out))
    assert cal.command.startswith("afd sim calibrate")
    assert cal.attn_token_s == pytest.approx(0.1, rel=0.05)
    assert cal.ffn_row_s == pytest.approx(0.05, rel=0.05)


def _as_report(run: MeasuredRun) -> dict[str, Any]:
    """What afd run --json wrote before ``afd-run-report/2`` (no schema, args as strings)."""
    return {
        "args": {
            "device": "cpu",
            "preset": "tiny",
            "layers": "None",
            "dtype": "float32",
            "attention_ranks": str(run.attention_ranks),
            "ffn_ranks": str(run.ffn_ranks),
            "max_num_batched_tokens": "256",
            "stages": "1",
            "colocated": "dp",
            "assign": "round-robin",
            "wire_format": "per_rank",
            "combine_reduce": "ffn",
            "shared": "attention",
            "workload": "uneven",
            "workload_file": "None",
        },
        "modes": {m: s.to_json() for m, s in run.modes.items()},
        "requests": [dataclasses.asdict(r) for r in run.requests],
    }


def test_sweep_splits_and_command(tmp_path: Path, capsys: Any) -> None:
    assert splits(4, None) == [(1, 3), (2, 2), (3, 1)]
    out = tmp_path / "sweep.json"
    code = main(
        [
            "sim",
            "sweep",
            "--calibration",
            "h200-v3",
            "--gpus",
            "4,8",
            "--ratios",
            "1:1,3:1",
            "--requests",
            "20",
            "--max-prompt-len",
            "4096",
            "--max-num-batched-tokens",
            "4096",
            "--json",
            str(out),
            "--no-progress",
        ]
    )
    assert code == 0
    assert "async/colocated" in capsys.readouterr().out
    report = json.loads(out.read_text())
    assert [row["gpus"] for row in report["best"]] == [4, 8]
    assert len(report["points"]) == 2 * 2 * 2 + 2


def _generic_truth() -> Calibration:
    """Coefficients like a CPU campaign's, none of them zero or round: a schedule built
    from round numbers has exact ties (two replicas' items ready at the same instant), and
    which way a tie goes turns on the last bit of a fitted coefficient -- a fitted 5.8e-19
    instead of a true 0 moved a held-out makespan by 10 %. The values the fit does not
    estimate (barrier, collectives) are the fit's own."""
    return _cal(
        attn_fixed_s=1.3e-3,
        attn_token_s=7.3e-6,
        attn_square_s=3.7e-8,
        ffn_item_s=2.6e-4,
        ffn_expert_s=1.9e-5,
        ffn_row_s=6.1e-7,
        dispatch_latency_s=3.4e-4,
        dispatch_bandwidth=4.1e8,
        combine_latency_s=3.4e-4,
        combine_bandwidth=4.1e8,
        notify_s=5e-4,
        barrier_s=calibrate.BARRIER_S,
        collective_latency_s=calibrate.COLLECTIVE_LATENCY_S,
        collective_bandwidth=calibrate.COLLECTIVE_BANDWIDTH,
        cores=None,
    )


EXACT = 1e-9
"""Relative error allowed where the fit must recover the truth: the measured worst over
the 15 held-out rows below is 9e-16 (rounding), so this leaves six orders of margin and
still fails on any real modelling difference (a merged combine latency alone moves a
makespan by 0.4 %)."""


def test_afd_sim_validate_leaves_each_pair_out(tmp_path: Path, capsys: Any) -> None:
    """On runs the model itself produced, every held-out pair is predicted exactly from
    the other pairs; fewer than two pairs is refused."""
    sources = []
    for i, run in enumerate(_synthetic_runs(_generic_truth())):
        sources.append(tmp_path / f"run{i}.json")
        sources[-1].write_text(json.dumps(_as_report(run)))
    out = tmp_path / "validation.json"
    grids = ["--cores-grid", "none", "--notify-grid", "500", "--no-progress"]
    assert main(["sim", "validate", *map(str, sources), *grids, "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| 1A2F uneven 10 req, budget 256, stages 1 | async | 1 |" in printed
    assert "makespan_s: 15 of 15 within 15%" in printed, printed
    rows = json.loads(out.read_text())["predictions"]
    assert len(rows) == 15  # five pairs x three modes
    for row in rows:
        for figure in ("makespan_s", "ttft_p50"):
            measured = row["measured"][figure][0]
            assert row["predicted"][figure] == pytest.approx(measured, rel=EXACT), row
    assert main(["sim", "validate", str(sources[0]), *grids]) == 2
    assert "at least two A:F pairs" in capsys.readouterr().err
