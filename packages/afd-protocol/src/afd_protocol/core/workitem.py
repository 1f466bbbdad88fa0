"""Work items: what an FFN rank receives, whatever the transport.

Contract (seed 002): a work item is one attention DP replica x one layer x one stage. It
is ready only when every participant of the replica has published its part; an FFN rank
may take any ready item but must not starve one. Each part arrives grouped by local
expert with its group list: the FFN side never routes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class WorkItemKey:
    """Identity of a work item."""

    replica: int
    layer: int
    stage: int


@dataclass(frozen=True)
class WorkItemPart:
    """One participant's rows, as zero-copy views where the transport received them."""

    src_rank: int
    """The attention rank that sent this part."""
    num_tokens: int
    """Tokens in the sender's batch (each may appear in several routed rows)."""
    routed_rows: torch.Tensor
    """``[R, H]`` in the activation dtype, grouped by local expert in ascending order."""
    shared_rows: torch.Tensor
    """``[S, H]`` (``S = 0`` unless shared experts run on the FFN side)."""
    group_list: torch.Tensor
    """int64 ``[num_local_experts]`` on the receiving device: rows per local expert
    (count-type), summing to ``R``."""
    layer_index: torch.Tensor
    """``[1]`` integer tensor on the receiving device holding the layer, for device code
    (a graph or a layer-select kernel) that must not read it through the host."""


@dataclass(frozen=True)
class WorkItem:
    """A ready work item: all participants of one replica at one (layer, stage)."""

    key: WorkItemKey
    parts: tuple[WorkItemPart, ...]

    @property
    def replica(self) -> int:
        return self.key.replica

    @property
    def layer(self) -> int:
        return self.key.layer

    @property
    def stage(self) -> int:
        return self.key.stage

    @property
    def num_routed_rows(self) -> int:
        """Rows ``reply`` expects in ``routed_out``: the parts' routed rows, concatenated."""
        return sum(int(p.routed_rows.shape[0]) for p in self.parts)

    @property
    def num_shared_rows(self) -> int:
        """Rows ``reply`` expects in ``shared_out`` (0: pass None)."""
        return sum(int(p.shared_rows.shape[0]) for p in self.parts)
