"""The FFN rank's compute in graph mode: static shapes, the layer chosen on the device.

On the NPU the FFN compute is captured as a graph and replayed, which needs every tensor's
shape fixed and no host value in the computation. :class:`StaticShapeFFN` computes CAM
work items that way, as a compute strategy of the one FFN serving loop
(:func:`afd_protocol.serve`, which keeps intake, timeouts, skipping, shutdown and stats):
each item's rows are copied into a preallocated buffer of the smallest *shape bucket* that
holds them (powers of two up to the receive capacity), the rest of the buffer zeroed, and
the experts run on the whole buffer with the item's device-side group list and layer index
(:class:`LayeredSwiGLUExperts`, through the layer-select GEMMs, which give zero rows past
the groups); only the reply slices the valid rows. So the expert computation sees one
shape per bucket, whatever the item -- what a captured graph per bucket needs. On the CPU
nothing is captured: this is the discipline, tested, not the speed-up.

    ffn = StaticShapeFFN(endpoint, experts, hidden_size, capacity)
    stats = afd_protocol.serve(endpoint, ffn, timeout=5.0)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from afd_protocol import FFNEndpoint, InvalidArgument, WorkItem
from afd_transport_cam.emulator.gemm import grouped_matmul_layered


def bucket_sizes(capacity: int, smallest: int = 16) -> tuple[int, ...]:
    """Powers of two from ``smallest`` below ``capacity``, then ``capacity`` itself."""
    if capacity < 1 or smallest < 1:
        raise InvalidArgument(f"capacity ({capacity}) and smallest ({smallest}) must be >= 1")
    sizes = []
    size = smallest
    while size < capacity:
        sizes.append(size)
        size *= 2
    return (*sizes, capacity)


@dataclass(frozen=True)
class LayeredSwiGLUExperts:
    """One FFN rank's routed experts for every layer, as the layer-select GEMMs take them.

    ``gate_up[layer]``: ``[E, H, 2I]`` (the first half activated, as the NPU's GMM-SwiGLU);
    ``down[layer]``: ``[E, I, H]``. Called with rows grouped by local expert, the group list
    (counts) and a one-element int64 layer index, all tensors.
    """

    gate_up: list[torch.Tensor]
    down: list[torch.Tensor]

    def __call__(
        self, rows: torch.Tensor, group_list: torch.Tensor, layer_index: torch.Tensor
    ) -> torch.Tensor:
        layer = layer_index.reshape(1).to(torch.int64)
        (h,) = grouped_matmul_layered(
            [rows], self.gate_up, [], [], layer, group_list, output_dtype=torch.float32
        )
        half = h.shape[1] // 2
        activated = torch.nn.functional.silu(h[:, :half]) * h[:, half:]
        (out,) = grouped_matmul_layered(
            [activated], self.down, [], [], layer, group_list, output_dtype=torch.float32
        )
        return out


@dataclass
class StaticShapeFFN:
    """Compute work items with static shapes (module docstring): a
    :data:`afd_protocol.Compute` for :func:`afd_protocol.serve`.

    ``endpoint`` is the FFN endpoint it computes for (the buffers take its dtype); one
    float buffer ``[size, hidden_size]`` per bucket of :attr:`buckets`, allocated once.
    """

    endpoint: FFNEndpoint
    experts: LayeredSwiGLUExperts
    hidden_size: int
    capacity: int
    """The most rows one work item can hold (the receive capacity)."""
    smallest_bucket: int = 16
    shapes: set[tuple[int, ...]] = field(default_factory=set)
    """Every row-buffer shape the experts were called with (one per bucket used)."""

    def __post_init__(self) -> None:
        self.buckets = bucket_sizes(self.capacity, self.smallest_bucket)
        self._buffers = {
            size: torch.zeros(size, self.hidden_size, dtype=self.endpoint.dtype)
            for size in self.buckets
        }

    def bucket(self, rows: int) -> int:
        for size in self.buckets:
            if rows <= size:
                return size
        raise InvalidArgument(f"a work item of {rows} rows exceeds the capacity {self.capacity}")

    def buffer(self, size: int) -> torch.Tensor:
        """The preallocated rows of bucket ``size`` (the same tensor every time)."""
        return self._buffers[size]

    def __call__(self, item: WorkItem) -> tuple[torch.Tensor, None]:
        """``(routed_out, None)`` for ``item``: float32 ``[routed rows, hidden_size]``, its
        parts' outputs concatenated in order (CAM carries no shared rows).

        Each part's routed rows ``[rows, hidden_size]`` are copied into its bucket's buffer,
        the rest of it zeroed, and the experts run on the whole buffer with the part's
        group list (int64 counts per local expert) and layer index (a one-element integer tensor,
        on the device); only the first ``rows`` output rows are kept.
        """
        outputs = []
        for part in item.parts:
            rows = part.routed_rows.shape[0]
            buffer = self._buffers[self.bucket(rows)]
            buffer[:rows].copy_(part.routed_rows)
            buffer[rows:].zero_()
            self.shapes.add(tuple(buffer.shape))
            out = self.experts(buffer, part.group_list, part.layer_index)
            outputs.append(out[:rows])
        if not outputs:
            return torch.empty(0, self.hidden_size), None
        return torch.cat(outputs), None
