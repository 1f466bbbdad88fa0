"""The simulator's one-GPU terms: ranks holding shares of the SMs under CUDA MPS (a cost
that scales as calibrated share / share, fitted across runs at different splits, swept by
``afd sim sweep --ffn-shares``) and sync's per-layer barrier on the host while the device
computes (``Calibration.host_barrier``)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from test_sim import (
    EXACT,
    ONE_LAYER,
    _cal,
    _generic_truth,
    synthetic_deployment,
    without_steps,
)

from afd_models import preset
from afd_tools.cli import main
from afd_tools.prefill.workload import assign
from afd_tools.sim import costs
from afd_tools.sim.calibrate import fit_runs, reference_split, replay
from afd_tools.sim.costs import Calibration, SimError, share_scale
from afd_tools.sim.measured import MeasuredRun
from afd_tools.sim.simulate import deployment, simulate, simulate_mode, summary
from afd_tools.sim.sweep import share_splits

MPS = {"attention_share": 25.0, "ffn_share": 25.0}


def _mps_cal(**changes: Any) -> Calibration:
    return _cal(**MPS).replace(**changes)


def _one_layer(mode: str, cal: Calibration, **shares: float) -> Any:
    dep = deployment(ONE_LAYER, cal, attention_ranks=2, ffn_ranks=1, budget=64, **shares)
    return summary(simulate_mode(dep, mode, assign([10, 30], [0.0, 0.0], 2, "round-robin")))


# the share term -----------------------------------------------------------------------------
def test_share_scale_is_calibrated_share_over_share() -> None:
    assert share_scale(25.0, 50.0, "--ffn-share") == 0.5
    assert share_scale(25.0, 12.5, "--ffn-share") == 2.0
    assert share_scale(25.0, None, "--ffn-share") == 1.0
    assert share_scale(None, None, "--ffn-share") == 1.0
    for bad in (0.0, -5.0, 100.5, math.nan, math.inf):
        with pytest.raises(SimError, match=r"--attention-share is a percent .* \(0, 100\]"):
            share_scale(25.0, bad, "--attention-share")
    with pytest.raises(SimError, match="--ffn-share needs a calibration measured under CUDA MPS"):
        share_scale(None, 50.0, "--ffn-share")


def test_twice_the_share_halves_every_compute_by_hand() -> None:
    # test_sim's async schedule with every compute halved (attention 1 + 0.1 T -> half,
    # FFN 0.05 per row -> half; dispatch, combine and arrival unchanged): replica 0
    # attention 0-1, dispatch 1-1.5, FFN 1.625-2.125, back 2.25, combine -> 2.5; replica 1
    # attention 0-2, dispatch 2-2.5, FFN 2.625-4.125, back 4.25, combine -> 4.5.
    cal = _mps_cal(attention_share=12.5, ffn_share=12.5)
    s = _one_layer("async", cal, attention_share=25.0, ffn_share=25.0)
    assert s.makespan_s == pytest.approx(4.5)
    assert s.ttft_p50 == pytest.approx(2.5)
    # At the calibration's own shares nothing changes (test_sim: 8.0).
    assert _one_layer("async", cal).makespan_s == pytest.approx(8.0)
    assert _one_layer("async", cal, attention_share=12.5).makespan_s == pytest.approx(8.0)
    # Only the FFN at twice its share: replica 1's 3 s item takes 1.5 s.
    s = _one_layer("async", cal, ffn_share=25.0)
    assert s.makespan_s == pytest.approx(8.0 - 1.5)


def test_the_colocated_baseline_keeps_the_calibrations_shares() -> None:
    plain = _one_layer("colocated", _mps_cal())
    shared = _one_layer("colocated", _mps_cal(), attention_share=30.0, ffn_share=40.0)
    assert shared.makespan_s == plain.makespan_s


def test_shares_need_a_calibration_measured_under_mps(capsys: Any) -> None:
    with pytest.raises(SimError, match="--attention-share needs a calibration measured"):
        deployment(ONE_LAYER, _cal(), attention_ranks=1, ffn_ranks=1, budget=64, attention_share=50)
    assert main(["sim", "--calibration", "cpu-tiny", "--ffn-share", "50"]) == 2
    assert "--ffn-share needs a calibration measured under CUDA MPS" in capsys.readouterr().err


def test_shares_of_one_gpu_add_up_to_at_most_all_of_it(capsys: Any) -> None:
    # 3 x 25 % + 50 %: more than the GPU; the calibration's own FFN share counts too.
    with pytest.raises(SimError, match=r"3 x 25 % \+ 1 x 50 % is 125 % of one GPU's SMs"):
        deployment(ONE_LAYER, _mps_cal(), attention_ranks=3, ffn_ranks=1, budget=64, ffn_share=50)
    with pytest.raises(SimError, match=r"2 x 40 % \+ 1 x 25 % is 105 %"):
        deployment(
            ONE_LAYER, _mps_cal(), attention_ranks=2, ffn_ranks=1, budget=64, attention_share=40
        )
    deployment(ONE_LAYER, _mps_cal(), attention_ranks=2, ffn_ranks=1, budget=64, ffn_share=50)
    argv = ["sim", "--calibration", "h200-mps-v3", "--attention-ranks", "3", "--ffn-ranks", "1"]
    assert main([*argv, "--ffn-share", "50"]) == 2
    assert "give shares that add up to at most 100 %" in capsys.readouterr().err


def test_a_calibration_files_shares_are_checked(tmp_path: Path, capsys: Any) -> None:
    data = costs.load("h200-mps-v3").to_json()
    assert (data["attention_share"], data["ffn_share"]) == (25.0, 25.0)
    for changes, message in (
        ({"ffn_share": None}, "attention_share and ffn_share are both set or both null"),
        ({"ffn_share": 0}, r"ffn_share is a percent of the SMs, in \(0, 100\]"),
        ({"attention_share": 101}, r"attention_share is a percent of the SMs"),
        ({"host_barrier": 1}, "host_barrier must be true or false"),
    ):
        with pytest.raises(SimError, match=message):
            costs.from_json({**data, **changes}, "x")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**data, "ffn_share": 0}))
    assert main(["sim", "--calibration", str(bad)]) == 2
    assert "ffn_share" in capsys.readouterr().err


# the host barrier ---------------------------------------------------------------------------
def test_a_host_barrier_is_reached_as_the_attention_is_launched_by_hand() -> None:
    # test_sim's sync schedule, but both replicas reach the layer's barrier at 0.0625 (the
    # step's exchange), when they launch their attention; it releases at 0.125, long before
    # either attention ends. Replica 0: attention until 2.0625, dispatch -> 2.5625, FFN
    # 2.6875-3.6875, back 3.8125, combine -> 4.0625. Replica 1: attention until 4.0625,
    # dispatch -> 4.5625, FFN 4.6875-7.6875, back 7.8125, combine -> 8.0625.
    s = _one_layer("sync", _cal(host_barrier=True))
    assert s.makespan_s == pytest.approx(8.0625)
    assert s.ttft_p50 == pytest.approx(4.0625)
    assert s.breakdown.barrier_ms_per_layer == pytest.approx(0.0)
    # After the compute (the CPU's barrier): test_sim's 9.125.
    assert _one_layer("sync", _cal()).makespan_s == pytest.approx(9.125)


def test_a_host_barrier_is_reached_before_the_dense_layers_are_computed_by_hand() -> None:
    # A dense layer, then an MoE layer (each attention 1 + 0.1 T), replicas of 10 and 60
    # tokens. Both hosts launch the dense layer and the MoE attention at once and reach
    # the barrier at 0.0625 (released 0.125). Replica 0: dense until 2.0625, attention
    # until 4.0625, dispatch -> 4.5625, FFN 4.6875-5.6875, back 5.8125, combine -> 6.0625.
    # Replica 1: dense until 7.0625, attention until 14.0625, dispatch -> 14.5625, FFN
    # 14.6875-20.6875, back 20.8125, combine -> 21.0625. Arriving after the dense layer
    # instead would hold replica 0 at the barrier from 4.0625 to 7.125.
    config = preset("tiny", num_layers=2, first_k_dense_replace=1)
    dep = deployment(config, _cal(host_barrier=True), attention_ranks=2, ffn_ranks=1, budget=64)
    s = summary(simulate_mode(dep, "sync", assign([10, 60], [0.0, 0.0], 2, "round-robin")))
    assert s.makespan_s == pytest.approx(21.0625)
    assert s.ttft_p50 == pytest.approx(6.0625)
    assert s.breakdown.barrier_ms_per_layer == pytest.approx(0.0)


def test_the_barrier_placement_can_be_chosen_on_the_command_line(tmp_path: Path) -> None:
    """``--sync-barrier`` overrides the calibration's: the device barrier (after the
    attention) makes sync slower than the host barrier on uneven replicas."""
    argv = [
        "sim", "--calibration", "h200-mps-v3", "--attention-ranks", "2", "--ffn-ranks", "1",
        "--requests", "16", "--max-prompt-len", "8192", "--max-num-batched-tokens", "8192",
        "--mode", "sync",
    ]  # fmt: skip
    makespans = {}
    for placement in ("host", "device"):
        out = tmp_path / f"{placement}.json"
        assert main([*argv, "--sync-barrier", placement, "--json", str(out)]) == 0
        report = json.loads(out.read_text())
        assert report["calibration"]["host_barrier"] is (placement == "host")
        makespans[placement] = report["modes"]["sync"]["makespan_s"]
    assert makespans["device"] > makespans["host"], makespans


def test_a_host_barrier_still_holds_every_dispatch_until_every_reply_of_the_layer() -> None:
    """Two MoE layers, one step per replica (10 and 60 tokens): no item of layer 1 reaches
    the FFN before both replies to layer 0 are back (a host reaches the next barrier only
    after its combine) -- sync's lockstep. Async has none: its short replica's layer 1 is
    served before the long replica's layer 0 is."""
    config = preset("tiny", num_layers=2, first_k_dense_replace=0)
    cal = _cal(host_barrier=True)
    requests = assign([10, 60], [0.0, 0.0], 2, "round-robin")
    dep = deployment(config, cal, attention_ranks=2, ffn_ranks=1, budget=64)

    def first_layer_one_before_layer_zero_is_back(mode: str) -> bool:
        intervals = simulate_mode(dep, mode, requests).ffn_intervals[0]
        assert sorted(layer for *_, layer, _ in intervals) == [0, 0, 1, 1]
        back = max(replied for _, replied, _, layer, _ in intervals if layer == 0) + cal.notify_s
        return min(taken for taken, _, _, layer, _ in intervals if layer == 1) < back

    assert not first_layer_one_before_layer_zero_is_back("sync")
    assert first_layer_one_before_layer_zero_is_back("async")
    sync = summary(simulate_mode(dep, "sync", requests))
    assert sync.breakdown.barrier_ms_per_layer > 0  # the short replica waited


# calibrating across splits ------------------------------------------------------------------
def _mps_runs(
    truth: Calibration, layouts: list[tuple[int, int, int, int]], stages: int = 1
) -> list[MeasuredRun]:
    """Simulated "measurements" on one GPU: (A, F, attention share, FFN share) each, at
    several workloads, every rank's share recorded as ``afd run`` records it."""
    config = preset("tiny")
    workloads = {
        0: [37, 200, 12, 90, 150, 8, 64, 256, 5, 120],
        1: [250, 10, 10, 240, 16, 200, 30, 9],
        2: [180, 45, 3, 77, 210, 33, 128, 60, 14, 99],
    }
    out = []
    for i, (a, f, a_share, f_share) in enumerate(layouts):
        lengths = workloads[i % 3]
        requests = assign(lengths, [0.0] * len(lengths), a, "round-robin")
        dep = deployment(
            config,
            truth,
            attention_ranks=a,
            ffn_ranks=f,
            budget=256,
            stages=stages,
            attention_share=a_share,
            ffn_share=f_share,
        )
        modes = {m: s for m, (_, s) in simulate(dep, ["async", "sync"], requests).items()}
        shares = {f"attention rank {r}": a_share for r in range(a)}
        shares |= {f"ffn rank {r}": f_share for r in range(f)}
        out.append(
            MeasuredRun(
                source=f"synthetic {a}A{f}F at {a_share}/{f_share}",
                deployment=synthetic_deployment(
                    a,
                    f,
                    f"w{i % 3}",
                    device="cuda",
                    colocated="mono",
                    transport="nvshmem",
                    backend="grouped_mm",
                    stages=stages,
                ),
                requests=tuple(requests),
                modes=modes,
                mps_shares=shares,
            )
        )
    return out


GPU_TRUTH = _generic_truth().replace(
    device="cuda", attention_share=25.0, ffn_share=25.0, host_barrier=True
)
GRIDS: dict[str, Any] = {
    "cores_grid": (None,),
    "notify_grid": (GPU_TRUTH.notify_s,),
    "idle_grid": (0.0,),
}
TRAINING = [(1, 1, 25, 25), (2, 1, 25, 25), (1, 2, 25, 25), (2, 2, 25, 25), (3, 1, 25, 25)]


@pytest.mark.parametrize("steps", [True, False], ids=["step records", "per-layer means"])
def test_runs_at_other_splits_are_fitted_through_the_share_term(steps: bool) -> None:
    """Runs at three splits fit the truth's coefficients (stated at the split most runs
    share), and a split the fit never saw is predicted exactly -- from the per-step
    records, and from the per-layer means alone (every shipped GPU run)."""
    runs = _mps_runs(GPU_TRUTH, [*TRAINING, (1, 1, 50, 50), (2, 1, 30, 40)])
    if not steps:
        runs = [without_steps(r) for r in runs]
    assert reference_split(runs) == (25.0, 25.0)
    fitted = fit_runs(runs, **GRIDS)
    assert (fitted.attention_share, fitted.ffn_share, fitted.host_barrier) == (25.0, 25.0, True)
    for name in ("attn_fixed_s", "attn_token_s", "attn_square_s", "ffn_row_s"):
        assert getattr(fitted, name) == pytest.approx(getattr(GPU_TRUTH, name), rel=1e-6), name
    unseen = _mps_runs(GPU_TRUTH, [(2, 1, 20, 60), (3, 1, 20, 40)])
    for rp in replay(unseen, fitted, ["async", "sync"]):
        predicted, measured = summary(rp.sim), rp.measured[0]
        assert predicted.makespan_s == pytest.approx(measured.makespan_s, rel=EXACT), rp.run.label
        assert predicted.ttft_p50 == pytest.approx(measured.ttft_p50, rel=EXACT), rp.run.label


def test_a_fit_without_the_share_term_would_miss_the_other_split() -> None:
    """The check above can fail: predicting the 50 % runs at the 25 % costs is far off."""
    fitted = fit_runs(_mps_runs(GPU_TRUTH, TRAINING), **GRIDS)
    unseen = _mps_runs(GPU_TRUTH, [(1, 1, 50, 50)])
    blind = fitted.replace(attention_share=None, ffn_share=None)
    off = [
        summary(rp.sim).makespan_s / rp.measured[0].makespan_s
        for rp in replay(unseen, blind, ["async", "sync"])
    ]
    assert all(ratio > 1.3 for ratio in off), off


def test_runs_with_and_without_shares_or_uneven_roles_are_refused() -> None:
    mps = _mps_runs(GPU_TRUTH, TRAINING[:2])
    bare = MeasuredRun(
        source="bare.json",
        deployment=mps[0].deployment,
        requests=mps[0].requests,
        modes=mps[0].modes,
    )
    with pytest.raises(SimError, match=r"some runs were measured under CUDA MPS .*bare\.json"):
        fit_runs([*mps, bare], **GRIDS)
    uneven = MeasuredRun(
        source="uneven.json",
        deployment=mps[1].deployment,
        requests=mps[1].requests,
        modes=mps[1].modes,
        mps_shares={"attention rank 0": 20, "attention rank 1": 30, "ffn rank 0": 50},
    )
    with pytest.raises(SimError, match=r"uneven\.json: the ranks of a role held different SM"):
        fit_runs([mps[0], uneven], **GRIDS)
    assert reference_split([bare]) is None


# per-step records ---------------------------------------------------------------------------
@pytest.mark.parametrize("stages", [1, 2])
def test_step_records_separate_the_squared_length_cost_that_means_cannot(stages: int) -> None:
    """Runs at one workload and budget (as every one-GPU run so far): from per-layer means
    the fit cannot determine all three attention coefficients and sets one to 0; from the
    per-step records (tokens, squared lengths, compute of each step) it recovers each."""
    layouts = [(2, 1, 25, 25), (3, 1, 25, 25), (2, 2, 25, 25)]
    runs = [r for r in _mps_runs(GPU_TRUTH, layouts * 3, stages) if r.workload == "w1"]
    assert {len(r.requests) for r in runs} == {8}
    assert {r.stages for r in runs} == {stages}
    attention = {"attn_fixed_s", "attn_token_s", "attn_square_s"}
    blind = fit_runs([without_steps(r) for r in runs], **GRIDS)
    lost = attention & set(blind.fit["not_determined"])
    assert lost
    assert all(getattr(blind, name) == 0.0 for name in lost)
    fitted = fit_runs(runs, **GRIDS)
    assert not attention & set(fitted.fit.get("not_determined", {}))
    for name in ("attn_fixed_s", "attn_token_s", "attn_square_s"):
        assert getattr(fitted, name) == pytest.approx(getattr(GPU_TRUTH, name), rel=1e-6), name


def test_a_simulated_replicas_step_records_add_up_to_its_sums() -> None:
    """Each replica's step records add up to its mode sums (the step's time outside
    dispatch, combine and the barrier; its dispatches; its batches' tokens, plus one per
    dummy batch), in every mode and at two stages."""
    config = preset("tiny", num_layers=2, first_k_dense_replace=1)
    lengths = [37, 200, 12, 90, 150, 8, 64, 256, 5, 120]
    for stages in (1, 2):
        dep = deployment(
            config, GPU_TRUTH, attention_ranks=2, ffn_ranks=1, budget=256, stages=stages
        )
        for mode in ("async", "sync", "colocated"):
            run = simulate_mode(dep, mode, assign(lengths, [0.0] * 10, 2, "round-robin"))
            for rec in run.replicas:
                t = rec.totals
                steps = rec.attention_steps
                assert len(steps) == len(rec.batches)
                compute = t.step_s - t.dispatch_s - t.combine_s - t.barrier_s
                assert sum(step[3] for step in steps) == pytest.approx(compute, rel=1e-12)
                assert sum(step[2] for step in steps) == t.layers
                batch_tokens = sum(tokens for *_, tokens in rec.batches)
                assert sum(step[0] for step in steps) == batch_tokens + rec.dummy_batches


# sweeping the split of one GPU --------------------------------------------------------------
def test_share_splits_give_the_attention_ranks_what_the_ffn_leaves() -> None:
    assert share_splits(2, 1, [25.0, 50.0, 99.0]) == [(37.5, 25.0), (25.0, 50.0)]
    assert share_splits(3, 1, None) == [(None, None)]
    assert share_splits(1, 2, [50.0]) == []  # nothing left for attention


def _sweep(tmp_path: Path, *extra: str) -> int:
    return main(
        [
            "sim",
            "sweep",
            "--calibration",
            "h200-mps-v3",
            "--gpus",
            "3,4",
            "--ratios",
            "2:1,3:1,1:1",
            "--requests",
            "12",
            "--max-prompt-len",
            "4096",
            "--max-num-batched-tokens",
            "8192",
            "--no-progress",
            *extra,
        ]
    )


def test_sweep_over_ffn_shares_on_one_gpu(tmp_path: Path, capsys: Any) -> None:
    out, plot = tmp_path / "sweep.json", tmp_path / "sweep.png"
    argv = ["--ffn-shares", "25,50", "--modes", "async,sync", "--json", str(out)]
    code = _sweep(tmp_path, *argv, "--plot", str(plot))
    assert code == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    assert "the ranks share one GPU, FFN shares 25,50 %" in printed
    assert "| ranks on one GPU | best async A:F |" in printed
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = json.loads(out.read_text())
    points = report["points"]
    # 3 ranks: 2:1 at 25 % (attention 37.5 %) and 50 % (25 %); 4 ranks: 3:1 at both
    # (25 %, 16.67 %); 2:2 at 25 % (25 %; 50 % leaves nothing); two modes each.
    assert len(points) == (2 + 2 + 1) * 2
    shares = {(p["attention_ranks"], p["ffn_ranks"], p["ffn_share"]) for p in points}
    assert (2, 2, 50.0) not in shares
    for p in points:
        used = p["attention_ranks"] * p["attention_share"] + p["ffn_ranks"] * p["ffn_share"]
        assert used == pytest.approx(100.0)
        assert math.isfinite(p["tokens_per_s"])
        assert p["tokens_per_s"] > 0
    best = {row["gpus"]: row for row in report["best"]}
    assert "%" in best[3]["async"]["split"]


def test_sweep_over_ffn_shares_refuses_what_it_cannot_model(tmp_path: Path, capsys: Any) -> None:
    assert _sweep(tmp_path, "--ffn-shares", "25") == 2  # colocated is in the default modes
    assert "the monolithic model on the whole GPU" in capsys.readouterr().err
    assert _sweep(tmp_path, "--ffn-shares", "25,x", "--modes", "async") == 2
    assert "'x' is not a percent" in capsys.readouterr().err
    assert _sweep(tmp_path, "--ffn-shares", "25", "--ffn-share", "30", "--modes", "async") == 2
    assert "leave out --attention-share" in capsys.readouterr().err
    assert (
        _sweep(tmp_path, "--ffn-shares", "60", "--ratios", "1:2", "--gpus", "3", "--modes", "async")
        == 2
    )
    assert "at 1:2 every share leaves each attention rank under 1 %" in capsys.readouterr().err


# the shipped one-GPU measurements -----------------------------------------------------------
CALIBRATIONS = Path(costs.__file__).with_name("calibrations")
QUARTERS = ", attention 25 %, ffn 25 %"
"""The label suffix of a run whose every rank held 25 % of the SMs."""


@pytest.mark.parametrize(
    ("preset_name", "summary_line"),
    [
        (
            "v2-lite",
            "makespan_s: 10 of 12 within 15%, mean |error| 11.3%, worst 19.8%; ttft_p50: 7 of "
            "12 within 15%, mean |error| 17.2%, worst 53.3%",
        ),
        (
            "v3-slice",
            "makespan_s: 11 of 12 within 15%, mean |error| 8.1%, worst 19.7%; ttft_p50: 9 of "
            "12 within 15%, mean |error| 12.2%, worst 46.5%",
        ),
    ],
)
def test_the_quick_one_gpu_runs_validate_as_docs_sim_says(
    preset_name: str, summary_line: str, capsys: Any
) -> None:
    """docs/sim.md's one-GPU validation table, remade from the shipped measurements: the
    1A1F rows at 50 % of the SMs are predicted from the runs at 25 % (the share term)."""
    bundle = CALIBRATIONS / f"h200-mps-quick-{preset_name}-runs.json.gz"
    assert main(["sim", "validate", str(bundle), "--cores-grid", "none", "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert summary_line in printed
    assert (
        "| 1A1F uneven 12 req, budget 8192, stages 1, attention 50 %, ffn 50 % | async | 1 |"
        in printed
    )


def test_the_h100_runs_at_27_layers_validate_as_docs_sim_says(capsys: Any) -> None:
    """docs/sim.md's H100 table: v2-lite's 27 layers, 1A1F at 50 % of the SMs predicted
    from 2A1F at 25 % and back, every row within 15 % on makespan and TTFT p50; the
    shipped calibration is the fit on all five reports."""
    bundle = CALIBRATIONS / "h100-mps-v2-lite-27-runs.json.gz"
    assert main(["sim", "validate", str(bundle), "--cores-grid", "none", "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert (
        "makespan_s: 8 of 8 within 15%, mean |error| 4.8%, worst 11.8%; ttft_p50: 8 of 8 "
        "within 15%, mean |error| 6.7%, worst 12.3%"
    ) in printed
    assert (
        "| 1A1F uneven 48 req, budget 16384, stages 4, attention 50 %, ffn 50 % | async | 1 |"
        in printed
    )
    cal = costs.load("h100-mps-v2-lite-27")
    assert (cal.layers, cal.attention_share, cal.ffn_share) == (27, 50.0, 50.0)
    assert cal.attn_square_s > 0  # the step records separate the squared-length cost


def test_the_h100_arrivals_runs_are_predicted_as_docs_sim_says(capsys: Any) -> None:
    """docs/sim.md's measured arrivals (2026-12-06): fitted on the all-at-once H100 runs,
    the simulator predicts async under Poisson arrivals within 18 % and sync 34-77 % slow
    on TTFT p50; each row names its arrival rate."""
    fit = CALIBRATIONS / "h100-mps-v2-lite-27-runs.json.gz"
    arrivals = CALIBRATIONS / "h100-mps-v2-lite-27-arrivals-runs.json.gz"
    argv = ["sim", "validate", str(fit), "--cores-grid", "none", "--notify-grid", "50,200,500",
            "--idle-grid", "0,0.1", "--predict", str(arrivals), "--no-progress"]  # fmt: skip
    main(argv)
    printed = capsys.readouterr().out
    assert (
        "makespan_s: 3 of 4 within 15%, mean |error| 5.2%, worst 18.1%; ttft_p50: 1 of 4 "
        "within 15%, mean |error| 32.1%, worst 76.6%"
    ) in printed
    rows = {
        f"| 2A1F uneven 48 req at 4/s, budget 16384, stages 2{QUARTERS} | sync | 2 |": "| +34% |",
        f"| 2A1F uneven 48 req at 2/s, budget 16384, stages 2{QUARTERS} | sync | 1 |": "| +77% |",
        f"| 2A1F uneven 48 req at 4/s, budget 16384, stages 2{QUARTERS} | async | 2 |": "| +0% |",
    }
    for row, ttft_error in rows.items():
        line = next(line for line in printed.splitlines() if line.startswith(row))
        assert line.endswith(ttft_error), line


H100_RUNS = CALIBRATIONS / "h100-mps-v2-lite-27-runs.json.gz"
H100_MORE_RUNS = CALIBRATIONS / "h100-mps-v2-lite-27-more-runs.json.gz"


def test_the_new_h100_runs_are_none_of_the_fitted_ones() -> None:
    """The 2026-12-06 bundle holds seven runs, none of them a measurement the shipped
    calibration was fitted on: 2A1F at two and four stages, 3A1F and 2A2F."""
    from afd_tools.sim.measured import read_runs

    old, new = read_runs([H100_RUNS]), read_runs([H100_MORE_RUNS])
    assert not [n.source for n in new if any(n.same_measurement(o) for o in old)]
    assert sorted((r.attention_ranks, r.ffn_ranks, r.stages) for r in new) == [
        (2, 1, 2), (2, 1, 4), (2, 2, 1), (2, 2, 2), (3, 1, 1), (3, 1, 2), (3, 1, 4)
    ]  # fmt: skip
    assert all(r.role_split() == (25.0, 25.0) and r.layers == 27 for r in new)


def test_the_new_h100_runs_are_predicted_as_docs_sim_says(capsys: Any) -> None:
    """docs/sim.md's out-of-sample check (2026-12-06): fitted on the five runs of
    2026-12-05 (the shipped calibration's fit), the seven new runs -- 3A1F and 2A2F among
    them -- are predicted; three rows miss 15 %, all fast."""
    argv = ["sim", "validate", str(H100_RUNS), "--cores-grid", "none", "--notify-grid",
            "50,200,500", "--idle-grid", "0,0.1", "--predict", str(H100_MORE_RUNS),
            "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert (
        "makespan_s: 8 of 9 within 15%, mean |error| 8.8%, worst 17.4%; ttft_p50: 6 of 9 "
        "within 15%, mean |error| 11.3%, worst 22.4%; both within 15%: 6 of 9"
    ) in printed
    row = (
        f"| 3A1F uneven 48 req, budget 16384, stages 2{QUARTERS} | async | 1 | 9.270 (9.270–9.270) "
    )
    line = next(line for line in printed.splitlines() if line.startswith(row))
    assert line.endswith("| 7.661 | -17% | 4.255 (4.255–4.255) | 3.303 | -22% |"), line


def test_leaving_one_pair_out_of_all_twelve_h100_runs_as_docs_sim_says(capsys: Any) -> None:
    """docs/sim.md's leave-one-A:F-out on the old and new H100 runs together (1A1F, 2A1F,
    3A1F, 2A2F); the 2A1F two-stage async rows of both days are two repeats."""
    argv = ["sim", "validate", str(H100_RUNS), str(H100_MORE_RUNS), "--cores-grid", "none"]
    assert main([*argv, "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert (
        "makespan_s: 15 of 16 within 15%, mean |error| 6.7%, worst 16.5%; ttft_p50: 13 of 16 "
        "within 15%, mean |error| 8.1%, worst 21.8%; both within 15%: 13 of 16"
    ) in printed
    assert (
        f"| 2A1F uneven 48 req, budget 16384, stages 2{QUARTERS} | async | 2 "
        "| 9.591 (9.586–9.596) |" in printed
    )


def test_a_bundle_can_leave_out_the_runs_bundled_before(tmp_path: Path, capsys: Any) -> None:
    """``afd sim bundle --exclude``: the reports of the given files that another file
    already holds (the same deployment, requests and measurements, whatever their names)
    are left out, and the command says so; excluding every report is an error."""
    from afd_tools.sim.measured import read_runs

    out = tmp_path / "new.json.gz"
    argv = ["sim", "bundle", str(H100_RUNS), str(H100_MORE_RUNS), "-o", str(out)]
    assert main([*argv, "--exclude", str(H100_RUNS)]) == 0
    assert "7 reports" in capsys.readouterr().out
    kept, expected = read_runs([out]), read_runs([H100_MORE_RUNS])
    assert len(kept) == len(expected)
    assert all(k.same_measurement(e) for k, e in zip(kept, expected, strict=True))
    import gzip

    command = json.loads(gzip.decompress(out.read_bytes()))["command"]
    assert command.endswith(f"--exclude {H100_RUNS}")
    both = ["--exclude", str(H100_MORE_RUNS), str(H100_RUNS)]
    assert main([*argv, *both]) == 2
    assert "no measured runs that the excluded files do not already hold" in (
        capsys.readouterr().err
    )


@pytest.mark.parametrize(
    "name", ["h100-mps-v2-lite-27", "h200-mps-v3-full", "h100-mps-v2-lite-27-fixed"]
)
def test_a_shipped_mps_calibration_is_its_command_on_its_runs(tmp_path: Path, name: str) -> None:
    """A shipped one-GPU calibration is what its own ``command`` fits on the shipped runs:
    every coefficient equal (only where and when it was written differ)."""
    import shlex

    shipped = json.loads((CALIBRATIONS / f"{name}.json").read_text())
    argv = shlex.split(shipped["command"])[1:]  # drop "afd"
    out = argv.index("-o") + 1
    root = Path(__file__).resolve().parents[2]
    argv = [str(root / a) if a.startswith("tools/") else a for a in argv]
    argv[out] = str(tmp_path / "refit.json")
    assert main([*argv, "--no-progress"]) == 0
    refit = json.loads((tmp_path / "refit.json").read_text())
    for key in ("command", "date"):
        shipped.pop(key)
        refit.pop(key)
    _assert_same_fit(refit, shipped)


def _assert_same_fit(got: Any, shipped: Any, where: str = "calibration") -> None:
    """``got`` is ``shipped``: the same keys, texts and counts, every float within 1e-9 of
    it (a refit's last digits follow the BLAS build and its threads: 2.8283837248884405e-05
    against 2.828383724888429e-05 on this VM), and no NaN or inf anywhere."""
    if isinstance(shipped, dict):
        assert isinstance(got, dict), where
        assert sorted(got) == sorted(shipped), where
        for key in shipped:
            _assert_same_fit(got[key], shipped[key], f"{where}.{key}")
    elif isinstance(shipped, list):
        assert isinstance(got, list), where
        assert len(got) == len(shipped), where
        for index, (g, s) in enumerate(zip(got, shipped, strict=True)):
            _assert_same_fit(g, s, f"{where}[{index}]")
    elif isinstance(shipped, float):
        assert isinstance(got, float | int), where
        assert math.isfinite(got), where
        assert math.isfinite(shipped), where
        assert got == pytest.approx(shipped, rel=1e-9, abs=0.0), where
    else:
        assert got == shipped, where


H100_V2_LITE = ["--calibration", "h100-mps-v2-lite-27", "--attention-share", "25",
                "--ffn-share", "25"]  # fmt: skip
H200_V3_SLICE = ["--calibration", "h200-mps-quick-v3", "--layers", "4", "--any-preset"]


@pytest.mark.parametrize(
    ("calibration", "rate", "expected"),
    [(H100_V2_LITE, 2, {"async": (44, 1.97, 0.49, 2.71, 8669),
                         "sync": (28, 1.25, 1.53, 4.54, 8643)}),
     (H100_V2_LITE, 4, {"async": (33, 2.80, 1.36, 4.81, 16447),
                         "sync": (12, 0.80, 3.68, 8.11, 12905)}),
     (H200_V3_SLICE, 2, {"async": (42, 1.88, 0.54, 2.85, 8673),
                          "sync": (27, 1.21, 1.54, 4.94, 8657)}),
     (H200_V3_SLICE, 4, {"async": (31, 2.55, 1.32, 5.24, 15920),
                          "sync": (13, 0.83, 3.93, 8.81, 12363)}),
     (H200_V3_SLICE, 8, {"async": (16, 1.55, 3.25, 6.71, 18813),
                          "sync": (11, 0.81, 5.32, 10.01, 14326)})],
)  # fmt: skip
def test_the_arrivals_projections_are_what_docs_sim_published(
    calibration: list[str],
    rate: int,
    expected: dict[str, tuple[int, float, float, float, int]],
    tmp_path: Path,
    capsys: Any,
) -> None:
    """docs/sim.md's projections of TTFT under Poisson arrivals (the H100's v2-lite and the
    H200's v3-slice main-job benchmarks), written before the GPU runs: per mode, the
    requests within a 2 s TTFT, the goodput, TTFT p50 and p99, and tokens/s."""
    from afd_tools.prefill.metrics import ModeSummary

    out = tmp_path / "sim.json"
    argv = ["sim", *calibration, "--attention-ranks", "2", "--ffn-ranks", "1", "--workload",
            "uneven", "--requests", "48", "--max-prompt-len", "16384",
            "--max-num-batched-tokens", "16384", "--stages", "2", "--rate", str(rate),
            "--mode", "all", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    capsys.readouterr()
    modes = json.loads(out.read_text())["modes"]
    for mode, (met, goodput, p50, p99, tokens_per_s) in expected.items():
        summary = ModeSummary.from_json(modes[mode], "sim.json")
        assert sum(1 for t in summary.ttft_s if t <= 2.0) == met
        assert summary.goodput(2.0) == pytest.approx(goodput, abs=0.005)
        assert summary.ttft_p50 == pytest.approx(p50, abs=0.005)
        assert summary.ttft_p99 == pytest.approx(p99, abs=0.005)
        assert round(summary.tokens_per_s) == tokens_per_s


def _assert_projected(
    argv: list[str],
    rate: int | None,
    out: Path,
    expected: dict[str, tuple[int, float, float]],
    capsys: Any,
) -> None:
    """``afd sim`` with ``argv`` (at Poisson ``rate`` when given, its JSON at ``out``) gives
    per mode the published tokens/s (rounded) and TTFT p50 and p99 (to 5 ms; NaN fails)."""
    from afd_tools.prefill.metrics import ModeSummary

    if rate is not None:
        argv = [*argv, "--rate", str(rate)]
    assert main(argv) == 0
    capsys.readouterr()
    modes = json.loads(out.read_text())["modes"]
    for mode, (tokens_per_s, p50, p99) in expected.items():
        summary = ModeSummary.from_json(modes[mode], "sim.json")
        assert round(summary.tokens_per_s) == tokens_per_s
        assert summary.ttft_p50 == pytest.approx(p50, abs=0.005)
        assert summary.ttft_p99 == pytest.approx(p99, abs=0.005)


def _fixed(ffn_share: int) -> list[str]:
    """h100-mps-v2-lite-27-fixed's options with every attention rank at 25 % of the SMs and
    the FFN rank at ``ffn_share``."""
    return ["--calibration", "h100-mps-v2-lite-27-fixed", "--preset", "v2-lite",
            "--attention-share", "25", "--ffn-share", str(ffn_share)]  # fmt: skip


BEFORE, RR, LT = H100_V2_LITE, "round-robin", "least-tokens"
V2_LITE_27_PROJECTED: list[
    tuple[list[str], int, int | None, str, dict[str, tuple[int, float, float]]]
] = [
    # main-job's assign-v2-lite and arrivals-assign-v2-lite (requests balanced by tokens
    # given, beside round-robin), with the fit from before the lower-right fix
    (BEFORE, 3, None, RR, {"async": (25281, 3.30, 7.66), "sync": (20895, 3.65, 9.27)}),
    (BEFORE, 3, None, LT, {"async": (28323, 4.90, 6.84), "sync": (24990, 5.81, 7.75)}),
    (BEFORE, 2, None, RR, {"async": (22686, 4.43, 8.54), "sync": (17289, 5.75, 11.20)}),
    (BEFORE, 2, None, LT, {"async": (23113, 5.58, 8.38), "sync": (16770, 7.95, 11.55)}),
    (BEFORE, 2, 4, RR, {"async": (16447, 1.36, 4.81), "sync": (12905, 3.68, 8.11)}),
    (BEFORE, 2, 4, LT, {"async": (16988, 1.13, 3.24), "sync": (13519, 3.50, 6.76)}),
    # split-v2-lite and arrivals-v2-lite after the fix, beside the two rows of its fit
    (_fixed(50), 2, None, RR, {"async": (30177, 3.23, 6.42), "sync": (23598, 4.21, 8.21)}),
    (_fixed(25), 2, None, RR, {"async": (26503, 3.83, 7.31), "sync": (19704, 5.03, 9.83)}),
    (_fixed(25), 2, 4, RR, {"async": (17296, 0.67, 2.73), "sync": (14547, 2.45, 6.48)}),
    (_fixed(25), 2, 2, RR, {"async": (8703, 0.37, 2.03), "sync": (8677, 1.25, 3.44)}),
    (_fixed(25), 2, 4, LT, {"async": (17296, 0.75, 2.39), "sync": (15499, 2.26, 5.06)}),
]  # fmt: skip
"""docs/sim.md's projections at v2-lite's 27 layers on the H100, each written before its GPU
run: (calibration options, attention ranks, rate or all at once, assignment, per mode
tokens/s and TTFT p50 and p99)."""


@pytest.mark.parametrize(
    ("calibration", "attention_ranks", "rate", "assign", "expected"), V2_LITE_27_PROJECTED
)
def test_the_v2_lite_27_projections_are_what_docs_sim_published(
    calibration: list[str],
    attention_ranks: int,
    rate: int | None,
    assign: str,
    expected: dict[str, tuple[int, float, float]],
    tmp_path: Path,
    capsys: Any,
) -> None:
    """:data:`V2_LITE_27_PROJECTED`: the 48 uneven requests up to 16K of the H100's
    main-job rows, A:1F, two stages, every mode; per mode tokens/s and TTFT p50 and p99."""
    out = tmp_path / "sim.json"
    argv = ["sim", *calibration, "--attention-ranks", str(attention_ranks), "--ffn-ranks",
            "1", "--workload", "uneven", "--requests", "48", "--max-prompt-len", "16384",
            "--max-num-batched-tokens", "16384", "--stages", "2", "--mode", "all",
            "--assign", assign, "--json", str(out)]  # fmt: skip
    _assert_projected(argv, rate, out, expected, capsys)


@pytest.mark.parametrize(
    ("attention_ranks", "ffn_ranks", "mix", "expected"),
    [(2, 1, "uneven", {1: (25595, 19340), 2: (25871, 19340)}),
     (2, 1, "long", {1: (14089, 11410), 2: (14079, 11301)}),
     (3, 1, "long", {1: (22043, 15802), 2: (21994, 15540)}),
     (2, 2, "uneven", {1: (29192, 23212), 2: (29192, 23212)})],
)  # fmt: skip
def test_the_ffn_batching_projections_are_what_docs_sim_published(
    attention_ranks: int,
    ffn_ranks: int,
    mix: str,
    expected: dict[int, tuple[int, int]],
    tmp_path: Path,
    capsys: Any,
) -> None:
    """docs/sim.md's what-if of FFN batching across replicas on one H200 (h200-mps-v3-full,
    two stages): async and sync tokens/s with one item per grouped GEMM and with up to two,
    on the uneven mix and the full long mix."""
    from afd_tools.bench.prefill_matrix import FULL, workload_lengths
    from afd_tools.prefill.metrics import ModeSummary

    if mix == "long":
        lengths = workload_lengths("long", "v3-slice", FULL, 0)
        assert lengths is not None
        workload = tmp_path / "full-long.jsonl"
        workload.write_text("".join(json.dumps({"prompt_len": n}) + "\n" for n in lengths))
        mix_args = ["--workload-file", str(workload)]
    else:
        mix_args = ["--workload", "uneven", "--requests", "48", "--max-prompt-len", "16384"]
    for batch, (async_tokens_per_s, sync_tokens_per_s) in expected.items():
        out = tmp_path / f"sim-{batch}.json"
        argv = ["sim", "--calibration", "h200-mps-v3-full", "--preset", "v3-slice",
                "--layers", "4", "--attention-ranks", str(attention_ranks), "--ffn-ranks",
                str(ffn_ranks), *mix_args, "--max-num-batched-tokens", "16384", "--stages",
                "2", "--mode", "all", "--ffn-batch", str(batch), "--no-progress",
                "--json", str(out)]  # fmt: skip
        assert main(argv) == 0
        capsys.readouterr()
        modes = json.loads(out.read_text())["modes"]
        got = {m: ModeSummary.from_json(modes[m], "sim.json").tokens_per_s for m in modes}
        assert all(math.isfinite(v) for v in got.values()), got
        assert (round(got["async"]), round(got["sync"])) == (
            async_tokens_per_s,
            sync_tokens_per_s,
        ), (batch, got)


def test_a_bundle_keeps_one_preset_when_asked(tmp_path: Path, capsys: Any) -> None:
    source = CALIBRATIONS / "h200-mps-quick-v3-slice-runs.json.gz"
    out = tmp_path / "v3.json.gz"
    assert main(["sim", "bundle", str(source), "--preset", "v3-slice", "-o", str(out)]) == 0
    assert "8 reports" in capsys.readouterr().out
    assert main(["sim", "bundle", str(source), "--preset", "v2-lite", "-o", str(out)]) == 2
    assert "no measured runs of preset v2-lite" in capsys.readouterr().err


def test_calibrating_the_one_gpu_runs_says_where_the_barrier_and_shares_are(
    tmp_path: Path, capsys: Any
) -> None:
    """The quick v3-slice runs (1A1F at 50 %, the rest at 25 %): stated at 25 %, the
    host barrier, and the squared-length cost named as not determined (no step records)."""
    bundle = CALIBRATIONS / "h200-mps-quick-v3-slice-runs.json.gz"
    out = tmp_path / "cal.json"
    argv = ["sim", "calibrate", str(bundle), "--cores-grid", "none", "-o", str(out)]
    assert main([*argv, "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert (
        "  sync barrier: on the host (reached at launch); SM shares per rank: attention 25 %, "
        "FFN 25 %" in printed
    )
    assert "not determined, set to 0: attn_square_s" in printed
    cal = costs.load(str(out))
    assert (cal.attention_share, cal.ffn_share, cal.host_barrier) == (25.0, 25.0, True)


LONG_BUNDLE = CALIBRATIONS / "h200-mps-quick-2a1f-long-runs.json.gz"


def test_a_fit_on_the_uneven_mix_predicts_the_long_mix_it_never_saw(capsys: Any) -> None:
    """docs/sim.md's held-out-workload table: fitted on the quick uneven runs (the four A:F
    pairs, and 2A1F again with per-step records, which determine attention's squared-length
    cost), the simulator predicts the 2A1F long-prompt runs (8K-16K tokens, twice the
    longest uneven prompt) within 15 % on makespan and TTFT p50, every mode."""
    bundle = CALIBRATIONS / "h200-mps-quick-v3-slice-runs.json.gz"
    argv = ["sim", "validate", str(bundle), str(LONG_BUNDLE), "--hold-out", "workload"]
    assert main([*argv, "--cores-grid", "none", "--no-progress"]) == 0
    printed = capsys.readouterr().out
    long_rows = [line for line in printed.splitlines() if "v3-slice-long" in line]
    assert len(long_rows) == 3, printed  # async N=1, sync, async N=2
    for line in long_rows:
        cells = [cell.strip() for cell in line.split("|")]
        errors = [cell for cell in cells[3:] if cell.endswith("%")]  # past config and mode
        assert len(errors) == 2, line
        assert all(abs(int(e.rstrip("%"))) <= 15 for e in errors), line


def test_without_step_records_the_long_mix_is_not_predicted(capsys: Any) -> None:
    """The same held-out long runs from a fit on the older uneven runs alone (no per-step
    records: the squared-length cost is not determined and set to 0) are predicted a third
    to more than half too fast (-33 to -57 % of their makespan): what the step records are
    for."""
    from afd_tools.sim.measured import read_runs
    from afd_tools.sim.validate import predict_held_out

    old = read_runs([CALIBRATIONS / "h200-mps-quick-v3-slice-runs.json.gz"])
    long_runs = [r for r in read_runs([LONG_BUNDLE]) if r.workload != "uneven"]
    assert long_runs
    predictions = predict_held_out(old, long_runs, cores_grid=[None])
    assert "attn_square_s" in predictions[0].not_determined
    assert all(p.error("makespan_s") < -0.25 for p in predictions), [
        (p.mode, p.error("makespan_s")) for p in predictions
    ]


FULL_LONG_BUNDLE = CALIBRATIONS / "h200-mps-full-2a1f-long-runs.json.gz"
FULL_2A2F_LONG_BUNDLE = CALIBRATIONS / "h200-mps-full-2a2f-long-runs.json.gz"


def test_the_quick_runs_predict_the_full_size_long_runs(capsys: Any) -> None:
    """docs/sim.md's full-size predictions: one fit on the quick runs (v3-slice 2 layers,
    prompts up to 16K) predicts the full-size long runs (4 layers, 16 prompts of 9.5K-27K)
    as the tables there say: 2A1F (three launches) within 3 % on makespan and TTFT p50,
    2A2F (two launches, measured after the fit was published) within 9 %, async and sync
    (``afd sim validate --predict``: fitted once, nothing of the predicted runs in it;
    naming a run on both sides is refused)."""
    argv = ["sim", "validate", str(CALIBRATIONS / "h200-mps-quick-v3-slice-runs.json.gz")]
    argv += [str(LONG_BUNDLE), "--cores-grid", "none", "--no-progress"]
    predict = ["--predict", str(FULL_LONG_BUNDLE), str(FULL_2A2F_LONG_BUNDLE)]
    assert main([*argv, *predict]) == 0
    printed = capsys.readouterr().out
    rows = [line for line in printed.splitlines() if "16 req, budget 16384, stages 2" in line]
    expected = [("2A1F", "async", 3, 3), ("2A1F", "sync", 3, 3)]
    expected += [("2A2F", "async", 2, 9), ("2A2F", "sync", 2, 9)]
    assert len(rows) == len(expected), printed
    for line, (pair, mode, launches, bound) in zip(rows, expected, strict=True):
        cells = [cell.strip() for cell in line.split("|")]
        assert cells[1].startswith(f"{pair} v3-slice-long"), line
        assert cells[2] == mode, line
        assert cells[3] == str(launches), line  # the launches, as repeats
        errors = [cell for cell in cells[3:] if cell.endswith("%")]  # past config and mode
        assert len(errors) == 2, line
        assert all(abs(int(e.rstrip("%"))) <= bound for e in errors), line
    assert main([*argv, *predict, "--hold-out", "workload"]) == 2
    assert "--predict fits once and predicts the runs it names" in capsys.readouterr().err
    assert main([*argv, "--predict", str(LONG_BUNDLE)]) == 2
    refused = capsys.readouterr().err
    assert "are also among the runs fitted on, so the prediction would be in-sample" in refused


def test_hold_out_needs_two_groups_and_a_known_kind() -> None:
    from afd_tools.sim.measured import read_runs
    from afd_tools.sim.validate import folds

    runs = read_runs([LONG_BUNDLE])
    assert folds(runs, "workload") == ["uneven", "v3-slice-long"]
    with pytest.raises(SimError, match="needs runs of at least two A:F pairs; these have 2A1F"):
        folds(runs, "pair")
    with pytest.raises(SimError, match="hold_out 'preset': choose one of pair, workload"):
        folds(runs, "preset")


H200_FULL_RUNS = CALIBRATIONS / "h200-mps-full-v3-runs.json.gz"
H200_3A1F_RUNS = CALIBRATIONS / "h200-mps-full-3a1f-long-runs.json.gz"
H200_MORE_RUNS = CALIBRATIONS / "h200-mps-full-v3-more-runs.json.gz"
"""The six runs of 2026-12-07 (balanced mix, long mix at two stages, pull under arrivals)."""
GRID_ARGS = ["--cores-grid", "none", "--notify-grid", "50,200,500", "--idle-grid", "0,0.1"]


@pytest.mark.parametrize(
    ("argv", "summary_line"),
    [
        (
            [str(H200_FULL_RUNS), "--hold-out", "workload"],
            "makespan_s: 13 of 13 within 15%, mean |error| 3.8%, worst 10.6%; ttft_p50: 10 of "
            "13 within 15%, mean |error| 13.2%, worst 47.5%",
        ),
        (
            [str(H200_FULL_RUNS), "--predict", str(H200_3A1F_RUNS)],
            "makespan_s: 2 of 2 within 15%, mean |error| 6.4%, worst 11.2%; ttft_p50: 2 of 2 "
            "within 15%, mean |error| 5.3%, worst 10.0%",
        ),
        (
            [str(H200_FULL_RUNS), str(H200_3A1F_RUNS)],
            "makespan_s: 15 of 15 within 15%, mean |error| 5.8%, worst 11.5%; ttft_p50: 10 of "
            "15 within 15%, mean |error| 22.5%, worst 132.0%",
        ),
        (
            [str(H200_FULL_RUNS), "--predict", str(H200_MORE_RUNS)],
            "makespan_s: 11 of 11 within 15%, mean |error| 1.8%, worst 4.0%; ttft_p50: 10 of "
            "11 within 15%, mean |error| 6.1%, worst 24.2%",
        ),
        (
            [str(H200_FULL_RUNS), str(H200_MORE_RUNS)],
            "makespan_s: 22 of 22 within 15%, mean |error| 3.0%, worst 7.4%; ttft_p50: 19 of "
            "22 within 15%, mean |error| 8.4%, worst 35.1%",
        ),
    ],
)
def test_the_h200_runs_after_the_lower_right_fix_validate_as_docs_sim_says(
    argv: list[str], summary_line: str, capsys: Any
) -> None:
    """docs/sim.md's current H200 table (checks 2-6), remade from the shipped runs of
    2026-12-06 and 2026-12-07: one workload held out, 3A1F at 3 layers from the 4-layer 2A1F
    fit, one A:F pair held out, the later runs predicted out of sample, and one pair held
    out over both."""
    main(["sim", "validate", *argv, *GRID_ARGS, "--no-progress"])
    assert summary_line in capsys.readouterr().out


def test_the_h200_calibration_after_the_fix_is_the_fit_of_its_bundle() -> None:
    """h200-mps-v3-full: fitted on the eleven reports of its bundle, at 25 % per rank and 4
    layers, with all three attention terms determined by the step records."""
    cal = costs.load("h200-mps-v3-full")
    assert (cal.layers, cal.attention_share, cal.ffn_share) == (4, 25.0, 25.0)
    assert min(cal.attn_fixed_s, cal.attn_token_s, cal.attn_square_s) > 0
    assert H200_FULL_RUNS.name in cal.command


PULL_PROJECTED: list[tuple[int | None, str, dict[str, tuple[int, float, float]]]] = [
     (None, "pull", {"async": (25163, 4.58, 7.70), "sync": (18591, 6.59, 10.42)}),
     (2, "pull", {"async": (8664, 0.51, 1.51), "sync": (8676, 1.03, 3.26)}),
     (4, "pull", {"async": (17144, 0.93, 2.66), "sync": (15716, 2.08, 5.44)}),
     (8, "pull", {"async": (23020, 2.38, 4.56), "sync": (17526, 4.57, 7.17)}),
     (8, "least-tokens", {"async": (23109, 2.50, 4.27), "sync": (16990, 4.88, 7.64)}),
     (8, "round-robin", {"async": (21378, 2.60, 5.49), "sync": (16461, 4.49, 7.81)})]  # fmt: skip
"""docs/sim.md's projection of --assign pull at the budget of main-job's arrivals-pull:
(rate or all at once, policy, per mode tokens/s and TTFT p50 and p99)."""


@pytest.mark.parametrize("case", PULL_PROJECTED)
def test_the_pull_projection_is_what_docs_sim_published(
    case: tuple[int | None, str, dict[str, tuple[int, float, float]]], tmp_path: Path, capsys: Any
) -> None:
    """:data:`PULL_PROJECTED` (h200-mps-v3-full, v3-slice 4 layers, 2A1F, two stages),
    written before the GPU run."""
    rate, assign, expected = case
    out = tmp_path / "sim.json"
    argv = ["sim", "--calibration", "h200-mps-v3-full", "--preset", "v3-slice", "--layers",
            "4", "--attention-ranks", "2", "--ffn-ranks", "1", "--workload", "uneven",
            "--requests", "48", "--max-prompt-len", "16384", "--max-num-batched-tokens",
            "16384", "--stages", "2", "--mode", "all", "--colocated", "dp", "--assign", assign,
            "--json", str(out)]  # fmt: skip
    _assert_projected(argv, rate, out, expected, capsys)


V3_FULL_SWEPT: dict[tuple[int, int, float | None], tuple[int, int]] = {
    (2, 1, None): (25595, 19340),
    (2, 2, None): (29192, 23212),
    (3, 1, None): (25492, 22911),
    (2, 1, 20.0): (22561, 22727),
    (2, 1, 25.0): (27661, 24608),
    (2, 1, 33.3): (34068, 25741),
    (2, 1, 40.0): (33843, 25349),
    (2, 1, 50.0): (29257, 23254),
    (3, 1, 33.3): (29744, 23217),
    (2, 2, 20.0): (33776, 25300),
}
"""docs/sim.md's sweeps with h200-mps-v3-full: (A, F, FFN share of one GPU or None for a
rank per 25 % "GPU") -> async and sync tokens/s."""


H100_FIXED_SWEPT: dict[tuple[int, int, float | None], tuple[int, int]] = {
    (2, 1, None): (26503, 19704),
    (2, 2, None): (29631, 23250),
    (3, 1, None): (26167, 23369),
    (2, 1, 25.0): (28085, 25171),
    (2, 1, 33.3): (35228, 26145),
    (2, 1, 40.0): (34990, 25697),
    (2, 1, 50.0): (30177, 23598),
    (3, 1, 33.3): (30433, 23902),
    (2, 2, 20.0): (34426, 25285),
}
"""docs/sim.md's sweeps with h100-mps-v2-lite-27-fixed: (A, F, FFN share of one GPU or None
for a rank per 25 % "GPU") -> async and sync tokens/s."""
SWEPT_AFTER_THE_FIX = {
    "h200-mps-v3-full": ("v3-slice", ["--layers", "4"], V3_FULL_SWEPT),
    "h100-mps-v2-lite-27-fixed": ("v2-lite", [], H100_FIXED_SWEPT),
}
"""Each calibration after the lower-right fix whose sweeps docs/sim.md publishes: its preset,
its layer option and the published rows."""


@pytest.mark.parametrize("one_gpu", [False, True])
@pytest.mark.parametrize("calibration", ["h200-mps-v3-full", "h100-mps-v2-lite-27-fixed"])
def test_the_sweeps_with_the_calibrations_after_the_fix_are_what_docs_sim_published(
    calibration: str, one_gpu: bool, tmp_path: Path, capsys: Any
) -> None:
    """The A:F sweep (one rank per quarter-GPU) and the split of one GPU (--ffn-shares), on
    the uneven mix at two stages: every published row's async and sync tokens/s, each
    finite."""
    preset, layers, swept = SWEPT_AFTER_THE_FIX[calibration]
    out = tmp_path / "sweep.json"
    argv = ["sim", "sweep", "--calibration", calibration, "--preset", preset, *layers,
            "--gpus", "3,4", "--modes", "async,sync", "--workload", "uneven",
            "--requests", "48", "--max-prompt-len", "16384", "--max-num-batched-tokens",
            "16384", "--stages", "2", "--no-progress", "--json", str(out)]  # fmt: skip
    if one_gpu:
        argv += ["--ratios", "2:1,3:1,2:2", "--ffn-shares", "20,25,33.3,40,50"]
    assert main(argv) == 0
    capsys.readouterr()
    got = {
        (p["attention_ranks"], p["ffn_ranks"], p["ffn_share"], p["mode"]): p["tokens_per_s"]
        for p in json.loads(out.read_text())["points"]
    }
    assert all(math.isfinite(v) for v in got.values())
    published = {k: v for k, v in swept.items() if (k[2] is not None) == one_gpu}
    assert published
    for (a, f, share), (async_tps, sync_tps) in published.items():
        assert round(got[(a, f, share, "async")]) == async_tps, (a, f, share)
        assert round(got[(a, f, share, "sync")]) == sync_tps, (a, f, share)


H100_FIXED_RUNS = CALIBRATIONS / "h100-mps-v2-lite-27-fixed-runs.json.gz"
"""The H100's four runs after the lower-right fix (2026-12-07: 3A1F and 2A1F least-tokens,
2A1F round-robin, 2A1F least-tokens under arrivals at 4/s)."""
H100_STATE = Path(__file__).resolve().parents[1] / "gpu" / "main-job-state" / "h100-80gb"


@pytest.mark.parametrize(
    ("argv", "lines"),
    [
        (
            [str(H100_RUNS), "--predict", str(H100_FIXED_RUNS)],
            [
                "the fit on the runs given: set to 0, ffn_expert_s: not separable from "
                "ffn_row_s, ffn_item_s in these measurements (FFN time per item)",
                "makespan_s: 5 of 8 within 15%, mean |error| 12.3%, worst 23.0%; ttft_p50: 4 "
                "of 8 within 15%, mean |error| 30.3%, worst 100.4%; both within 15%: 4 of 8",
            ],
        ),
        (
            [str(H100_FIXED_RUNS)],
            [
                "makespan_s: 8 of 8 within 15%, mean |error| 6.0%, worst 12.6%; ttft_p50: 6 of "
                "8 within 15%, mean |error| 12.4%, worst 45.1%; both within 15%: 6 of 8",
            ],
        ),
        (
            [str(H100_STATE / "assign-v2-lite.json"), str(H100_STATE / "depth-v2-lite.json"),
             "--predict", str(H100_STATE / "arrivals-assign-v2-lite.json")],
            [
                "makespan_s: 2 of 2 within 15%, mean |error| 2.3%, worst 4.4%; ttft_p50: 0 of "
                "2 within 15%, mean |error| 20.8%, worst 25.3%; both within 15%: 0 of 2",
            ],
        ),
    ],
)  # fmt: skip
def test_the_h100_runs_after_the_lower_right_fix_validate_as_docs_sim_says(
    argv: list[str], lines: list[str], capsys: Any
) -> None:
    """docs/sim.md's H100 table after the fix: the fit from before it predicting the runs
    after it (one fit, so one line for what it left undetermined, not one per run), one A:F
    pair held out, and the arrivals run from the all-at-once ones."""
    assert main(["sim", "validate", *argv, *GRID_ARGS, "--no-progress"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-len(lines) :] == lines
    folds = [line for line in out if line.startswith("fold without")]
    if "--predict" in argv:
        assert folds == []
    else:  # 2A1F held out: 3A1F's one run cannot separate the FFN's per-expert cost
        assert len(folds) == 3
        assert all(f.startswith("fold without 2A1F") and "ffn_expert_s" in f for f in folds)


def test_the_h100_calibration_after_the_fix_is_the_fit_of_its_bundle() -> None:
    """h100-mps-v2-lite-27-fixed: the four runs of its bundle, at 25 % per rank and 27
    layers, every coefficient determined (the step records separate the attention terms)."""
    cal = costs.load("h100-mps-v2-lite-27-fixed")
    assert (cal.layers, cal.attention_share, cal.ffn_share) == (27, 25.0, 25.0)
    assert min(cal.attn_fixed_s, cal.attn_token_s, cal.attn_square_s) > 0
    assert H100_FIXED_RUNS.name in cal.command
    assert (
        json.loads((CALIBRATIONS / "h100-mps-v2-lite-27-fixed.json").read_text())["fit"][
            "not_determined"
        ]
        == {}
    )
