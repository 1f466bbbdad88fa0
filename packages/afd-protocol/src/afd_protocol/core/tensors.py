"""Small tensor utilities every layer uses: dtype names, cached index tables, errors."""

from __future__ import annotations

import functools

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

    The measure every afd verification uses to compare an output with its reference.
    """
    if reference.numel() == 0:
        return 0.0
    ref = reference.detach().double().cpu()
    diff = (out.detach().double().cpu() - ref).norm()
    return float(diff / ref.norm().clamp_min(1e-30))


__all__ = ["constant_index", "relative_error", "torch_dtype"]
