"""The exchange record a replica keeps for the verification (afd_tools.run.exchanges) and its
check: which rows are kept across stages, what a missing layer or row says, the row errors
(NaN never passes), what came back and what went out (experts and weights against the
reference's router on the same rows), and how the verdict reports it."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from afd_models import MonolithicModel, RandomWeights
from afd_models import preset as make_preset
from afd_tools.run.exchanges import (
    ExchangeError,
    ExchangeLog,
    StepExchanges,
    probed_rows,
    row_owners,
)
from afd_tools.run.job import EXCHANGE_TOLERANCE
from afd_tools.run.ranks import ModeResult
from afd_tools.run.verify import (
    ROUTER_WEIGHT_TOLERANCE,
    TIE_MARGIN,
    ExchangeCheck,
    RequestCheck,
    Verdict,
    check_exchanges,
    row_errors,
)

H, K = 4, 2
MARGIN = TIE_MARGIN["float32"]


DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
        ],
    ),
]
"""On a GPU the rows go through page-locked memory and land in device buffers."""


def call(log: ExchangeLog, layer: int, first_row: int, rows: int, device: str = "cpu") -> None:
    """One stage's exchange of ``rows`` rows whose values encode their step row."""
    x = torch.arange(first_row, first_row + rows, dtype=torch.float32, device=device)
    x = x[:, None].repeat(1, H)
    ids = torch.arange(first_row, first_row + rows, device=device)[:, None].repeat(1, K)
    returned = log(layer, x, ids, torch.full((rows, K), 0.5, device=device))
    if returned is not None:
        returned(-x)


@pytest.mark.parametrize("device", DEVICES)
def test_the_probed_rows_are_kept_across_stages_in_order(device: str) -> None:
    log = ExchangeLog([1, 2])
    log.expect([2, 3, 7])
    for layer in (1, 2):  # two stages: rows 0-4, then 5-7
        call(log, layer, 0, 5, device)
        call(log, layer, 5, 3, device)
    record = log.take()
    assert record is not None
    assert record.rows == (2, 3, 7)
    assert record.x.shape == (2, 3, H)
    assert record.x[:, :, 0].tolist() == [[2.0, 3.0, 7.0]] * 2
    assert record.topk_ids.dtype == torch.int64
    assert record.topk_ids[1, :, 0].tolist() == [2, 3, 7]
    assert record.weights.dtype == torch.float32
    assert torch.equal(record.out, -record.x)
    assert log.take() is None  # taken: the next step starts empty


def test_which_rows_are_probed_and_whose_they_are() -> None:
    """Short chunks are probed whole; a longer one at 8 rows evenly spaced from its first
    token to its last; each probed row maps back to its request and prompt position."""
    assert probed_rows([3, 1, 4]) == [0, 1, 2, 3, 4, 5, 6, 7]
    assert probed_rows([2, 15]) == [0, 1, 2, 4, 6, 8, 10, 12, 14, 16]
    long = probed_rows([16384])
    assert len(long) == 8
    assert (long[0], long[-1]) == (0, 16383)
    assert probed_rows([9, 9], per_chunk=2) == [0, 8, 9, 17]
    assert probed_rows([]) == []
    with pytest.raises(ValueError, match="probe at least 2 rows per chunk"):
        probed_rows([4], per_chunk=1)
    step = [(7, 100, 102, False), (3, 0, 15, True)]
    owners = row_owners(step, probed_rows([2, 15]))
    assert owners[:3] == [(7, 100), (7, 101), (3, 0)]
    assert owners[-1] == (3, 14)
    with pytest.raises(ExchangeError, match="probed row 17 is outside the step's 17 rows"):
        row_owners(step, [17])


def test_a_dummy_step_records_nothing_and_a_gap_is_named() -> None:
    log = ExchangeLog([1, 2])
    log.expect([])
    call(log, 1, 0, 1)
    assert log.take() is None
    log.expect([0])
    call(log, 1, 0, 2)
    with pytest.raises(ExchangeError, match=r"no exchange was recorded for MoE layers \[2\]"):
        log.take()
    log.expect([0])
    assert log(1, torch.zeros(0, H), torch.zeros(0, K, dtype=torch.long), torch.zeros(0, K)) is None
    log.expect([0, 4])
    call(log, 1, 0, 2)
    call(log, 2, 0, 6)
    with pytest.raises(ExchangeError, match=r"MoE layers \[1\] covered fewer than the 2 rows"):
        log.take()


def test_row_errors_are_relative_per_row_and_never_nan() -> None:
    reference = torch.tensor([[1.0, 0.0], [0.0, 2.0], [0.0, 0.0], [1.0, 1.0], [0.0, 0.0]])
    out = torch.tensor([[1.0, 0.0], [0.0, 2.2], [0.0, 0.0], [math.nan, 1.0], [1e-3, 0.0]])
    errors = row_errors(out, reference).tolist()
    assert errors[0] == 0.0
    assert errors[1] == pytest.approx(0.1)
    assert errors[2] == 0.0  # two zero rows
    assert errors[3] == math.inf  # a NaN fails whatever the tolerance
    assert errors[4] == math.inf  # anything against a zero row


def last_rows(step: list[tuple[int, int, int, bool]]) -> tuple[int, ...]:
    """The step row of each chunk's last token (one probed row per chunk)."""
    ends = torch.tensor([end - begin for _, begin, end, _ in step]).cumsum(0)
    return tuple(int(end) - 1 for end in ends)


def _steps_of(
    model: MonolithicModel,
    scale: float,
    weight_scale: float = 1.0,
    worst_expert: bool = False,
) -> ModeResult:
    """A replica record of two steps whose exchanges are the reference's own (its router's
    experts and weights), except in step 1 at the last MoE layer: the rows come back
    ``scale`` times too large, go out with weights ``weight_scale`` times too large, and
    with ``worst_expert`` each row's k-th expert is its lowest-scoring one."""
    gen = torch.Generator().manual_seed(3)
    layers = model.config.moe_layers
    result = ModeResult()
    for index, step in enumerate([[(0, 0, 5, True)], [(1, 0, 4, True), (2, 0, 6, False)]]):
        rows = len(step)
        x = torch.randn(len(layers), rows, model.config.hidden_size, generator=gen)
        ids, weights = [], []
        for i, layer in enumerate(layers):
            moe = model.moe_layers[layer]
            chosen = moe.router(x[i]).topk_ids
            if index == 1 and i == len(layers) - 1 and worst_expert:
                chosen = chosen.clone()
                chosen[:, -1] = moe.router.scores(x[i]).argmin(dim=1)
            ids.append(chosen)
            weights.append(moe.routed_weights(x[i], chosen)[1])
        if index == 1:
            weights[-1] = weights[-1] * weight_scale
        out = torch.stack([
            model.moe_layers[layer].exchanged(x[i], ids[i], weights[i], with_shared=False)
            for i, layer in enumerate(layers)
        ])  # fmt: skip
        if index == 1:
            out[-1] = out[-1] * scale
        result.steps.append(step)
        result.exchanges.append(
            StepExchanges(last_rows(step), x, torch.stack(ids), torch.stack(weights), out)
        )
    return result


def test_a_scaled_exchange_fails_naming_the_layer_and_the_token() -> None:
    model = MonolithicModel(make_preset("tiny"), RandomWeights(2))
    right = check_exchanges(model, _steps_of(model, 1.0), MARGIN)
    layers = len(model.config.moe_layers)
    assert set(right) == {0, 1, 2}
    assert all(c.error <= 1e-6 and c.weight_error <= 1e-6 for c in right.values())
    assert all(c.wrong is None and c.problem(1e-6) is None for c in right.values())
    assert right[0].rows == layers
    wrong = check_exchanges(model, _steps_of(model, 1.03), MARGIN)
    assert wrong[0].error <= 1e-6  # step 0 is right
    last = model.config.moe_layers[-1]
    for rid, position in ((1, 3), (2, 5)):
        check = wrong[rid]
        assert check.error == pytest.approx(0.03, rel=1e-3)
        assert (check.layer, check.position) == (last, position)
        assert check.problem(2e-2) == (
            f"the MoE exchange at layer {last} returned token {position}'s experts "
            f"3.00e-02 off from the reference's (bound 2e-02; {layers} token-layer rows "
            "checked)"
        )
        assert check.problem(5e-2) is None
    assert check_exchanges(model, ModeResult(), MARGIN) == {}


def test_an_exchange_is_held_to_its_own_bound_below_the_run_tolerance() -> None:
    """Returned rows 1.5 % off pass bf16's end-to-end tolerance of 2e-2 but not the
    exchange's own bound (one layer's rounding: ``EXCHANGE_TOLERANCE``, 1e-2 in bf16); the
    run's tolerance still applies where it is smaller."""
    model = MonolithicModel(make_preset("tiny"), RandomWeights(2))
    layers = len(model.config.moe_layers)
    checks = check_exchanges(model, _steps_of(model, 1.015), MARGIN, EXCHANGE_TOLERANCE["bfloat16"])
    assert checks[0].problem(2e-2) is None  # step 0 is right
    check = checks[1]
    assert check.bound == 1e-2
    assert check.problem(2e-2) == (
        f"the MoE exchange at layer {check.layer} returned token 3's experts 1.50e-02 off "
        f"from the reference's (bound 1e-02; {layers} token-layer rows checked)"
    )
    assert check.problem(1e-3) is not None
    assert dataclasses.replace(check, bound=None).problem(2e-2) is None  # the old rule
    assert EXCHANGE_TOLERANCE == {"float32": 1e-5, "bfloat16": 1e-2}


@pytest.mark.parametrize("weight_scale", [1.03, 1.015, 1.001])
def test_weights_sent_off_from_the_router_fail_though_the_experts_answered_them(
    weight_scale: float,
) -> None:
    """The replica's weights at the last layer too large (a wrong routed scale on the
    attention side): the FFN computed exactly what it was sent, so the returned rows match,
    but the weights are checked against the reference's router on the same rows, to
    :data:`ROUTER_WEIGHT_TOLERANCE` whatever the run's tolerance (a 1.5 % error passed the
    bf16 tolerance of 2e-2)."""
    model = MonolithicModel(make_preset("tiny"), RandomWeights(2))
    checks = check_exchanges(model, _steps_of(model, 1.0, weight_scale=weight_scale), MARGIN)
    last = model.config.moe_layers[-1]
    layers = len(model.config.moe_layers)
    assert checks[0].weight_error <= 1e-6
    assert checks[0].problem(2e-2) is None
    off = weight_scale - 1
    for rid, position in ((1, 3), (2, 5)):
        check = checks[rid]
        assert check.error <= 1e-6  # what came back is what was asked for
        assert check.weight_error == pytest.approx(off, rel=1e-3)
        assert (check.weight_layer, check.weight_position) == (last, position)
        for tolerance in (2e-2, 5e-2):  # bf16's and the quantized wire's run tolerance
            assert check.problem(tolerance) == (
                f"the MoE exchange at layer {last} weighted token {position}'s experts "
                f"{off:.2e} off from the reference router's weights (bound 1e-04; {layers} "
                "token-layer rows checked)"
            )
    assert ROUTER_WEIGHT_TOLERANCE == 1e-4


def test_weights_sent_not_finite_fail_as_not_finite() -> None:
    model = MonolithicModel(make_preset("tiny"), RandomWeights(2))
    checks = check_exchanges(model, _steps_of(model, 1.0, weight_scale=math.nan), MARGIN)
    assert checks[1].weight_error == math.inf
    only_weights = ExchangeCheck(0.0, 1, 3, 4, math.inf, 1, 3)
    assert only_weights.problem(1.0) == (
        "the MoE exchange at layer 1 weighted token 3's experts not finite from the "
        "reference router's weights (bound 1e-04; 4 token-layer rows checked)"
    )


def test_experts_the_router_would_not_choose_fail_unless_near_a_tie() -> None:
    """Each row of step 1 sent to its lowest-scoring expert at the last layer: a wrong
    expert by the reference's router on the same row, named with the layer and token; with
    a margin that makes every decision a near tie, it is followed and passes."""
    model = MonolithicModel(make_preset("tiny"), RandomWeights(2))
    record = _steps_of(model, 1.0, worst_expert=True)
    checks = check_exchanges(model, record, MARGIN)
    last = model.config.moe_layers[-1]
    assert checks[0].wrong is None
    for rid, position in ((1, 3), (2, 5)):
        check = checks[rid]
        assert check.wrong is not None
        assert check.wrong_count == 1
        assert (check.wrong.layer, check.wrong.position) == (last, position)
        assert check.wrong.run != check.wrong.reference
        assert check.wrong.gap > MARGIN
        problem = check.problem(2e-2)
        assert problem is not None
        assert problem.startswith(
            f"the router on a dispatched row: wrong expert at layer {last}: token {position} "
            f"went to experts {list(check.wrong.run)} where the reference routes it to "
            f"{list(check.wrong.reference)} with no near tie"
        )
    followed = check_exchanges(model, record, math.inf)
    assert all(c.wrong is None and c.problem(2e-2) is None for c in followed.values())


def test_the_verdict_reports_the_exchange_and_fails_on_it_first() -> None:
    bad = ExchangeCheck(error=3e-2, layer=1, position=3, rows=4)
    fine = ExchangeCheck(error=4e-3, layer=2, position=0, rows=2)
    nan = ExchangeCheck(error=math.inf, layer=1, position=7, rows=2)
    checks = {
        "async": {0: RequestCheck(1e-3, exchange=fine), 1: RequestCheck(5e-3, exchange=bad)},
        "sync": {0: RequestCheck(1e-3, exchange=nan)},
        "colocated": {0: RequestCheck(1e-3)},
    }
    verdict = Verdict(checks, 2e-2, 2.0**-3)
    assert verdict.failures() == {
        "async": {1: "the MoE exchange at layer 1 returned token 3's experts 3.00e-02 off "
                     "from the reference's (bound 2e-02; 4 token-layer rows checked)"},
        "sync": {0: "the MoE exchange at layer 1 returned token 7's experts not finite from "
                    "the reference's (bound 2e-02; 2 token-layer rows checked)"},
    }  # fmt: skip
    data = json.loads(json.dumps(verdict.as_json(), allow_nan=False))
    assert data["verification_exchanges"] == {
        "async": {
            "rows": 6,
            "worst": 3e-2,
            "request": 1,
            "layer": 1,
            "position": 3,
            "bound": 2e-2,
            "weights_worst": 0.0,
            "weights_bound": 1e-4,
            "router_wrong": 0,
            "router_margin": 1e-4,
        },
        "sync": {
            "rows": 2,
            "worst": None,
            "request": 0,
            "layer": 1,
            "position": 7,
            "bound": 2e-2,
            "weights_worst": 0.0,
            "weights_bound": 1e-4,
            "router_wrong": 0,
            "router_margin": 1e-4,
        },
    }
    passing = Verdict({"async": {0: RequestCheck(1e-3, exchange=fine)}}, 2e-2, 2.0**-3)
    assert (
        ", and so does every MoE exchange, layer by layer (2 token-layer rows: up to 8 "
        "tokens of each chunk; worst 4.0e-03 (bound 2e-02), request 0 at layer 2 in async; "
        "the experts sent "
        "the router's own, their weights within 0.0e+00 of its, bound 1e-04)" in passing.pass_line()
    )
