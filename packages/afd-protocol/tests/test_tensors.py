"""relative_error, the measure every afd verification compares outputs with: its value on
known inputs (computed by hand here), and non-finite inputs never passing a tolerance; and
constant_index's cache with the keeping_constants blocks a CUDA graph capture relies on."""

from __future__ import annotations

import math

import pytest
import torch

from afd_protocol import constant_index, relative_error


def test_relative_error_is_the_frobenius_ratio() -> None:
    reference = torch.tensor([[3.0, 0.0], [0.0, 4.0]], dtype=torch.float64)  # norm 5
    out = reference + torch.tensor([[0.0, 0.3], [0.4, 0.0]], dtype=torch.float64)  # diff 0.5
    assert relative_error(out, reference) == pytest.approx(0.1, rel=1e-12)
    assert relative_error(reference, reference) == 0.0
    assert relative_error(torch.empty(0), torch.empty(0)) == 0.0


def test_relative_error_compares_across_dtypes_in_float64() -> None:
    reference = torch.ones(8, dtype=torch.float64)
    out = torch.ones(8, dtype=torch.bfloat16)
    out[0] = 1.0078125  # one bfloat16 ulp above 1: difference 2**-7, reference norm sqrt(8)
    assert relative_error(out, reference) == pytest.approx(2**-7 / math.sqrt(8), rel=1e-12)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("side", ["out", "reference"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_non_finite_value_on_either_side_is_an_infinite_error(
    bad: float, side: str, dtype: torch.dtype
) -> None:
    """inf, never NaN: ``nan > tolerance`` is False, so a NaN error once passed a check."""
    good = torch.ones(4, 3, dtype=dtype)
    planted = good.clone()
    planted[2, 1] = bad
    args = (planted, good) if side == "out" else (good, planted)
    error = relative_error(*args)
    assert error == math.inf
    assert not error <= 1.0
    assert max(0.0, error) == math.inf


def test_a_zero_reference_gives_a_finite_error() -> None:
    error = relative_error(torch.full((3,), 1e-3), torch.zeros(3))
    assert math.isfinite(error)
    assert error > 1.0


def test_constant_index_caches_each_table_and_drops_the_least_recently_used() -> None:
    import weakref

    from afd_protocol.core import tensors

    cpu = torch.device("cpu")
    first = constant_index((1, 2, 3), cpu)
    assert first.dtype == torch.int64
    assert first.tolist() == [1, 2, 3]
    assert constant_index((1, 2, 3), cpu) is first  # built once
    gone = weakref.ref(first)
    del first
    for j in range(tensors.MAX_TABLES):
        constant_index((j, -1), cpu)
    assert gone() is None  # dropped from the cache, and nothing else held it


def test_keeping_constants_holds_every_table_returned_inside_the_block() -> None:
    """What a CUDA graph needs: it holds the tables' addresses, the block's list their
    references, past the cache dropping them."""
    import weakref

    from afd_protocol import keeping_constants
    from afd_protocol.core import tensors

    cpu = torch.device("cpu")
    with keeping_constants() as outer:
        with keeping_constants() as inner:
            table = constant_index((7, 8), cpu)
        again = constant_index((7, 8), cpu)
    assert inner == [table]
    assert outer == [table, again]
    assert again is table
    held = weakref.ref(table)
    del table, again, inner
    for j in range(tensors.MAX_TABLES + 1):
        constant_index((j, -2), cpu)
    assert held() is not None  # the outer block's list still holds it
    assert outer[0].tolist() == [7, 8]
    assert not tensors._KEEPERS  # both blocks ended
