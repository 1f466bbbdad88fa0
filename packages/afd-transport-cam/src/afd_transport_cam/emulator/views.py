"""Typed views of the emulated windows (the layout of :mod:`afd_transport_cam.geometry`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from afd_protocol import InvalidArgument
from afd_transport_cam.geometry import (
    HEADER_WORDS,
    POINTER_BYTES,
    STATS_WORDS,
    CamGeometry,
)


def _check_size(window: torch.Tensor, needed: int, whose: str) -> None:
    if window.numel() < needed:
        raise InvalidArgument(
            f"{whose} window is {window.numel()} bytes but this geometry needs {needed}; "
            f"make the windows larger (on the NPU: HCCL_BUFFSIZE) or lower max_seq_len"
        )


@dataclass(frozen=True)
class Region:
    """One attention rank's region in an FFN rank's window."""

    header: torch.Tensor
    """int64[5]: ready (pairs + 1), attention rank, layer, Q, selected."""
    counts: torch.Tensor
    """int32[R]: pairs per local expert."""
    flags: torch.Tensor
    """int32[R]: 1 once a work item took the expert."""
    store: torch.Tensor
    """uint8[rows_per_rank, row_bytes]: the de-duplicated token rows."""
    table: torch.Tensor
    """int32[K * rows_per_rank]: token-store row of each (expert, occurrence)."""


def ffn_region(window: torch.Tensor, geo: CamGeometry, attention_rank: int) -> Region:
    _check_size(window, geo.ffn_window_bytes, "an FFN rank's")
    base = attention_rank * geo.region_bytes
    r, k, rows = geo.experts_per_rank, geo.top_k, geo.rows_per_rank

    def words(offset: int, count: int, dtype: torch.dtype) -> torch.Tensor:
        start = base + offset
        return window[start : start + count * dtype.itemsize].view(dtype)

    store_start = base + geo.store_offset
    store = window[store_start : store_start + rows * geo.row_bytes].view(rows, geo.row_bytes)
    return Region(
        header=words(geo.header_offset, HEADER_WORDS, torch.int64),
        counts=words(geo.counts_offset, r, torch.int32),
        flags=words(geo.flags_offset, r, torch.int32),
        store=store,
        table=words(geo.table_offset, k * rows, torch.int32),
    )


def scan_pointer(window: torch.Tensor, geo: CamGeometry) -> torch.Tensor:
    """int64[1]: the first attention rank of the replica an FFN rank scans next."""
    _check_size(window, geo.ffn_window_bytes, "an FFN rank's")
    start = geo.ffn_window_bytes - POINTER_BYTES
    return window[start : start + 8].view(torch.int64)


@dataclass(frozen=True)
class Home:
    """What an attention rank's window holds for its own combine."""

    words: torch.Tensor
    """int64[2]: the routing digest of the dispatch in flight, and whether one is."""
    counts: torch.Tensor
    """int32[M, R]: the pairs it sent to each FFN rank's experts."""
    status: torch.Tensor
    """int32[M]: ``Q + 1`` from each FFN rank once its replies are all written."""
    rows: torch.Tensor
    """``[combine_rows, H]`` in the activation dtype: the replies."""


def home(window: torch.Tensor, geo: CamGeometry) -> Home:
    _check_size(window, geo.attention_window_bytes, "an attention rank's")
    m, r, h = geo.num_ffn, geo.experts_per_rank, geo.hidden_size
    counts_start = 8 * STATS_WORDS
    rows_bytes = geo.combine_rows * h * geo.dtype.itemsize
    rows = window[geo.combine_offset : geo.combine_offset + rows_bytes].view(geo.dtype)
    return Home(
        words=window[: 8 * STATS_WORDS].view(torch.int64),
        counts=window[counts_start : counts_start + 4 * m * r].view(torch.int32).view(m, r),
        status=window[geo.status_offset : geo.status_offset + 4 * m].view(torch.int32),
        rows=rows.view(geo.combine_rows, h),
    )
