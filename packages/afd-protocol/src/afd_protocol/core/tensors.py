"""Small tensor utilities every layer uses: dtype names, cached index tables, errors."""

from __future__ import annotations

import contextlib
import math
import threading
from collections import OrderedDict
from collections.abc import Iterator

import torch


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype named by a layout dtype string (``"bfloat16"`` -> ``torch.bfloat16``)."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype")
    return dtype


_TABLES: OrderedDict[tuple[tuple[int, ...], torch.device], torch.Tensor] = OrderedDict()
""":func:`constant_index`'s tables, least recently used first (at most :data:`MAX_TABLES`)."""
MAX_TABLES = 256
_TABLES_LOCK = threading.Lock()
_KEEPERS: list[list[torch.Tensor]] = []
"""The lists of the :func:`keeping_constants` blocks active now (innermost last)."""


def constant_index(values: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """``values`` as a read-only int64 tensor on ``device``, built once per distinct tuple.

    For small tables that stay fixed while a transport runs (watched flag indices, expert
    wire positions, rank offsets, window addresses): on an accelerator, building them per
    call would be a synchronising host-to-device copy each time. Do not write into it. The
    :data:`MAX_TABLES` most recently used are cached.

    Inside a :func:`keeping_constants` block every table returned is also kept there. While
    the current CUDA stream captures a graph, a table not in the cache is built through
    page-locked memory instead (a copy that the graph holds and redoes on every replay;
    neither is cached, both are kept): a capture forbids the synchronising copy.
    """
    key = (values, device)
    with _TABLES_LOCK:
        table = _TABLES.get(key)
        if table is not None:
            _TABLES.move_to_end(key)
    if table is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            host = torch.tensor(values, dtype=torch.int64).pin_memory()
            table = host.to(device, non_blocking=True)
            for keeper in _KEEPERS:
                keeper.append(host)
        else:
            table = torch.tensor(values, dtype=torch.int64, device=device)
            with _TABLES_LOCK:
                _TABLES[key] = table
                while len(_TABLES) > MAX_TABLES:
                    _TABLES.popitem(last=False)
    for keeper in _KEEPERS:
        keeper.append(table)
    return table


@contextlib.contextmanager
def keeping_constants() -> Iterator[list[torch.Tensor]]:
    """Collect every :func:`constant_index` table (and its page-locked source, where one was
    built during a capture) returned inside the block into the list it yields.

    A CUDA graph holds the addresses of the tables it was captured with, not references:
    keep this list as long as the graph (``constant_index``'s cache may drop a table)."""
    kept: list[torch.Tensor] = []
    _KEEPERS.append(kept)
    try:
        yield kept
    finally:
        # By identity (lists of tensors do not compare): blocks nest, but a generator may
        # be closed late.
        index = next(i for i, k in enumerate(_KEEPERS) if k is kept)
        del _KEEPERS[index]


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
