"""Turning the ranks' records into the numbers ``afd run`` reports.

Every attention replica, measured (``afd_tools.run.replica.ModeResult``) or simulated
(``afd_tools.sim.modes.ReplicaRecord``), keeps a :class:`ReplicaTimes` of each mode;
:func:`summarize` turns them into the mode's :class:`ModeSummary`.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from afd_tools.prefill.layer_times import LayerBreakdown
from afd_tools.prefill.typed_json import check_value, dataclass_from_json, field_error
from afd_tools.prefill.workload import Request


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in [0, 100]) of a non-empty sequence."""
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, math.ceil(q / 100 * len(ordered)) - 1))
    return ordered[rank]


@dataclass
class ReplicaTimes:
    """One attention replica's record of one mode: what :func:`summarize` and the timeline
    plot (:func:`afd_tools.prefill.report.write_plot`) read. ``afd run``'s ranks extend it
    (``afd_tools.run.replica.ModeResult``: the outputs to verify) and so does the simulator
    (``afd_tools.sim.modes.ReplicaRecord``: the cost model's inputs)."""

    done: dict[int, float] = field(default_factory=dict)
    """request id -> seconds after the mode start when its prefill finished."""
    busy_s: float = 0.0
    wait_s: float = 0.0
    batches: list[tuple[float, float, int]] = field(default_factory=list)
    """(start, end, tokens) of every batch, seconds after the mode start."""
    dummy_batches: int = 0
    origin: float = 0.0
    """``time.monotonic()`` at the mode start (comparable across processes on Linux)."""
    layer_times: dict[str, float] = field(default_factory=dict)
    """Per MoE layer: compute, dispatch, combine and barrier times
    (:meth:`afd_tools.prefill.layer_times.LayerTimes.as_dict`); empty where the replica
    timed no MoE layer."""
    attention_steps: list[list[float]] = field(default_factory=list)
    """Per step (:data:`STEP_FIELDS`): what the step computed and the seconds of its compute
    (the breakdown's compute, step by step); empty where steps were not timed."""


STEP_FIELDS = ("tokens", "square", "dispatches", "compute_s")
"""One entry of ``attention_steps``: the step's tokens, ``sum(end**2 - begin**2)`` over
its prompt pieces (a whole prompt of ``n`` tokens adds ``n**2``), its MoE dispatches (MoE
layers times stages), and its compute in seconds -- the step's time outside dispatch,
combine and sync's barrier, on the device's timeline on a GPU: attention, dense layers,
router, local shared experts (in a colocated mode, which dispatches nothing, the whole
step, experts included). What lets ``afd sim calibrate`` tell attention's cost per
token from its cost per squared length, which per-layer means cannot."""


def step_problem(steps: Sequence[Sequence[float]]) -> tuple[int, str] | None:
    """The first entry of ``steps`` that is not :data:`STEP_FIELDS` (each finite and
    >= 0), as (index, what is wrong); None when every entry is."""
    for i, entry in enumerate(steps):
        if len(entry) != len(STEP_FIELDS) or not all(math.isfinite(v) and v >= 0 for v in entry):
            return i, (
                f"must be {len(STEP_FIELDS)} finite numbers >= 0 ({', '.join(STEP_FIELDS)}), "
                f"got {list(entry)!r:.80}"
            )
    return None


@dataclass(frozen=True)
class ModeSummary:
    """One mode's figures, as ``afd run`` and ``afd sim`` report them."""

    mode: str
    makespan_s: float
    tokens_per_s: float
    ttft_p50: float
    ttft_p90: float
    ttft_p99: float
    attention_busy: list[float]
    attention_wait: list[float]
    ffn_busy: list[float]
    dummy_batches: int
    breakdown: LayerBreakdown
    """Per MoE layer, mean over the attention ranks (ms): compute, dispatch, combine,
    barrier; and the FFN ranks' mean expert time per work item (ms) and items served in
    this mode."""
    ttft_s: list[float] = field(default_factory=list)
    """Every request's time to first token (seconds from its arrival to the end of its
    prefill), in request order; empty in reports written before it was recorded."""
    attention_steps: list[list[float]] = field(default_factory=list)
    """Every attention replica's steps (:data:`STEP_FIELDS`), replica after replica; empty
    in reports written before they were recorded."""

    def __post_init__(self) -> None:
        problem = step_problem(self.attention_steps)
        if problem is not None:
            raise ValueError(f"attention_steps[{problem[0]}] {problem[1]}")

    def goodput(self, ttft_slo_s: float) -> float | None:
        """Requests per second of the mode's makespan whose TTFT met ``ttft_slo_s`` (the
        goodput under that SLO); ``None`` where the report has no per-request TTFT."""
        if not self.ttft_s:
            return None
        met = sum(1 for t in self.ttft_s if t <= ttft_slo_s)
        return met / self.makespan_s

    def as_dict(self) -> dict[str, Any]:
        """This summary as JSON data (:meth:`to_json`)."""
        return self.to_json()

    def to_json(self) -> dict[str, Any]:
        """This summary as the report's ``modes`` object holds it (without ``ttft_s`` and
        ``attention_steps`` where they are empty, as reports were written before they were
        recorded)."""
        out = {**self.__dict__, "breakdown": self.breakdown.to_json()}
        for name in ("ttft_s", "attention_steps"):
            if not out[name]:
                del out[name]
        return out

    @classmethod
    def from_json(cls, obj: Any, where: str, name: str = "mode") -> ModeSummary:
        """A summary from its ``to_json`` object; a :class:`ReportError` that names
        ``where`` and the field when one is missing or of the wrong type."""
        return dataclass_from_json(
            cls,
            obj,
            where,
            name,
            readers={"breakdown": LayerBreakdown.from_json, "attention_steps": _read_steps},
        )


def _read_steps(obj: Any, where: str, name: str) -> list[list[float]]:
    steps: list[list[float]] = check_value(obj, list[list[float]], where, name)
    problem = step_problem(steps)
    if problem is not None:
        raise field_error(where, f"{name}[{problem[0]}]", problem[1])
    return steps


def _busy_spans(
    intervals: Sequence[tuple[float, ...]], origin: float, end: float
) -> list[tuple[float, float]]:
    """When one FFN rank was busy, clipped to ``[origin, end]`` and sorted: each item's
    host span (taken to replied) and its expert time on the device, which on a GPU the
    host does not wait for (it replies once the experts are queued): one stream runs the
    items in the order taken, each from when it was taken or the previous one ended. On
    a CPU the expert time lies inside the host span, so the host spans are what counts."""
    spans = []
    device_free = float("-inf")
    for taken, replied, *_, compute_s in sorted(intervals):
        start = max(taken, device_free)
        device_free = start + compute_s
        spans += [(taken, replied), (start, device_free)]
    return sorted((max(a, origin), min(b, end)) for a, b in spans)


def _covered(spans: Sequence[tuple[float, float]]) -> float:
    """Seconds covered by the union of sorted ``(start, stop)`` spans (empty ones add 0)."""
    total, reach = 0.0, float("-inf")
    for start, stop in spans:
        if stop > max(start, reach):
            total += stop - max(start, reach)
            reach = stop
    return total


def served_by(
    mode: str, requests: Sequence[Request], replica_results: Sequence[ReplicaTimes]
) -> list[int]:
    """Per request of ``requests`` (in their order), the index in ``replica_results`` of the
    replica that finished its prefill in ``mode``: the assignment the mode made (under
    ``--assign pull``, the replicas' claims). A :class:`RuntimeError` names the requests
    that no replica finished or that two did (each must be prefilled exactly once)."""
    owner: dict[int, int] = {}
    twice: list[str] = []
    for index, result in enumerate(replica_results):
        for request_id in result.done:
            if request_id in owner:
                twice.append(f"{request_id} (replicas {owner[request_id]} and {index})")
            owner.setdefault(request_id, index)
    if twice:
        raise RuntimeError(
            f"mode {mode}: requests {', '.join(twice[:10])} were prefilled twice; each must "
            "be prefilled by exactly one replica"
        )
    missing = [r.request_id for r in requests if r.request_id not in owner]
    if missing:
        raise RuntimeError(f"mode {mode}: requests {missing[:10]} never completed")
    return [owner[r.request_id] for r in requests]


def summarize(
    mode: str,
    requests: Sequence[Request],
    replica_results: Sequence[ReplicaTimes],
    ffn_intervals: Sequence[Sequence[tuple[float, ...]]],
) -> ModeSummary:
    """Summarise one mode from every replica's record and the FFN intervals
    (``(taken, replied, replica, layer, expert seconds)`` per work item); every request
    must be prefilled exactly once (:func:`served_by`)."""
    served_by(mode, requests, replica_results)
    done: dict[int, float] = {}
    for result in replica_results:
        done.update(result.done)
    ttft = [done[r.request_id] - r.arrival for r in requests]
    makespan = max(done.values())
    origin = min(result.origin for result in replica_results)
    end = origin + makespan
    ffn_busy = []
    item_seconds: list[float] = []
    for intervals in ffn_intervals:
        ffn_busy.append(_covered(_busy_spans(intervals, origin, end)) / makespan)
        # Items taken during this mode (modes run one after the other).
        item_seconds += [float(i[4]) for i in intervals if origin <= i[0] <= end]
    layers = _mean_layer_times([r.layer_times for r in replica_results])
    if item_seconds:
        layers["ffn_ms_per_item"] = 1e3 * statistics.fmean(item_seconds)
        layers["ffn_items"] = float(len(item_seconds))
    breakdown = LayerBreakdown(**layers)
    return ModeSummary(
        mode=mode,
        makespan_s=makespan,
        tokens_per_s=sum(r.prompt_len for r in requests) / makespan,
        ttft_p50=percentile(ttft, 50),
        ttft_p90=percentile(ttft, 90),
        ttft_p99=percentile(ttft, 99),
        attention_busy=[r.busy_s / makespan for r in replica_results],
        attention_wait=[r.wait_s / makespan for r in replica_results],
        ffn_busy=ffn_busy,
        dummy_batches=sum(r.dummy_batches for r in replica_results),
        breakdown=breakdown,
        ttft_s=ttft,
        attention_steps=[step for r in replica_results for step in r.attention_steps],
    )


def _mean_layer_times(records: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Every key's mean over the ranks that recorded it."""
    present = [r for r in records if r]
    keys = sorted({k for r in present for k in r})
    return {k: statistics.fmean(r[k] for r in present if k in r) for k in keys}


def ratios(summaries: Mapping[str, ModeSummary]) -> dict[str, float]:
    """Throughput of async over the other modes (above 1: async is faster)."""
    out = {}
    if "async" in summaries:
        for other in ("sync", "colocated"):
            if other in summaries:
                out[f"async/{other} tokens/s"] = (
                    summaries["async"].tokens_per_s / summaries[other].tokens_per_s
                )
    return out


def mean(values: Sequence[float]) -> float:
    return statistics.fmean(values) if values else 0.0
