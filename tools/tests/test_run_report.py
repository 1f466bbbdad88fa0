"""The typed ``afd run --json`` report: it round-trips, a malformed one names the file and
the field, and the simulator reads a real run's report as it read the unversioned one."""

from __future__ import annotations

import dataclasses
import gzip
import json
import re
from importlib import resources
from pathlib import Path
from typing import Any

import pytest

from afd_tools.cli import main
from afd_tools.outputs import json_safe
from afd_tools.prefill.layer_times import LayerBreakdown
from afd_tools.prefill.metrics import ModeSummary
from afd_tools.prefill.run_report import SCHEMA, Deployment, RunReport
from afd_tools.prefill.typed_json import ReportError
from afd_tools.prefill.workload import Request
from afd_tools.sim.costs import SimError, Wire
from afd_tools.sim.measured import parse_legacy_report, parse_report, read_runs

BUNDLE = Path(str(resources.files("afd_tools.sim") / "calibrations" / "cpu-tiny-runs.json.gz"))

DEPLOYMENT = Deployment(
    device="cpu",
    preset="tiny",
    layers=None,
    dtype="float32",
    attention_ranks=2,
    ffn_ranks=1,
    max_num_batched_tokens=64,
    stages=2,
    colocated="dp",
    assign="round-robin",
    wire_format="per_rank",
    combine_reduce="ffn",
    shared="attention",
    transport="shm",
    backend="reference",
    workload="uneven",
    workload_file="/data/prompts.jsonl",
    max_prompt_len=48,
    rate=12.5,
    seed=3,
)


def _summary(mode: str, makespan: float) -> ModeSummary:
    return ModeSummary(
        mode=mode,
        makespan_s=makespan,
        tokens_per_s=100 / makespan,
        ttft_p50=0.25,
        ttft_p90=0.5,
        ttft_p99=0.75,
        attention_busy=[0.9, 0.8],
        attention_wait=[0.1, 0.2],
        ffn_busy=[0.4],
        dummy_batches=2,
        breakdown=LayerBreakdown(moe_layers=12.0, compute_ms_per_layer=1.5, ffn_items=6.0),
    )


def _report() -> RunReport:
    return RunReport(
        deployment=DEPLOYMENT,
        requests=(Request(0, 40, 0.0, 0, (5, 6, 7)), Request(1, 8, 0.125, 1)),
        modes={"async": _summary("async", 1.0), "sync": _summary("sync", 1.25)},
        ratios={"async/sync tokens/s": 1.25},
        placement={"kind": "cpu", "attention": ["cpu", "cpu"], "ffn": ["cpu"]},
        verification={"verification_failures": {}, "verification_tolerance": 1e-5},
        args={"device": "cpu", "requests": "2"},
    )


def test_a_report_round_trips_through_json_text() -> None:
    report = _report()
    data = json.loads(json.dumps(json_safe(report.to_json()), allow_nan=False))
    assert data["schema"] == SCHEMA
    assert data["deployment"]["max_num_batched_tokens"] == 64
    assert data["verification_failures"] == {}  # verdict fields stay at the top level
    assert RunReport.from_json(data, "run.json") == report
    assert DEPLOYMENT.workload_name == "prompts"


def test_a_float_that_is_not_finite_reads_back() -> None:
    report = dataclasses.replace(_report(), ratios={"async/sync tokens/s": float("inf")})
    data = json.loads(json.dumps(json_safe(report.to_json()), allow_nan=False))
    assert data["ratios"]["async/sync tokens/s"] == "inf"
    assert RunReport.from_json(data, "run.json").ratios["async/sync tokens/s"] == float("inf")


def _broken(change: Any) -> dict[str, Any]:
    data = json.loads(json.dumps(_report().to_json()))
    change(data)
    return data


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d["deployment"].pop("dtype"), "field 'deployment.dtype' is missing"),
        (
            lambda d: d["deployment"].update(attention_ranks="2"),
            "field 'deployment.attention_ranks' must be int, got '2'",
        ),
        (
            lambda d: d["deployment"].update(ffn_ranks=True),
            "field 'deployment.ffn_ranks' must be int",
        ),
        (
            lambda d: d["modes"]["sync"].update(makespan_s="slow"),
            "field 'modes.sync.makespan_s' must be float",
        ),
        (
            lambda d: d["modes"]["async"]["attention_busy"].append(None),
            r"field 'modes.async.attention_busy\[2\]' must be float",
        ),
        (lambda d: d["modes"]["async"].update(mode="sync"), "field 'modes.async.mode' is 'sync'"),
        (
            lambda d: d["requests"][1].pop("prompt_len"),
            r"field 'requests\[1\].prompt_len' is missing",
        ),
        (
            lambda d: d["modes"]["async"]["breakdown"].update(compute_ms_per_layer="fast"),
            r"field 'modes.async.breakdown.compute_ms_per_layer' must be float \| None, got 'fast'",
        ),
        (
            lambda d: d["modes"]["sync"]["breakdown"].update(compute_ms=1.0),
            "field 'modes.sync.breakdown.compute_ms' is not a breakdown field",
        ),
        (
            lambda d: d["modes"]["sync"]["breakdown"].update(ffn_ms_per_item="nan"),
            "field 'modes.sync.breakdown.ffn_ms_per_item' must be finite, got 'nan'",
        ),
        (
            lambda d: d["modes"]["async"].update(breakdown=[1.5]),
            "field 'modes.async.breakdown' must be an object",
        ),
        (
            lambda d: d["modes"]["async"].pop("breakdown"),
            "field 'modes.async.breakdown' is missing",
        ),
        (lambda d: d.pop("modes"), "field 'modes' is missing"),
        (
            lambda d: d.update(schema="afd-run-report/9"),
            "field 'schema' is 'afd-run-report/9': this afd reads run reports of schema "
            "'afd-run-report/2'",
        ),
    ],
)
def test_a_malformed_report_names_the_file_and_the_field(change: Any, message: str) -> None:
    data = _broken(change)
    with pytest.raises(ReportError, match=f"^run.json: {message}"):
        RunReport.from_json(data, "run.json")
    with pytest.raises(SimError, match=f"^run.json: {message}"):  # as afd sim reports it
        parse_report(data, "run.json")


BREAKDOWN_KEYS = [
    "barrier_ms_per_layer",
    "combine_ms_per_layer",
    "compute_ms_per_layer",
    "dispatch_ms_per_layer",
    "moe_layers",
    "ffn_ms_per_item",
    "ffn_items",
]
"""The keys of a timed AFD mode's ``breakdown``, in the order ``afd run`` has written them
(the ranks' keys sorted, then the FFN's)."""


@pytest.mark.parametrize(
    "breakdown",
    [
        LayerBreakdown(),
        LayerBreakdown(ffn_ms_per_item=0.5, ffn_items=3.0),
        LayerBreakdown(**dict.fromkeys(BREAKDOWN_KEYS[:5], 0.25)),
        LayerBreakdown(**{k: float(i) for i, k in enumerate(BREAKDOWN_KEYS)}),
    ],
)
def test_a_breakdown_round_trips_through_json_text(breakdown: LayerBreakdown) -> None:
    text = json.dumps(json_safe(breakdown.to_json()), allow_nan=False)
    data = json.loads(text)
    assert list(data) == [k for k in BREAKDOWN_KEYS if getattr(breakdown, k) is not None]
    assert LayerBreakdown.from_json(data, "run.json") == breakdown
    assert breakdown.empty == (data == {})
    assert LayerBreakdown.from_json(dict.fromkeys(BREAKDOWN_KEYS), "run.json") == LayerBreakdown()


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_a_breakdown_refuses_a_value_that_is_not_finite(value: float) -> None:
    with pytest.raises(ValueError, match="breakdown field 'combine_ms_per_layer' must be finite"):
        LayerBreakdown(combine_ms_per_layer=value)
    written = json_safe({"combine_ms_per_layer": value})  # how the report writes one
    with pytest.raises(
        ReportError,
        match=r"^run.json: field 'modes.async.breakdown.combine_ms_per_layer' must be finite",
    ):
        LayerBreakdown.from_json(written, "run.json", "modes.async.breakdown")


def test_a_malformed_breakdown_in_a_file_names_the_file_and_the_field(tmp_path: Path) -> None:
    """Read from disk by ``afd sim``: the typed report and the unversioned one alike."""
    typed = _broken(lambda d: d["modes"]["sync"]["breakdown"].update(moe_layers=[12]))
    legacy = _broken(lambda d: d["modes"]["sync"]["breakdown"].update(moe_layers=[12]))
    legacy.pop("schema")
    legacy["args"] = {k: str(v) for k, v in DEPLOYMENT.to_json().items()}
    for name, data in (("typed.json", typed), ("legacy.json", legacy)):
        path = tmp_path / name
        path.write_text(json.dumps(data))
        field = "field 'modes.sync.breakdown.moe_layers' must be float | None, got [12]"
        with pytest.raises(SimError, match=f"^{re.escape(f'{path}: {field}')}$"):
            read_runs([path])


def test_every_mode_of_the_shipped_bundle_reads_back_to_the_same_json() -> None:
    """The run bundle the ``cpu-tiny`` calibration is fitted from (unversioned reports):
    each mode's summary, breakdown included, reads into the typed summary and writes back
    the same object -- the key set ``afd run`` writes has not changed."""
    with gzip.open(BUNDLE, "rt", encoding="utf-8") as f:
        entries = json.load(f)["reports"]
    seen = set()
    for entry in entries:
        for mode, data in entry["report"]["modes"].items():
            summary = ModeSummary.from_json(data, entry["source"], f"modes.{mode}")
            assert summary.to_json() == data
            seen.add((mode, tuple(summary.breakdown.to_json())))
    assert seen == {
        ("async", tuple(BREAKDOWN_KEYS)),
        ("sync", tuple(BREAKDOWN_KEYS)),
        ("colocated", ()),
    }


def test_the_simulator_reads_a_real_run_report_as_before(tmp_path: Path) -> None:
    """A real ``afd run --json``: typed, every number kept, and ``afd sim`` code reads it
    into the same :class:`MeasuredRun` as the unversioned reader reads its ``args``."""
    path = tmp_path / "run.json"
    argv = ["run", "--device", "cpu", "--requests", "6", "--max-prompt-len", "32"]
    argv += ["--max-num-batched-tokens", "32", "--stages", "2", "--no-progress"]
    assert main([*argv, "--json", str(path)]) == 0
    data = json.loads(path.read_text())
    assert data["schema"] == SCHEMA
    report = RunReport.from_json(data, str(path))
    assert report.to_json() == data  # the typed report holds everything the file does
    # ... and writes it back byte for byte, breakdowns in the order afd run always wrote
    assert json.dumps(json_safe(report.to_json()), indent=2, allow_nan=False) == path.read_text()
    for mode in ("async", "sync"):
        assert list(data["modes"][mode]["breakdown"]) == BREAKDOWN_KEYS
    assert report.modes["colocated"].breakdown.empty  # colocated dp times no MoE exchange
    assert set(report.modes) == {"async", "sync", "colocated"}
    assert report.deployment.device == "cpu"
    assert report.deployment.max_num_batched_tokens == 32
    assert len(report.requests) == 6
    (run,) = read_runs([path])
    assert run == parse_legacy_report(data, str(path))
    assert (run.budget, run.stages, run.attention_ranks, run.ffn_ranks) == (32, 2, 2, 2)
    assert run.wire == Wire("per_rank", "ffn", "attention")
    assert run.workload == "uneven"
    assert run.modes["async"].tokens_per_s > 0


def test_a_reports_sm_split_is_read_for_the_share_term() -> None:
    """The split each report records is what the calibration's share term reads: runs at
    several splits calibrate together (stated at the split most share:
    test_sim_one_gpu), but not beside runs without shares, nor runs whose ranks of one
    role held different shares."""
    from afd_tools.sim.calibrate import fit_runs, reference_split
    from afd_tools.sim.measured import measured_run

    def at(shares: dict[str, int]) -> Any:
        report = dataclasses.replace(_report(), placement={"kind": "cuda", "mps_shares": shares})
        return measured_run(report, "run.json")

    half = at({"attention rank 0": 25, "attention rank 1": 25, "ffn rank 0": 50})
    quarter = at({"attention rank 0": 25, "attention rank 1": 25, "ffn rank 0": 25})
    assert half.split == "attention 25 %, ffn 50 %"
    assert half.role_split() == (25.0, 50.0)
    assert at({}).split == "no MPS shares"
    assert at({}).role_split() is None
    uneven = at({"attention rank 0": 20, "attention rank 1": 30, "ffn rank 0": 50})
    assert uneven.split == "attention rank 0 20 %, attention rank 1 30 %, ffn rank 0 50 %"
    assert reference_split([half, quarter, quarter]) == (25.0, 25.0)
    with pytest.raises(SimError) as caught:
        fit_runs([half, at({})])
    assert str(caught.value) == (
        "some runs were measured under CUDA MPS shares and some were not (run.json); "
        "calibrate each kind separately"
    )
    with pytest.raises(SimError, match="the ranks of a role held different SM shares"):
        fit_runs([half, uneven])


def test_a_run_against_the_monolithic_baseline_calibrates_on_its_afd_modes_alone() -> None:
    """``--colocated mono`` (the one-GPU baseline: the whole model on a whole GPU) is outside
    the cost model's MPS shares: its figures are left out; the AFD modes are simulated."""
    from afd_tools.sim.calibrate import replay
    from afd_tools.sim.costs import load
    from afd_tools.sim.measured import measured_run

    base = _report()
    modes = {**base.modes, "colocated": _summary("colocated", 2.0)}
    mono = dataclasses.replace(
        base, deployment=dataclasses.replace(DEPLOYMENT, colocated="mono"), modes=modes
    )
    run = measured_run(mono, "mono.json")
    assert set(run.modes) == {"async", "sync"}
    assert run.colocated == "dp"  # a stand-in: the simulator never runs its colocated mode
    assert run.deployment.colocated == "mono"  # the report itself is kept as measured
    replayed = replay([run], load("cpu-tiny"), ("async", "sync", "colocated"))
    assert [r.mode for r in replayed] == ["async", "sync"]
    dp = dataclasses.replace(base, modes=modes)  # colocated dp: modelled, so kept
    assert set(measured_run(dp, "dp.json").modes) == {"async", "sync", "colocated"}
    unknown = dataclasses.replace(mono, deployment=dataclasses.replace(DEPLOYMENT, colocated="x"))
    with pytest.raises(SimError, match="--colocated must be one of \\['dp', 'dp-ep'\\], got 'x'"):
        replay([measured_run(unknown, "x.json")], load("cpu-tiny"), ("async",))
