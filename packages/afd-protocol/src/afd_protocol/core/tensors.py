"""Small tensor utilities every layer uses: dtype names, cached index tables, errors."""

from __future__ import annotations

import functools
import math

import torch


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype named by a layout dtype string (``"bfloat16"`` -> ``torch.bfloat16``)."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype")
    return dtype


@functools.lru_cache(maxsize=256)
def constant_index(values: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """``values`` as a read-only int64 tensor on ``device``, built once per distinct tuple.

    For small tables that stay fixed while a transport runs (watched flag indices, expert
    wire positions, rank offsets, window addresses): on an accelerator, building them per
    call would be a synchronising host-to-device copy each time. Do not write into it.
    """
    return torch.tensor(values, dtype=torch.int64, device=device)


def relative_error(out: torch.Tensor, reference: torch.Tensor) -> float:
    """``|out - ref| / |ref|`` in the Frobenius norm, in float64 (0 for two empty tensors).

    The measure every afd verification uses to compare an output with its reference: any
    shape, dtype and device (both are compared on the CPU). ``inf`` when either tensor
    holds a NaN or an infinity, so that ``error <= tolerance`` and ``max`` over errors
    fail on it; NaN never comes back (``nan > tolerance`` is False, which once let a
    NaN output pass). A caller that must say which side was not finite checks that
    itself (``torch.isfinite``).
    """
    if reference.numel() == 0:
        return 0.0
    ref = reference.detach().double().cpu()
    got = out.detach().double().cpu()
    if not (bool(torch.isfinite(got).all()) and bool(torch.isfinite(ref).all())):
        return math.inf
    diff = (got - ref).norm()
    return float(diff / ref.norm().clamp_min(1e-30))


__all__ = ["constant_index", "relative_error", "torch_dtype"]
