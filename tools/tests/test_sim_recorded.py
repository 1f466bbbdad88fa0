"""``afd sim`` against recorded real measurements (issue #16's validation in CI).

The shipped run bundle ``calibrations/cpu-tiny-runs.json.gz`` holds the 108 ``afd run``
reports of ``tools/dev/sim_campaign.sh`` on the 2-core CPU VM (six A:F pairs x two
workloads x three modes x three repeats). The measurements are real and fixed, and the
simulator and the fit are deterministic, so these tests check the *model* -- not the
machine CI happens to run on, whose load made a live timing check flaky (that one is
``make sim-validate``). A change to the simulator or the fit that predicts these runs
worse fails here.

The leave-one-pair-out protocol is ``afd sim validate``'s: each A:F pair is predicted
from a fit on the other five pairs, so every figure is out-of-sample.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
from importlib import resources
from pathlib import Path

import pytest

from afd_tools.cli import main
from afd_tools.sim import costs
from afd_tools.sim.calibrate import fit_runs
from afd_tools.sim.costs import SimError
from afd_tools.sim.measured import MeasuredRun, bundle, encode_bundle, read_runs
from afd_tools.sim.validate import FIGURES, Prediction, leave_one_pair_out, table

BUNDLE = Path(str(resources.files("afd_tools.sim") / "calibrations" / "cpu-tiny-runs.json.gz"))
TOLERANCE = 0.15
"""The issue's bound on the relative error of makespan and TTFT p50."""
AT_LEAST_WITHIN = {"makespan_s": 30, "ttft_p50": 29}
"""Rows of 36 within TOLERANCE that the model must keep. At commit e47042b's campaign the
model reached 31 and 30 (docs/sim.md), the same with the scipy fit; one row of slack each
for a change to the simulator that moves a borderline row (the fit itself no longer varies
between machines: ``test_sim_fitting.py``)."""
MEAN_ERROR_BELOW = 0.10
"""Mean absolute relative error, both figures (8.3 % and 8.0 % when recorded)."""
WHOLE_CONFIGURATIONS = 6
"""The issue's wording: at least six configurations predicted within 15 % on both
figures in all three modes."""


@pytest.fixture(scope="module")
def runs() -> list[MeasuredRun]:
    return read_runs([BUNDLE])


def test_the_bundle_is_the_campaign_the_docs_describe(runs: list[MeasuredRun]) -> None:
    assert len(runs) == 108
    pairs = {(r.attention_ranks, r.ffn_ranks) for r in runs}
    assert pairs == {(1, 1), (1, 2), (1, 3), (2, 1), (2, 2), (3, 1)}
    assert {r.workload for r in runs} == {"uneven", "bimodal"}
    assert {mode for r in runs for mode in r.modes} == {"async", "sync", "colocated"}
    assert {(r.preset, r.dtype, r.device) for r in runs} == {("tiny", "float32", "cpu")}


def test_the_shipped_calibration_is_refitted_from_its_bundle(runs: list[MeasuredRun]) -> None:
    shipped = costs.load("cpu-tiny")
    assert "cpu-tiny-runs.json.gz" in shipped.command
    _assert_same_coefficients(shipped, fit_runs(runs))


def _misses(predictions: list[Prediction]) -> list[str]:
    """What of the bar (the constants above) ``predictions`` fail; empty when they pass."""
    misses = []
    for figure in FIGURES:
        errors = [abs(p.error(figure)) for p in predictions]
        within = sum(e <= TOLERANCE for e in errors)
        if within < AT_LEAST_WITHIN[figure]:
            misses.append(f"{figure}: {within} within {TOLERANCE:.0%}")
        if sum(errors) / len(errors) >= MEAN_ERROR_BELOW:
            misses.append(f"{figure}: mean error {sum(errors) / len(errors):.1%}")
    whole: dict[str, bool] = {}
    for p in predictions:
        good = all(abs(p.error(f)) <= TOLERANCE for f in FIGURES)
        whole[p.label] = whole.get(p.label, True) and good
    if sum(whole.values()) < WHOLE_CONFIGURATIONS:
        misses.append(f"{sum(whole.values())} whole configurations within {TOLERANCE:.0%}")
    return misses


@pytest.mark.timeout(600)  # a hang guard: 26 s alone on two cores; 120 s was hit under CI load
def test_held_out_pairs_are_predicted_within_15_percent(runs: list[MeasuredRun]) -> None:
    predictions = leave_one_pair_out(runs)
    assert len(predictions) == 36
    print(table(predictions))
    assert _misses(predictions) == []


def test_a_deliberately_worse_model_fails_the_bar(runs: list[MeasuredRun]) -> None:
    """The bar is not loose: the same protocol with ``cores`` forced to 2 (the core count,
    ignoring hyper-threads and memory bandwidth) and the notification latency to 50 us
    misses it (docs/sim.md: 25 and 23 of 36)."""
    predictions = leave_one_pair_out(runs, cores_grid=[2.0], notify_grid=[5e-5])
    assert len(predictions) == 36
    misses = _misses(predictions)
    assert any(m.startswith("makespan_s:") for m in misses), misses
    assert any(m.startswith("ttft_p50:") for m in misses), misses


def test_validate_command_reads_the_bundle(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Two pairs only, to keep it quick: the command path, not the accuracy, is under test.
    data = json.loads(gzip.decompress(BUNDLE.read_bytes()))
    keep = [e for e in data["reports"] if e["source"].startswith(("a1f1-", "a2f1-"))]
    small = tmp_path / "small.json.gz"
    small.write_bytes(encode_bundle({**data, "reports": keep}))
    out = tmp_path / "v.json"
    assert main(["sim", "validate", str(small), "--no-progress", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| 1A1F uneven 48 req" in text
    assert "| 2A1F bimodal 48 req" in text
    assert len(json.loads(out.read_text())["predictions"]) == 12


def test_bundle_round_trip_names_and_refusals(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = json.loads(gzip.decompress(BUNDLE.read_bytes()))
    first, second = data["reports"][:2]
    files = []
    for entry in (first, second):
        path = tmp_path / entry["source"]
        path.write_text(json.dumps(entry["report"]))
        files.append(path)
    out = tmp_path / "b.json.gz"
    assert main(["sim", "bundle", *map(str, files), "-o", str(out), "--notes", "n"]) == 0
    made = json.loads(gzip.decompress(out.read_bytes()))
    assert [e["source"] for e in made["reports"]] == [first["source"], second["source"]]
    assert made["notes"] == "n"
    assert made["command"].startswith("afd sim bundle ")
    from_files = [
        dataclasses.replace(r, source=f"{out}:{p.name}")
        for r, p in zip(read_runs(files), files, strict=True)
    ]
    assert read_runs([out]) == from_files
    # the same reports give the same bytes (no timestamp): a re-bundle shows no git change
    assert encode_bundle(made) == encode_bundle(json.loads(gzip.decompress(out.read_bytes())))
    with pytest.raises(SimError, match="share a name"):
        bundle([out, out], "c", "")
    assert main(["sim", "bundle", str(files[0]), "-o", str(tmp_path / "b.json")]) == 2
    assert "name it *.json.gz" in capsys.readouterr().err
    assert not (tmp_path / "b.json").exists()
    broken = tmp_path / "broken.json.gz"
    broken.write_bytes(encode_bundle({"schema": "afd-sim-runs/1", "reports": {}}))
    with pytest.raises(SimError, match="'reports' must be a list"):
        read_runs([broken])
    garbled = tmp_path / "garbled.json.gz"
    garbled.write_bytes(gzip.compress(b"{not json"))
    with pytest.raises(SimError, match="not valid JSON"):
        read_runs([garbled])


ONE_GPU_BUNDLE = Path(
    str(resources.files("afd_tools.sim") / "calibrations" / "h200-mps-v3-runs.json.gz")
)


def test_the_one_gpu_calibration_is_refitted_from_its_bundle() -> None:
    """``h200-mps-v3``: one H200, every rank an MPS client at 25 % of the SMs, fitted from
    the four shipped ``afd bench prefill`` runs (their colocated mode was the monolithic
    model on the whole GPU, outside the cost model's shares: left out)."""
    runs = read_runs([ONE_GPU_BUNDLE])
    assert sorted((r.attention_ranks, r.ffn_ranks, r.stages) for r in runs) == [
        (2, 1, 1),
        (2, 1, 2),
        (2, 2, 2),
        (3, 1, 2),
    ]
    assert {r.split for r in runs} == {"attention 25 %, ffn 25 %"}
    assert {(r.preset, r.dtype, r.device, r.deployment.colocated) for r in runs} == {
        ("v3-slice", "bfloat16", "cuda", "mono")
    }
    assert all("colocated" not in r.modes for r in runs)
    shipped = costs.load("h200-mps-v3")
    assert "h200-mps-v3-runs.json.gz --cores-grid none" in shipped.command
    _assert_same_coefficients(shipped, fit_runs(runs, cores_grid=(None,)))


def _assert_same_coefficients(shipped: costs.Calibration, refit: costs.Calibration) -> None:
    """Every coefficient of ``refit`` equals ``shipped``'s (not its provenance fields)."""
    for field in dataclasses.fields(shipped):
        if field.name in ("command", "date", "notes", "sources", "fit"):
            continue
        want, got = getattr(shipped, field.name), getattr(refit, field.name)
        if isinstance(want, float):
            assert got == pytest.approx(want, rel=1e-6, abs=1e-15), field.name
        else:
            assert got == want, field.name


def test_the_quick_one_gpu_calibration_is_refitted_from_its_bundles() -> None:
    """``h200-mps-quick-v3``: the quick v3-slice runs of one H200 (the four A:F pairs on the
    uneven mix, and 2A1F on the uneven and long mixes with per-step records), refitted
    from the two shipped bundles; the step records determine the squared-length cost."""
    names = ("h200-mps-quick-v3-slice-runs.json.gz", "h200-mps-quick-2a1f-long-runs.json.gz")
    folder = resources.files("afd_tools.sim") / "calibrations"
    runs = read_runs([Path(str(folder / name)) for name in names])
    assert len(runs) == 16
    assert {r.workload for r in runs} == {"uneven", "v3-slice-long"}
    shipped = costs.load("h200-mps-quick-v3")
    assert all(name in shipped.command for name in names)
    assert "--cores-grid none" in shipped.command
    refit = fit_runs(runs, cores_grid=(None,))
    assert "attn_square_s" not in refit.fit.get("not_determined", {})
    assert shipped.attn_square_s > 0
    _assert_same_coefficients(shipped, refit)
