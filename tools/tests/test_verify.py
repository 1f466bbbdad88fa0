"""afd run's verification, without processes: non-finite outputs, a planted wrong expert, a
planted near tie, the report's JSON, and the replay reuse -- each against a "run" that is
the monolithic model itself with the planted routing (so the expected outcome is known)."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from afd_replica_records import record_steps

from afd_models import KVCache, MonolithicModel, PromptChunk, RandomWeights, Selection
from afd_models import preset as make_preset
from afd_tools.run import verify as verify_module
from afd_tools.run.ranks import ModeResult
from afd_tools.run.routing import RoutingLog, TieFollower
from afd_tools.run.verify import (
    LAYER_TIE_MARGIN,
    TIE_DEPTH,
    TIE_MARGIN,
    RequestCheck,
    RoutingCounts,
    Verdict,
    VerificationTimes,
    WrongExpert,
    check_request,
    replay_replica,
    tie_margin_at,
    verify,
)

SEED = 5
MARGIN = TIE_MARGIN["float32"]
STEPS = [
    [(0, 0, 6, True), (1, 0, 4, False)],
    [(1, 4, 9, True), (2, 0, 5, True)],
]
"""Two steps: request 1 is prefilled in two chunks."""
Plant = Callable[[int, Selection], torch.Tensor]


@pytest.fixture(scope="module")
def model() -> MonolithicModel:
    return MonolithicModel(make_preset("tiny"), RandomWeights(SEED))


def prompts(model: MonolithicModel) -> dict[int, torch.Tensor]:
    gen = torch.Generator().manual_seed(SEED)
    return {rid: torch.randint(0, model.config.vocab_size, (n,), generator=gen) for rid, n in
            ((0, 6), (1, 9), (2, 5))}  # fmt: skip


def run_steps(model: MonolithicModel, plant: Plant | None = None) -> ModeResult:
    """What a replica of the monolithic model records, with ``plant`` choosing its experts."""

    def choose(log: RoutingLog, layer: int, selection: Selection) -> torch.Tensor:
        if plant is not None:
            selection = dataclasses.replace(selection, ids=plant(layer, selection))
        return log(layer, selection)

    return record_steps(model, prompts(model), STEPS, choose)


def checks_of(
    model: MonolithicModel, result: ModeResult, margin: float = MARGIN
) -> dict[int, RequestCheck]:
    return verify(model, [(["async"], [], [{"async": result}], [])], prompts(model), margin)[
        "async"
    ]


def swap_worst(layer: int, token_row: int, at_step: int) -> Plant:
    """At ``layer`` of step ``at_step``, the token in ``token_row`` gets its lowest-scoring
    expert instead of its k-th: far from any tie."""
    calls = {"n": 0}
    layers = make_preset("tiny").moe_layers

    def plant(now: int, selection: Selection) -> torch.Tensor:
        step = calls["n"] // len(layers)
        calls["n"] += 1
        ids = selection.ids.clone()
        if now == layer and step == at_step:
            ids[token_row, -1] = selection.scores[token_row].argmin()
        return ids

    return plant


def test_the_monolithic_run_matches_exactly_with_no_ties_followed(model: MonolithicModel) -> None:
    checks = checks_of(model, run_steps(model))
    assert set(checks) == {0, 1, 2}
    for check in checks.values():
        assert check.error == 0.0
        assert check.problem(1e-5) is None
        assert check.routing.followed == 0
        assert check.routing.wrong == 0


def test_a_planted_wrong_expert_fails_naming_the_layer_and_the_token(
    model: MonolithicModel,
) -> None:
    """Request 1's token at position 6 (row 2 of the second step) goes to its worst expert
    at the last MoE layer. Its final state is unchanged -- after the last layer no later
    token attends to it -- so only the routing check can see it."""
    checks = checks_of(model, run_steps(model, swap_worst(2, 2, 1)))
    problem = checks[1].problem(1e-5)
    assert problem is not None
    assert problem.startswith("wrong expert at layer 2: token 6 went to experts ")
    assert "with no near tie" in problem
    assert problem.endswith("; 1 such token-layer decisions")
    assert checks[1].error <= 1e-5  # the numbers alone would have passed
    assert checks[0].problem(1e-5) is None
    assert checks[2].problem(1e-5) is None


def near_tie_plant(threshold: float) -> Plant:
    """Every token whose top-k is within ``threshold`` of a tie takes its (k+1)-th expert
    instead of its k-th (what another rounding would have chosen)."""

    def plant(layer: int, selection: Selection) -> torch.Tensor:
        ids = selection.ids.clone()
        k = ids.shape[1]
        near = selection.near_ties(threshold)
        ids[near, k - 1] = selection.choice.topk(k + 1, dim=-1).indices[near, k]
        return ids

    return plant


def smallest_gaps(model: MonolithicModel) -> list[float]:
    """Every routing decision's tie gap in the plain run, smallest first."""
    gaps: list[float] = []

    def keep(layer: int, selection: Selection) -> torch.Tensor:
        gaps.extend(selection.tie_gaps().tolist())
        return selection.ids

    tokens = prompts(model)
    cache = KVCache()
    for step in STEPS:
        entries = [PromptChunk(r, tokens[r][b:e], b, final) for r, b, e, final in step]
        model.forward(entries, compute_logits=False, cache=cache, select=keep)
    return sorted(gaps)


def test_the_tie_margin_grows_in_proportion_to_the_layer_past_the_tie_depth() -> None:
    assert TIE_DEPTH == 8
    assert [tie_margin_at(0.125, layer) for layer in (1, 8, 16, 26)] == [
        0.125, 0.125, 0.25, 0.40625,
    ]  # fmt: skip
    assert tie_margin_at(1.0, 26) == 3.25  # --tie-margin 1 still follows everything


def test_a_near_tie_deep_in_the_model_is_held_to_that_layers_margin() -> None:
    """A 20-layer model whose run flips one decision at its last MoE layer (19), the
    closest to a tie there (gap ``g``): with a base margin of 0.44 ``g`` -- a wrong expert
    at layers up to 8 -- the margin at layer 19 is 1.05 ``g`` and the flip is followed;
    with 0.38 ``g`` it is 0.9 ``g`` and the flip fails, naming that margin.
    The layer-local router check (of up to 8 tokens of each chunk) would catch a flip there at
    one layer's rounding whatever the depth (:data:`LAYER_TIE_MARGIN`)."""
    deep = MonolithicModel(make_preset("tiny", num_layers=20), RandomWeights(SEED))
    last = deep.config.moe_layers[-1]
    assert last == 19
    at_last: list[float] = []

    def keep(log: RoutingLog, layer: int, selection: Selection) -> torch.Tensor:
        if layer == last:
            at_last.extend(selection.tie_gaps().tolist())
        return log(layer, selection)

    record_steps(deep, prompts(deep), STEPS, keep)
    gap = min(at_last)
    flip = near_tie_plant(gap * (1 + 1e-6))
    result = run_steps(deep, lambda layer, s: flip(layer, s) if layer == last else s.ids)
    scale = TIE_DEPTH / last
    passing = checks_of(deep, result, 1.05 * gap * scale)
    assert all(c.problem(1e-5) is None for c in passing.values())
    assert sum(c.routing.followed for c in passing.values()) == 1
    followed = [c.routing.largest_followed_by_layer for c in passing.values()]
    assert {layer: g for by in followed for layer, g in by.items()} == {
        last: pytest.approx(gap, rel=1e-6)
    }
    base = 0.9 * gap * scale
    failing = checks_of(deep, result, base)
    problems = [p for c in failing.values() if (p := c.problem(1e-5))]
    assert len(problems) == 1
    assert problems[0].startswith(f"wrong expert at layer {last}: token ")
    assert f"(gap {gap:.1e}, margin {tie_margin_at(base, last):.1e} at that layer)" in problems[0]
    assert LAYER_TIE_MARGIN == 1e-4


def test_a_planted_near_tie_is_followed_counted_and_passes(model: MonolithicModel) -> None:
    """The run flips its k-th and (k+1)-th experts wherever its top-k is within a margin of
    a tie (three decisions); with that margin the reference follows every one, matches
    exactly and counts them; with a margin below them they are wrong experts; and with the
    reference's own routing (the old check) the outputs differ by about a percent."""
    gaps = smallest_gaps(model)
    margin = (gaps[2] + gaps[3]) / 2
    result = run_steps(model, near_tie_plant(margin))
    checks = checks_of(model, result, margin)
    followed = sum(c.routing.followed for c in checks.values())
    assert followed >= 1
    assert followed == sum(c.routing.near_ties for c in checks.values())
    largest = max(c.routing.largest_followed_gap for c in checks.values())
    assert gaps[0] <= largest <= margin
    for check in checks.values():
        assert check.problem(1e-5) is None
        assert check.error == 0.0
    strict = checks_of(model, result, gaps[0] / 2)
    assert sum(c.routing.wrong for c in strict.values()) >= 1
    assert any(c.problem(1e-5) for c in strict.values())
    ignored = replay_replica(model, prompts(model), result.steps, None, margin)
    assert not ignored.agrees_with(result.routing)
    errors = [check_request(h, ignored.outputs[r]).error for r, h in result.last_hidden.items()]
    assert max(errors) > 1e-3  # a few percent (1.3e-2 here) from three flipped decisions


@pytest.mark.parametrize("bad", [math.nan, math.inf])
@pytest.mark.parametrize("side", ["run", "reference"])
def test_a_non_finite_output_fails_naming_the_side(bad: float, side: str) -> None:
    good = torch.ones(16)
    planted = good.clone()
    planted[3] = bad
    out, reference = (planted, good) if side == "run" else (good, planted)
    check = check_request(out, reference)
    assert check.error == math.inf
    problem = check.problem(1e99)  # no tolerance lets it pass
    word = "NaN" if math.isnan(bad) else "inf"
    holder = "the run's output" if side == "run" else "the reference"
    counts = "1 NaN and 0 inf" if word == "NaN" else "0 NaN and 1 inf"
    assert problem == f"not finite: {holder} holds {counts} of 16 values"


def strict_json(text: str) -> Any:
    """``json.loads`` that refuses NaN and Infinity (which Python would otherwise accept)."""

    def refuse(name: str) -> None:
        raise ValueError(f"invalid JSON constant {name}")

    return json.loads(text, parse_constant=refuse)


def test_the_report_names_failures_in_valid_json_and_one_line() -> None:
    wrong = WrongExpert(layer=2, position=6, run=(1, 7), reference=(1, 4), gap=0.25, margin=0.1)
    followed = RoutingCounts(4, 1, 0.01, {3: 0.01, 1: 0.005})
    checks = {
        "async": {
            0: check_request(torch.tensor([1.0, math.nan]), torch.ones(2)),
            1: RequestCheck(0.0, routing=followed),
            2: RequestCheck(1e-3, routing=RoutingCounts(wrong=1, first_wrong=wrong)),
        },
        "sync": {0: RequestCheck(3e-2), 1: RequestCheck(1e-6)},
    }
    verdict = Verdict(checks, tolerance=2e-2, margin=2.0**-6)
    data = strict_json(json.dumps(verdict.as_json(), allow_nan=False))
    assert data["verification_failures"] == {"async": [0, 2], "sync": [0]}
    assert data["verification_errors"] == {"async": {"0": None, "2": 1e-3}, "sync": {"0": 3e-2}}
    reasons = data["verification_reasons"]
    assert reasons["async"]["0"] == "not finite: the run's output holds 1 NaN and 0 inf of 2 values"
    assert reasons["async"]["2"].startswith(
        "wrong expert at layer 2: token 6 went to experts [1, 7] where the reference routes "
        "it to [1, 4] with no near tie (gap 2.5e-01, margin 1.0e-01 at that layer)"
    )
    assert reasons["sync"]["0"] == "relative error 3.00e-02"
    assert data["verification_worst"]["async"] == {
        "request": 0,
        "relative_error": None,
        "problem": reasons["async"]["0"],
    }
    assert data["verification_worst"]["sync"]["request"] == 0
    assert data["verification_near_ties"]["async"] == {
        "decisions": 4,
        "followed": 1,
        "largest_followed_gap": 0.01,
        "largest_followed_gap_by_layer": {"1": 0.005, "3": 0.01},
        "requests": {"1": {"near_ties": 4, "followed": 1}},
    }
    assert data["verification_tie_margin"] == 2.0**-6
    line = verdict.fail_line()
    assert line.startswith("FAIL: outputs differ from the monolithic reference (tolerance 2e-02")
    assert "async: request 0 (not finite: the run's output holds 1 NaN" in line
    assert "request 2 (wrong expert at layer 2: token 6" in line
    assert "sync: request 0 (relative error 3.00e-02)" in line


def test_the_pass_line_gives_the_worst_error_and_the_near_ties() -> None:
    checks = {
        "async": {
            0: RequestCheck(
                2e-3, routing=RoutingCounts(near_ties=5, followed=2, largest_followed_gap=3e-3)
            )
        },
        "sync": {0: RequestCheck(4e-3)},
    }
    line = Verdict(checks, 2e-2, 2.0**-6).pass_line()
    assert "(tolerance 2e-02; worst 4.0e-03, request 0 in sync)" in line
    assert "decisions: async 5 (2 followed, largest gap 3.0e-03), sync 0 (0 followed)" in line


def test_a_replay_is_reused_only_for_a_run_that_routed_alike(
    model: MonolithicModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[bool] = []
    original = verify_module.replay_replica

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(True)
        return original(*args, **kwargs)

    monkeypatch.setattr(verify_module, "replay_replica", counted)
    plain = run_steps(model)
    planted = run_steps(model, swap_worst(1, 0, 0))
    values = [{"async": plain, "sync": plain, "colocated": planted}]
    checks = verify(
        model, [(["async", "sync", "colocated"], [], values, [])], prompts(model), MARGIN
    )
    assert len(calls) == 2  # async replayed, sync reused, colocated routed otherwise
    assert checks["async"] == checks["sync"]
    assert checks["colocated"][0].routing.first_wrong is not None


def test_the_routing_log_joins_stages_in_row_order(model: MonolithicModel) -> None:
    tokens = [list(range(3, 14)), [7, 8, 9]]
    whole, staged = RoutingLog(model.config.moe_layers), RoutingLog(model.config.moe_layers)
    model.forward(tokens, select=whole)
    model.forward(tokens, num_stages=3, select=staged)
    one, three = whole.take(), staged.take()
    assert one.dtype == torch.int32
    assert one.shape == (len(model.config.moe_layers), 14, model.config.num_experts_per_tok)
    assert torch.equal(one, three)


def test_the_follower_refuses_a_record_of_another_shape(model: MonolithicModel) -> None:
    k = model.config.num_experts_per_tok
    wrong = torch.zeros(len(model.config.moe_layers), 3, k, dtype=torch.int32)
    hook = TieFollower(model.config.moe_layers, MARGIN, wrong)
    with pytest.raises(RuntimeError, match=r"recorded routing of shape \(2, 3, 2\)"):
        model.forward([[1, 2, 3, 4]], select=hook)


def test_json_safe_writes_non_finite_floats_as_strings() -> None:
    from afd_tools.outputs import json_safe

    report = {"a": [1.0, math.nan, (math.inf, -math.inf)], "b": {"c": 2}, "d": "x"}
    safe = json_safe(report)
    assert safe == {"a": [1.0, "nan", ["inf", "-inf"]], "b": {"c": 2}, "d": "x"}
    assert strict_json(json.dumps(safe, allow_nan=False)) == safe


class _FlakyReference:
    """The monolithic model whose forward passes listed by index (0 = the first) come out
    scaled by 1 + 1e-4: a reference replay that goes wrong once, as one did on a loaded
    CI machine."""

    def __init__(self, model: MonolithicModel, wrong_calls: set[int]) -> None:
        self.model, self.config = model, model.config
        self.wrong_calls, self.calls = wrong_calls, 0

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        out = self.model.forward(*args, **kwargs)
        if self.calls in self.wrong_calls:
            with torch.inference_mode():
                out.hidden_states.mul_(1 + 1e-4)
        self.calls += 1
        return out


def _verify_with(
    reference: Any,
    result: ModeResult,
    tolerance: float | None,
    times: VerificationTimes | None = None,
) -> tuple[Any, list[str]]:
    notes: list[str] = []
    values = [{"async": result, "sync": result}]
    checks = verify(
        reference, [(["async", "sync"], [], values, [])], prompts(reference.model), MARGIN,
        tolerance, notes, times=times,
    )  # fmt: skip
    return checks, notes


def test_a_reference_replay_that_went_wrong_once_is_replayed_and_named(
    model: MonolithicModel,
) -> None:
    """The first replay (two steps: forward calls 0 and 1) is off; the second and third
    agree: the run is checked against them and passes, with a note. Without a tolerance
    (no confirmation) the same run fails: the check above can fail."""
    result = run_steps(model)
    times = VerificationTimes()
    checks, notes = _verify_with(_FlakyReference(model, {0, 1}), result, 1e-5, times)
    assert all(c.error == 0.0 for mode in checks.values() for c in mode.values()), checks
    # async's replay, then its second and third (confirming); sync reuses the third
    assert times.counts == {"replays": 1, "confirmations": 2, "exchanges": 2}
    assert len(notes) == 1, notes
    assert notes[0].startswith(
        "the reference's first replay of the replica with requests [0, 1, 2] differed from "
        "two later ones that agree bitwise (largest relative difference 1.0e-04"
    )
    unconfirmed, notes = _verify_with(_FlakyReference(model, {0, 1}), result, None)
    assert all(c.problem(1e-5) for c in unconfirmed["async"].values())
    assert notes == []


def test_a_run_that_differs_fails_against_a_replay_that_reproduces(
    model: MonolithicModel,
) -> None:
    """A run off by 1e-4 in one request: the second replay agrees with the first, so the
    failure stands after one more replay (2 steps x 2 replays), with no note; the replay
    of sync, which ran the same steps, is reused."""
    result = run_steps(model)
    result.last_hidden[1] = result.last_hidden[1] * (1 + 1e-4)
    reference = _FlakyReference(model, set())
    times = VerificationTimes()
    checks, notes = _verify_with(reference, result, 1e-5, times)
    for mode in ("async", "sync"):
        assert checks[mode][1].problem(1e-5) == "relative error 1.00e-04", checks[mode][1]
        assert checks[mode][0].error == checks[mode][2].error == 0.0
    assert notes == []
    assert reference.calls == 2 * 2 + 2  # async: replay + confirmation; sync: confirmation
    assert times.counts == {"replays": 1, "confirmations": 2, "exchanges": 2}
    assert times.describe() == (
        f"1 replay {times.seconds['replays']:.1f} s, 2 confirming replays "
        f"{times.seconds['confirmations']:.1f} s, exchanges of 2 replicas "
        f"{times.seconds['exchanges']:.1f} s"
    )


def test_replays_that_never_agree_leave_the_failure_and_say_so(model: MonolithicModel) -> None:
    result = run_steps(model)
    reference = _FlakyReference(model, {0, 1, 4, 5})  # first and third replay off, second not
    checks, notes = _verify_with(reference, result, 1e-5)
    assert all(c.problem(1e-5) for c in checks["async"].values())
    assert notes[0] == (
        "the reference's replays of the replica with requests [0, 1, 2] differ from each "
        "other (three replays); checked against the first"
    )


def test_verification_times_count_only_parts_that_finished_and_refuse_unknown_ones() -> None:
    """A timed block that raises is not counted (its exception passes through); a part
    outside PARTS is refused; nothing timed describes as nothing."""
    times = VerificationTimes()
    assert times.describe() == ""
    with times.timed("twin"):
        pass
    with pytest.raises(torch.OutOfMemoryError), times.timed("twin replays"):
        raise torch.OutOfMemoryError("no room")
    assert times.counts == {"twin": 1}
    assert times.describe() == f"float32 twin built {times.seconds['twin']:.1f} s"
    with pytest.raises(ValueError, match="part must be one of"), times.timed("warm-up"):
        pass
