"""An FFN rank's routed-expert step as CUDA-graph replays: one graph per row bucket, any
MoE layer.

The ``triton`` backend's step -- grouped GEMM (gate/up), SwiGLU, grouped GEMM (down) --
reads the rows per expert and the layer index from device tensors
(:mod:`afd_models.triton_grouped_gemm`) over an :class:`~afd_models.experts.ExpertStack`,
so one capture serves every layer and every split of the rows among the experts. Per
bucket of ``B`` rows the graph owns static buffers: ``rows [B, H]``, ``counts [E]``,
``layer [1]`` and the output ``[B, H]``. A call copies the item's rows, its group list and
the layer's stack position into them, replays, and returns a copy of the first ``N`` output
rows: the host work per item is three small copies and one replay, where eager mode
launches every kernel. Rows past ``N`` in the static buffer keep an earlier item's values;
no tile reads them (every tile lies inside an expert's rows, which sum to ``N``).

A batch larger than the largest bucket runs eagerly (the same kernels, launched), never
truncated. Without CUDA (or with ``capture=False``) every bucket runs its step eagerly on
the same static buffers, which is how the CPU tests check the buffer handling under
Triton's interpreter; on a GPU the suite checks replays against eager calls.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from afd_models.errors import ConfigError
from afd_models.experts import ExpertStack, GroupedRows


@dataclass
class _Bucket:
    rows: torch.Tensor
    counts: torch.Tensor
    layer: torch.Tensor
    out: torch.Tensor | None = None
    graph: torch.cuda.CUDAGraph | None = None


class GraphedExperts:
    """The routed-expert step of every layer of ``stack`` (module docstring).

    ``buckets``: row capacities, each one graph (ascending after sorting, each >= 1);
    ``capture``: capture CUDA graphs (default: when the stack is on a CUDA device).
    """

    def __init__(
        self, stack: ExpertStack, buckets: Sequence[int], *, capture: bool | None = None
    ) -> None:
        from afd_models import triton_grouped_gemm  # Triton only when graphs are wanted

        sizes = sorted(set(buckets))
        if not sizes or sizes[0] < 1:
            raise ConfigError(f"graph buckets must be row counts >= 1, got {list(buckets)}")
        self.stack = stack
        self.buckets = tuple(sizes)
        self._expert_step = triton_grouped_gemm.expert_step
        device = stack.gate_up.device
        self.device = device
        self.capture = device.type == "cuda" if capture is None else capture
        self._pool = torch.cuda.graph_pool_handle() if self.capture else None
        """One memory pool for every bucket's graph."""
        if self.capture and device.type != "cuda":
            raise ConfigError(f"CUDA graphs need a CUDA device; the experts are on {device}")
        hidden = stack.down.shape[2]
        experts = len(stack.expert_ids)
        self._buckets: dict[int, _Bucket] = {}
        for size in self.buckets:
            bucket = _Bucket(
                rows=torch.zeros(size, hidden, dtype=stack.gate_up.dtype, device=device),
                counts=torch.zeros(experts, dtype=torch.int64, device=device),
                layer=torch.zeros(1, dtype=torch.int32, device=device),
            )
            if self.capture:
                self._capture(bucket)
            self._buckets[size] = bucket

    def _step(self, rows: torch.Tensor, counts: torch.Tensor, layer: torch.Tensor) -> torch.Tensor:
        """The expert step of the stack's layer at position ``layer``."""
        return self._expert_step(rows, self.stack.gate_up, self.stack.down, counts, layer)

    def _capture(self, bucket: _Bucket) -> None:
        with torch.cuda.device(self.device):
            # Compile and warm up on a side stream first, as torch's graph capture wants.
            side = torch.cuda.Stream(device=self.device)  # type: ignore[no-untyped-call]
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self._step(bucket.rows, bucket.counts, bucket.layer)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            # thread_local: a transport thread's CUDA calls elsewhere do not break capture.
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                bucket.out = self._step(bucket.rows, bucket.counts, bucket.layer)
        bucket.graph = graph

    def bucket_for(self, num_rows: int) -> int | None:
        """The smallest bucket that holds ``num_rows`` rows (``None``: larger than all)."""
        return next((b for b in self.buckets if b >= num_rows), None)

    def __call__(self, layer: int, work: GroupedRows) -> torch.Tensor:
        """``[N, H]``: each row through its expert of model layer ``layer`` (unit weight),
        as the ``triton`` backend computes it."""
        position = self.stack.position(layer)
        n = work.num_rows
        if n == 0:
            return work.rows.new_empty(0, work.rows.shape[1])
        size = self.bucket_for(n)
        if size is None:  # larger than every bucket: the same kernels, launched
            index = torch.tensor([position], dtype=torch.int32, device=work.rows.device)
            return self._step(work.rows, work.group_list.to(work.rows.device), index)
        bucket = self._buckets[size]
        bucket.rows[:n].copy_(work.rows)
        bucket.counts.copy_(work.group_list)
        bucket.layer.fill_(position)
        if bucket.graph is not None:
            with torch.cuda.device(self.device):
                bucket.graph.replay()
        else:
            bucket.out = self._step(bucket.rows, bucket.counts, bucket.layer)
        assert bucket.out is not None
        return bucket.out[:n].clone()
