"""``afd sim validate``: how well the simulator predicts runs it was not calibrated on.

Leave one A:F pair out: for each (attention ranks, FFN ranks) pair among the measured
runs, the calibration is fitted (:func:`~afd_tools.sim.calibrate.fit_runs`) on every
*other* pair's runs, and the held-out pair's configurations are simulated and compared
with the median of their repeats, mode by mode, on makespan and TTFT p50. Nothing of a
held-out measurement enters its own fit, so the errors are out-of-sample.

``--hold-out workload`` leaves one workload out instead (the prompt mix by name: ``uneven``,
a workload file's): can a fit on one mix of prompt lengths predict another, e.g. prompts
twice as long as any it was fitted on, where attention's squared-length term dominates?

``--predict RUNS`` fits once on the runs given and predicts the runs named (no folds): can a
fit on quick runs predict full-size ones, with more layers and longer prompts?
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from afd_tools.sim.calibrate import fit_runs, replay
from afd_tools.sim.costs import SimError
from afd_tools.sim.measured import MeasuredRun
from afd_tools.sim.modes import MODES
from afd_tools.sim.simulate import summary

FIGURES = ("makespan_s", "ttft_p50")


@dataclass(frozen=True)
class Prediction:
    """One held-out (configuration, mode): every repeat's measurement and the prediction."""

    label: str
    mode: str
    measured: dict[str, list[float]]
    predicted: dict[str, float]
    not_determined: dict[str, str]
    """Coefficients the fold's training runs could not determine (set to 0), and why."""

    def median(self, figure: str) -> float:
        return statistics.median(self.measured[figure])

    def error(self, figure: str) -> float:
        """Relative error of the prediction against the measured median."""
        return self.predicted[figure] / self.median(figure) - 1


def predict_held_out(
    calibration_runs: Sequence[MeasuredRun], held_out: Sequence[MeasuredRun], **fit: Any
) -> list[Prediction]:
    """Fit on ``calibration_runs`` (``fit`` goes to :func:`fit_runs`) and predict every
    configuration and mode of ``held_out`` (runs of one configuration are repeats)."""
    if not held_out:
        raise SimError("no held-out runs to predict")
    out = []
    cal = fit_runs(calibration_runs, **fit)
    gaps = dict(cal.fit.get("not_determined", {}))
    for rp in replay(held_out, cal, MODES):
        result = summary(rp.sim)
        predicted = {"makespan_s": result.makespan_s, "ttft_p50": result.ttft_p50}
        measured = {
            "makespan_s": [m.makespan_s for m in rp.measured],
            "ttft_p50": [m.ttft_p50 for m in rp.measured],
        }
        out.append(Prediction(rp.run.label, rp.mode, measured, predicted, gaps))
    return out


HOLD_OUT: dict[str, tuple[str, Callable[[MeasuredRun], str]]] = {
    "pair": ("A:F pairs", lambda r: f"{r.attention_ranks}A{r.ffn_ranks}F"),
    "workload": ("workloads", lambda r: r.workload),
}
"""What a fold holds out: its name in messages, and each run's group."""


def folds(runs: Sequence[MeasuredRun], hold_out: str = "pair") -> list[str]:
    """The groups of ``runs`` that are held out one at a time (sorted); :class:`SimError`
    for an unknown ``hold_out`` or fewer than two groups."""
    if hold_out not in HOLD_OUT:
        raise SimError(f"hold_out {hold_out!r}: choose one of {', '.join(HOLD_OUT)}")
    name, group = HOLD_OUT[hold_out]
    groups = sorted({group(r) for r in runs})
    if len(groups) < 2:
        raise SimError(
            f"leaving one out needs runs of at least two {name}; these have "
            f"{', '.join(groups) or 'none'}"
        )
    return groups


def leave_one_out(
    runs: Sequence[MeasuredRun],
    hold_out: str = "pair",
    progress: Callable[[int, int], None] | None = None,
    **fit: Any,
) -> list[Prediction]:
    """Every group (an A:F pair, or a workload) predicted from a fit on the others
    (module docstring)."""
    groups = folds(runs, hold_out)
    group = HOLD_OUT[hold_out][1]
    out: list[Prediction] = []
    for index, held_group in enumerate(groups):
        train = [r for r in runs if group(r) != held_group]
        held = [r for r in runs if group(r) == held_group]
        out.extend(predict_held_out(train, held, **fit))
        if progress is not None:
            progress(index + 1, len(groups))
    return out


def leave_one_pair_out(
    runs: Sequence[MeasuredRun],
    progress: Callable[[int, int], None] | None = None,
    **fit: Any,
) -> list[Prediction]:
    """Every A:F pair predicted from a fit on the others (module docstring)."""
    return leave_one_out(runs, "pair", progress, **fit)


def table(predictions: Sequence[Prediction]) -> str:
    """The markdown table of ``docs/sim.md``: medians, min-max spread, prediction, error."""
    lines = [
        "| config | mode | reps | makespan s: measured median (min–max) | predicted | error "
        "| TTFT p50 s: measured median (min–max) | predicted | error |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for p in predictions:
        cells = [p.label, p.mode, str(len(p.measured["makespan_s"]))]
        for figure in FIGURES:
            values = p.measured[figure]
            cells += [
                f"{p.median(figure):.3f} ({min(values):.3f}–{max(values):.3f})",
                f"{p.predicted[figure]:.3f}",
                f"{p.error(figure):+.0%}",
            ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def gaps(predictions: Sequence[Prediction], one_fit: bool = False) -> list[str]:
    """One line per held-out configuration whose fold left coefficients undetermined; with
    ``one_fit`` (``--predict``: every prediction from the one fit on the runs given), one
    line for that fit."""
    lines: dict[str, str] = {}
    for p in predictions:
        if p.not_determined and p.label not in lines:
            named = "; ".join(f"{k}: {why}" for k, why in p.not_determined.items())
            if one_fit:
                return [f"the fit on the runs given: set to 0, {named}"]
            lines[p.label] = f"fold without {p.label}: set to 0, {named}"
    return list(lines.values())


def verdict(predictions: Sequence[Prediction], tolerance: float) -> str:
    """How many rows are within ``tolerance``, the mean absolute and the worst errors."""
    n = len(predictions)
    parts = []
    for figure in FIGURES:
        errors = [abs(p.error(figure)) for p in predictions]
        within = sum(e <= tolerance for e in errors)
        parts.append(
            f"{figure}: {within} of {n} within {tolerance:.0%}, mean |error| "
            f"{statistics.mean(errors):.1%}, worst {max(errors):.1%}"
        )
    both = sum(all(abs(p.error(f)) <= tolerance for f in FIGURES) for p in predictions)
    parts.append(f"both within {tolerance:.0%}: {both} of {n}")
    return "; ".join(parts)
