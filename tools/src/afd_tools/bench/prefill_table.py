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


def sync_of(results: Sequence[BenchRun]) -> dict[tuple[Any, ...], ModeSummary]:
    """Each group's sync summary per repeat (from the run of its group and repeat that ran
    sync), keyed by ``(*group, repeat)``."""
    found: dict[tuple[Any, ...], ModeSummary] = {}
    for entry in results:
        if entry.report is not None and "sync" in entry.report.modes:
            key = (*entry.point.group, entry.point.repeat)
            found[key] = entry.report.modes["sync"]
    return found


def markdown_table(results: Sequence[BenchRun], ttft_slo_s: float | None = None) -> str:
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
    repeats = 1 + max((entry.point.repeat for entry in results), default=0)
    for entry in results:
        p, report = entry.point, entry.report
        lead = [p.preset, p.workload, p.layout, shares_label(report, p), _rate_label(p.rate)]
        if report is None:
            modes = ", ".join(mode_label(p, m, repeats) for m in p.modes)
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
            vs_sync = mode != "sync" and sync is not None
            cells = [
                *lead,
                mode_label(p, mode, repeats),
                f"{m.tokens_per_s:.0f}",
                f"{m.ttft_p50:.3f}",
                f"{m.ttft_p99:.3f}",
                *good,
                split,
                item,
                _ratio(m.tokens_per_s, sync.tokens_per_s if vs_sync and sync else None),
                _ratio(m.ttft_p99, sync.ttft_p99 if vs_sync and sync else None),
                verified(report, mode),
            ]
            lines.append("| " + " | ".join(cells) + " |")
    notes = [*placement_notes(results), *spread_notes(results), *best_split_notes(results)]
    return "\n".join([*lines, *([""] if notes else []), *notes])


def spread_notes(results: Sequence[BenchRun]) -> list[str]:
    """Where a group ran more than once (``--repeats``): per mode, the median of its
    tokens/s and TTFT p99 against the sync run of the same repeat, with the range over the
    repeats and how many verified repeats it has -- the spread a single ratio hides."""
    syncs = sync_of(results)
    ratios: dict[tuple[Any, ...], list[tuple[float, float]]] = {}
    for entry in results:
        p, report = entry.point, entry.report
        sync = syncs.get((*p.group, p.repeat))
        if report is None or sync is None:
            continue
        for mode, m in report.modes.items():
            if mode == "sync" or verified(report, mode).startswith("no"):
                continue
            key = (*p.group, mode_label(p, mode))
            ratios.setdefault(key, []).append(
                (m.tokens_per_s / sync.tokens_per_s, m.ttft_p99 / sync.ttft_p99)
            )
    repeated = {p.group for p in (e.point for e in results) if p.repeat > 0}
    notes = []
    for (preset, workload, a, f, share, rate, label), values in ratios.items():
        if (preset, workload, a, f, share, rate) not in repeated:
            continue
        tokens = sorted(v[0] for v in values)
        p99 = sorted(v[1] for v in values)
        shares = "" if share is None else f", A {share} %"
        notes.append(
            f"Over {len(values)} verified repeats, {preset} {workload} {a}A{f}F{shares} "
            f"{_rate_label(rate)}, {label} vs sync: tokens/s median "
            f"{statistics.median(tokens):.2f}x ({tokens[0]:.2f}-{tokens[-1]:.2f}x), TTFT p99 "
            f"median {statistics.median(p99):.2f}x ({p99[0]:.2f}-{p99[-1]:.2f}x)."
        )
    return notes


def placement_notes(results: Sequence[BenchRun]) -> list[str]:
    """One line per distinct placement of the runs: the device, how the ranks shared GPUs
    (under CUDA MPS, with each rank's share) and the colocated baseline."""
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
    return notes


def best_split_notes(results: Sequence[BenchRun]) -> list[str]:
    """Where runs of one (preset, workload, A:F, rate) differ in the attention ranks' SM
    share: the share at which async (any stage count) and sync had their highest tokens/s,
    each verified."""
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
            best: tuple[float, BenchRun, str] | None = None
            for e in entries:
                if e.report is None:
                    continue
                for mode, m in e.report.modes.items():
                    if mode != family or verified(e.report, mode).startswith("no"):
                        continue
                    if best is None or m.tokens_per_s > best[0]:
                        best = (m.tokens_per_s, e, mode)
            if best is not None:
                tokens, e, mode = best
                parts.append(
                    f"{mode_label(e.point, mode)} at {shares_label(e.report)} "
                    f"({tokens:,.0f} tokens/s)"
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
    """The table's verdict for one mode: yes or no, the worst error, near ties followed.

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
    return verdict
