"""``afd run``'s verification: every request's final hidden state against the monolithic
reference, which replays each replica's own steps and follows its expert choice only at
routing near-ties.

The reference replays a replica's steps -- the same batches, the same chunks of long
prompts -- and computes its routed experts with the FFN ranks' backend, so that what it
does differently is the MoE exchange under test (and the rounding of other batch shapes).
A request passes when:

* its output and the reference's are finite (a NaN or an infinity on either side fails,
  naming the side);
* wherever the run chose other experts than the reference's own router would, the
  reference's top-k was within the margin of a tie (:data:`TIE_MARGIN`, growing with depth
  past :data:`TIE_DEPTH`: :func:`tie_margin_at`); elsewhere it is a *wrong expert*, named
  with its layer and token (the tighter margin from the tie-gap drift measured at the
  probed tokens, :class:`DriftMargins`, is reported beside it, and judges instead where
  :data:`TIE_MARGIN_FROM` says so);
* at every MoE layer, what the exchange returned for the probed tokens of each of its
  chunks (up to 8, the last included: :func:`~afd_tools.run.exchanges.probed_rows`) is
  within one layer's rounding (the run's exchange tolerance) of the reference's experts on
  the same row, experts and weights,
  and the experts and weights it went out with are the reference router's for that row
  (within :data:`LAYER_TIE_MARGIN` and :data:`ROUTER_WEIGHT_TOLERANCE`)
  (:class:`ExchangeCheck`; :mod:`afd_tools.run.exchanges`): one layer's rounding, whatever
  the depth;
* its relative error is within the tolerance -- or, in a lower precision than float32,
  it is no farther from the reference's *float32 twin* than :data:`DRIFT_FACTOR` times the
  reference itself is (:class:`TwinCheck`; both distances finite).

Why the near-tie rule: in bfloat16, other batch shapes round the GEMMs differently, and
where two experts' router scores are that close the top-k flips from one layer on -- a
difference of several percent in one token's state that says nothing about AFD. At such a
token the reference takes the run's choice, so both compute the same experts and the
tolerance stays tight everywhere; the tokens where that happened are counted per request.

Why the twin: over many layers two bfloat16 computations of one model that differ only in
their reduction orders drift apart (v2-lite's 27 layers land at 2.0-2.4e-2 from the bf16
reference on an H200, the tiny preset at 27 layers 2-4e-2 on the CPU, where 2-8 layers stay
below 1e-2). The twin is the same model -- every weight rounded to the run's dtype -- computed
in float32, replaying the same steps and following the run's expert choice at near ties
like the reference; a request that misses the tolerance is checked against it only after a
second replay confirmed the miss and its exchanges passed. The bound is FlashAttention's
test rule (its output's distance from a float32 reference at most twice that of the
same-precision reference implementation), so it grows with the model's own rounding; it
replaces the tolerance for that request (docs/testing.md measures what it still catches:
at depth, the exchange check comes first for that reason).
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import math
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from afd_models import KVCache, MonolithicModel, PromptChunk
from afd_protocol import relative_error
from afd_tools.run.exchanges import PROBES_PER_CHUNK, row_owners
from afd_tools.run.routing import RoutingError, TieFollower, differs, gap_drift
from afd_tools.run.verify_times import VerificationTimes

TIE_MARGIN = {"float32": 2.0**-16, "bfloat16": 2.0**-3}
"""Largest relative gap (:meth:`afd_models.Selection.tie_gaps`) at which a routing
decision counts as a near tie, per dtype (see docs/testing.md for how it was measured):
bf16 is 2.8x the largest flip measured on an H200, 4.5e-2 (2A1F v2-lite, 8 layers, the
uneven 24-request mix, ranks at 25 % MPS shares against a whole-GPU reference: cuBLAS
picks other kernels for another SM count, so they round differently; 3.4e-2 at 50 %, where
every disagreement followed with --tie-margin 1 was 8,542 of 379,897 decisions); on CPU
the largest was 2.7e-3. A followed decision still has its output checked to the
tolerance."""
TIE_DEPTH = 8
"""The layer up to which the end-to-end check's tie margin is :data:`TIE_MARGIN` (what
the margins were measured at); at layer ``L`` past it the margin is ``TIE_MARGIN * L /
TIE_DEPTH`` (:func:`tie_margin_at`). The reference replays a request through every layer
before ``L``, and its distance from the run grows with depth, so a gap the rounding moves
grows too: with ``--tie-margin 1`` (every disagreement followed) the largest followed gap
at layer ``L`` was at most 0.0074 L on this CPU (bf16, 27 layers, tiny and v3-mini, three
seeds of 32 requests each: 0.008 at layer 2, 0.125 at layers 17 and 26) and on GPUs
(0.045 by layer 7 on an H200, 0.13 at layers 22-25 on an H100); the margin is 2.1x that
line at every depth. A decision followed there is excused from the wrong-expert check
alone: the output is still checked, and the layer-local router check (:data:`LAYER_TIE_MARGIN`)
holds the run's router to one layer's rounding at every depth, on up to 8 tokens of each
chunk (:func:`~afd_tools.run.exchanges.probed_rows`)."""
LAYER_TIE_MARGIN = 1e-4
"""The tie margin of the layer-local router check (:func:`check_exchanges`; the run's
margin where that is smaller): the reference's router computes from the very row the
replica's router saw, with the same gate in float32, so only the order of float32 sums can
flip a choice there, whatever the depth or dtype."""
ROUTER_WEIGHT_TOLERANCE = 1e-4
"""Largest relative error of the expert weights a replica sent for a row against the
weights the reference's router gives the same experts (:class:`ExchangeCheck`), whatever
the run's dtype and tolerance: the reference holds its gate in the run's dtype, as the
replica does, and both routers compute in float32 from the same row, so only the order of
float32 sums separates them (0 on CPU, where the two compute alike; a matmul of other
shapes moves a weight by ~1e-6). A routed scale 1.5 % off passed the run's bf16 tolerance
of 2e-2; this bound names it."""
DRIFT_FACTOR = 2.0
"""How many times the reference's own distance from the float32 twin a lower-precision
run's output may be (:class:`TwinCheck`); FlashAttention's tests use 2 on the largest
element, this applies it to each request's relative error."""
QUANT_TIE_MARGIN = 2.0**-4
"""The same with int8 dispatch rows (``--cam-dynamic-quant``): the expert inputs, and so the
next layers' router inputs, carry about 1 % of quantisation error."""


def layer_tie_margin(margin: float) -> float:
    """The layer-local router check's tie margin for the run's ``margin``:
    :data:`LAYER_TIE_MARGIN`, or ``margin`` where that is smaller."""
    return min(margin, LAYER_TIE_MARGIN)


def tie_margin_at(margin: float, layer: int) -> float:
    """The end-to-end check's tie margin at model layer ``layer`` for the run's ``margin``:
    ``margin`` up to :data:`TIE_DEPTH`, in proportion to the layer past it."""
    return margin * max(1.0, layer / TIE_DEPTH)


TIE_MARGIN_SOURCES = ("depth", "drift")
"""What the end-to-end check may judge a followed decision by (:data:`TIE_MARGIN_FROM`)."""
TIE_MARGIN_FROM = "depth"
"""Which tie margin judges a followed decision: ``depth`` (:func:`tie_margin_at`), or
``drift``, the margin from the tie-gap drift measured at the probed tokens
(:class:`DriftMargins`), which makes a followed decision whose gap is above it a wrong
expert. The replay follows near ties within the depth margin either way (so outputs are
the same), and the drift margins and what they would reject are reported either way
(``verification_near_ties``). ``depth`` stays the default. The drift margin's first rule
(3x the largest drift at the probes, whatever their number) falsely rejected a followed
decision on one H100 (2026-12-06, v2-lite 27 layers, 48 requests up to 16K): in the
two-stage runs (2A1F and 2A2F async, ``--stages 2``, whose split changes the GEMM shapes
and so the rounding from the first MoE layer on) the largest drift of 452 probes at MoE
layer 1 was 0.00238, the margin 0.00714, and a correct run followed a gap of 0.00737 there
(margin / gap 0.97): the largest of ~190K tokens' drifts reaches further than the largest
of 452, and at the first MoE layer no shallower layer's drift raises the margin. The
margin now extrapolates from the probes to every token (:func:`drift_reach`,
:data:`DRIFT_SAFETY`): chosen on 36 CPU runs, it rejects none of the 15 GPU readings
(held out; margin / gap 1.45 at that layer, 2.12-2.65 in the other readings), but on
those long prompts (~430 tokens per probe) it is tighter than the depth margin only at the
first 3-7 MoE layers (docs/testing.md, "The drift-measured tie margin"). Two limits of
``drift`` as it stands: a failure by the drift margin is judged on the first replay (it is
applied once the whole mode is checked, after the second replay that confirms other
failures), and the float32 twin's replay still follows near ties within the depth
margin."""
DRIFT_SAFETY = 2.25
"""The drift margin at a MoE layer is this many times :func:`drift_reach` (how far the
largest drift over the mode's tokens may exceed that over its probed tokens) times the
largest tie-gap drift measured at a probed token there or at a shallower MoE layer
(:class:`DriftMargins`). Chosen on 36 CPU runs (tiny and v3-mini, bf16, 27 layers, async:
32 requests seeds 1-13, 12 requests up to 2K seeds 1-3, 6 up to 8K seeds 1-2; 5-355
tokens per probe, reach 1.30-2.46) as the least multiple of 1/4 that keeps every followed
gap at most 1 / 1.5 of its margin there (the largest gap / drift was 1.41x the reach);
checked on the GPU's 15 readings, which did not choose it (1.55x the reach at the
two-stage runs' layer 1: margin / gap 1.45). The first rule was 3 with no reach (3 =
1.55 x the 1.93 that seeds 4-13 of 32 requests reached); at 5-8 tokens per probe (reach
about 1.33) the two are alike."""
DRIFT_FLOOR = 2.0**-8
"""The least drift margin (relative gap): one bf16 rounding of a router input. Where the
drift measured is 0 -- on the CPU at the first MoE layer, whose input the replay computes
bitwise as the run did -- the margin is this, not 0. It is never looser than the depth
margin either, so in float32 (2^-16) the drift margin is the depth margin."""


def drift_reach(tokens: int, probes: int) -> float:
    """How many times the largest gap drift over a layer's ``tokens`` decisions (one per
    token of the mode) may exceed the largest over its ``probes`` probed tokens: the ratio
    of the expected maxima of ``tokens`` and ``probes`` draws from an exponential tail,
    ``ln(tokens) / ln(probes)`` (dimensionless). 1 where every token was probed (``tokens
    <= probes``); ``inf`` where at most one probe stands for more tokens (one draw shows no
    tail), which leaves the depth margin."""
    if tokens <= probes:
        return 1.0
    if probes < 2:
        return math.inf
    return math.log(tokens) / math.log(probes)


def drift_margin_at(drift: float, depth_margin: float, reach: float = 1.0) -> float:
    """The drift margin (a relative tie gap) at a layer whose largest measured gap drift
    (relative, there or shallower) is ``drift``, extrapolated from the probes to every
    token by ``reach`` (:func:`drift_reach`): ``DRIFT_SAFETY * reach * drift``, at least
    :data:`DRIFT_FLOOR`, at most ``depth_margin`` (it only tightens; a drift or reach that
    is not finite leaves the depth margin)."""
    if not (math.isfinite(drift) and math.isfinite(reach)):
        return depth_margin
    return min(depth_margin, max(DRIFT_FLOOR, DRIFT_SAFETY * reach * drift))


Steps = list[list[tuple[int, int, int, bool]]]
"""A replica's steps: per step, ``(request id, begin, end, final)`` per chunk."""


@dataclass(frozen=True)
class DriftMargins:
    """One mode's tie margins from the drift measured at its probed tokens.

    At a probed token the replica recorded the row its router saw; the reference's router
    gives that row a tie gap, and the reference replay gives its own row of the same token
    and layer another (:func:`~afd_tools.run.routing.gap_drift`: how far the gap moved
    between the two states). The largest such drift over every probed token of the mode
    (every replica's) is :attr:`drift` at that MoE layer; the drift margin there is
    :func:`drift_margin_at` the largest of those at it and every shallower MoE layer
    (:attr:`envelope`), extrapolated from the probed tokens to every token of the mode
    (:attr:`reach`)."""

    layers: tuple[int, ...]
    """The MoE layers."""
    drift: tuple[float, ...]
    """Per MoE layer, the largest gap drift measured at a probed token (``inf`` where none
    was probed or one was not finite)."""
    envelope: tuple[float, ...]
    """Per MoE layer, the largest of :attr:`drift` at it and every shallower MoE layer:
    what its margin is computed from (the drift grows with depth; a layer's maximum over a
    few hundred probes scatters, and dips where they missed the tail)."""
    margins: tuple[float, ...]
    """Per MoE layer, the drift margin (:func:`drift_margin_at` the envelope)."""
    depth: tuple[float, ...]
    """Per MoE layer, the depth margin (:func:`tie_margin_at`), which the replay followed
    near ties within."""
    probes: int
    """Probed tokens the drift was measured at (each at every MoE layer)."""
    applied: bool
    """Whether a followed decision above the drift margin is a wrong expert
    (:data:`TIE_MARGIN_FROM`)."""
    tokens: int = 0
    """The mode's tokens: the decisions judged at each MoE layer (one per token)."""
    reach: float = 1.0
    """:func:`drift_reach` of :attr:`tokens` over :attr:`probes`: how far the largest drift
    at the probes is extrapolated to every token (dimensionless, at least 1; ``inf``, which
    leaves the depth margin, where one probe stood for more tokens)."""
    factor: float = 0.0
    """What each margin multiplies its :attr:`envelope` by: :data:`DRIFT_SAFETY` times
    :attr:`reach` when measured (before the floor and the depth cap)."""


@dataclass(frozen=True)
class _Followed:
    """A decision where the replay took the run's choice within the depth margin."""

    step: int
    index: int
    """Its MoE layer's index (into ``moe_layers``)."""
    rid: int
    position: int
    gap: float
    run: tuple[int, ...]
    reference: tuple[int, ...]


@dataclass
class TieEvidence:
    """One replica's routing decisions and the gap drift measured at its probed tokens,
    kept by :meth:`Verifier.check` until its mode's :class:`DriftMargins` are known
    (:func:`apply_drift_margins`); every tensor on the CPU."""

    probe_drift: torch.Tensor
    """float64 ``[moe layers, P]``: the gap drift at each probed token (P may be 0)."""
    gaps: torch.Tensor
    """float32 ``[moe layers, N]``: the reference's gap of each decision, N the replica's
    tokens over every step."""
    owners: torch.Tensor
    """int64 ``[N]``: each token's request id."""
    followed: list[_Followed]
    """Every followed decision, in step, layer, row order."""
    checks: dict[int, RequestCheck]
    """The replica's checks (the dict :meth:`Verifier.check` returned, updated in place)."""


def tie_evidence(
    replay: ReplicaReplay,
    steps: Steps,
    routing: Sequence[torch.Tensor] | None,
    probed: ProbedGaps | None,
    checks: dict[int, RequestCheck],
    moe_layers: int,
) -> TieEvidence:
    """The :class:`TieEvidence` of one replica's ``replay`` of ``steps`` (a model of
    ``moe_layers`` MoE layers), following its ``routing`` (one int32 ``[moe layers, T, k]``
    per step, or ``None``), with the reference router's gaps on its recorded rows
    (``probed``). A replica that ran no step gives empty records."""
    owners = [rid for step in steps for rid, begin, end, _ in step for _ in range(end - begin)]
    gaps = torch.cat(replay.gaps, dim=1) if replay.gaps else torch.zeros(moe_layers, 0)
    followed: list[_Followed] = []
    for number, (step, here) in enumerate(zip(steps, replay.followed, strict=True)):
        if routing is None or not bool(here.any()):
            continue
        place = [(rid, position) for rid, b, e, _ in step for position in range(b, e)]
        layer_index, row_index = here.nonzero(as_tuple=True)  # one gather per step, not per row
        picked = zip(
            layer_index.tolist(),
            row_index.tolist(),
            replay.gaps[number][layer_index, row_index].tolist(),
            routing[number][layer_index, row_index].sort(dim=-1).values.tolist(),
            replay.own[number][layer_index, row_index].sort(dim=-1).values.tolist(),
            strict=True,
        )
        for index, row, gap, run, own in picked:
            rid, position = place[row]
            followed.append(_Followed(number, index, rid, position, gap, tuple(run), tuple(own)))
    drift = torch.zeros(moe_layers, 0, dtype=torch.float64)
    if probed is not None and probed.steps:
        columns: dict[int, list[int]] = {}
        for step_number, row in zip(probed.steps, probed.rows, strict=True):
            columns.setdefault(step_number, []).append(row)
        reference_gaps = torch.cat(
            [replay.gaps[n][:, torch.tensor(rows)] for n, rows in columns.items()], dim=1
        )
        reference_ids = torch.cat(
            [replay.own[n][:, torch.tensor(rows)] for n, rows in columns.items()], dim=1
        )
        drift = gap_drift(reference_gaps, reference_ids, probed.gaps, probed.ids)
    return TieEvidence(drift, gaps, torch.tensor(owners, dtype=torch.int64), followed, checks)


def apply_drift_margins(
    evidence: Sequence[TieEvidence],
    layers: Sequence[int],
    margin: float,
    applied: bool | None = None,
) -> DriftMargins:
    """One mode's :class:`DriftMargins` from its replicas' ``evidence`` (MoE ``layers``; the
    run's tie ``margin``), written into every one of their checks: each request's
    decisions within the drift margin, its followed decisions above it
    (:attr:`RoutingCounts.drift_rejected`, the first as :attr:`RoutingCounts.drift_wrong`)
    and the smallest margin / gap; where ``applied`` (default: :data:`TIE_MARGIN_FROM` is
    ``drift``), those above it are wrong experts (:meth:`RequestCheck.problem`)."""
    if applied is None:
        applied = TIE_MARGIN_FROM == "drift"
    depth = tuple(tie_margin_at(margin, layer) for layer in layers)
    probes = sum(e.probe_drift.shape[1] for e in evidence)
    tokens = sum(e.gaps.shape[1] for e in evidence)
    reach = drift_reach(tokens, probes)
    drift = [math.inf] * len(layers)
    if probes:
        measured = torch.cat([e.probe_drift for e in evidence], dim=1)
        drift = [float(v) if not math.isnan(v) else math.inf for v in measured.amax(dim=1)]
    envelope = tuple(itertools.accumulate(drift, max))
    margins = tuple(drift_margin_at(d, m, reach) for d, m in zip(envelope, depth, strict=True))
    record = DriftMargins(
        tuple(layers), tuple(drift), envelope, margins, depth, probes, applied,
        tokens, reach, DRIFT_SAFETY * reach,
    )  # fmt: skip
    limit = torch.tensor(margins, dtype=torch.float64)[:, None]
    for e in evidence:
        within = (e.gaps.double() <= limit).sum(dim=0)
        followed_by_request: dict[int, list[_Followed]] = {}
        for f in e.followed:
            followed_by_request.setdefault(f.rid, []).append(f)
        for rid, check in list(e.checks.items()):
            mine = e.owners == rid
            # Counted afresh (applying twice counts once), on a copy that shares nothing
            # mutable with the replay's own counts.
            routing = dataclasses.replace(
                check.routing,
                largest_followed_by_layer=dict(check.routing.largest_followed_by_layer),
                decisions=int(mine.sum()) * len(layers),
                within_drift=int(within[mine].sum()),
                drift_rejected=0,
                drift_wrong=None,
                smallest_drift_ratio=math.inf,
            )
            for f in followed_by_request.get(rid, []):
                routing.smallest_drift_ratio = min(
                    routing.smallest_drift_ratio,
                    margins[f.index] / f.gap if f.gap > 0 else math.inf,
                )
                if f.gap <= margins[f.index]:
                    continue
                routing.drift_rejected += 1
                if routing.drift_wrong is None:
                    routing.drift_wrong = WrongExpert(
                        layers[f.index], f.position, f.run, f.reference, f.gap,
                        margins[f.index], depth[f.index],
                    )  # fmt: skip
            e.checks[rid] = dataclasses.replace(check, routing=routing, drift=record)
    return record


@dataclass(frozen=True)
class WrongExpert:
    """A request's first routing decision where the run chose other experts than the
    reference's router with no near tie."""

    layer: int
    position: int
    """The token's position in its prompt."""
    run: tuple[int, ...]
    """The experts the run chose (sorted)."""
    reference: tuple[int, ...]
    gap: float
    """The reference's relative tie gap at that token (above the margin)."""
    margin: float
    """The tie margin there."""
    depth_margin: float | None = None
    """Where :attr:`margin` is the drift margin (:class:`DriftMargins`): the depth margin
    (:func:`tie_margin_at`) the replay followed the run's choice within."""

    def describe(self, count: int) -> str:
        if self.depth_margin is None:
            margins = f"margin {self.margin:.1e} at that layer"
        else:
            margins = (
                f"drift margin {self.margin:.1e} at that layer, from the drift measured at the "
                f"probed tokens; depth margin {self.depth_margin:.1e}"
            )
        return (
            f"wrong expert at layer {self.layer}: token {self.position} went to experts "
            f"{list(self.run)} where the reference routes it to {list(self.reference)} "
            + ("with no near tie" if self.depth_margin is None else "above the drift margin")
            + f" (gap {self.gap:.1e}, {margins}); "
            f"{count} such token-layer decisions"
        )


@dataclass
class RoutingCounts:
    """One request's routing against the reference, over every MoE layer and step."""

    near_ties: int = 0
    """Token-layer decisions within the margin of a tie."""
    followed: int = 0
    """Of those, where the run chose otherwise and the reference took its choice."""
    largest_followed_gap: float = 0.0
    """The largest tie gap among the followed decisions: how close to the margin the
    rounding came (``afd run --tie-margin 1`` follows every disagreement, which measures
    what margin a device needs)."""
    largest_followed_by_layer: dict[int, float] = field(default_factory=dict)
    """MoE layer -> the largest tie gap followed there (layers with a followed decision):
    how the rounding that moves a gap grows with depth."""
    wrong: int = 0
    first_wrong: WrongExpert | None = None
    decisions: int = 0
    """Every token-layer routing decision of the request (near a tie or not)."""
    within_drift: int = 0
    """Of those, within the drift margin of a tie (:class:`DriftMargins`; at most
    :attr:`near_ties`, the decisions within the depth margin)."""
    drift_rejected: int = 0
    """Followed decisions whose gap is above the drift margin: wrong experts where the
    drift margin applies (:attr:`DriftMargins.applied`), else what it would have rejected."""
    drift_wrong: WrongExpert | None = None
    """The first of those (in step, layer, token order)."""
    smallest_drift_ratio: float = math.inf
    """The smallest drift margin / gap over the followed decisions (``inf``: none followed):
    below 1 the drift margin rejects it."""


@dataclass(frozen=True)
class ExchangeCheck:
    """A request's recorded exchanges -- its chunks' probed tokens at every MoE layer --
    against the reference's experts on the same rows, experts and weights
    (:meth:`afd_models.MoELayer.exchanged`), and the experts and weights the replica sent
    against the reference's router on the same rows
    (:meth:`afd_models.MoELayer.routed_weights`): the worst of each."""

    error: float
    """The largest relative error of a row (``inf`` where either side is not finite)."""
    layer: int
    position: int
    """Where it was: the layer, and the token's position in its prompt."""
    rows: int
    """How many (token, layer) rows of the request were checked."""
    weight_error: float = 0.0
    """The largest relative error of a row's expert weights against the weights the
    reference's router gives the same experts (``inf`` where not finite); it must be within
    :data:`ROUTER_WEIGHT_TOLERANCE`, not the run's tolerance."""
    weight_layer: int = -1
    weight_position: int = -1
    """Where that was."""
    wrong: WrongExpert | None = None
    """The first row (in layer order) whose experts are not the reference router's own
    top-k for it, with no near tie: a router fault at one layer's rounding, whatever the
    depth."""
    wrong_count: int = 0
    bound: float | None = None
    """What came back is held to this (the run's ``exchange_tolerance``: one layer's
    rounding), or to the run's tolerance where that is smaller; ``None``: the run's
    tolerance."""

    def limit(self, tolerance: float) -> float:
        """What the returned rows are held to, for a run of ``tolerance``."""
        return tolerance if self.bound is None else min(self.bound, tolerance)

    def problem(self, tolerance: float) -> str | None:
        if self.wrong is not None:
            return f"the router on a dispatched row: {self.wrong.describe(self.wrong_count)}"
        limit = self.limit(tolerance)
        if not self.error <= limit:
            shown = "not finite" if math.isinf(self.error) else f"{self.error:.2e} off"
            return (
                f"the MoE exchange at layer {self.layer} returned token {self.position}'s "
                f"experts {shown} from the reference's (bound {limit:.0e}; {self.rows} "
                "token-layer rows checked)"
            )
        if not self.weight_error <= ROUTER_WEIGHT_TOLERANCE:
            shown = (
                "not finite" if math.isinf(self.weight_error) else f"{self.weight_error:.2e} off"
            )
            return (
                f"the MoE exchange at layer {self.weight_layer} weighted token "
                f"{self.weight_position}'s experts {shown} from the reference router's "
                f"weights (bound {ROUTER_WEIGHT_TOLERANCE:.0e}; {self.rows} token-layer rows "
                "checked)"
            )
        return None


@dataclass(frozen=True)
class TwinCheck:
    """A lower-precision request that missed the tolerance, against the float32 twin (the
    module docstring): it passes when the run's output is within ``DRIFT_FACTOR *
    reference_error`` of the twin's, both distances are finite and the twin found no wrong
    expert."""

    run_error: float
    """The run's output against the twin's (relative; ``inf`` if either is not finite)."""
    reference_error: float
    """The reference's output against the twin's: the model's own rounding drift."""
    wrong: WrongExpert | None = None
    """The first decision where the run chose otherwise than the twin with no near tie."""
    wrong_count: int = 0

    @property
    def bound(self) -> float:
        """How far from the twin the run may be."""
        return DRIFT_FACTOR * self.reference_error

    def passes(self) -> bool:
        finite = math.isfinite(self.run_error) and math.isfinite(self.reference_error)
        return finite and self.wrong is None and self.run_error <= self.bound

    def describe(self) -> str:
        if self.wrong is not None:
            return f"against the float32 twin: {self.wrong.describe(self.wrong_count)}"
        return (
            f"{self.run_error:.2e} from the float32 twin, where the reference is "
            f"{self.reference_error:.2e} from it (at most {self.bound:.2e} passes)"
        )


@dataclass(frozen=True)
class RequestCheck:
    """One request's output in one mode against the reference."""

    error: float
    """Relative error (:func:`afd_protocol.relative_error`); ``inf`` if not finite."""
    not_finite: str | None = None
    """Which side held NaN or inf, and how many (``None``: both finite)."""
    routing: RoutingCounts = field(default_factory=RoutingCounts)
    twin: TwinCheck | None = None
    """Where the error missed the tolerance in a lower precision: the float32 twin's check."""
    exchange: ExchangeCheck | None = None
    """Its exchanges checked layer by layer (``None``: the mode has no exchange)."""
    drift: DriftMargins | None = None
    """Its mode's drift margins (one object shared by the mode's requests; ``None``: not
    measured, e.g. a check built by hand)."""

    def problem(self, tolerance: float) -> str | None:
        """Why this request fails (one line), or ``None`` if it passes."""
        if self.not_finite is not None:
            return f"not finite: {self.not_finite}"
        if self.routing.first_wrong is not None:
            return self.routing.first_wrong.describe(self.routing.wrong)
        if self.exchange is not None and (why := self.exchange.problem(tolerance)):
            return why
        if (wrong := self.wrong_by_drift) is not None:
            return wrong.describe(self.routing.drift_rejected)
        if not self.error <= tolerance:
            if self.twin is None:
                return f"relative error {self.error:.2e}"
            if not self.twin.passes():
                return f"relative error {self.error:.2e}; {self.twin.describe()}"
        return None

    @property
    def wrong_by_drift(self) -> WrongExpert | None:
        """The first followed decision above the drift margin, where that margin applies
        (:attr:`DriftMargins.applied`): a wrong expert named after the layer-local check's
        findings, which hold the router to one layer's rounding."""
        applied = self.drift is not None and self.drift.applied
        return self.routing.drift_wrong if applied else None

    def drifted(self, tolerance: float) -> bool:
        """Whether its final state's relative error alone misses the tolerance: both sides
        finite, no wrong expert, its exchanges within it (what the float32 twin judges)."""
        return (
            self.not_finite is None
            and self.routing.first_wrong is None
            and self.wrong_by_drift is None
            and (self.exchange is None or self.exchange.problem(tolerance) is None)
            and not self.error <= tolerance
        )

    def passed_by_twin(self, tolerance: float) -> bool:
        """Whether the request passes only through the float32 twin."""
        return not self.error <= tolerance and self.problem(tolerance) is None


Checks = dict[str, dict[int, RequestCheck]]
"""Per mode, request id -> its check."""


def not_finite(out: torch.Tensor, reference: torch.Tensor) -> str | None:
    """Which of ``out`` (the run's output) and ``reference`` hold NaN or inf (any shapes)."""
    parts = []
    for side, tensor in (("the run's output", out), ("the reference", reference)):
        nan, inf = int(tensor.isnan().sum()), int(tensor.isinf().sum())
        if nan or inf:
            parts.append(f"{side} holds {nan} NaN and {inf} inf of {tensor.numel()} values")
    return "; ".join(parts) or None


def check_request(
    out: torch.Tensor, reference: torch.Tensor, routing: RoutingCounts | None = None
) -> RequestCheck:
    """Compare one request's final hidden state ``out [H]`` with the reference's ``[H]``."""
    return RequestCheck(
        relative_error(out, reference), not_finite(out, reference), routing or RoutingCounts()
    )


@dataclass
class ReplicaReplay:
    """The reference's replay of one replica's steps."""

    outputs: dict[int, torch.Tensor] = field(default_factory=dict)
    """request id -> float32 ``[H]`` final hidden state, on the CPU."""
    own: list[torch.Tensor] = field(default_factory=list)
    """Per step, the reference's own top-k, int32 ``[moe layers, T, k]`` (CPU)."""
    gaps: list[torch.Tensor] = field(default_factory=list)
    """Per step, the reference's relative tie gap of every decision, float32 ``[moe layers,
    T]`` (CPU; :meth:`afd_models.Selection.tie_gaps` on the replay's own router input)."""
    followed: list[torch.Tensor] = field(default_factory=list)
    """Per step, bool ``[moe layers, T]`` (CPU): where the reference took the run's choice
    at a near tie."""
    counts: dict[int, RoutingCounts] = field(default_factory=dict)
    disagreed: bool = False
    """Whether the run chose otherwise anywhere (followed or wrong)."""

    def agrees_with(self, routing: Sequence[torch.Tensor]) -> bool:
        """Whether a run routed every token of every step as this replay did (as sets)."""
        return len(routing) == len(self.own) and all(
            not bool(differs(run, own).any()) for run, own in zip(routing, self.own, strict=True)
        )


def replay_replica(
    reference: MonolithicModel,
    prompts: Mapping[int, torch.Tensor],
    steps: Steps,
    routing: Sequence[torch.Tensor] | None,
    margin: float,
) -> ReplicaReplay:
    """Replay ``steps`` (one replica's), following ``routing`` (the replica's record, one
    int32 ``[moe layers, T, k]`` per step; ``None``: the reference's own routing) at near
    ties within ``margin`` (at each MoE layer :func:`tie_margin_at` it)."""
    if routing is not None and len(routing) != len(steps):
        raise RoutingError(f"the replica recorded routing for {len(routing)} of {len(steps)} steps")
    layers = reference.config.moe_layers
    cache = KVCache()
    replay = ReplicaReplay()
    for index, step in enumerate(steps):
        entries = [PromptChunk(rid, prompts[rid][b:e], b, final) for rid, b, e, final in step]
        hook = TieFollower(
            layers,
            [tie_margin_at(margin, layer) for layer in layers],
            None if routing is None else routing[index],
        )
        last = reference.forward(entries, compute_logits=False, cache=cache, select=hook)
        states = last.last_hidden_states().float().cpu()
        replay.own.append(hook.record("own"))
        replay.gaps.append(hook.record("gaps"))
        replay.followed.append(hook.record("followed"))
        _count(replay, step, hook, layers)
        for row, (rid, _, _, final) in enumerate(step):
            if final:
                replay.outputs[rid] = states[row]
    return replay


def _count(
    replay: ReplicaReplay,
    step: list[tuple[int, int, int, bool]],
    hook: TieFollower,
    layers: Sequence[int],
) -> None:
    """Add one step's near ties, followed and wrong decisions to each request's counts."""
    near, followed, wrong, gaps = (
        hook.record(name) for name in ("near", "followed", "wrong", "gaps")
    )
    replay.disagreed = replay.disagreed or bool((followed | wrong).any())
    row = 0
    for rid, begin, end, _ in step:
        rows = slice(row, row + end - begin)
        counts = replay.counts.setdefault(rid, RoutingCounts())
        counts.near_ties += int(near[:, rows].sum())
        counts.followed += int(followed[:, rows].sum())
        if bool(followed[:, rows].any()):
            here = followed[:, rows]
            per_layer = gaps[:, rows].masked_fill(~here, -math.inf).amax(dim=1)
            counts.largest_followed_gap = max(counts.largest_followed_gap, float(per_layer.max()))
            by_layer = counts.largest_followed_by_layer
            for index in here.any(dim=1).nonzero().flatten().tolist():
                gap = float(per_layer[index])
                by_layer[layers[index]] = max(by_layer.get(layers[index], 0.0), gap)
        counts.wrong += int(wrong[:, rows].sum())
        if counts.first_wrong is None and bool(wrong[:, rows].any()):
            counts.first_wrong = _first_wrong(hook, layers, rows, begin)
        row = rows.stop


def _first_wrong(hook: TieFollower, layers: Sequence[int], rows: slice, begin: int) -> WrongExpert:
    """The first (layer, token) of ``rows`` where the run chose otherwise with no near tie."""
    assert hook.run is not None
    wrong = hook.record("wrong")[:, rows]
    index, offset = (int(v) for v in wrong.nonzero()[0])
    token = rows.start + offset
    return WrongExpert(
        layer=layers[index],
        position=begin + offset,
        run=tuple(sorted(int(e) for e in hook.run[index, token])),
        reference=tuple(sorted(int(e) for e in hook.record("own")[index, token])),
        gap=float(hook.record("gaps")[index, token]),
        margin=hook.margins[index],
    )


def same_replay(a: ReplicaReplay, b: ReplicaReplay) -> bool:
    """Whether two replays of the same steps gave bitwise the same outputs and routing."""
    return (
        a.outputs.keys() == b.outputs.keys()
        and all(torch.equal(a.outputs[rid], b.outputs[rid]) for rid in a.outputs)
        and len(a.own) == len(b.own)
        and all(torch.equal(x, y) for x, y in zip(a.own, b.own, strict=True))
    )


def _largest_difference(a: ReplicaReplay, b: ReplicaReplay) -> float:
    return max((relative_error(a.outputs[rid], b.outputs[rid]) for rid in a.outputs), default=0.0)


@dataclass
class Verifier:
    """Replays every replica of every mode and checks each request (see the module
    docstring); a plain replay is reused for a replica of another mode that ran the same
    steps and routed every token as it did.

    With a ``tolerance``, a replica with a failing request is replayed again before the
    failure is reported: the reference is meant to be deterministic (a passing run matches
    it bitwise), so a second replay that agrees with the first confirms the failure. One
    that does not, and a third that agrees with the second, say the first replay itself
    went wrong (seen once on a loaded 2-core CI machine: one replay of a replica off by
    ~1e-4 on the rows of four requests, then never reproduced in ~500 replays); the run is
    then checked against the later replays and :attr:`notes` says so. A run that really
    differs fails against every replay. A request whose confirmed failure is its relative
    error alone is then checked against the float32 twin, where there is one
    (:class:`TwinCheck`): :meth:`check` checks against the reference and keeps such requests
    aside, and :meth:`twin_pass`, called once every replica is checked, replays them on the
    twin. So the reference and the twin need not fit in memory together: with
    ``release_reference`` the reference is dropped before the twin is built (v2-lite's 27
    layers on an H100: 31 GB in bf16, 63 GB as the twin, 78 GB of device memory)."""

    reference: MonolithicModel | None
    """The reference; ``None`` once :meth:`twin_pass` released it."""
    margin: float
    tolerance: float | None = None
    twin: Callable[[], MonolithicModel] | None = None
    """Builds the float32 twin of a lower-precision reference (:class:`TwinCheck`), on the
    first request that needs it; ``None``: no twin (a float32 reference is its own)."""
    exchange_tolerance: float | None = None
    """What each recorded exchange may return off the reference's experts (one layer's
    rounding; :data:`afd_tools.run.job.EXCHANGE_TOLERANCE`); ``None``: the tolerance."""
    notes: list[str] = field(default_factory=list)
    """One line per replica whose reference replay did not reproduce, and where the twin
    could not be built."""
    release_reference: bool = False
    """Drop :attr:`reference` before the twin is built (the caller must hold no other
    reference to the model for its memory to be freed); no check can follow."""
    evidence: list[TieEvidence] = field(default_factory=list)
    """Per replica checked, in order: its :class:`TieEvidence`, for
    :func:`apply_drift_margins` once its mode's replicas are all checked."""
    times: VerificationTimes = field(default_factory=VerificationTimes)
    """Where the verification's time went: each replay, confirmation, exchange check and
    the twin's build and replays, timed."""
    _plain: dict[tuple[Any, ...], ReplicaReplay] = field(default_factory=dict)
    _pending: list[_TwinJob] = field(default_factory=list, init=False, repr=False)
    _twin: MonolithicModel | None = field(default=None, init=False, repr=False)
    _twin_failed: bool = field(default=False, init=False, repr=False)

    def replica(
        self,
        prompts: Mapping[int, torch.Tensor],
        steps: Steps,
        routing: Sequence[torch.Tensor] | None,
    ) -> ReplicaReplay:
        """The replay of one replica's ``steps`` following its ``routing`` (``None``: a
        replica that recorded none is replayed with the reference's own routing: no near
        tie followed, no wrong expert detected)."""
        key = tuple(tuple(step) for step in steps)
        plain = self._plain.get(key)
        if plain is not None and (routing is None or plain.agrees_with(routing)):
            return plain
        with self.times.timed("replays"):
            replay = replay_replica(self._model(), prompts, steps, routing, self.margin)
        if not replay.disagreed:  # it routed as a plain replay does: reusable
            self._plain[key] = replay
        return replay

    def _model(self) -> MonolithicModel:
        """The reference, while it is held."""
        if self.reference is None:
            raise RuntimeError("the reference was released for the float32 twin: check first")
        return self.reference

    def check(self, prompts: Mapping[int, torch.Tensor], result: Any) -> dict[int, RequestCheck]:
        """Every finished request of one replica's :class:`~afd_tools.run.replica.ModeResult`
        against the reference. Requests that miss the tolerance alone are kept for
        :meth:`twin_pass`, which adds their twin checks to the dict returned here."""
        with self.times.timed("exchanges"):
            exchanges, probed = _check_exchanges(
                self._model(), result, layer_tie_margin(self.margin), self.exchange_tolerance
            )
        recorded = getattr(result, "routing", None) or None
        replay = self.replica(prompts, result.steps, recorded)
        checks = self._against(replay, result, exchanges)
        tolerance = self.tolerance
        if tolerance is not None and any(_end_to_end(c, tolerance) for c in checks.values()):
            confirmed = self._confirmed(prompts, result, recorded, replay)
            if confirmed is not replay:
                checks = self._against(confirmed, result, exchanges)
                replay = confirmed
            drifted = [rid for rid, c in checks.items() if c.drifted(tolerance)]
            if drifted and self.twin is not None:
                self._pending.append(_TwinJob(prompts, result, recorded, replay, checks, drifted))
        layers = len(self._model().config.moe_layers)
        self.evidence.append(tie_evidence(replay, result.steps, recorded, probed, checks, layers))
        return checks

    def _confirmed(
        self,
        prompts: Mapping[int, torch.Tensor],
        result: Any,
        recorded: Sequence[torch.Tensor] | None,
        replay: ReplicaReplay,
    ) -> ReplicaReplay:
        """The replay a failing replica is judged against: ``replay`` where a second one
        reproduces it (or a third disagrees with the second), else the later two's."""
        with self.times.timed("confirmations"):
            again = replay_replica(self._model(), prompts, result.steps, recorded, self.margin)
        if same_replay(replay, again):
            return replay  # the reference reproduces: the failure stands
        with self.times.timed("confirmations"):
            third = replay_replica(self._model(), prompts, result.steps, recorded, self.margin)
        requests = sorted(result.last_hidden)
        if not same_replay(again, third):
            self.notes.append(
                f"the reference's replays of the replica with requests {requests} differ "
                f"from each other (three replays); checked against the first"
            )
            return replay
        self.notes.append(
            f"the reference's first replay of the replica with requests {requests} differed "
            f"from two later ones that agree bitwise (largest relative difference "
            f"{_largest_difference(replay, again):.1e}); checked against the later ones"
        )
        key = tuple(tuple(step) for step in result.steps)
        if self._plain.get(key) is replay:
            self._plain[key] = again
        return again

    def twin_pass(self) -> None:
        """Replay every replica kept by :meth:`check` on the float32 twin (built here, once)
        and add a :class:`TwinCheck` to each of its drifted requests, in the dicts
        :meth:`check` returned. With :attr:`release_reference`, the reference is dropped
        first, its device memory returned to the driver."""
        jobs, self._pending = self._pending, []
        if not jobs:
            return
        if self.release_reference:
            device = self._model().device
            self.reference, self._plain = None, {}
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        twin = self._twin_model()
        for job in jobs:
            if twin is None:
                return
            try:
                with self.times.timed("twin replays"):
                    mirrored = replay_replica(
                        twin, job.prompts, job.result.steps, job.recorded, self.margin
                    )
            except torch.OutOfMemoryError as exc:
                self._out_of_memory(exc)
                return
            for rid in job.drifted:
                assert self.tolerance is not None, "only a check with a tolerance keeps a job"
                if not job.checks[rid].drifted(self.tolerance):
                    continue  # a wrong expert by the drift margin since: no twin can pass it
                counts = mirrored.counts.get(rid, RoutingCounts())
                job.checks[rid] = dataclasses.replace(
                    job.checks[rid],
                    twin=TwinCheck(
                        run_error=relative_error(
                            job.result.last_hidden[rid], mirrored.outputs[rid]
                        ),
                        reference_error=relative_error(
                            job.replay.outputs[rid], mirrored.outputs[rid]
                        ),
                        wrong=counts.first_wrong,
                        wrong_count=counts.wrong,
                    ),
                )

    def _twin_model(self) -> MonolithicModel | None:
        """The float32 twin, built on first use; ``None`` (with a note) where it cannot be
        built, e.g. out of device memory (a v3-slice twin is twice the bf16 model)."""
        if self._twin is None and not self._twin_failed:
            assert self.twin is not None
            try:
                with self.times.timed("twin"):
                    self._twin = self.twin()
            except torch.OutOfMemoryError as exc:
                self._out_of_memory(exc)
        return self._twin

    def _out_of_memory(self, exc: torch.OutOfMemoryError) -> None:
        """No twin from here on (it or its replay did not fit), with a note."""
        self._twin, self._twin_failed = None, True
        gc.collect()
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        self.notes.append(
            f"the float32 twin does not fit in memory ({first}); requests that missed the "
            f"tolerance fail on it"
        )

    def close(self) -> None:
        """Drop the float32 twin (its memory)."""
        self._twin = None

    @staticmethod
    def _against(
        replay: ReplicaReplay, result: Any, exchanges: Mapping[int, ExchangeCheck] | None = None
    ) -> dict[int, RequestCheck]:
        return {
            rid: dataclasses.replace(
                check_request(hidden, replay.outputs[rid], replay.counts.get(rid)),
                exchange=(exchanges or {}).get(rid),
            )
            for rid, hidden in result.last_hidden.items()
        }


@dataclass
class _TwinJob:
    """One replica's drifted requests, waiting for :meth:`Verifier.twin_pass`."""

    prompts: Mapping[int, torch.Tensor]
    result: Any
    recorded: Sequence[torch.Tensor] | None
    replay: ReplicaReplay
    """The reference's (confirmed) replay the requests were checked against."""
    checks: dict[int, RequestCheck]
    """The dict :meth:`Verifier.check` returned, completed in place."""
    drifted: list[int]


def check_exchanges(
    reference: MonolithicModel, result: Any, margin: float, bound: float | None = None
) -> dict[int, ExchangeCheck]:
    """Each request's recorded exchanges (``result.exchanges``, one
    :class:`~afd_tools.run.exchanges.StepExchanges` or ``None`` per step; with the shared
    experts where ``result.exchange_includes_shared``) against ``reference``: what came back
    against its experts on the same rows, experts and weights, and the experts and weights
    that went out against its router on the same rows (a choice other than the router's own
    top-k is wrong unless within ``margin`` of a tie). What came back is held to ``bound``
    (:attr:`ExchangeCheck.bound`). Every MoE layer's rows of every step are computed in one
    call on the reference's device. Empty for a mode without an exchange."""
    return _check_exchanges(reference, result, margin, bound)[0]


@dataclass(frozen=True)
class ProbedGaps:
    """The reference's router on the rows a replica recorded (its probed tokens,
    :func:`~afd_tools.run.exchanges.probed_rows`), in the order the steps recorded them;
    every tensor on the CPU."""

    steps: tuple[int, ...]
    """Per probed token, its step (an index into the replica's steps)."""
    rows: tuple[int, ...]
    """Per probed token, its row in that step."""
    gaps: torch.Tensor
    """float32 ``[moe layers, P]``: the reference router's relative tie gap on the run's row."""
    ids: torch.Tensor
    """int64 ``[moe layers, P, k]``: the reference router's own top-k on that row, sorted."""


def _check_exchanges(
    reference: MonolithicModel, result: Any, margin: float, bound: float | None = None
) -> tuple[dict[int, ExchangeCheck], ProbedGaps | None]:
    """:func:`check_exchanges`, and the reference router's gaps and choices on the recorded
    rows (``None`` where nothing was recorded), for :func:`tie_evidence`."""
    records = getattr(result, "exchanges", None) or []
    if not records:
        return {}, None
    owners: list[tuple[int, int]] = []  # per probed row: (request id, position)
    where: list[tuple[int, int]] = []  # per probed row: (step, row in the step)
    pieces: list[tuple[torch.Tensor, ...]] = []
    for number, (step, record) in enumerate(zip(result.steps, records, strict=True)):
        if record is None:
            continue
        owners.extend(row_owners(step, record.rows))
        where.extend((number, row) for row in record.rows)
        pieces.append((record.x, record.topk_ids, record.weights, record.out))
    if not owners:
        return {}, None
    x, ids, weights, out = (torch.cat(column, dim=1) for column in zip(*pieces, strict=True))
    device = reference.device
    layers = reference.config.moe_layers
    rows = Counter(rid for rid, _ in owners)  # probed tokens per request, each at every layer
    with_shared = bool(getattr(result, "exchange_includes_shared", False))
    worst: dict[int, tuple[float, int, int]] = {}
    heaviest: dict[int, tuple[float, int, int]] = {}
    wrong: dict[int, tuple[WrongExpert, int]] = {}
    all_gaps: list[torch.Tensor] = []
    all_own: list[torch.Tensor] = []
    with torch.inference_mode():
        for index, layer in enumerate(layers):
            moe = reference.moe_layers[layer]
            rows_x, chosen = x[index].to(device), ids[index].to(device, torch.int64)
            sent = weights[index].to(device)
            expected = moe.exchanged(rows_x, chosen, sent, with_shared=with_shared)
            selection, router_weights = moe.routed_weights(rows_x, chosen)
            errors = row_errors(out[index], expected).tolist()
            weight_errors = row_errors(sent, router_weights).tolist()
            own = selection.ids.sort(dim=1).values.cpu()
            run = chosen.sort(dim=1).values.cpu()
            gaps = selection.tie_gaps().float().cpu()
            all_gaps.append(gaps)
            all_own.append(own)
            off = ((own != run).any(dim=1) & ~(gaps <= margin)).tolist()
            for row, (rid, position) in enumerate(owners):
                _keep_worst(worst, rid, (errors[row], layer, position))
                _keep_worst(heaviest, rid, (weight_errors[row], layer, position))
                if off[row]:
                    first, count = wrong.get(rid, (None, 0))
                    if first is None:
                        first = WrongExpert(
                            layer, position, tuple(run[row].tolist()), tuple(own[row].tolist()),
                            float(gaps[row]), margin,
                        )  # fmt: skip
                    wrong[rid] = (first, count + 1)
    out_checks: dict[int, ExchangeCheck] = {}
    for rid, (error, layer, position) in worst.items():
        weight_error, weight_layer, weight_position = heaviest[rid]
        first, count = wrong.get(rid, (None, 0))
        out_checks[rid] = ExchangeCheck(
            error, layer, position, rows[rid] * len(layers),
            weight_error, weight_layer, weight_position, first, count, bound,
        )  # fmt: skip
    probed = ProbedGaps(
        tuple(s for s, _ in where),
        tuple(r for _, r in where),
        torch.stack(all_gaps),
        torch.stack(all_own),
    )
    return out_checks, probed


def _keep_worst(
    held: dict[int, tuple[float, int, int]], rid: int, candidate: tuple[float, int, int]
) -> None:
    """Keep ``candidate`` (error, layer, position) for ``rid`` if its error is the largest
    so far (``inf`` counts as the largest)."""
    current = held.get(rid)
    if current is None or candidate[0] > current[0]:
        held[rid] = candidate


def _end_to_end(check: RequestCheck, tolerance: float) -> bool:
    """Whether ``check`` fails on its final state or routing (what a second replay of the
    reference confirms), not on its exchange alone."""
    failed = check.not_finite is not None or check.routing.first_wrong is not None
    return failed or check.drifted(tolerance)


def row_errors(out: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """float64 ``[P]``: each row's :func:`~afd_protocol.relative_error` of ``out [P, H]``
    against ``reference [P, H]`` (compared on the CPU): ``inf`` where either row is not
    finite, 0 for two zero rows."""
    a, b = out.detach().double().cpu(), reference.detach().double().cpu()
    finite = torch.isfinite(a).all(dim=1) & torch.isfinite(b).all(dim=1)
    difference = (a - b).norm(dim=1)
    size = b.norm(dim=1)
    errors = torch.where(size > 0, difference / size.clamp_min(1e-300), difference * math.inf)
    errors = torch.where(difference == 0, torch.zeros_like(errors), errors)
    return torch.where(finite, errors, torch.full_like(errors, math.inf))


@dataclass(frozen=True)
class Verdict:
    """Every check of a run against its tolerance and tie margin."""

    checks: Checks
    tolerance: float
    margin: float

    def failures(self) -> dict[str, dict[int, str]]:
        """Per mode with a failing request: request id -> why."""
        out: dict[str, dict[int, str]] = {}
        for mode, by_request in self.checks.items():
            bad = {r: p for r, c in by_request.items() if (p := c.problem(self.tolerance))}
            if bad:
                out[mode] = dict(sorted(bad.items()))
        return out

    def worst(self) -> dict[str, tuple[int, RequestCheck]]:
        """Per mode, the request with the largest error (a non-finite one first)."""
        return {
            mode: max(by_request.items(), key=lambda item: _severity(item[1]))
            for mode, by_request in self.checks.items()
            if by_request
        }

    def near_ties(self) -> dict[str, tuple[int, int, float]]:
        """Per mode, ``(near-tie decisions, of which followed, the largest followed gap)``
        over every request."""
        return {
            mode: (
                sum(c.routing.near_ties for c in by_request.values()),
                sum(c.routing.followed for c in by_request.values()),
                max((c.routing.largest_followed_gap for c in by_request.values()), default=0.0),
            )
            for mode, by_request in self.checks.items()
        }

    def _followed_by_layer(self, mode: str) -> dict[str, float]:
        """``mode``'s largest followed tie gap per MoE layer over every request (JSON keys:
        the layer), in layer order."""
        largest: dict[int, float] = {}
        for check in self.checks[mode].values():
            for layer, gap in check.routing.largest_followed_by_layer.items():
                largest[layer] = max(largest.get(layer, 0.0), gap)
        return {str(layer): largest[layer] for layer in sorted(largest)}

    def drift_margins(self, mode: str) -> dict[str, Any]:
        """``mode``'s drift margins and what they excuse (the JSON fields; empty where they
        were not measured): the probed tokens and the mode's tokens, the reach between them
        and the factor on the drift (:class:`DriftMargins`), per MoE layer the largest gap
        drift at a probed token and the drift margin, and over every request the decisions,
        those within the drift margin, the followed decisions above it and the smallest
        margin / gap of a followed one (``None``: not finite)."""
        by_request = self.checks[mode].values()
        record = next((c.drift for c in by_request if c.drift is not None), None)
        if record is None:
            return {}
        source = {"tie_margin_from": "drift" if record.applied else "depth"}
        if not record.probes:  # nothing measured (colocated has no exchange): no figures
            return source | {"drift_probes": 0}
        return source | {
            "drift_probes": record.probes,
            "drift_tokens": record.tokens,
            "drift_reach": _number(record.reach),
            "drift_margin_factor": _number(record.factor),
            "drift_unmeasured_layers": [
                layer
                for layer, envelope in zip(record.layers, record.envelope, strict=True)
                if not math.isfinite(envelope)
            ],
            "drift_by_layer": {
                str(layer): _number(d) for layer, d in zip(record.layers, record.drift, strict=True)
            },
            "drift_margin_by_layer": {
                str(layer): _number(m)
                for layer, m in zip(record.layers, record.margins, strict=True)
            },
            "all_decisions": sum(c.routing.decisions for c in by_request),
            "within_drift_margin": sum(c.routing.within_drift for c in by_request),
            "drift_rejected": sum(c.routing.drift_rejected for c in by_request),
            "smallest_drift_margin_to_gap": _number(
                min((c.routing.smallest_drift_ratio for c in by_request), default=math.inf)
            ),
        }

    def exchanges(self) -> dict[str, tuple[int, int, ExchangeCheck]]:
        """Per mode whose exchanges were checked: ``(token-layer rows checked, request with
        the worst, its check)``."""
        out: dict[str, tuple[int, int, ExchangeCheck]] = {}
        for mode, by_request in self.checks.items():
            held = [(r, c.exchange) for r, c in sorted(by_request.items()) if c.exchange]
            if held:
                rid, worst = max(held, key=lambda item: item[1].error)
                out[mode] = (sum(e.rows for _, e in held), rid, worst)
        return out

    def _exchange_routing(self, mode: str) -> tuple[float, int]:
        """``mode``'s largest expert-weight error over its checked exchanges, and how many
        dispatched rows went to other experts than the reference router's with no near tie."""
        held = [c.exchange for c in self.checks[mode].values() if c.exchange is not None]
        return max(e.weight_error for e in held), sum(e.wrong_count for e in held)

    def twin_checks(self) -> dict[str, dict[int, TwinCheck]]:
        """Per mode with any, request id -> its float32 twin's check (passed or not)."""
        out: dict[str, dict[int, TwinCheck]] = {}
        for mode, by_request in self.checks.items():
            twins = {r: c.twin for r, c in sorted(by_request.items()) if c.twin is not None}
            if twins:
                out[mode] = twins
        return out

    def as_json(self) -> dict[str, Any]:
        """The report's verification fields: valid JSON (no NaN, no inf; ``null`` plus a
        reason where an error is not a finite number)."""
        failures = self.failures()
        worst = self.worst()
        return {
            "verification_tolerance": self.tolerance,
            "verification_tie_margin": self.margin,
            "verification_failures": {m: sorted(f) for m, f in failures.items()},
            "verification_errors": {
                m: {str(r): _number(self.checks[m][r].error) for r in f}
                for m, f in failures.items()
            },
            "verification_reasons": {
                m: {str(r): why for r, why in f.items()} for m, f in failures.items()
            },
            "verification_worst": {
                m: {
                    "request": r,
                    "relative_error": _number(c.error),
                    "problem": c.problem(self.tolerance),
                }
                for m, (r, c) in worst.items()
            },
            "verification_near_ties": {
                m: {
                    "decisions": near,
                    "followed": followed,
                    "largest_followed_gap": largest,
                    "largest_followed_gap_by_layer": self._followed_by_layer(m),
                    **self.drift_margins(m),
                    "requests": {
                        str(r): {"near_ties": c.routing.near_ties, "followed": c.routing.followed}
                        for r, c in sorted(self.checks[m].items())
                        if c.routing.near_ties
                    },
                }
                for m, (near, followed, largest) in self.near_ties().items()
            },
            "verification_twin": {
                m: {
                    str(r): {
                        "run_error": _number(t.run_error),
                        "reference_error": _number(t.reference_error),
                        "bound": _number(t.bound),
                        "passed": t.passes(),
                    }
                    for r, t in twins.items()
                }
                for m, twins in self.twin_checks().items()
            },
            "verification_drift_factor": DRIFT_FACTOR,
            "verification_exchanges": {
                m: {
                    "rows": rows,
                    "worst": _number(check.error),
                    "request": rid,
                    "layer": check.layer,
                    "position": check.position,
                    "bound": check.limit(self.tolerance),
                    "weights_worst": _number(self._exchange_routing(m)[0]),
                    "weights_bound": ROUTER_WEIGHT_TOLERANCE,
                    "router_wrong": self._exchange_routing(m)[1],
                    "router_margin": layer_tie_margin(self.margin),
                }
                for m, (rows, rid, check) in self.exchanges().items()
            },
        }

    def fail_line(self) -> str:
        listed = "; ".join(
            f"{mode}: " + ", ".join(f"request {r} ({why})" for r, why in bad.items())
            for mode, bad in self.failures().items()
        )
        return (
            f"FAIL: outputs differ from the monolithic reference (tolerance "
            f"{self.tolerance:.0e}, routing tie margin {self.margin:.1e} up to layer "
            f"{TIE_DEPTH}, in proportion to the layer past it): {listed}"
        )

    def pass_line(self) -> str:
        ties = ", ".join(
            f"{mode} {near} ({followed} followed"
            + (f", largest gap {largest:.1e})" if followed else ")")
            for mode, (near, followed, largest) in self.near_ties().items()
        )
        return (
            f"PASS: every request's final hidden state matches the monolithic reference in "
            f"every mode (tolerance {self.tolerance:.0e}; worst {self._worst_text()}"
            f"{self._twin_text()}){self._exchange_text()}; routing near ties within "
            f"{self.margin:.1e} up to layer {TIE_DEPTH} (in proportion to the layer past it), "
            f"token-layer decisions: {ties or 'none'}{self._drift_text()}"
        )

    def _drift_text(self) -> str:
        """How close the followed decisions came to the drift margins, where those apply."""
        applied = [
            record
            for mode in self.checks
            if (record := self.drift_margins(mode))
            and record["tie_margin_from"] == "drift"
            and record["drift_probes"]
        ]
        if not applied:
            return ""
        ratios = [r["smallest_drift_margin_to_gap"] for r in applied]
        closest = min((r for r in ratios if r is not None), default=None)
        unmeasured = sorted({layer for r in applied for layer in r["drift_unmeasured_layers"]})
        factors = [f for r in applied if (f := r["drift_margin_factor"]) is not None]
        low, high = min(factors, default=math.inf), max(factors, default=math.inf)
        factor = f"{low:.3g}" if low == high else f"{low:.3g}-{high:.3g}"
        reached = any(r["drift_reach"] != 1 for r in applied)
        return (
            f"; every followed decision within its layer's drift margin ({factor}x the "
            "largest tie-gap drift measured at the probed tokens there or shallower"
            + (
                f": {DRIFT_SAFETY:g}x, times ln(tokens) / ln(probed tokens) for the tokens no "
                "probe saw"
                if reached
                else ""
            )
            + (f"; closest margin / gap {closest:.2f}" if closest is not None else "")
            + (
                f"; layers {unmeasured} held to the depth margin: a drift there was not finite"
                if unmeasured
                else ""
            )
            + ")"
        )

    def _exchange_text(self) -> str:
        """How many exchanged rows were checked layer by layer, and the worst."""
        checked = self.exchanges()
        if not checked:
            return ""
        rows = sum(n for n, _, _ in checked.values())
        mode, (_, rid, worst) = max(checked.items(), key=lambda item: item[1][2].error)
        weights = max(self._exchange_routing(m)[0] for m in checked)
        bound = worst.limit(self.tolerance)
        return (
            f", and so does every MoE exchange, layer by layer ({rows} token-layer rows: up "
            f"to {PROBES_PER_CHUNK} tokens of each chunk; worst {worst.error:.1e} (bound "
            f"{bound:.0e}), request {rid} at layer {worst.layer} in {mode}; the experts sent "
            f"the router's own, their weights within {weights:.1e} of its, bound "
            f"{ROUTER_WEIGHT_TOLERANCE:.0e})"
        )

    def _twin_text(self) -> str:
        """How many requests passed only through the float32 twin, and the closest call."""
        twins = [t for by_request in self.twin_checks().values() for t in by_request.values()]
        if not twins:
            return ""
        closest = max(twins, key=lambda t: t.run_error / t.bound)
        return (
            f"; {len(twins)} over the tolerance, each within {DRIFT_FACTOR:g}x the reference's "
            f"own distance from its float32 twin (rounding drift; closest "
            f"{closest.run_error:.1e} against the reference's {closest.reference_error:.1e})"
        )

    def _worst_text(self) -> str:
        worst = self.worst()
        if not worst:
            return "none"
        mode, (request, check) = max(worst.items(), key=lambda item: _severity(item[1][1]))
        return f"{check.error:.1e}, request {request} in {mode}"


def _severity(check: RequestCheck) -> float:
    """Sort key: the error, with anything not a number above everything."""
    return check.error if not math.isnan(check.error) else math.inf


def _number(value: float) -> float | None:
    """``value`` for JSON: ``None`` unless finite (the reason is given beside it)."""
    return value if math.isfinite(value) else None


@dataclass(frozen=True)
class ReferenceBuilder:
    """A reference :func:`verify` builds itself, holds alone and drops before the twin is
    built (a model passed in stays alive beside the twin: its caller holds it)."""

    build: Callable[[], MonolithicModel]


def verify(
    reference: MonolithicModel | ReferenceBuilder,
    outcomes: Sequence[tuple[Sequence[str], Sequence[Any], Sequence[Mapping[str, Any]], Any]],
    prompts: Mapping[int, torch.Tensor],
    margin: float,
    tolerance: float | None = None,
    notes: list[str] | None = None,
    twin: Callable[[], MonolithicModel] | None = None,
    exchange_tolerance: float | None = None,
    tie_margin_from: str | None = None,
    times: VerificationTimes | None = None,
) -> Checks:
    """Check every request of every mode of ``outcomes`` (per launch: modes, requests,
    per-replica results by mode, FFN intervals) against ``reference``; with a
    ``tolerance``, a failure is confirmed by a second replay (:class:`Verifier`), a
    confirmed miss of the tolerance alone is checked against the float32 ``twin`` (built
    only then, dropped before returning), and ``notes`` receives a line for each replay
    that did not reproduce. Recorded exchanges are checked layer by layer
    (:func:`check_exchanges`; what came back to ``exchange_tolerance``). Once a mode's
    replicas are checked, its :class:`DriftMargins` are measured and written into its
    checks (:func:`apply_drift_margins`); with ``tie_margin_from`` ``drift`` (default:
    :data:`TIE_MARGIN_FROM`) a followed decision above them is a wrong expert. The twin
    replays come after every reference check.

    ``reference`` is the model, or a :class:`ReferenceBuilder`: a model built here is held
    by the verifier alone and dropped before the twin is built, so the two need not fit in
    device memory together (v2-lite's 27 bf16 layers and their twin do not fit an H100).
    A model passed in stays alive (the caller holds it) beside the twin. ``times``, where
    given, receives where the verification's time went (:class:`VerificationTimes`)."""
    rule = TIE_MARGIN_FROM if tie_margin_from is None else tie_margin_from
    if rule not in TIE_MARGIN_SOURCES:
        raise ValueError(f"tie_margin_from must be one of {TIE_MARGIN_SOURCES}, got {rule!r}")
    times = VerificationTimes() if times is None else times
    if isinstance(reference, ReferenceBuilder):
        with times.timed("reference"):
            model, built = reference.build(), True
    else:
        model, built = reference, False
    verifier = Verifier(
        model, margin, tolerance, twin, exchange_tolerance, release_reference=built, times=times
    )
    layers = model.config.moe_layers
    del model, reference
    parts: dict[str, list[dict[int, RequestCheck]]] = {}
    try:
        for modes, _, values, _ in outcomes:
            for mode in modes:
                first = len(verifier.evidence)
                parts[mode] = [verifier.check(prompts, replica[mode]) for replica in values]
                apply_drift_margins(verifier.evidence[first:], layers, margin, rule == "drift")
                del verifier.evidence[first:]  # its gaps are counted: free them
        verifier.twin_pass()
    finally:
        verifier.close()
    checks: Checks = {mode: {} for mode in parts}
    for mode, replicas in parts.items():
        for part in replicas:
            twice = sorted(part.keys() & checks[mode].keys())
            if twice:  # a request is checked once: a second replica's output would hide one
                raise ValueError(
                    f"mode {mode}: requests {twice[:10]} were prefilled by two replicas; each "
                    "must be prefilled exactly once"
                )
            checks[mode].update(part)
    if notes is not None:
        notes.extend(verifier.notes)
    return checks


__all__ = [
    "DRIFT_FACTOR",
    "DRIFT_FLOOR",
    "DRIFT_SAFETY",
    "LAYER_TIE_MARGIN",
    "QUANT_TIE_MARGIN",
    "ROUTER_WEIGHT_TOLERANCE",
    "TIE_DEPTH",
    "TIE_MARGIN",
    "TIE_MARGIN_FROM",
    "TIE_MARGIN_SOURCES",
    "Checks",
    "DriftMargins",
    "ProbedGaps",
    "ReferenceBuilder",
    "ReplicaReplay",
    "RequestCheck",
    "RoutingCounts",
    "TieEvidence",
    "TwinCheck",
    "Verdict",
    "VerificationTimes",
    "Verifier",
    "WrongExpert",
    "apply_drift_margins",
    "check_request",
    "drift_margin_at",
    "drift_reach",
    "layer_tie_margin",
    "not_finite",
    "replay_replica",
    "same_replay",
    "tie_evidence",
    "tie_margin_at",
    "verify",
]
