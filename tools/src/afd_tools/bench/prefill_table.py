"""The table of ``afd bench prefill``: one row per run and mode, each compared with the
sync run of its own group (same preset, workload, A:F, SM split and arrival rate), the
goodput under a stated TTFT SLO, and notes on where the ranks ran and which SM split was
best per A:F."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from afd_tools.bench.prefill_matrix import Point
from afd_tools.outputs import json_safe
from afd_tools.prefill.metrics import ModeSummary
from afd_tools.prefill.run_report import RunReport, role_shares
from afd_tools.run.hardware import describe_hardware


@dataclass(frozen=True)
class BenchRun:
    """One run of the benchmark: where it stands in the matrix, how it ended, its report."""

    point: Point
    command: str
    """The equivalent ``afd run`` command line."""
    exit_code: int
    wall_s: float
    report: RunReport | None
    """``None`` where the run did not finish (a configuration error, a crash)."""

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            **self.point.to_json(),
            "command": self.command,
            "exit_code": self.exit_code,
            "wall_s": self.wall_s,
        }
        if self.report is not None:
            out["report"] = json_safe(self.report.to_json())
        return out


def mode_label(point: Point, mode: str, repeats: int = 1) -> str:
    """``async N=2`` for async (its stages), the mode's name otherwise; with several
    ``repeats``, which launch it is (``async N=2, run 2 of 3``)."""
    label = f"async N={point.stages}" if mode == "async" else mode
    return label if repeats < 2 else f"{label}, run {point.repeat + 1} of {repeats}"


def shares_label(report: RunReport | None, point: Point | None = None) -> str:
    """Each role's CUDA MPS share, ``A 25 / F 50`` (every rank of a role alike) or every
    rank's; ``-`` where no GPU was shared under MPS. A run without a report shows the
    attention share it was given (``A 25``), if any."""
    shares: dict[str, int] = (report.placement.get("mps_shares") or {}) if report else {}
    if not shares:
        given = None if point is None else point.attention_share
        return "-" if report is not None or given is None else f"A {given}"
    roles = role_shares(shares)
    if roles is not None:
        letters = {"attention": "A", "ffn": "F"}
        return " / ".join(f"{letters.get(r, r)} {share}" for r, share in roles.items())
    return ", ".join(f"{name} {share}" for name, share in shares.items())


def _rate_label(rate: float | None) -> str:
    return "all at once" if rate is None else f"{rate:g}/s"


def _ratio(value: float, base: float | None) -> str:
    if base is None or not base > 0:
        return "-"
    return f"{value / base:.2f}x"


def sync_of(
    results: Sequence[BenchRun], verified_only: bool = False
) -> dict[tuple[Any, ...], ModeSummary]:
    """Each group's sync summary per repeat (from the run of its group and repeat that ran
    sync), keyed by ``(*group, repeat)``; with ``verified_only``, only where sync's outputs
    were verified."""
    found: dict[tuple[Any, ...], ModeSummary] = {}
    for entry in results:
        report = entry.report
        if report is None or "sync" not in report.modes:
            continue
        if verified_only and verified(report, "sync").startswith("no"):
            continue
        key = (*entry.point.group, entry.point.repeat)
        found[key] = report.modes["sync"]
    return found


def markdown_table(
    results: Sequence[BenchRun], ttft_slo_s: float | None = None, repeats: int | None = None
) -> str:
    """One row per (run, mode); a failed or unverified run says so. Ratios are this row over
    the sync row of its group: tokens/s (above 1: faster) and TTFT p99 (below 1: sooner)."""
    goodput = [] if ttft_slo_s is None else [f"goodput at TTFT <= {ttft_slo_s:g} s, req/s"]
    header = [
        "preset",
        "workload",
        "A:F",
        "SM shares %",
        "arrivals",
        "mode",
        "tokens/s",
        "TTFT p50 s",
        "TTFT p99 s",
        *goodput,
        "per layer: compute / dispatch / combine / barrier ms",
        "FFN ms per item",
        "tokens/s vs sync",
        "TTFT p99 vs sync",
        "verified (worst error)",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    syncs = sync_of(results)
    if repeats is None:  # the plan's count where given (a stopped benchmark has fewer)
        repeats = 1 + max((entry.point.repeat for entry in results), default=0)
    for entry in results:
        p, report = entry.point, entry.report
        lead = [p.preset, p.workload, p.layout, shares_label(report, p), _rate_label(p.rate)]
        if report is None:
            modes = ", ".join(mode_label(p, m) for m in p.modes)
            if repeats > 1:
                modes += f" (run {p.repeat + 1} of {repeats})"
            rest = [f"failed (exit {entry.exit_code})"] + [""] * (len(header) - 8) + ["no"]
            lines.append("| " + " | ".join([*lead, modes, *rest]) + " |")
            continue
        sync = syncs.get((*p.group, p.repeat))
        for mode, m in report.modes.items():
            b = m.breakdown
            split = " / ".join(
                "-" if v is None else f"{v:.2f}"
                for v in (
                    b.compute_ms_per_layer,
                    b.dispatch_ms_per_layer,
                    b.combine_ms_per_layer,
                    b.barrier_ms_per_layer,
                )
            )
            item = "-" if b.ffn_ms_per_item is None else f"{b.ffn_ms_per_item:.2f}"
            good = []
            if ttft_slo_s is not None:
                value = m.goodput(ttft_slo_s)
                good = ["-" if value is None else f"{value:.2f}"]
            base = sync if mode != "sync" else None
            ratios = (
                ["ran cold"] * 2
                if _cold(report, mode)
                else [
                    _ratio(m.tokens_per_s, base.tokens_per_s if base else None),
                    _ratio(m.ttft_p99, base.ttft_p99 if base else None),
                ]
            )
            cells = [
                *lead,
                mode_label(p, mode, repeats),
                f"{m.tokens_per_s:.0f}",
                f"{m.ttft_p50:.3f}",
                f"{m.ttft_p99:.3f}",
                *good,
                split,
                item,
                *ratios,
                verified(report, mode),
            ]
            lines.append("| " + " | ".join(cells) + " |")
    notes = [
        *placement_notes(results),
        *spread_notes(results, repeats),
        *best_split_notes(results),
    ]
    return "\n".join([*lines, *([""] if notes else []), *notes])


def spread_notes(results: Sequence[BenchRun], repeats: int | None = None) -> list[str]:
    """Where a group ran more than once (``--repeats``): per mode, how many of the
    ``repeats`` launches compared a verified mode with a verified sync of the same repeat,
    and over those the median of its tokens/s and TTFT p99 against that sync, with the
    range (from two such repeats on) -- the spread a single ratio hides."""
    planned = repeats or 1 + max((e.point.repeat for e in results), default=0)
    if planned < 2:
        return []
    syncs = sync_of(results, verified_only=True)
    ratios: dict[tuple[Any, ...], list[tuple[float, float]]] = {}
    cold: dict[tuple[Any, ...], int] = {}  # repeats whose baseline ran cold, left out
    for entry in results:
        p, report = entry.point, entry.report
        for mode in p.modes:
            if mode != "sync":
                ratios.setdefault((*p.group, mode_label(p, mode)), [])
        sync = syncs.get((*p.group, p.repeat))
        if report is None or sync is None or not (sync.tokens_per_s > 0 and sync.ttft_p99 > 0):
            continue
        for mode, m in report.modes.items():
            if mode == "sync" or verified(report, mode).startswith("no"):
                continue
            key = (*p.group, mode_label(p, mode))
            if _cold(report, mode):
                cold[key] = cold.get(key, 0) + 1
                continue
            ratios[key].append((m.tokens_per_s / sync.tokens_per_s, m.ttft_p99 / sync.ttft_p99))
    notes = []
    for key, values in ratios.items():
        preset, workload, a, f, share, rate, label = key
        where = (
            f"{preset} {workload} {a}A{f}F{'' if share is None else f', A {share} %'} "
            f"{_rate_label(rate)}, {label} vs sync"
        )
        counted = f"{len(values)} of {planned} repeats verified"
        if key in cold:
            counted = (
                f"{len(values)} of {planned} repeats verified and warm; {cold[key]} verified "
                "but run cold, left out"
            )
        if not values:
            warm = " that ran warm" if key in cold else ""
            notes.append(f"Spread, {where}: no verified repeat{warm}.")
            continue
        tokens = sorted(v[0] for v in values)
        p99 = sorted(v[1] for v in values)

        def figure(sorted_values: list[float]) -> str:
            median = f"{statistics.median(sorted_values):.2f}x"
            if len(sorted_values) < 2:
                return f"{median} (one repeat: no range)"
            return f"median {median} ({sorted_values[0]:.2f}-{sorted_values[-1]:.2f}x)"

        notes.append(
            f"Spread, {where} ({counted}): tokens/s {figure(tokens)}, TTFT p99 {figure(p99)}."
        )
    return notes


def _cold(report: RunReport, mode: str) -> bool:
    """Whether ``mode`` of ``report`` is a colocated baseline that ran cold beside warm AFD
    modes (:attr:`~afd_tools.prefill.run_report.Deployment.baseline_ran_cold`): its ratios
    are not shown."""
    return mode == "colocated" and report.deployment.baseline_ran_cold


def placement_notes(results: Sequence[BenchRun]) -> list[str]:
    """One line per distinct placement of the runs: the device, how the ranks shared GPUs
    (under CUDA MPS, with each rank's share) and the colocated baseline; and one per
    distinct hardware they ran on (GPUs, CPU, software), where the report records it."""
    notes: list[str] = []
    for entry in results:
        placement = entry.report.placement if entry.report is not None else {}
        if "colocated_label" not in placement:
            continue
        sharing = placement.get("sharing", "none")
        where = placement["kind"] + ("" if sharing == "none" else f" ({sharing})")
        note = f"Placement: {where}; {placement['colocated_label']}."
        if note not in notes:
            notes.append(note)
        if "hardware" in placement:  # reports since the record was added
            on = f"Hardware: {describe_hardware(placement['hardware'])}."
            if on not in notes:
                notes.append(on)
    return notes


def best_split_notes(results: Sequence[BenchRun]) -> list[str]:
    """Where runs of one (preset, workload, A:F, rate) differ in the attention ranks' SM
    share: the share at which async (any stage count) and sync had their highest tokens/s,
    each verified -- with ``--repeats``, the highest median over a split's verified
    repeats (not its luckiest launch)."""
    sweeps: dict[tuple[Any, ...], list[BenchRun]] = {}
    for entry in results:
        p = entry.point
        sweeps.setdefault((p.preset, p.workload, p.layout, p.rate), []).append(entry)
    notes = []
    for (preset, workload, layout, rate), entries in sweeps.items():
        if len({e.point.attention_share for e in entries}) < 2:
            continue
        parts = []
        for family in ("async", "sync"):
            # (split, mode label) -> the verified launches' tokens/s and a report to label
            launches: dict[tuple[Any, str], tuple[list[float], BenchRun]] = {}
            for e in entries:
                if e.report is None:
                    continue
                for mode, m in e.report.modes.items():
                    if mode != family or verified(e.report, mode).startswith("no"):
                        continue
                    key = (e.point.attention_share, mode_label(e.point, mode))
                    launches.setdefault(key, ([], e))[0].append(m.tokens_per_s)
            if launches:
                (_, label), (values, e) = max(
                    launches.items(), key=lambda item: statistics.median(item[1][0])
                )
                runs = "" if len(values) < 2 else f", median of {len(values)} launches"
                parts.append(
                    f"{label} at {shares_label(e.report)} "
                    f"({statistics.median(values):,.0f} tokens/s{runs})"
                )
            else:
                parts.append(f"{family}: no verified run")
        notes.append(
            f"Best SM split, {preset} {workload} {layout} {_rate_label(rate)}: "
            + "; ".join(parts)
            + "."
        )
    return notes


def verified(report: RunReport, mode: str) -> str:
    """The table's verdict for one mode: yes or no, the worst error, near ties followed,
    requests over the tolerance that passed against the float32 twin.

    A worst error that is missing (``None``: not finite) or not a finite number is a
    failure whatever the failures list says."""
    verification = report.verification
    worst = verification.get("verification_worst", {}).get(mode, {})
    error = worst.get("relative_error")
    finite = isinstance(error, int | float) and math.isfinite(error)
    failed = mode in verification.get("verification_failures", {}) or (bool(worst) and not finite)
    verdict = "no" if failed else "yes"
    if finite:
        verdict += f" ({error:.1e})"
    elif worst:
        verdict += " (not finite)"
    followed = verification.get("verification_near_ties", {}).get(mode, {}).get("followed", 0)
    if followed:
        verdict += f", {followed} near ties followed"
    twins = verification.get("verification_twin", {}).get(mode, {})
    by_twin = sum(1 for t in twins.values() if t.get("passed") is True)
    if by_twin and not failed:
        factor = verification.get("verification_drift_factor")
        verdict += f", {by_twin} within {factor:g}x the reference's drift from the float32 twin"
    return verdict
