"""The calibration's linear fits (``afd_tools.sim.fitting``): unique answers, named gaps.

The reference for the non-negative solution is SciPy's bounded least squares with the
BVLS method (``scipy.optimize.lsq_linear``), a different algorithm from the Lawson--Hanson
solver the fit uses. "Another machine" is played by perturbing every input at the level of
rounding (a few ulps), which is how a different BLAS or processor changes the inputs a fit
sees: the decisions and the answer must not move.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from scipy.optimize import lsq_linear

from afd_tools.sim.costs import SimError
from afd_tools.sim.fitting import SEPARABLE, fit_nonnegative

NAMES = ("a", "b", "c")


def _relative_problem(rows: np.ndarray, targets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return rows / targets[:, None], np.ones_like(targets)


def _objective(x: np.ndarray, rows: np.ndarray, targets: np.ndarray) -> float:
    return float(np.sum((rows @ x / targets - 1.0) ** 2))


def test_recovers_a_line_and_clamps_a_negative_slope_to_exactly_zero() -> None:
    ts = (1.0, 2.0, 5.0, 9.0)
    fit = fit_nonnegative(
        ("fixed", "slope"), [[1.0, t] for t in ts], [0.5 + 2 * t for t in ts], "x"
    )
    assert fit["fixed"] == pytest.approx(0.5, rel=1e-12)
    assert fit["slope"] == pytest.approx(2.0, rel=1e-12)
    assert fit.dropped == {}
    falling = fit_nonnegative(("fixed", "slope"), [[1.0, t] for t in ts], [10 - t for t in ts], "x")
    assert falling["slope"] == 0.0  # exactly: the bound is active, not a rounding residue
    # with the slope at 0 the best fixed cost on relative errors is sum(1/y) / sum(1/y^2)
    ys = [10 - t for t in ts]
    want = sum(1 / y for y in ys) / sum(1 / y**2 for y in ys)
    assert falling["fixed"] == pytest.approx(want, rel=1e-12)


def test_a_true_zero_comes_out_exactly_zero() -> None:
    rng = np.random.default_rng(7)
    rows = rng.uniform(0.5, 3.0, size=(12, 3))
    truth = np.array([2e-3, 0.0, 4e-5])
    fit = fit_nonnegative(NAMES, rows.tolist(), (rows @ truth).tolist(), "x")
    assert fit["b"] == 0.0
    assert fit["a"] == pytest.approx(2e-3, rel=1e-12)
    assert fit["c"] == pytest.approx(4e-5, rel=1e-12)


def test_unexercised_and_inseparable_features_are_dropped_by_name() -> None:
    rng = np.random.default_rng(3)
    base = rng.uniform(1.0, 2.0, size=(10, 2))
    targets = base @ np.array([0.3, 0.7])
    # b is never exercised
    rows = np.column_stack([base[:, 0], np.zeros(10), base[:, 1]])
    fit = fit_nonnegative(NAMES, rows.tolist(), targets.tolist(), "the FFN fit")
    assert fit["b"] == 0.0
    assert fit.dropped == {
        "b": "no measurement exercises it (the FFN fit: its feature is 0 in every row)"
    }
    assert (fit["a"], fit["c"]) == pytest.approx((0.3, 0.7), rel=1e-12)
    # c moves with a in every row: only their sum is known, the later one is dropped
    rows = np.column_stack([base[:, 0], base[:, 1], 4.0 * base[:, 0]])
    fit = fit_nonnegative(NAMES, rows.tolist(), targets.tolist(), "the FFN fit")
    assert fit.dropped == {"c": "not separable from a, b in these measurements (the FFN fit)"}
    assert (fit["a"], fit["b"], fit["c"]) == pytest.approx((0.3, 0.7, 0.0), rel=1e-12)


def test_separable_is_far_from_rounding_and_from_real_data() -> None:
    """A column a hair (1e-4 relative) off the others' span is kept; one within rounding
    of it is dropped, whatever the rounding."""
    rng = np.random.default_rng(11)
    base = rng.uniform(1.0, 2.0, size=(20, 2))
    wiggle = rng.standard_normal(20)
    for off, dropped in ((1e-4, False), (1e-13, True)):
        third = base[:, 0] + base[:, 1] + off * wiggle
        rows = np.column_stack([base, third])
        fit = fit_nonnegative(NAMES, rows.tolist(), (rows @ [1.0, 1.0, 1.0]).tolist(), "x")
        assert ("c" in fit.dropped) is dropped, off
    assert SEPARABLE < 1e-4


@given(
    st.integers(min_value=0, max_value=2**32 - 1),
    st.lists(st.sampled_from([0.0, 1.0]), min_size=3, max_size=3),
    st.floats(min_value=-0.3, max_value=0.3),
)
def test_matches_bounded_least_squares_and_ignores_rounding_noise(
    seed: int, present: list[float], noise: float
) -> None:
    """Against BVLS on random well-posed problems (some true coefficients zero, targets
    with noise so that bounds bind): the same objective; and the inputs perturbed by a few
    ulps give the same answer to 1e-10."""
    rng = np.random.default_rng(seed)
    rows = rng.uniform(0.1, 5.0, size=(9, 3))
    truth = np.array(present) * rng.uniform(1e-4, 1e-2, size=3)
    targets = rows @ truth + 1e-3
    targets = targets * (1.0 + noise * rng.uniform(-1.0, 1.0, size=9))
    fit = fit_nonnegative(NAMES, rows.tolist(), targets.tolist(), "x")
    assert fit.dropped == {}
    x = np.array([fit[n] for n in NAMES])
    assert (x >= 0).all()
    assert all(math.isfinite(v) for v in x)
    scaled, ones = _relative_problem(rows, targets)
    reference = lsq_linear(scaled, ones, bounds=(0.0, np.inf), method="bvls", tol=1e-14).x
    assert _objective(x, rows, targets) <= _objective(reference, rows, targets) * (1 + 1e-9) + 1e-15
    ulps = 1.0 + 4e-16 * rng.standard_normal(size=rows.shape)
    again = fit_nonnegative(NAMES, (rows * ulps).tolist(), targets.tolist(), "x")
    assert again.dropped == fit.dropped
    for n in NAMES:
        assert again[n] == pytest.approx(fit[n], rel=1e-10, abs=1e-18), n


def test_bad_input_is_refused_with_what_to_do() -> None:
    with pytest.raises(SimError, match="NaN or inf"):
        fit_nonnegative(("a",), [[1.0], [2.0]], [1.0, math.nan], "the attention fit")
    with pytest.raises(SimError, match="NaN or inf"):
        fit_nonnegative(("a",), [[math.inf], [2.0]], [1.0, 2.0], "the attention fit")
    with pytest.raises(SimError, match="no measurements to fit"):
        fit_nonnegative(("a",), [], [], "the attention fit")
    with pytest.raises(SimError, match="no measurements to fit"):
        fit_nonnegative(("a",), [[1.0]], [0.0], "the attention fit")  # no positive target
    with pytest.raises(ValueError, match="2 rows but 1 targets"):
        fit_nonnegative(("a",), [[1.0], [2.0]], [1.0], "x")
    with pytest.raises(ValueError, match="repeat"):
        fit_nonnegative(("a", "a"), [[1.0, 1.0]], [1.0], "x")
