"""Typed tensor views of a window's bytes, laid out by :class:`WindowLayout`.

Every transport exposes a window as one flat ``uint8`` tensor (host shared memory, a
peer-mapped GPU buffer, an emulator's buffer); these helpers slice it into the typed
fields of the protocol without copying. Views are built once per (region, ring) and
reused, so the per-layer path does no layout arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from afd_protocol.core.layout import FieldSpec, WindowLayout
from afd_protocol.core.tensors import torch_dtype


def _field(window: torch.Tensor, base: int, spec: FieldSpec) -> torch.Tensor:
    return window[base + spec.offset : base + spec.offset + spec.nbytes]


@dataclass(frozen=True)
class SlotView:
    """Zero-copy typed views of one slot."""

    header: torch.Tensor
    """int32 ``[header_words]``."""
    route_index: torch.Tensor
    """int32 ``[routed_cap]``: source token of each routed row (written on dispatch)."""
    route_ids: torch.Tensor
    """int32 ``[token_cap, k]`` (``per_rank``; ``[0, k]`` otherwise): local expert ids of
    each token row, -1 where the choice is on another FFN rank."""
    route_weights: torch.Tensor
    """float32 ``[token_cap, k]`` (``per_rank``): the routing weights beside ``route_ids``."""
    routed_rows: torch.Tensor
    """``[routed_cap, H]`` in the activation dtype."""
    shared_rows: torch.Tensor
    """``[shared_cap, H]`` in the activation dtype."""
    routed_scales: torch.Tensor
    shared_scales: torch.Tensor


def slot_view(window: torch.Tensor, layout: WindowLayout, region: int, ring: int) -> SlotView:
    """Views of slot ``(region, ring)`` inside ``window`` (flat uint8, ``layout.total_bytes``)."""
    if window.dtype != torch.uint8 or window.dim() != 1 or window.numel() < layout.total_bytes:
        raise ValueError(
            f"a window must be a flat uint8 tensor of at least {layout.total_bytes} bytes, got "
            f"{window.dtype} of shape {tuple(window.shape)}"
        )
    slot = layout.slot
    base = layout.slot_offset(region, ring)
    dtype = torch_dtype(slot.dtype)
    hidden = slot.hidden_size

    def rows(name: str) -> torch.Tensor:
        spec = slot.field(name)
        return _field(window, base, spec).view(dtype).view(spec.shape[0], hidden)

    def words(name: str, dtype: torch.dtype) -> torch.Tensor:
        return _field(window, base, slot.field(name)).view(dtype)

    def table(name: str, dtype: torch.dtype) -> torch.Tensor:
        return words(name, dtype).view(slot.field(name).shape)

    return SlotView(
        header=words("header", torch.int32),
        route_index=words("route_index", torch.int32),
        route_ids=table("route_ids", torch.int32),
        route_weights=table("route_weights", torch.float32),
        routed_rows=rows("routed_rows"),
        shared_rows=rows("shared_rows"),
        routed_scales=words("routed_scales", torch.float32),
        shared_scales=words("shared_scales", torch.float32),
    )


def flag_words(window: torch.Tensor, layout: WindowLayout) -> torch.Tensor:
    """int32 ``[num_regions * ring_depth]`` flag array; index with ``layout.flag_index``."""
    n = layout.num_regions * layout.ring_depth
    return window[layout.flags_offset : layout.flags_offset + 4 * n].view(torch.int32)


def abort_words(window: torch.Tensor, layout: WindowLayout) -> torch.Tensor:
    """int32 ``[num_regions]`` abort words; non-zero means that region's sender failed."""
    return window[layout.abort_offset : layout.abort_offset + 4 * layout.num_regions].view(
        torch.int32
    )
