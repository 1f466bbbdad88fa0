"""``afd sim`` against live ``afd run`` measurements on this CPU (issue #16's validation,
at a small size). Run by ``make sim-validate``, not by ``make test``: its verdict depends
on how busy the machine is, which makes it a benchmark. CI checks the model against the
recorded campaign instead (``test_sim_recorded.py``: fixed real measurements, a
deterministic fit). On 2026-12-01, after the rank processes began freezing their start-up
heap, 1 of 3 runs of this test on the 2-core VM met 15 % on every figure; the misses were
a held-out colocated makespan +20 % (TTFT p50 +26 %) in one run, sync makespan -15.0 % and
TTFT p50 -18 % / -22 % in another: the fit from two training configurations moved the
prediction of the same held-out configuration by up to 20 % between runs.

Two ``afd run`` configurations are measured, ``TRAIN_REPEATS`` launches per mode as in the
full campaign (with ``--mode all`` the later modes run on warm caches, which the model does not
describe), and the simulator is calibrated on them; a third configuration -- an A:F pair
the calibration never saw -- is measured ``REPEATS`` times per
mode, and the simulator must predict its median makespan and TTFT p50 in every mode
within ``TOLERANCE``. ``docs/sim.md`` has the full-size table (six A:F pairs,
two workloads, three repeats, leave-one-pair-out).

The check is real, not a tautology: the held-out pair's requests, batches and contention
(how many processes share the two cores) differ from every training run's, and nothing
of its measurement enters the fit.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from afd_tools.sim.measured import read_runs
from afd_tools.sim.validate import FIGURES, predict_held_out, table

TOLERANCE = {"makespan_s": 0.15, "ttft_p50": 0.15}
"""Relative error allowed on the held-out median: the issue's 15 % on both figures (the
module docstring says how often this small live version meets it)."""
REPEATS = 3
"""Launches per mode of the held-out pair, whose median is the measurement: a single run's
spread here is up to about +-15 % (docs/sim.md), and with one launch the check failed
about one run in four on a noisy machine. Each launch costs ~8 s on 2 cores."""
MODES = ("async", "sync", "colocated")
SIZE = ["--requests", "32", "--max-prompt-len", "512", "--max-num-batched-tokens", "512"]
TRAIN = [(1, 1, "uneven"), (2, 1, "bimodal")]
TRAIN_REPEATS = 2
"""Launches per mode of each training configuration: the fit reads every repeat, so one
slow launch does not shift the coefficients (with one launch, a held-out colocated
makespan once came out 15.3 % high while its own three launches agreed within 6 %)."""
CORES_GRID = (1.6,)
NOTIFY_GRID = (5e-4,)
"""The fit's two grid parameters, fixed at what the full campaign's fit chose on this
machine class (the shipped cpu-tiny calibration: cores 1.6, notify 0.5 ms): from two training
configurations, a grid search flipped between grid points from run to run and swung the
held-out prediction by up to 20 %; the coefficients are still fitted here."""
HELD_OUT = (1, 2, "uneven")
"""An A:F pair no training run had (as in docs/sim.md's leave-one-pair-out table, the
training covers both workloads)."""

pytestmark = [pytest.mark.slow, pytest.mark.timing]


def _measure(folder: Path, a: int, f: int, workload: str, mode: str, rep: int) -> Path:
    out = folder / f"a{a}f{f}-{workload}-{mode}-r{rep}.json"
    argv = [
        sys.executable,
        "-m",
        "afd_tools.cli",
        "run",
        "--device",
        "cpu",
        "--attention-ranks",
        str(a),
        "--ffn-ranks",
        str(f),
        "--workload",
        workload,
        *SIZE,
        "--mode",
        mode,
        "--no-progress",
        "--json",
        str(out),
    ]
    # The JSON is written before verification; a verification failure (exit 1) does not
    # change the timings this test is about.
    subprocess.run(argv, check=False, capture_output=True, timeout=100)
    assert out.exists(), f"afd run {a}A{f}F {workload} wrote no report"
    return out


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    folder = tmp_path_factory.mktemp("sim-validation")
    train: list[Path] = []
    held: list[Path] = []
    # Interleaved, round by round, so that a change of the machine's load during the test
    # falls on training and held-out launches alike instead of on one side of the fit.
    for rep in range(max(REPEATS, TRAIN_REPEATS)):
        for mode in MODES:
            if rep < TRAIN_REPEATS:
                train += [_measure(folder, a, f, w, mode, rep) for a, f, w in TRAIN]
            if rep < REPEATS:
                held.append(_measure(folder, *HELD_OUT, mode, rep))
    return {"train": read_runs(train), "held": read_runs(held)}


@pytest.mark.timeout(400)
def test_held_out_configuration_is_predicted_within_tolerance(measured: dict[str, Any]) -> None:
    predictions = predict_held_out(
        measured["train"], measured["held"], cores_grid=CORES_GRID, notify_grid=NOTIFY_GRID
    )
    assert sorted(p.mode for p in predictions) == sorted(MODES)
    text = table(predictions)
    print(text)
    bad = {
        f"{p.mode} {figure}": round(p.error(figure), 3)
        for p in predictions
        for figure in FIGURES
        if abs(p.error(figure)) > TOLERANCE[figure]
    }
    assert not bad, f"beyond {TOLERANCE}: {bad}\n{text}"
