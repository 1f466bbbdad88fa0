"""Work items (FFN side) and in-flight dispatch state (attention side).

Contract (seed 002): a work item is one attention DP replica x one layer x one stage.
It is ready only when every participant of the replica has published its part; an FFN
rank may take any ready item but must not starve one; the attention side may combine
only after every FFN rank that received rows has answered (``expected_ffn``: a rank
that got nothing is never waited on).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from afd_protocol.device_pack import DevicePlan
from afd_protocol.header import Header
from afd_protocol.plan import DispatchPlan


@dataclass(frozen=True)
class WorkItemKey:
    """Identity of a work item."""

    replica: int
    layer: int
    stage: int


@dataclass(frozen=True)
class WorkItemPart:
    """One participant's published slot: zero-copy views into the receiver's window."""

    src_rank: int
    ring: int
    header: Header
    routed_rows: torch.Tensor
    """``[header.routed_rows, H]``, grouped by local expert in ascending order."""
    shared_rows: torch.Tensor
    """``[header.shared_rows, H]`` (empty unless shared experts run on the FFN side)."""
    group_list: torch.Tensor
    """Rows per local expert for this part (int64, on the window's device)."""
    header_words: torch.Tensor
    """The part's header as it landed (int32, on the window's device): layer, stage and
    counts at :class:`~afd_protocol.header.Word` positions, for device code (a graph or a
    layer-select kernel) that reads them without the host."""


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
        return sum(p.header.routed_rows for p in self.parts)


@dataclass
class PendingDispatch:
    """What the attention side keeps between ``dispatch`` and ``combine`` of one layer.

    The weights stay here and never travel; ``expected_ffn`` lists the FFN ranks whose
    reply ``combine`` waits for, with the sequence number each reply must answer.
    """

    layer: int
    stage: int
    ring: int
    plan: DispatchPlan | DevicePlan
    topk_weights: torch.Tensor
    dtype: torch.dtype
    hidden_size: int
    expected_ffn: dict[int, int] = field(default_factory=dict)
    """FFN rank -> the dispatch sequence number its reply must carry in ANSWER_SEQ."""
    arrived: dict[int, Header] = field(default_factory=dict)
    """Replies already received and checked (kept so a retried ``combine`` after a
    timeout waits only for the ranks that have not answered)."""
    issued_at: float = 0.0
    """``time.monotonic()`` when the writes were issued (for timeouts and reports)."""
    device_segment_offsets: torch.Tensor | None = None
    """The plan's segment bounds on the device, for a fused combine (None: not used)."""
