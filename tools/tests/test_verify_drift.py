"""afd run's drift-measured tie margin (afd_tools.run.verify.DriftMargins): the gap drift
at a probed token, the margin it gives each layer, the post-hoc rule that makes a followed
decision above it a wrong expert (or only counts it), and its record in the report -- each
against hand-computed values, then end to end against a "run" that is the monolithic
model itself with near ties flipped where no token is probed."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pytest
import test_verify
import torch

from afd_models import KVCache, MonolithicModel, PromptChunk, Selection
from afd_models import monolithic as monolithic_module
from afd_tools.run import verify as verify_module
from afd_tools.run.exchanges import StepExchanges
from afd_tools.run.ranks import ModeResult
from afd_tools.run.routing import RoutingLog, gap_drift
from afd_tools.run.verify import (
    DriftMargins,
    ProbedGaps,
    ReplicaReplay,
    RequestCheck,
    TieEvidence,
    Verdict,
    apply_drift_margins,
    drift_margin_at,
    drift_reach,
    tie_evidence,
    tie_margin_at,
    verify,
)
from afd_tools.run.verify import _Followed as Followed

INF, NAN = math.inf, math.nan


SHIPPED_SAFETY = verify_module.DRIFT_SAFETY
SHIPPED_FLOOR = verify_module.DRIFT_FLOOR
SHIPPED_REACH = verify_module.drift_reach
"""The shipped rule, for the tests that judge it rather than the arithmetic."""


@pytest.fixture(autouse=True)
def fixed_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    """The hand-computed values below assume a safety of 3, a floor of 2^-8 and no
    extrapolation from the probed tokens to the rest (a reach of 1), whatever the shipped
    constants are; the reach is tested on its own, and the shipped rule on a case shaped
    like the GPU's (below)."""
    monkeypatch.setattr(verify_module, "DRIFT_SAFETY", 3.0)
    monkeypatch.setattr(verify_module, "DRIFT_FLOOR", 2.0**-8)
    monkeypatch.setattr(verify_module, "drift_reach", lambda tokens, probes: 1.0)


def shipped_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    """Undo :func:`fixed_rule`: the rule as shipped."""
    monkeypatch.setattr(verify_module, "DRIFT_SAFETY", SHIPPED_SAFETY)
    monkeypatch.setattr(verify_module, "DRIFT_FLOOR", SHIPPED_FLOOR)
    monkeypatch.setattr(verify_module, "drift_reach", SHIPPED_REACH)


def test_the_gap_drift_is_the_difference_or_the_sum_where_the_choice_crossed() -> None:
    reference_gaps = torch.tensor([[0.10, 0.02, INF, NAN, 0.05]])
    run_gaps = torch.tensor([[0.07, 0.03, INF, 0.10, INF]])
    reference_ids = torch.tensor([[[0, 1], [2, 3], [0, 1], [0, 1], [4, 5]]])
    run_ids = torch.tensor([[[1, 0], [2, 4], [0, 1], [0, 1], [5, 4]]])  # same set, crossed, ...
    drift = gap_drift(reference_gaps, reference_ids, run_gaps, run_ids)
    assert drift.dtype == torch.float64
    assert drift.shape == (1, 5)
    assert drift[0, 0].item() == pytest.approx(0.03, abs=1e-7)  # |0.10 - 0.07|, same experts
    assert drift[0, 1].item() == pytest.approx(0.05, abs=1e-7)  # 0.02 + 0.03: they crossed
    assert drift[0, 2].item() == 0.0  # no boundary on either side
    assert drift[0, 3].item() == INF  # NaN: no evidence of a small drift
    assert drift[0, 4].item() == INF  # a boundary on one side only


def test_the_drift_margin_is_safety_times_the_drift_floored_and_capped_by_depth() -> None:
    assert drift_margin_at(0.01, 0.125) == pytest.approx(0.03)
    assert drift_margin_at(0.0, 0.125) == 2.0**-8  # states alike at the probes: the floor
    assert drift_margin_at(0.1, 0.125) == 0.125  # never looser than the depth margin
    assert drift_margin_at(0.0, 1e-5) == 1e-5  # the floor neither
    assert drift_margin_at(INF, 0.3) == 0.3  # unmeasured: the depth margin


def test_the_reach_extrapolates_from_the_probed_tokens_to_every_token_by_their_logs() -> None:
    reach = drift_reach
    assert reach(193_681, 452) == pytest.approx(math.log(193_681) / math.log(452))  # ~1.99
    assert reach(10_000, 100) == pytest.approx(2.0)
    assert reach(8, 8) == 1.0  # every token probed: the largest drift is measured
    assert reach(5, 8) == 1.0
    assert reach(100, 1) == INF  # one probe shows no tail
    assert reach(100, 0) == INF
    assert reach(0, 0) == 1.0


def test_the_drift_margin_multiplies_the_drift_by_the_reach_within_floor_and_depth() -> None:
    assert drift_margin_at(0.01, 0.125, 2.0) == pytest.approx(0.06)  # 3 x 2 x 0.01
    assert drift_margin_at(0.05, 0.125, 2.0) == 0.125  # never looser than the depth margin
    assert drift_margin_at(0.0, 0.125, 2.0) == 2.0**-8
    assert drift_margin_at(0.01, 0.125, INF) == 0.125  # no tail measured: the depth margin
    assert drift_margin_at(0.0, 0.125, INF) == 0.125


def test_the_evidence_pairs_each_probe_with_the_replay_s_row_and_lists_the_followed() -> None:
    """A replay of two steps at two MoE layers: step 0 holds request 7's tokens 0-1 and
    request 8's token 0, step 1 request 7's tokens 2-3. The probes are step 0's rows 0 and 2
    and step 1's row 1; at layer index 1 of step 0's row 2 the replay chose experts [2, 3]
    where the router on the run's row chose [0, 1]: their gaps add."""
    pair = torch.tensor([0, 1], dtype=torch.int32)
    own0 = pair.repeat(2, 3, 1)
    own0[1, 2] = torch.tensor([2, 3])
    replay = ReplicaReplay(
        own=[own0, pair.repeat(2, 2, 1)],
        gaps=[torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.25, 0.6]]),
              torch.tensor([[0.1, 0.8], [0.9, 1.0]])],
        followed=[torch.tensor([[False, False, False], [False, True, False]]),
                  torch.tensor([[True, False], [False, False]])],
    )  # fmt: skip
    run0, run1 = pair.repeat(2, 3, 1), pair.repeat(2, 2, 1)
    run0[1, 1] = torch.tensor([5, 0])
    run1[0, 0] = torch.tensor([1, 4])
    probed = ProbedGaps(
        steps=(0, 0, 1),
        rows=(0, 2, 1),
        gaps=torch.tensor([[0.15, 0.3, 0.75], [0.4, 0.65, 0.9]]),
        ids=torch.tensor([0, 1]).repeat(2, 3, 1),
    )
    steps = [[(7, 0, 2, False), (8, 0, 1, True)], [(7, 2, 4, True)]]
    checks = {7: RequestCheck(0.0), 8: RequestCheck(0.0)}
    e = tie_evidence(replay, steps, [run0, run1], probed, checks, moe_layers=2)
    expected = torch.tensor([[0.05, 0.0, 0.05], [0.0, 0.6 + 0.65, 0.1]], dtype=torch.float64)
    assert e.probe_drift.dtype == torch.float64
    assert torch.allclose(e.probe_drift, expected, atol=1e-6)
    assert e.owners.tolist() == [7, 7, 8, 7, 7]
    assert e.gaps.shape == (2, 5)
    assert e.followed == [
        Followed(step=0, index=1, rid=7, position=1, gap=pytest.approx(0.25), run=(0, 5),
                 reference=(0, 1)),
        Followed(step=1, index=0, rid=7, position=2, gap=pytest.approx(0.1), run=(1, 4),
                 reference=(0, 1)),
    ]  # fmt: skip
    nothing = tie_evidence(ReplicaReplay(), [], None, None, {}, moe_layers=2)
    assert nothing.probe_drift.shape == (2, 0)
    assert nothing.gaps.shape == (2, 0)
    record = apply_drift_margins([e, nothing], (1, 20), 0.125, applied=True)
    assert record.probes == 3
    assert record.drift == pytest.approx((0.05, 1.25))
    assert record.margins == pytest.approx((0.125, 0.3125))  # 3 x drift capped by depth
    assert all(c.problem(2e-2) is None for c in e.checks.values())  # 0.1, 0.25 within
    assert e.checks[7].routing.smallest_drift_ratio == pytest.approx(0.125 / 0.1)


LAYERS = (1, 20)
"""Two MoE layers: the depth margin (run margin 0.125) is 0.125 at 1 and 0.3125 at 20."""


def evidence(checks: dict[int, RequestCheck]) -> list[TieEvidence]:
    """Two replicas: the first holds requests 0 (3 tokens) and 1 (1 token), the second
    request 2 (2 tokens). Measured gap drift: largest 0.002 at layer 1 (replica one) and
    0.02 at layer 20 (replica two), so the drift margins are max(2^-8, 0.006) = 0.006 and
    0.06 (safety 3). Followed: request 0 at layer 1 with gap 0.005 (within 0.006) and at
    layer 20 with gap 0.1 (above 0.06, within the depth margin 0.3125); request 2 at layer
    20 with gap 0.05 (within 0.06)."""
    one = TieEvidence(
        probe_drift=torch.tensor([[0.001, 0.002], [0.01, 0.004]], dtype=torch.float64),
        gaps=torch.tensor([[0.005, 0.2, 0.004, 0.5], [0.3, 0.1, 0.07, 0.01]]),
        owners=torch.tensor([0, 0, 0, 1]),
        followed=[
            Followed(step=0, index=0, rid=0, position=0, gap=0.005, run=(1, 2), reference=(1, 3)),
            Followed(step=1, index=1, rid=0, position=1, gap=0.1, run=(0, 5), reference=(0, 4)),
        ],
        checks={0: RequestCheck(1e-3), 1: RequestCheck(2e-3)},
    )
    two = TieEvidence(
        probe_drift=torch.tensor([[0.0005], [0.02]], dtype=torch.float64),
        gaps=torch.tensor([[0.001, 0.9], [0.05, INF]]),
        owners=torch.tensor([2, 2]),
        followed=[
            Followed(step=0, index=1, rid=2, position=0, gap=0.05, run=(6, 7), reference=(3, 7))
        ],
        checks={2: RequestCheck(4e-3)},
    )
    checks.update(one.checks)
    checks.update(two.checks)
    return [one, two]


def test_a_followed_decision_above_the_drift_margin_is_a_wrong_expert_when_applied() -> None:
    checks: dict[int, RequestCheck] = {}
    replicas = evidence(checks)
    record = apply_drift_margins(replicas, LAYERS, 0.125, applied=True)
    assert record == DriftMargins(
        layers=LAYERS,
        drift=(0.002, 0.02),
        envelope=(0.002, 0.02),
        margins=(pytest.approx(0.006), pytest.approx(0.06)),  # type: ignore[arg-type]
        depth=(0.125, 0.3125),
        probes=3,
        applied=True,
        tokens=6,
        reach=1.0,
        factor=3.0,
    )
    checks = {rid: c for e in replicas for rid, c in e.checks.items()}
    rejected = checks[0]
    assert rejected.routing.drift_rejected == 1
    assert rejected.routing.wrong == 0  # no wrong expert by the depth margin
    assert rejected.wrong_by_drift == rejected.routing.drift_wrong
    assert not rejected.drifted(1e-4)  # a routing failure: no float32 twin can pass it
    assert rejected.routing.decisions == 6  # 3 tokens x 2 layers
    # within (0.006, 0.06): 0.005 and 0.004 at layer 1; 0.01 is request 1's
    assert rejected.routing.within_drift == 2
    assert rejected.routing.smallest_drift_ratio == pytest.approx(0.06 / 0.1)
    assert rejected.problem(2e-2) == (
        "wrong expert at layer 20: token 1 went to experts [0, 5] where the reference routes "
        "it to [0, 4] above the drift margin (gap 1.0e-01, drift margin 6.0e-02 at that "
        "layer, from the drift measured at the probed tokens; depth margin 3.1e-01); 1 such "
        "token-layer decisions"
    )
    assert checks[1].problem(2e-2) is None
    assert (checks[1].routing.decisions, checks[1].routing.within_drift) == (2, 1)
    kept = checks[2]
    assert kept.problem(2e-2) is None
    assert (kept.routing.drift_rejected, kept.routing.drift_wrong) == (0, None)
    assert kept.routing.smallest_drift_ratio == pytest.approx(0.06 / 0.05)
    assert (kept.routing.decisions, kept.routing.within_drift) == (4, 2)  # 0.001, 0.05
    assert all(c.drift is record for c in checks.values())


def test_a_followed_decision_above_the_drift_margin_is_only_counted_by_default() -> None:
    checks: dict[int, RequestCheck] = {}
    replicas = evidence(checks)
    assert verify_module.TIE_MARGIN_FROM == "depth"
    record = apply_drift_margins(replicas, LAYERS, 0.125)
    assert not record.applied
    checks = {rid: c for e in replicas for rid, c in e.checks.items()}
    assert checks[0].routing.drift_rejected == 1
    assert checks[0].routing.drift_wrong is not None  # recorded, not applied
    assert checks[0].wrong_by_drift is None
    assert all(c.problem(2e-2) is None for c in checks.values())


def test_a_layer_s_margin_is_taken_from_the_largest_drift_at_it_or_shallower() -> None:
    """Drift 0.03 measured at layer 1, only 0.01 at layer 20 (its probes missed the tail):
    layer 20's margin is 3 x 0.03 = 0.09, not 0.03, and a gap of 0.05 followed there stays
    excused."""
    replica = TieEvidence(
        torch.tensor([[0.03], [0.01]], dtype=torch.float64),
        torch.tensor([[0.2], [0.05]]),
        torch.tensor([4]),
        [Followed(0, 1, 4, 0, 0.05, (1, 2), (1, 3))],
        {4: RequestCheck(0.0)},
    )
    record = apply_drift_margins([replica], LAYERS, 0.125, applied=True)
    assert record.drift == (0.03, 0.01)
    assert record.envelope == (0.03, 0.03)
    assert record.margins == pytest.approx((0.09, 0.09))
    check = replica.checks[4]
    assert check.problem(2e-2) is None
    assert check.routing.smallest_drift_ratio == pytest.approx(0.09 / 0.05)
    assert check.routing.within_drift == 1  # 0.05 at layer 20; 0.2 at layer 1 is above


def test_a_mode_with_nothing_probed_keeps_the_depth_margin() -> None:
    replica = TieEvidence(
        torch.zeros(2, 0, dtype=torch.float64),
        torch.tensor([[0.2], [0.3]]),
        torch.tensor([5]),
        [Followed(0, 1, 5, 0, 0.3, (1, 2), (1, 3))],
        {5: RequestCheck(0.0)},
    )
    record = apply_drift_margins([replica], LAYERS, 0.125, applied=True)
    assert record.drift == (INF, INF)
    assert record.margins == record.depth == (0.125, 0.3125)
    assert replica.checks[5].problem(2e-2) is None
    assert replica.checks[5].routing.within_drift == 1  # 0.3 at layer 20


def test_the_report_gives_the_drift_margins_per_layer_in_strict_json() -> None:
    checks: dict[int, RequestCheck] = {}
    replicas = evidence(checks)
    apply_drift_margins(replicas, LAYERS, 0.125)
    by_request = {rid: c for e in replicas for rid, c in e.checks.items()}
    unprobed = TieEvidence(
        torch.zeros(2, 0, dtype=torch.float64), torch.tensor([[0.2], [0.3]]),
        torch.tensor([0]), [], {0: RequestCheck(0.0)},
    )  # fmt: skip
    apply_drift_margins([unprobed], LAYERS, 0.125)
    verdict = Verdict({"async": by_request, "colocated": unprobed.checks}, 2e-2, 0.125)
    data = json.loads(
        json.dumps(verdict.as_json(), allow_nan=False),
        parse_constant=lambda name: pytest.fail(f"non-finite {name} in the JSON"),
    )
    ties = data["verification_near_ties"]["async"]
    assert ties["tie_margin_from"] == "depth"
    assert ties["drift_probes"] == 3
    assert (ties["drift_tokens"], ties["drift_reach"], ties["drift_margin_factor"]) == (6, 1, 3)
    assert ties["drift_by_layer"] == {"1": 0.002, "20": 0.02}
    assert ties["drift_margin_by_layer"] == {
        "1": pytest.approx(0.006),
        "20": pytest.approx(0.06),
    }
    assert ties["all_decisions"] == 12
    assert ties["within_drift_margin"] == 5
    assert ties["drift_rejected"] == 1
    assert ties["smallest_drift_margin_to_gap"] == pytest.approx(0.6)
    for value in (*ties["drift_by_layer"].values(), *ties["drift_margin_by_layer"].values()):
        assert math.isfinite(value)
    assert ties["drift_unmeasured_layers"] == []
    quiet = data["verification_near_ties"]["colocated"]  # nothing probed: no figures
    assert {k: quiet[k] for k in ("tie_margin_from", "drift_probes")} == {
        "tie_margin_from": "depth",
        "drift_probes": 0,
    }
    assert "drift_margin_by_layer" not in quiet
    assert "smallest_drift_margin_to_gap" not in quiet
    hand_built = Verdict({"async": {0: RequestCheck(0.0)}}, 2e-2, 0.125).as_json()
    assert "drift_by_layer" not in hand_built["verification_near_ties"]["async"]


# End to end: a "run" that is the monolithic model, recording its rows at two probed tokens
# of each chunk (its first and last) as a replica's exchange log does.

model = test_verify.model  # the same module-scoped fixture: tiny, random weights
prompts = test_verify.prompts
STEPS = test_verify.STEPS


def probed(step: Sequence[tuple[int, int, int, bool]]) -> tuple[int, ...]:
    """Each chunk's first and last row."""
    rows, start = [], 0
    for _, begin, end, _ in step:
        rows += [start, start + end - begin - 1]
        start += end - begin
    return tuple(rows)


Plant = Callable[[int, Selection], torch.Tensor]


def recorded_run(
    model: MonolithicModel,
    tokens: Mapping[int, torch.Tensor],
    plant: Plant,
    monkeypatch: pytest.MonkeyPatch,
) -> ModeResult:
    """The model's prefill of :data:`STEPS` choosing experts by ``plant``, recorded as a
    replica records it: routing, final states, and the probed rows' exchanges."""
    layers = model.config.moe_layers
    seen: dict[int, torch.Tensor] = {}
    original = monolithic_module._LocalMoE.begin

    def begin(self: Any, layer: int, stage: int, x: torch.Tensor) -> Any:
        seen[layer] = x.clone()
        return original(self, layer, stage, x)

    monkeypatch.setattr(monolithic_module._LocalMoE, "begin", begin)
    log = RoutingLog(layers)
    result = ModeResult()
    cache = KVCache()
    for step in STEPS:
        entries = [PromptChunk(r, tokens[r][b:e], b, final) for r, b, e, final in step]
        out = model.forward(
            entries, compute_logits=False, cache=cache,
            select=lambda layer, s: log(layer, dataclasses.replace(s, ids=plant(layer, s))),
        )  # fmt: skip
        routing = log.take()
        rows = probed(step)
        index = torch.tensor(rows)
        x = torch.stack([seen[layer][index] for layer in layers])
        ids = routing[:, index].long()
        weights = torch.stack(
            [model.moe_layers[layer].routed_weights(x[i], ids[i])[1] for i, layer in
             enumerate(layers)]
        )  # fmt: skip
        back = torch.stack(
            [model.moe_layers[layer].exchanged(x[i], ids[i], weights[i], with_shared=True)
             for i, layer in enumerate(layers)]
        )  # fmt: skip
        result.steps.append(step)
        result.routing.append(routing)
        result.exchanges.append(StepExchanges(rows, x, ids, weights, back))
        result.exchange_includes_shared = True
        last = out.last_hidden_states().float()
        for row, (rid, _, _, final) in enumerate(step):
            if final:
                result.last_hidden[rid] = last[row].clone()
    monkeypatch.setattr(monolithic_module._LocalMoE, "begin", original)
    return result


def test_near_ties_flipped_off_the_probes_fail_by_the_drift_margin_only(
    model: MonolithicModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The run is the reference's own model, so at every probed token its rows are the
    replay's bitwise: the measured drift is 0 and the drift margin the floor, 2^-8, at every
    layer. Its router takes its (k+1)-th expert at the decision closest to a tie among
    tokens no probe sees whose gap is above the floor (and below the run margin of 0.25):
    the replay follows it within the depth margin and matches exactly; by the depth margin
    the run passes with it counted as what the drift margin would reject, by the drift
    margin it is a wrong expert naming both margins. The layer-local check never saw it."""
    tokens = prompts(model)
    layers = model.config.moe_layers
    unprobed: list[tuple[float, int, int, int]] = []  # gap, step, layer, row

    def keep(step: int) -> Plant:
        def plant(layer: int, selection: Selection) -> torch.Tensor:
            gaps = selection.tie_gaps().tolist()
            hidden = set(probed(STEPS[step]))
            unprobed.extend((g, step, layer, r) for r, g in enumerate(gaps) if r not in hidden)
            return selection.ids

        return plant

    calls = {"n": 0}

    def by_step(layer: int, selection: Selection) -> torch.Tensor:
        step = calls["n"] // len(layers)
        calls["n"] += 1
        return keep(step)(layer, selection)

    recorded_run(model, tokens, by_step, monkeypatch)
    floor = 2.0**-8
    chosen = sorted(u for u in unprobed if floor < u[0] < 0.25)[:1]
    assert chosen, "a decision off the probes with a gap between the floor and 0.25"
    gap, at_step, at_layer, at_row = chosen[0]
    calls["n"] = 0

    def flip(layer: int, selection: Selection) -> torch.Tensor:
        step = calls["n"] // len(layers)
        calls["n"] += 1
        ids = selection.ids.clone()
        if (step, layer) == (at_step, at_layer):
            k = ids.shape[1]
            ids[at_row, k - 1] = selection.choice.topk(k + 1, dim=-1).indices[at_row, k]
        return ids

    result = recorded_run(model, tokens, flip, monkeypatch)
    values = [{"async": result}]

    def checks_with(rule: str) -> dict[int, RequestCheck]:
        monkeypatch.setattr(verify_module, "TIE_MARGIN_FROM", rule)
        return verify(model, [(["async"], [], values, [])], tokens, 0.25)["async"]

    lenient = checks_with("depth")
    assert all(c.problem(1e-5) is None for c in lenient.values())
    assert all(c.error == 0.0 for c in lenient.values())  # followed: the replay matches
    assert sum(c.routing.followed for c in lenient.values()) == 1
    assert sum(c.routing.drift_rejected for c in lenient.values()) == 1
    assert all(c.exchange is not None and c.exchange.wrong is None for c in lenient.values())
    record = lenient[0].drift
    assert record is not None
    assert record.drift == (0.0,) * len(layers)
    assert record.margins == (floor,) * len(layers)
    assert record.probes == sum(len(probed(step)) for step in STEPS)
    strict = checks_with("drift")
    problems = [p for c in strict.values() if (p := c.problem(1e-5))]
    assert len(problems) == 1
    depth = tie_margin_at(0.25, at_layer)
    assert problems[0].startswith(f"wrong expert at layer {at_layer}: token ")
    assert (
        f"(gap {gap:.1e}, drift margin {floor:.1e} at that layer, from the drift measured at "
        f"the probed tokens; depth margin {depth:.1e}); 1 such token-layer decisions"
    ) in problems[0]


def test_the_pass_line_names_the_drift_margin_only_where_it_applies() -> None:
    def line(applied: bool) -> str:
        replica = TieEvidence(
            torch.tensor([[0.01], [0.02]], dtype=torch.float64),
            torch.tensor([[0.2], [0.05]]),
            torch.tensor([0]),
            [Followed(0, 1, 0, 0, 0.05, (1, 2), (1, 3))],
            {0: RequestCheck(1e-3)},
        )
        apply_drift_margins([replica], LAYERS, 0.125, applied=applied)
        return Verdict({"async": replica.checks}, 2e-2, 0.125).pass_line()

    assert line(applied=True).endswith(
        "; every followed decision within its layer's drift margin (3x the largest tie-gap "
        "drift measured at the probed tokens there or shallower; closest margin / gap 1.20)"
    )  # 3 x 0.02 / 0.05
    assert "drift margin" not in line(applied=False)


def test_applying_the_drift_margins_twice_counts_once_and_leaves_the_replay_s_counts() -> None:
    """The counts are made afresh from the evidence each time, on copies: a second
    application gives the same checks, and the replay's own counts are not touched."""
    checks: dict[int, RequestCheck] = {}
    replicas = evidence(checks)
    replicas[0].checks[0].routing.largest_followed_by_layer[20] = 0.1
    before = replicas[0].checks[0]
    apply_drift_margins(replicas, LAYERS, 0.125, applied=True)
    once = {rid: c for e in replicas for rid, c in e.checks.items()}
    apply_drift_margins(replicas, LAYERS, 0.125, applied=True)
    twice = {rid: c for e in replicas for rid, c in e.checks.items()}
    assert twice == once
    assert twice[0].routing.drift_rejected == 1
    twice[0].routing.largest_followed_by_layer[20] = 0.9
    assert before.routing.largest_followed_by_layer == {20: 0.1}
    assert (before.routing.drift_rejected, before.drift) == (0, None)


def test_a_layer_whose_drift_is_not_finite_is_named_as_held_to_the_depth_margin() -> None:
    """A NaN drift at layer 20 (a probe that could not be measured) leaves that layer at the
    depth margin; the report and the pass line name it rather than claim a drift margin."""
    replica = TieEvidence(
        torch.tensor([[0.01], [math.nan]], dtype=torch.float64),
        torch.tensor([[0.2], [0.05]]),
        torch.tensor([0]),
        [Followed(0, 1, 0, 0, 0.05, (1, 2), (1, 3))],
        {0: RequestCheck(1e-3)},
    )
    record = apply_drift_margins([replica], LAYERS, 0.125, applied=True)
    assert record.margins == (pytest.approx(0.03), 0.3125)  # layer 20: the depth margin
    verdict = Verdict({"async": replica.checks}, 2e-2, 0.125)
    ties = verdict.as_json()["verification_near_ties"]["async"]
    assert ties["drift_unmeasured_layers"] == [20]
    assert ties["drift_by_layer"] == {"1": 0.01, "20": None}
    assert "; layers [20] held to the depth margin: a drift there was not finite)" in (
        verdict.pass_line()
    )


GPU_TOKENS, GPU_PROBES = 193_681, 452
"""The H100's two-stage runs (v2-lite, 27 layers, 2A1F and 2A2F async with --stages 2, 48
requests up to 16K): tokens of the mode and probed tokens among them."""


def gpu_shaped(gaps_followed: Sequence[float]) -> TieEvidence:
    """One replica shaped like those runs at MoE layers 1 (the first; no shallower layer's
    drift can raise its margin) and 2: the largest drift at the 452 probes 0.00238 at layer
    1 and 0.0094 at layer 2, and the decisions followed at layer 1 with ``gaps_followed``
    (the runs' largest, 0.00737, was within the depth margin and every final state passed)."""
    drift = torch.full((2, GPU_PROBES), 1e-3, dtype=torch.float64)
    drift[0, 17], drift[1, 301] = 0.00238, 0.0094
    gaps = torch.full((2, GPU_TOKENS), 0.5)
    owners = torch.arange(GPU_TOKENS) // 4096  # 48 requests of 4096 tokens (the last short)
    followed = []
    for n, gap in enumerate(gaps_followed):
        row = 1000 + 5000 * n
        gaps[0, row] = gap
        followed.append(Followed(0, 0, row // 4096, row % 4096, gap, (1, 2), (1, 3)))
    checks = {rid: RequestCheck(1e-3) for rid in range(int(owners[-1]) + 1)}
    return TieEvidence(drift, gaps, owners, followed, checks)


def test_the_first_moe_layer_s_tail_beyond_the_probes_is_not_a_wrong_expert(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The GPU's false rejection: 3 x the largest drift of 452 probes at layer 1 is 0.00714,
    below the gap 0.00737 of a decision followed there in a correct run. The largest of
    193,681 draws reaches further than the largest of 452 -- by ln(193,681) / ln(452) = 1.99
    for an exponential tail -- so the shipped margin extrapolates by that reach and passes
    it with room to spare, while still rejecting a decision four times as far from a tie
    (within the depth margin of 0.125, which the replay followed it by)."""
    layers = (1, 2)
    old = apply_drift_margins([gpu_shaped([0.00737])], layers, 0.125, applied=True)
    assert old.margins[0] == pytest.approx(0.00714)  # the rule before: 3 x 0.00238
    shipped_rule(monkeypatch)
    replica = gpu_shaped([0.00737])
    record = apply_drift_margins([replica], layers, 0.125, applied=True)
    assert record.tokens == GPU_TOKENS
    assert record.reach == pytest.approx(1.99, abs=0.005)
    assert record.factor == pytest.approx(SHIPPED_SAFETY * record.reach)
    assert record.margins[0] == pytest.approx(record.factor * 0.00238)
    assert record.margins[0] <= record.depth[0]
    assert all(c.problem(2e-2) is None for c in replica.checks.values())
    assert sum(c.routing.drift_rejected for c in replica.checks.values()) == 0
    ratio = min(c.routing.smallest_drift_ratio for c in replica.checks.values())
    assert ratio >= 1.4  # margin / gap: the rule's headroom on the GPU's worst case
    verdict = Verdict({"async": replica.checks}, 2e-2, 0.125)
    ties = verdict.as_json()["verification_near_ties"]["async"]
    assert ties["drift_tokens"] == GPU_TOKENS
    assert ties["drift_reach"] == pytest.approx(record.reach)
    assert ties["drift_rejected"] == 0
    assert (
        f"({record.factor:.3g}x the largest tie-gap drift measured at the probed tokens "
        f"there or shallower: {SHIPPED_SAFETY:g}x, times ln(tokens) / ln(probed tokens) for "
        "the tokens no probe saw; closest margin / gap" in verdict.pass_line()
    )
    far = gpu_shaped([0.00737, 4 * 0.00737])
    apply_drift_margins([far], layers, 0.125, applied=True)
    problems = [p for c in far.checks.values() if (p := c.problem(2e-2))]
    assert len(problems) == 1
    assert "above the drift margin (gap 2.9e-02" in problems[0]


def test_the_old_rule_rejected_the_gpu_s_correct_decision() -> None:
    """What the test above fixes, under the rule before it (a reach of 1): the followed
    decision at gap 0.00737 is counted as a wrong expert at margin / gap 0.97."""
    replica = gpu_shaped([0.00737])
    apply_drift_margins([replica], (1, 2), 0.125, applied=True)
    assert sum(c.routing.drift_rejected for c in replica.checks.values()) == 1
    ratio = min(c.routing.smallest_drift_ratio for c in replica.checks.values())
    assert ratio == pytest.approx(0.97, abs=0.005)
