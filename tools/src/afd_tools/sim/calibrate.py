"""``afd sim calibrate``: coefficients of the cost model from measurements.

Two sources:

* **measured runs** (``afd run --json`` reports, or ``afd bench prefill --json`` files that
  hold several): every report carries its exact requests and, per mode, the per-MoE-layer
  breakdown (attention-side compute, dispatch) and the FFN ranks' mean time per item. The
  simulator replays each run, which gives the cost model's inputs summed the way the
  report averages them (tokens, squared tokens, rows, experts touched, bytes) -- and how
  much the simulated ranks were slowed down by sharing the processors. A non-negative
  least-squares fit (relative errors; :mod:`afd_tools.sim.fitting`, which sets to 0 and
  names, in the calibration's ``fit.not_determined``, any coefficient the runs cannot
  separate from the others) of the measured times on those inputs gives the
  coefficients; replaying again with them refines the slow-down, three times. Where a
  report has per-step records (``attention_steps``: every step's tokens, squared lengths,
  dispatches and compute) and the ranks do not share processors (a GPU each, or an SM
  share each), the attention coefficients are fitted on one row per step instead
  (:func:`step_rows`): steps of different prompt mixes separate attention's per-token from
  its squared-length cost, which per-layer means of a few runs cannot. The number
  of ``cores`` (how much two busy processes really get on this machine: hyper-threads and
  memory bandwidth make it less than the core count) and the arrival-notification latency
  cannot be read off a breakdown, nor can the share of a core that a waiting rank's
  polling takes (``idle_load``), so they are chosen on a grid: the values whose
  simulation best predicts the training runs' makespan and TTFT p50;
* **anchors** (a JSON file of measured per-layer figures with their sources, e.g.
  ``calibrations/h200-anchors.json``): straight-line fits of attention time on (1, T,
  sum of squares), FFN time on (experts, rows), dispatch+combine on bytes, the colocated
  exchange on bytes. This is how the H200 projection is calibrated.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from afd_models import preset
from afd_tools.prefill.metrics import ModeSummary
from afd_tools.prefill.workload import PULL
from afd_tools.sim.costs import Calibration, CostModel, Shapes, SimError, Wire
from afd_tools.sim.fitting import LinearFit, fit_nonnegative
from afd_tools.sim.measured import MeasuredRun
from afd_tools.sim.modes import MODES, ModeRun
from afd_tools.sim.simulate import Deployment, deployment, simulate_mode, summary

CORES_GRID = (1.0, 1.2, 1.4, 1.6, 1.8, 2.0)
NOTIFY_GRID = (5e-5, 2e-4, 5e-4)
IDLE_GRID = (0.0, 0.1)
BARRIER_S = 5e-5
"""CPU lockstep: one message through a pipe to each other replica (a blocking poll wakes
at once); fixed, not fitted."""
COLLECTIVE_LATENCY_S = 1e-4
COLLECTIVE_BANDWIDTH = 1e9
"""The colocated exchange's cost in a calibration from runs: not fitted (the fit reads the
AFD modes' breakdowns only), an estimate for gloo on one machine."""
ITERATIONS = 3
AFD_MODES = ("async", "sync")


@dataclass
class Replay:
    """One distinct configuration and mode, simulated once, with the measurements of
    every repeat of it."""

    run: MeasuredRun
    mode: str
    measured: list[ModeSummary]
    sim: ModeRun
    deployment: Deployment
    """What ``sim`` simulated (its share scales: the run's SM split against the
    calibration's)."""


def _key(run: MeasuredRun) -> tuple[Any, ...]:
    """Runs with equal keys are repeats (same deployment, same requests)."""
    return (
        run.attention_ranks,
        run.ffn_ranks,
        run.budget,
        run.stages,
        run.min_stage_tokens,
        run.colocated,
        run.assign,
        run.wire,
        run.requests,
        run.split,
        tuple(sorted(run.served_by.items())) if run.assign == PULL else None,
    )


def replay(runs: Sequence[MeasuredRun], cal: Calibration, modes: Sequence[str]) -> list[Replay]:
    """Each distinct configuration of ``runs`` simulated once per mode in ``modes`` that was
    measured, beside every repeat's measurement (the fit's and ``afd sim validate``'s view)."""
    groups: dict[tuple[Any, ...], tuple[MeasuredRun, dict[str, list[ModeSummary]]]] = {}
    for run in runs:
        _, by_mode = groups.setdefault(_key(run), (run, {}))
        for mode, measured in run.modes.items():
            by_mode.setdefault(mode, []).append(measured)
    out = []
    for first, by_mode in groups.values():
        dep = _deployment(first, cal)
        for mode in modes:
            if mode in by_mode:
                requests, policy = first.assignment(mode)
                sim = simulate_mode(dep, mode, requests, policy)
                out.append(Replay(first, mode, by_mode[mode], sim, dep))
    return out


def _deployment(run: MeasuredRun, cal: Calibration) -> Deployment:
    shares = _shares(run, cal)
    return deployment(
        run.config,
        cal,
        attention_ranks=run.attention_ranks,
        ffn_ranks=run.ffn_ranks,
        budget=run.budget,
        stages=run.stages,
        min_stage_tokens=run.min_stage_tokens,
        colocated=run.colocated,
        wire=run.wire,
        dtype=run.dtype,
        attention_share=shares[0],
        ffn_share=shares[1],
    )


def _shares(run: MeasuredRun, cal: Calibration) -> tuple[float | None, float | None]:
    """The SM shares ``run`` was measured at, as :func:`deployment` takes them (None when
    the calibration has no share term)."""
    split = run.role_split()
    if split is None or cal.attention_share is None:
        return None, None
    return split


ATTENTION_FEATURES = ("attn_token_s", "attn_square_s", "attn_fixed_s")
"""Attention per layer: tokens, squared lengths, a fixed cost (in order of preference when
the runs cannot separate them)."""
FFN_FEATURES = ("ffn_row_s", "ffn_item_s", "ffn_expert_s")
"""An FFN rank's time per item: rows computed, serves, local experts touched."""
DISPATCH_FEATURES = ("dispatch_latency_s", "dispatch_s_per_byte")
"""A dispatch: a fixed cost and bytes. The measured combine includes the wait for the FFN
ranks, so it cannot calibrate itself: combine is given dispatch's latency and bandwidth."""


def step_rows(
    run: MeasuredRun, steps: Sequence[Sequence[float]]
) -> list[tuple[list[float], float]]:
    """The attention regression's rows from a mode's measured steps (:data:`afd_tools.
    prefill.metrics.STEP_FIELDS`), one per step: its inputs summed over every layer and
    stage piece in :data:`ATTENTION_FEATURES` order (tokens, squared lengths, pieces),
    and its measured compute. Used where every rank has its own processor (no sharing to
    undo): each step is then a direct measurement, and steps of different prompt mixes
    separate the per-token from the squared-length cost, which per-layer means over a
    mode cannot."""
    config = run.config
    layers = config.num_hidden_layers
    moe = sum(config.is_moe_layer(i) for i in range(layers))
    out = []
    for tokens, square, dispatches, compute in steps:
        pieces = dispatches / moe if moe and dispatches else 1.0
        out.append(([layers * tokens, layers * square, layers * pieces], compute))
    return out


def _regress(replays: list[Replay], cal: Calibration) -> tuple[Calibration, dict[str, str]]:
    """One least-squares pass: coefficients from the measured breakdowns, given the
    simulated inputs and slow-downs of ``replays``; and which coefficients the
    measurements could not determine (by name, why)."""
    attn_rows, attn_t = [], []
    ffn_rows, ffn_t = [], []
    disp_rows, disp_t = [], []
    pairs = [(rp, m) for rp in replays for m in rp.measured]
    for rp, measured in pairs:
        b = measured.breakdown
        recs = [r for r in rp.sim.replicas if r.totals.layers]
        # The simulated work carries the run's share scale; the fitted coefficients are
        # at the calibration's shares, so each input counts scale times.
        scaled = rp.deployment
        if measured.attention_steps and cal.cores is None:
            for row, seconds in step_rows(rp.run, measured.attention_steps):
                attn_rows.append([scaled.attention_scale * x for x in row])
                attn_t.append(seconds)
        elif b.compute_ms_per_layer is not None and recs:
            row = [0.0, 0.0, 0.0]
            for r in recs:
                s = r.attention.stretch / r.totals.layers / len(recs) * scaled.attention_scale
                row[0] += s * r.attention.tokens
                row[1] += s * r.attention.square
                row[2] += s * r.attention.count
            attn_rows.append(row)
            attn_t.append(b.compute_ms_per_layer / 1e3)
        if b.dispatch_ms_per_layer is not None and recs:
            row = [0.0, 0.0]
            for r in recs:
                s = r.dispatch.stretch / r.totals.layers / len(recs)
                row[0] += s * r.dispatch.count
                row[1] += s * r.dispatch.square  # bytes
            disp_rows.append(row)
            disp_t.append(b.dispatch_ms_per_layer / 1e3)
        f = rp.sim.ffn
        if b.ffn_ms_per_item is not None and f.items:
            s = f.stretch / f.items * scaled.ffn_scale
            ffn_rows.append([s * f.rows, s * f.serves, s * f.touched])
            ffn_t.append(b.ffn_ms_per_item / 1e3)
    fits: list[LinearFit] = [
        fit_nonnegative(ATTENTION_FEATURES, attn_rows, attn_t, "attention compute per layer"),
        fit_nonnegative(FFN_FEATURES, ffn_rows, ffn_t, "FFN time per item"),
        fit_nonnegative(DISPATCH_FEATURES, disp_rows, disp_t, "dispatch per layer"),
    ]
    values = {name: v for fit in fits for name, v in fit.coefficients.items()}
    per_byte = values.pop("dispatch_s_per_byte")
    bandwidth = 1.0 / per_byte if per_byte > 0 else 1e15
    cal = cal.replace(
        **values,
        dispatch_bandwidth=bandwidth,
        combine_latency_s=values["dispatch_latency_s"],
        combine_bandwidth=bandwidth,
    )
    return cal, {name: why for fit in fits for name, why in fit.dropped.items()}


def _log_error(predicted: float, measured: float) -> float:
    return abs(math.log(max(predicted, 1e-12) / max(measured, 1e-12)))


def score(runs: Sequence[MeasuredRun], cal: Calibration) -> float:
    """Mean absolute log error of the simulated makespan and TTFT p50 against the median
    of the repeats, over every mode of every configuration (what the grid search
    minimises)."""
    errors = []
    for rp in replay(runs, cal, MODES):
        s = summary(rp.sim)
        for value, measured in (
            (s.makespan_s, [m.makespan_s for m in rp.measured]),
            (s.ttft_p50, [m.ttft_p50 for m in rp.measured]),
        ):
            errors.append(_log_error(value, statistics.median(measured)))
    return statistics.fmean(errors) if errors else math.inf


def _start(run: MeasuredRun, cores: float | None, notify: float) -> Calibration:
    """Rough coefficients to replay with before the first fit (only the slow-downs of the
    first replay depend on them)."""
    return Calibration(
        device=run.device,
        preset=run.preset,
        dtype=run.dtype,
        layers=run.config.num_hidden_layers,
        attn_fixed_s=1e-3,
        attn_token_s=1e-5,
        attn_square_s=1e-8,
        ffn_item_s=1e-3,
        ffn_expert_s=1e-4,
        ffn_row_s=1e-6,
        dispatch_latency_s=5e-4,
        dispatch_bandwidth=1e9,
        combine_latency_s=5e-4,
        combine_bandwidth=1e9,
        notify_s=notify,
        barrier_s=BARRIER_S,
        collective_latency_s=COLLECTIVE_LATENCY_S,
        collective_bandwidth=COLLECTIVE_BANDWIDTH,
        cores=cores,
        comm_uses_cores=run.device == "cpu",
        host_barrier=run.device != "cpu",
    )


def reference_split(runs: Sequence[MeasuredRun]) -> tuple[float, float] | None:
    """The (attention, FFN) SM shares a calibration from ``runs`` is stated at: the split
    most runs were measured at (runs at other splits are fitted through
    :func:`~afd_tools.sim.costs.share_scale`); None when no run was measured under MPS
    shares. :class:`SimError` when some were and others were not."""
    splits = [run.role_split() for run in runs]
    with_shares = [s for s in splits if s is not None]
    if not with_shares:
        return None
    if len(with_shares) < len(splits):
        bare = next(r.source for r, s in zip(runs, splits, strict=True) if s is None)
        raise SimError(
            f"some runs were measured under CUDA MPS shares and some were not ({bare}); "
            f"calibrate each kind separately"
        )
    return max(dict.fromkeys(with_shares), key=with_shares.count)


def fit_runs(
    runs: Sequence[MeasuredRun],
    *,
    cores_grid: Sequence[float | None] = CORES_GRID,
    notify_grid: Sequence[float] = NOTIFY_GRID,
    idle_grid: Sequence[float] = IDLE_GRID,
    progress: Callable[[int, int], None] | None = None,
) -> Calibration:
    """The calibration that best explains ``runs`` (module docstring)."""
    if not runs:
        raise SimError("no measured runs to calibrate from")
    first = runs[0]
    mixed = sorted({(r.preset, r.layers, r.dtype, r.device) for r in runs})
    if len(mixed) > 1:
        raise SimError(
            f"the runs mix presets/layers/dtypes/devices {mixed}; calibrate each separately"
        )
    reference = reference_split(runs)
    best: tuple[float, Calibration, dict[str, str]] | None = None
    points = [(c, n, i) for c in cores_grid for n in notify_grid for i in idle_grid]
    for index, (cores, notify, idle) in enumerate(points):
        if cores is None and idle != idle_grid[0]:
            continue  # idle polling only matters when the ranks share cores
        cal = _start(first, cores, notify).replace(idle_load=idle)
        if reference is not None:
            cal = cal.replace(attention_share=reference[0], ffn_share=reference[1])
        for _ in range(ITERATIONS):
            cal, dropped = _regress(replay(runs, cal, AFD_MODES), cal)
        value = score(runs, cal)
        if best is None or value < best[0]:
            best = (value, cal, dropped)
        if progress is not None:
            progress(index + 1, len(points))
    assert best is not None
    value, cal, dropped = best
    return cal.replace(
        fit={
            "runs": len(runs),
            "not_determined": dropped,
            "configurations": sorted({r.label for r in runs}),
            "mean_abs_log_error_makespan_ttft_p50": value,
            "grid": {
                "cores": list(cores_grid),
                "notify_s": list(notify_grid),
                "idle_load": list(idle_grid),
            },
        }
    )


# anchors ----------------------------------------------------------------------------
def _number(entry: dict[str, Any], key: str, where: str) -> float:
    value = entry.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
        raise SimError(f"{where}: {key} must be a non-negative number")
    return float(value)


def _entries(anchors: dict[str, Any], key: str) -> list[dict[str, Any]]:
    entries = anchors.get(key)
    if not isinstance(entries, list) or not entries:
        raise SimError(f"anchors: {key!r} must be a non-empty list of measured points")
    for i, e in enumerate(entries):
        if not isinstance(e, dict) or not isinstance(e.get("source"), str):
            raise SimError(f"anchors: {key}[{i}] must be an object with a 'source' string")
    return entries


def _fit(
    names: tuple[str, ...], rows: list[list[float]], values: list[float], what: str
) -> list[float]:
    """The anchors' fits (:func:`fit_nonnegative`); a coefficient the figures cannot
    determine is an error here: anchors are few, chosen points, so add one that separates
    it."""
    fit = fit_nonnegative(names, rows, values, f"anchors: {what}")
    if fit.dropped:
        raise SimError("; ".join(f"{name}: {why}" for name, why in fit.dropped.items()))
    return [fit[name] for name in names]


def fit_anchors(anchors: dict[str, Any], command: str, date: str) -> Calibration:
    """A calibration from published/measured per-layer figures (module docstring)."""
    name = str(anchors.get("preset", ""))
    try:
        config = preset(name)
    except Exception as exc:
        raise SimError(f"anchors: preset {name!r}: {exc}") from None
    dtype = str(anchors.get("dtype", "bfloat16"))
    shapes = Shapes.of(config, dtype)
    sources: dict[str, str] = {}
    # attention: per layer ms for a batch of prompt lengths
    rows, values = [], []
    for i, e in enumerate(_entries(anchors, "attention")):
        lengths = e.get("lengths")
        if not isinstance(lengths, list) or not all(isinstance(n, int) for n in lengths):
            raise SimError(f"anchors: attention[{i}].lengths must be a list of whole numbers")
        rows.append([1.0, float(sum(lengths)), float(sum(n * n for n in lengths))])
        values.append(_number(e, "ms", f"anchors: attention[{i}]") / 1e3)
        sources[f"attention[{i}]"] = e["source"]
    fixed = bool(anchors.get("attention_without_fixed", False))
    if fixed:
        a1, a2 = _fit(("tokens", "squares"), [r[1:] for r in rows], values, "attention")
        a0 = 0.0
    else:
        a0, a1, a2 = _fit(("fixed", "tokens", "squares"), rows, values, "attention")
    # FFN: one GPU holding every expert, shared experts included in the figure
    rows, values = [], []
    k, e_all, shared = shapes.topk, shapes.experts, shapes.shared_experts
    for i, e in enumerate(_entries(anchors, "ffn")):
        tokens = _number(e, "tokens", f"anchors: ffn[{i}]")
        routed = tokens * k
        touched = e_all * (1 - math.exp(-routed / e_all)) + shared
        rows.append([touched, routed + tokens * shared])
        values.append(_number(e, "ms", f"anchors: ffn[{i}]") / 1e3)
        sources[f"ffn[{i}]"] = e["source"]
    fe, fr = _fit(("experts", "rows"), rows, values, "ffn")
    # dispatch + combine per layer, measured with given shapes and wire format
    rows, values = [], []
    notify = _number(anchors.get("notify", {}), "us", "anchors: notify") / 1e6
    sources["notify"] = str(anchors.get("notify", {}).get("source", ""))
    for i, e in enumerate(_entries(anchors, "dispatch_combine")):
        shape_name = str(e.get("preset", name))
        sh = Shapes.of(preset(shape_name), str(e.get("dtype", dtype)))
        wire = Wire(
            str(e.get("wire_format", "per_choice")), str(e.get("combine_reduce", "attention"))
        )
        probe = Calibration(
            device="", preset=shape_name, dtype=dtype, attn_fixed_s=0, attn_token_s=0,
            attn_square_s=0, ffn_item_s=0, ffn_expert_s=0, ffn_row_s=0,
            dispatch_latency_s=0, dispatch_bandwidth=1, combine_latency_s=0,
            combine_bandwidth=1, notify_s=0, barrier_s=0, collective_latency_s=0,
            collective_bandwidth=1,
        )  # fmt: skip
        cm = CostModel(probe, sh, 1, int(e.get("ffn_ranks", 1)), wire)
        tokens = _number(e, "tokens", f"anchors: dispatch_combine[{i}]")
        rows.append([2.0, cm.dispatch_bytes(tokens) + cm.combine_bytes(tokens)])
        values.append(_number(e, "ms", f"anchors: dispatch_combine[{i}]") / 1e3)
        sources[f"dispatch_combine[{i}]"] = e["source"]
    lat, inv_bw = _fit(("latency", "bytes"), rows, values, "dispatch_combine")
    # The identity-FFN round trip includes one arrival each way: the simulator adds those.
    lat = max(0.0, lat - notify)
    # colocated all_gather (model dtype) + reduce_scatter (fp32) per layer, 2 ranks
    rows, values = [], []
    for i, e in enumerate(_entries(anchors, "collective")):
        tokens = _number(e, "tokens", f"anchors: collective[{i}]")
        hidden = _number(e, "hidden", f"anchors: collective[{i}]")
        world = _number(e, "world", f"anchors: collective[{i}]")
        rows.append([2.0, (world - 1) * tokens * hidden * (shapes.dtype_bytes + 4)])
        values.append(_number(e, "ms", f"anchors: collective[{i}]") / 1e3)
        sources[f"collective[{i}]"] = e["source"]
    c_lat, c_inv = _fit(("latency", "bytes"), rows, values, "collective")
    internode = anchors.get("internode", {})
    barrier = anchors.get("barrier", {})
    for key in ("internode", "barrier", "gpus_per_node"):
        if key in anchors and isinstance(anchors[key], dict):
            sources[key] = str(anchors[key].get("source", ""))
    return Calibration(
        device=str(anchors.get("device", "gpu")),
        preset=name,
        dtype=dtype,
        layers=None,
        attn_fixed_s=a0,
        attn_token_s=a1,
        attn_square_s=a2,
        ffn_item_s=0.0,
        ffn_expert_s=fe,
        ffn_row_s=fr,
        shared_token_s=fr,
        dispatch_latency_s=lat,
        dispatch_bandwidth=1 / inv_bw if inv_bw > 0 else 1e15,
        combine_latency_s=lat,
        combine_bandwidth=1 / inv_bw if inv_bw > 0 else 1e15,
        notify_s=notify,
        barrier_s=_number(barrier, "us", "anchors: barrier") / 1e6 if barrier else 0.0,
        collective_latency_s=c_lat,
        collective_bandwidth=1 / c_inv if c_inv > 0 else 1e15,
        internode_bandwidth=(
            _number(internode, "gbps", "anchors: internode") * 1e9 if internode else None
        ),
        gpus_per_node=int(anchors["gpus_per_node"]["value"])
        if isinstance(anchors.get("gpus_per_node"), dict)
        else None,
        cores=None,
        comm_uses_cores=False,
        command=command,
        date=date,
        notes=str(anchors.get("notes", "")),
        sources=sources,
    )
