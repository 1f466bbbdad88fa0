"""Non-negative linear fits of measured times, posed so that the answer is well defined.

Every coefficient of the cost model is a non-negative number of seconds (or seconds per
token, row, byte) fitted from measured times: ``time_i ~ sum_j x_j * feature_ij`` with
``x >= 0``, on relative errors (a 0.1 ms and a 10 ms measurement weigh alike).

Least squares only has one answer when the data separate the coefficients. Two ways they
do not, both seen in real campaigns:

* a feature that no measurement exercises (a column of zeros: no prompt long enough for
  the quadratic term, a wire whose bytes are all zero) -- its coefficient is unknown;
* features that move together in every measurement (every FFN item touched every local
  expert, so "experts touched" is a multiple of "items served") -- only their
  combination is known, and how a solver splits it depends on rounding in the linear
  algebra underneath, so it changes between numpy/BLAS builds and processors.

:func:`fit_nonnegative` finds both before solving and drops such a feature (its
coefficient becomes 0, the rest absorb it), keeping the caller's order of preference:
a feature is kept when it adds a direction the *earlier* kept features do not span (a
relative residual above :data:`SEPARABLE`), so the answer does not hinge on pivoting
ties. What was dropped is reported by name with the reason. The remaining problem has
full column rank, so its non-negative least-squares solution is unique; SciPy's
Lawson--Hanson solver (:func:`scipy.optimize.nnls`) computes it and leaves at exactly
zero every coefficient whose gradient is within rounding of zero, so a coefficient whose
true value is zero does not come out as ``+-1e-18`` depending on the machine.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from afd_tools.sim.costs import SimError

SEPARABLE = 1e-6
"""A feature whose scaled column lies within this relative distance of the span of the
features before it is not separable from them (well above rounding, ~1e-15, and well below
any real campaign's: the smallest on the shipped CPU bundle is 0.036)."""


@dataclass(frozen=True)
class LinearFit:
    """Fitted coefficients by feature name (dropped features at 0.0) and why any were
    dropped."""

    coefficients: dict[str, float]
    dropped: dict[str, str] = field(default_factory=dict)

    def __getitem__(self, name: str) -> float:
        return self.coefficients[name]


def _residual_ratio(column: np.ndarray, basis: np.ndarray) -> float:
    """``|column - projection onto span(basis)| / |column|`` (``basis`` may be empty)."""
    if basis.shape[1] == 0:
        return 1.0
    solution, *_ = np.linalg.lstsq(basis, column, rcond=None)
    return float(np.linalg.norm(column - basis @ solution) / np.linalg.norm(column))


def fit_nonnegative(
    names: Sequence[str], rows: Sequence[Sequence[float]], targets: Sequence[float], what: str
) -> LinearFit:
    """Minimise ``sum_i (x . rows[i] / targets[i] - 1)**2`` over ``x >= 0`` (module
    docstring); ``names`` label the columns in order of preference; ``what`` names the
    fit in errors and reasons. Rows whose target is not positive carry no information on
    a relative scale and are left out."""
    if len(set(names)) != len(names):
        raise ValueError(f"{what}: feature names repeat: {list(names)}")
    if any(len(row) != len(names) for row in rows):
        raise ValueError(f"{what}: every row needs {len(names)} features ({list(names)})")
    if len(rows) != len(targets):
        raise ValueError(f"{what}: {len(rows)} rows but {len(targets)} targets")
    a = np.array(rows, dtype=float).reshape(len(rows), len(names))
    b = np.array(targets, dtype=float)
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        raise SimError(f"{what}: the measurements hold NaN or inf; re-run the measurement")
    keep_rows = b > 0
    a, b = a[keep_rows], b[keep_rows]
    if a.shape[0] == 0:
        raise SimError(f"{what}: no measurements to fit (the runs have no per-layer breakdown)")
    a = a / b[:, None]
    ones = np.ones_like(b)
    norms = np.linalg.norm(a, axis=0)
    dropped: dict[str, str] = {}
    kept: list[int] = []
    for j, name in enumerate(names):
        if norms[j] == 0:
            dropped[name] = f"no measurement exercises it ({what}: its feature is 0 in every row)"
            continue
        column = a[:, j] / norms[j]
        basis = a[:, kept] / norms[kept]
        if _residual_ratio(column, basis) < SEPARABLE:
            others = ", ".join(names[k] for k in kept)
            dropped[name] = f"not separable from {others} in these measurements ({what})"
            continue
        kept.append(j)
    coefficients = dict.fromkeys(names, 0.0)
    if kept:
        scaled = a[:, kept] / norms[kept]
        from scipy.optimize import nnls  # here: 0.37 s of import every afd process would pay

        solution, _ = nnls(scaled, ones)
        for j, value in zip(kept, solution / norms[kept], strict=True):
            coefficients[names[j]] = float(value)
    if not all(math.isfinite(v) for v in coefficients.values()):
        raise SimError(f"{what}: the fit did not converge to finite coefficients")
    return LinearFit(coefficients, dropped)
