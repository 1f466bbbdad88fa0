"""The typed ``afd run --json`` report: it round-trips, a malformed one names the file and
the field, and the simulator reads a real run's report as it read the unversioned one."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from afd_tools.cli import main
from afd_tools.outputs import json_safe
from afd_tools.prefill.metrics import ModeSummary
from afd_tools.prefill.run_report import SCHEMA, Deployment, RunReport
from afd_tools.prefill.typed_json import ReportError
from afd_tools.prefill.workload import Request
from afd_tools.sim.costs import SimError, Wire
from afd_tools.sim.measured import parse_legacy_report, parse_report, read_runs

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
        breakdown={"moe_layers": 12.0, "compute_ms_per_layer": 1.5, "ffn_items": 6.0},
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
    assert set(report.modes) == {"async", "sync", "colocated"}
    assert report.deployment.device == "cpu"
    assert report.deployment.max_num_batched_tokens == 32
    assert len(report.requests) == 6
    (run,) = read_runs([path])
    assert run == parse_legacy_report(data, str(path))
    assert (run.budget, run.stages, run.attention_ranks, run.ffn_ranks) == (32, 2, 2, 2)
    assert run.wire == Wire("per_rank", "ffn", "attention")
    assert run.workload == "uneven"
    assert run.modes["async"]["tokens_per_s"] > 0
